"""RPC over ZMQ: the layer below the TransferQueue and the single controller.

A service object exposes methods named ``rpc_<name>``; a server serves them on a ROUTER
socket and a client keeps one DEALER socket per endpoint, matching replies to calls by id.
Messages are ``codec`` frames: a JSON header plus raw tensor buffers, never pickle, with a
tag in front of the header that authenticates the message under the run's key (``auth``):
``[tag + header, *buffers]``. A receiver checks the tag before decoding anything; a message
that fails is dropped and counted (``auth_failures``).

- ``async_server``: ``RpcServer``, coroutine methods on the running event loop; a call that
  waits (get_meta) never blocks the others.
- ``blocking_server``: ``BlockingRpcServer``, plain methods on the calling thread, in order.
- ``async_client``: ``RpcClient``, many calls in flight on the running event loop.
- ``blocking_client``: ``BlockingRpcClient``, the same calls without an event loop.
- ``local_endpoint``: ``LocalEndpoint``, a service in this event loop called directly, with
  the client's signature (the in-process default).
- ``thread_endpoint``: ``ThreadEndpoint``, a service on another event loop of this process
  called directly, with the client's signature and the wire's copies, refusals and errors.
- ``loop_thread``: ``EventLoopThread``, an event loop on a thread for synchronous code.
- ``spin``: bounded busy-waiting for a reply, and the policy that decides when to spin.
- ``server_base``, ``client_replies``, ``sockets``: the steps the servers, the clients, and
  both, share.
- ``auth``: the run key and the MAC that authenticates every message.
- ``codec``: a JSON header plus raw tensor frames, never pickle.
- ``errors``: this layer's errors, and the names by which errors travel back.
- ``alloc``: allocator and GC tuning for processes that mostly move messages.
- ``store_wait``: waiting for a value in torchrun's TCPStore.

Every server speaks the same protocol, so either client talks to either server.
Nothing here imports ``asyncflow.transfer_queue`` or ``asyncflow.single_controller``
(``tests/test_import_layers.py`` checks it).
"""
from .errors import RemoteError, RpcError, RpcTimeout

__all__ = ["RpcError", "RpcTimeout", "RemoteError"]

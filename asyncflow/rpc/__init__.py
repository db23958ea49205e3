"""RPC over ZMQ: the layer below the TransferQueue and the single controller.

- ``async_client``: request/reply with asyncio or blocking sockets, timeouts, bounded spinning.
- ``auth``: the run key and the MAC that authenticates every message.
- ``codec``: a JSON header plus raw tensor frames, never pickle.
- ``errors``: this layer's errors, and the names by which errors travel back.
- ``alloc``: allocator and GC tuning for processes that mostly move messages.
- ``store_wait``: waiting for a value in torchrun's TCPStore.

Nothing here imports ``asyncflow.transfer_queue`` or ``asyncflow.single_controller``
(``tests/test_import_layers.py`` checks it).
"""
from .errors import RemoteError, RpcError, RpcTimeout

__all__ = ["RpcError", "RpcTimeout", "RemoteError"]

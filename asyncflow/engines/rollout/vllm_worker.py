"""Runs inside vLLM's worker processes: how new weights get into vLLM's model.

vLLM loads this class into every worker (`worker_extension_cls`), so the engine can call
`collective_rpc("asyncflow_...", ...)` by name: no pickled callables, and the same code
works whatever the worker class (CPU, GPU, vllm-ascend NPU).

Every version goes in through vLLM's own reload path (`vllm_reload.Reload`): the model's
``load_weights`` maps HF names to vLLM's fused and tensor-parallel parameters, and the
layer-wise reload lets each layer redo the processing vLLM applied after the first load
(CPU repacks linear weights into its kernels' layout; quantized layers re-quantize).
``load_weights`` on the live model would write into parameters that processing replaced.

Ways in:
- ``asyncflow_load_weights``: one whole version passed with the call (host tensors);
- ``asyncflow_begin_reload`` / ``asyncflow_load_chunk`` / ``asyncflow_load_ipc`` /
  ``asyncflow_finish_reload``: a version handed over in chunks (an instance colocated with a
  training rank; CUDA IPC handles of tensors on the same device, or host tensors);
- the training ranks' weight-sync groups (weight_sync wire groups), which every worker joins:
  in place (``asyncflow_receive_header`` / ``asyncflow_receive_buckets``: each bucket loaded
  as it arrives, generation paused for the transfer), or staged
  (``asyncflow_stage_receive`` starts a thread that receives the version into buffers of its own
  (in the worker's device memory) while generation goes on; ``asyncflow_staged_header`` / ``asyncflow_load_staged``
  check and load it at a step boundary).

LoRA (``asyncflow_lora_init``, model.lora.vllm=adapters): a version's adapter tensors go into the
policy's vLLM adapter (vllm_lora.AdapterSlot) once its base tensors, if it has any, are
reloaded; a version of adapters alone leaves vLLM's weights untouched (no reload at all).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

import torch

from asyncflow.engines.rollout.lora_apply import is_adapter_name
from asyncflow.engines.rollout.vllm_lora import AdapterSlot, LoraSpec
from asyncflow.engines.rollout.vllm_reload import Reload
from asyncflow.weight_sync.protocol import views
from asyncflow.weight_sync.receive import finish_bucket, post_bucket
from asyncflow.weight_sync.wire_group import WireGroup


def ipc_args_on(args: tuple, device_index: int) -> tuple:
    """CUDA IPC rebuild arguments (torch.multiprocessing.reductions.reduce_tensor) with the
    device index rewritten for the receiving process: it numbers devices by its own
    CUDA_VISIBLE_DEVICES, in which the instance's device is another index than the sender's."""
    out = list(args)
    out[6] = int(device_index)  # rebuild_cuda_tensor(..., storage_device, storage_handle, ...)
    return tuple(out)


class _Staged:
    """A version being received by a thread of the worker while the worker generates."""

    def __init__(self) -> None:
        self.header: Any = None
        self.buckets: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.got_header = threading.Event()
        self.thread: threading.Thread | None = None


class _Version:
    """One version into a worker's model: base tensors through vLLM's reload (opened only when
    the version has some), adapter tensors (LoRA) kept and installed in the adapter slot last."""

    def __init__(self, reload: Reload, slot: Any, has_base: bool) -> None:
        self.reload, self.slot = reload, slot
        self.has_base = has_base or slot is None
        self.adapters: dict[str, torch.Tensor] = {}

    def begin(self) -> None:
        if self.has_base:
            self.reload.begin()

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.slot is None:
            self.reload.load(named)
            return
        base = []
        for n, t in named:
            if is_adapter_name(n):
                self.adapters[n] = t.detach().to("cpu", copy=True)  # the buffer may be reused or unmapped
            else:
                base.append((n, t))
        if base:
            if not self.has_base:
                raise RuntimeError(f"base weight {base[0][0]!r} in a version announced as adapters only")
            self.reload.load(base)

    def finish(self) -> None:
        if self.has_base:
            self.reload.finish()  # drops vLLM's adapters (reset_lora_state): installed again below
        if self.slot is not None:
            if self.adapters:
                self.slot.install(self.adapters)
            elif self.has_base:
                self.slot.install_zero()


def _has_base(names: Iterable[str]) -> bool:
    return any(not is_adapter_name(n) for n in names)


class WeightLoaderExtension:
    """Mixed into vLLM's Worker; `self.model_runner` is the worker's."""

    # the Worker's, which this class is mixed into (vLLM's classes are untyped here)
    model_runner: Any
    vllm_config: Any
    _asyncflow_staged: _Staged | None

    def _asyncflow_model(self) -> Any:
        return self.model_runner.model

    def _asyncflow_device(self) -> torch.device:
        # taken once: during a reload the layers wait on the meta device for their new tensors
        dev = getattr(self, "_asyncflow_dev", None)
        if dev is None:
            dev = self._asyncflow_dev = next(self._asyncflow_model().parameters()).device
        return dev

    def _asyncflow_reload(self) -> Reload:
        r = getattr(self, "_asyncflow_reloader", None)
        if r is None:
            self._asyncflow_device()  # before the first reload puts the layers on the meta device
            r = self._asyncflow_reloader = Reload(self._asyncflow_model(), self.model_runner, self.vllm_config)
        return r

    def _asyncflow_sync(self) -> None:
        device = self._asyncflow_device()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _asyncflow_version(self, has_base: bool) -> _Version:
        return _Version(self._asyncflow_reload(), getattr(self, "_asyncflow_slot", None), has_base)

    def asyncflow_lora_init(self, rank: int, alpha: float) -> int:
        """LoRA through vLLM's own support: the policy's adapter slot, holding a zero adapter
        (version 0 is the base) until the first version's adapters arrive."""
        self._asyncflow_reload()  # the device, before any reload
        self._asyncflow_slot = AdapterSlot(self.model_runner, LoraSpec(int(rank), float(alpha)))
        self._asyncflow_slot.install_zero()
        return self._asyncflow_slot.installed

    def asyncflow_lora_held(self) -> dict:
        """The adapters this worker's LoRA manager holds (registered) and has in slots (active)."""
        manager = self.model_runner.lora_manager._adapter_manager
        return {"registered": sorted(manager.list_adapters()), "active": sorted(dict(manager._active_adapters.cache)),
                "installed": getattr(getattr(self, "_asyncflow_slot", None), "installed", 0)}

    def _asyncflow_load_all(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One whole version through vLLM's reload path (and the adapter slot)."""
        device = self._asyncflow_device()
        v = self._asyncflow_version(_has_base(n for n, _ in named))
        v.begin()
        v.load((n, t.to(device, non_blocking=True)) for n, t in named)
        v.finish()
        self._asyncflow_sync()

    # ---- a version passed with the calls ---------------------------------------------------

    def asyncflow_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self._asyncflow_load_all(named)
        return len(named)

    def asyncflow_begin_reload(self, has_base: bool = True) -> None:
        """Open a version handed over in chunks (``has_base``: it carries base weights, not
        only adapters)."""
        self._asyncflow_open = self._asyncflow_version(bool(has_base))
        self._asyncflow_open.begin()

    def asyncflow_load_chunk(self, named: list[tuple[str, torch.Tensor]]) -> int:
        device = self._asyncflow_device()
        self._asyncflow_open.load((n, t.to(device, non_blocking=True)) for n, t in named)
        return len(named)

    def asyncflow_load_ipc(self, handles: list[tuple[str, Any, tuple]]) -> int:
        """(name, rebuild function, its arguments) per tensor: the sender's device memory, mapped here."""
        device = self._asyncflow_device()
        named = [(name, fn(*ipc_args_on(args, device.index or 0))) for name, fn, args in handles]
        self._asyncflow_open.load(named)
        self._asyncflow_sync()
        return len(named)

    def asyncflow_finish_reload(self) -> None:
        self._asyncflow_open.finish()
        self._asyncflow_sync()

    # ---- the training ranks' weight-sync groups ---------------------------------------------

    def asyncflow_join_weight_groups(self, addrs: list[dict], base: int, timeout_s: float) -> int:
        """Join each training rank's group as member ``base + this worker's rank`` (one member
        per tensor-parallel worker); returns that index."""
        index = int(base) + int(getattr(self, "rank", 0))
        device = self._asyncflow_device()
        self._asyncflow_groups = {k: WireGroup(a, index, timeout_s, device=device) for k, a in enumerate(addrs)}
        self._asyncflow_timeout_s = float(timeout_s)
        return index

    @staticmethod
    def _asyncflow_describe(header: Any) -> dict:
        return {"version": header.version, "seq": header.seq, "specs": [asdict(s) for s in header.specs],
                "buckets": len(header.buckets)}

    def asyncflow_receive_header(self) -> dict:
        """In place: the next version's header (every worker receives it; the engine checks it)."""
        self._asyncflow_header = header = self._asyncflow_groups[0].broadcast_object(None, 0)
        return self._asyncflow_describe(header)

    def _asyncflow_buckets(self, header: Any, fresh: bool) -> Iterator[tuple[int, torch.Tensor]]:
        """Receive the header's buckets in order, each into a buffer of its own (``fresh``: the
        layer-wise reload keeps views of a layer's tensors until the layer is complete, which
        may be in a later bucket) or into one reused buffer (draining refused weights)."""
        groups, device = self._asyncflow_groups, self._asyncflow_device()
        n = len(header.buckets)
        shared = None if fresh else torch.empty(max(header.bucket_nbytes(b) for b in range(n)),
                                                dtype=torch.uint8, device=device)
        pieces: dict[int, torch.Tensor] = {}

        def scratch(i: int, size: int) -> torch.Tensor:  # a training rank's pieces of several runs
            if i not in pieces or pieces[i].numel() < size:
                pieces[i] = torch.empty(size, dtype=torch.uint8, device=device)
            return pieces[i][:size]
        for b in range(n):
            size = header.bucket_nbytes(b)
            part = torch.empty(size, dtype=torch.uint8, device=device) if shared is None else shared[:size]
            try:
                finish_bucket(post_bucket(header, b, groups, part, scratch), groups)
            except Exception as e:
                raise RuntimeError(f"version {header.version}, bucket {b + 1}/{n}: {e}") from e
            yield b, part

    def asyncflow_receive_buckets(self, load: bool) -> int:
        """In place: receive every bucket of the header's version and (``load``) feed each to
        vLLM's reload as it arrives; with load False only drain (refused weights)."""
        header = self._asyncflow_header
        if not load:
            return sum(1 for _ in self._asyncflow_buckets(header, fresh=False))
        r = self._asyncflow_version(_has_base(s.name for s in header.specs))
        r.begin()
        n = 0
        for b, part in self._asyncflow_buckets(header, fresh=True):
            r.load([(spec.name, t) for spec, t in views(header, b, part)])
            n += 1
        r.finish()
        self._asyncflow_sync()
        return n

    def asyncflow_stage_receive(self) -> None:
        """Staged: receive the next version on a thread of this worker, while it generates."""
        old = getattr(self, "_asyncflow_staged", None)
        if old is not None and old.thread is not None and old.thread.is_alive():
            raise RuntimeError("a staged version is still being received; load or drop it first")
        st = self._asyncflow_staged = _Staged()

        def run() -> None:
            try:
                st.header = self._asyncflow_groups[0].broadcast_object(None, 0)
                st.got_header.set()
                st.buckets = [part for _, part in self._asyncflow_buckets(st.header, fresh=True)]
            except BaseException as e:  # noqa: BLE001 - raised by the call that waits for it
                st.error = e
                st.got_header.set()
        st.thread = threading.Thread(target=run, name="asyncflow-stage-receive", daemon=True)
        st.thread.start()

    def _asyncflow_wait_staged(self, timeout_s: float, what: str) -> _Staged:
        st = getattr(self, "_asyncflow_staged", None)
        if st is None or st.thread is None:
            raise RuntimeError(f"{what}: no staged receive was started (asyncflow_stage_receive)")
        if what == "header":
            if not st.got_header.wait(timeout_s):
                raise TimeoutError(f"staged weights: no header within {timeout_s:.0f} s")
        else:
            st.thread.join(timeout_s)
            if st.thread.is_alive():
                raise TimeoutError(f"staged weights: version {st.header.version} not received within "
                                   f"{timeout_s:.0f} s")
        if st.error is not None:
            raise RuntimeError(f"staged weights: the receive failed: {st.error}") from st.error
        return st

    def asyncflow_staged_header(self, timeout_s: float) -> dict:
        """Staged: the header of the version being received (waits for it)."""
        return self._asyncflow_describe(self._asyncflow_wait_staged(timeout_s, "header").header)

    def asyncflow_load_staged(self, load: bool, timeout_s: float) -> int:
        """Staged: wait until the whole version is here, then (``load``) put it in through vLLM's
        reload path; either way the staged copy is freed. Returns the buckets received."""
        st = self._asyncflow_wait_staged(timeout_s, "version")
        self._asyncflow_staged = None
        if load:
            r = self._asyncflow_version(_has_base(s.name for s in st.header.specs))
            r.begin()
            for b, part in enumerate(st.buckets):
                r.load([(spec.name, t) for spec, t in views(st.header, b, part)])
            r.finish()
            self._asyncflow_sync()
        return len(st.buckets)

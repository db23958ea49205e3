"""Runs inside vLLM's worker processes: how new weights get into vLLM's model.

vLLM loads this class into every worker (`worker_extension_cls`), so the engine can call
`collective_rpc("asyncflow_...", ...)` by name: no pickled callables, and the same code
works whatever the worker class (GPU, vllm-ascend NPU). Three ways in:
- ``asyncflow_load_weights``: tensors passed with the call (host tensors: the fallback);
- ``asyncflow_load_ipc``: CUDA IPC handles of tensors on the same device, for an instance
  colocated with a training rank (no copy through the host);
- ``asyncflow_join_weight_groups`` / ``asyncflow_receive_header`` / ``asyncflow_receive_buckets``:
  every worker joins the training ranks' weight-sync groups (workers/wire_group.py) and
  receives each version's buckets there straight into device memory.
The model's own ``load_weights`` maps HF names to vLLM's fused and tensor-parallel
parameters (qkv_proj, gate_up_proj, slices), so every tensor-parallel worker gets whole tensors.
"""
from __future__ import annotations

from typing import Any

import torch


def ipc_args_on(args: tuple, device_index: int) -> tuple:
    """CUDA IPC rebuild arguments (torch.multiprocessing.reductions.reduce_tensor) with the
    device index rewritten for the receiving process: it numbers devices by its own
    CUDA_VISIBLE_DEVICES, in which the instance's device is another index than the sender's."""
    out = list(args)
    out[6] = int(device_index)  # rebuild_cuda_tensor(..., storage_device, storage_handle, ...)
    return tuple(out)


class WeightLoaderExtension:
    """Mixed into vLLM's Worker; `self.model_runner` is the worker's."""

    def _asyncflow_model(self) -> Any:
        return self.model_runner.model

    def _asyncflow_device(self) -> torch.device:
        return next(self._asyncflow_model().parameters()).device

    def _asyncflow_load(self, named: Any) -> None:
        device = self._asyncflow_device()
        self._asyncflow_model().load_weights(weights=((n, t.to(device, non_blocking=True)) for n, t in named))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def asyncflow_load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self._asyncflow_load(named)
        return len(named)

    def asyncflow_load_ipc(self, handles: list[tuple[str, Any, tuple]]) -> int:
        """(name, rebuild function, its arguments) per tensor: the sender's device memory, mapped here."""
        device = self._asyncflow_device()
        named = [(name, fn(*ipc_args_on(args, device.index or 0))) for name, fn, args in handles]
        self._asyncflow_load(named)
        return len(named)

    def asyncflow_join_weight_groups(self, addrs: list[dict], base: int, timeout_s: float) -> int:
        """Join each training rank's group as member ``base + this worker's rank`` (one member
        per tensor-parallel worker); returns that index."""
        from asyncflow.workers.wire_group import WireGroup
        index = int(base) + int(getattr(self, "rank", 0))
        device = self._asyncflow_device()
        self._asyncflow_groups = {k: WireGroup(a, index, timeout_s, device=device) for k, a in enumerate(addrs)}
        self._asyncflow_timeout_s = float(timeout_s)
        return index

    def asyncflow_receive_header(self) -> dict:
        """The next version's header (every worker receives it; the engine checks it)."""
        from dataclasses import asdict
        self._asyncflow_header = header = self._asyncflow_groups[0].broadcast_object(None, 0)
        return {"version": header.version, "seq": header.seq, "specs": [asdict(s) for s in header.specs],
                "buckets": len(header.buckets)}

    def asyncflow_receive_buckets(self, load: bool) -> int:
        """Receive every bucket of the header's version into device memory and (``load``)
        load each into the model as it arrives; with load False only drain (refused weights).
        Returns the buckets received."""
        from asyncflow.workers.weight_recv import finish_bucket, post_bucket
        from asyncflow.workers.weight_sync import views
        header, groups = self._asyncflow_header, self._asyncflow_groups
        device = self._asyncflow_device()
        n = len(header.buckets)
        buf = torch.empty(max(header.bucket_nbytes(b) for b in range(n)), dtype=torch.uint8, device=device)
        pieces: dict[int, torch.Tensor] = {}

        def scratch(i: int, size: int) -> torch.Tensor:  # a training rank's pieces of several runs
            if i not in pieces or pieces[i].numel() < size:
                pieces[i] = torch.empty(size, dtype=torch.uint8, device=device)
            return pieces[i][:size]
        for b in range(n):
            part = buf[:header.bucket_nbytes(b)]
            try:
                finish_bucket(post_bucket(header, b, groups, part, scratch), groups)
            except Exception as e:
                raise RuntimeError(f"version {header.version}, bucket {b + 1}/{n}: {e}") from e
            if load:
                self._asyncflow_load([(spec.name, t) for spec, t in views(header, b, part)])
        return n

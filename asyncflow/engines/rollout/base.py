"""The rollout engine interface: what the rest of AsyncFlow calls to generate.

Contract shared by every engine:
- prompts are 1-D int64 token tensors, one per row; outputs come back per row, on CPU;
- sampling is seeded per row: a row's tokens depend on (prompt, seed, params, weights)
  only, never on the other rows of the batch or their order;
- log-probs are those of the sampling distribution before top-p/top-k filtering
  (softmax(logits / temperature); plain logits when greedy), which is what the
  trainer recomputes for importance ratios;
- a generation can be aborted between decode steps; the partial rows come back with
  finish reason "abort" and can be continued later with prompt + partial as the prompt.

Request level (``RequestEngine``): a request is submitted alone and its result comes back
as soon as that row finishes; the engine keeps a running batch full (continuous
batching) and swaps new weights in between decode steps without dropping running rows.
Every generated token records the policy version of the weights that produced it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FINISH_REASONS", "GenerationOutput", "GenerationRequest", "RequestEngine", "RequestResult",
           "RequestId", "RolloutEngine", "SamplingParams", "SWAP_MODES", "check_generate_args"]

# A request's id: any hashable value, unique among the engine's queued and running requests.
# The rollout workers use tuples (instance, counter[, turn]) so that their ids never collide.
RequestId = Hashable

FINISH_REASONS = ("stop", "length", "abort", "error")  # "error": that request alone was refused
# How running rows continue after new weights are swapped in mid-generation:
# keep: on the KV cache computed so far (old weights); recompute: re-prefill it with the new weights.
SWAP_MODES = ("keep", "recompute")


@dataclass
class SamplingParams:
    """How to sample. Same meaning in every engine."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's eos ids
    # The engine's eos ids do not stop a row (stop_token_ids still do): every row runs to its
    # budget. For benchmarks of fixed lengths, as vLLM's ignore_eos.
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationOutput:
    """Per-row results, in the order of the prompts."""

    response_ids: list[torch.Tensor]  # 1-D int64; includes the stop token if one was produced
    log_probs: list[torch.Tensor]  # 1-D float32, same length as response_ids
    finish_reasons: list[str]  # "stop" | "length" | "abort"


@dataclass
class GenerationRequest:
    """One row to generate. ``max_new_tokens`` (when set) overrides ``params.max_new_tokens``;
    ``min_version``: the row is admitted only once the engine holds weights of at least this
    policy version (the staleness bound, enforced per row at admission)."""

    request_id: RequestId
    prompt_ids: torch.Tensor  # 1-D int64
    params: SamplingParams
    seed: int = 0
    max_new_tokens: int | None = None
    min_version: int = 0

    @property
    def budget(self) -> int:
        return self.params.max_new_tokens if self.max_new_tokens is None else int(self.max_new_tokens)


@dataclass
class RequestResult:
    """A finished request. ``token_versions[i]`` is the policy version that sampled token i;
    ``error`` says why a request was refused (finish_reason "error", no tokens)."""

    request_id: RequestId
    response_ids: torch.Tensor  # 1-D int64
    log_probs: torch.Tensor  # 1-D float32, behaviour log-probs
    token_versions: torch.Tensor  # 1-D int64
    finish_reason: str
    error: str | None = None

    @property
    def gen_version(self) -> int | None:
        """The version of the row's oldest token (None for a row with no tokens)."""
        return int(self.token_versions.min()) if self.token_versions.numel() else None


class RequestEngine(ABC):
    """An engine driven request by request (continuous batching). Not thread-safe: one
    thread drives ``step``; other threads go through a ``RolloutService``."""

    version: int

    @abstractmethod
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request. A request that cannot run (prompt over the context, bad ids) is
        not raised: its result comes back from the next ``step`` with finish reason "error"."""

    @abstractmethod
    def abort(self, request_id: RequestId) -> bool:
        """Finish a queued or running request at the next step with what it has ("abort").
        An unknown id is a no-op that returns False (and is counted in ``stats``)."""

    @abstractmethod
    def step(self) -> list[RequestResult]:
        """One scheduling iteration: admit, prefill, decode one token; return what finished."""

    @abstractmethod
    def has_work(self) -> bool:
        """Requests are queued or running."""

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, mode: str = "keep") -> None:
        """Swap new weights in now (call between steps); running rows continue (``SWAP_MODES``).
        Wrong names, shapes or dtypes, or a version older than the one held, raise and leave
        the weights held unchanged."""

    def load_weights_stream(self, specs: Sequence[Any], stream: Iterable[tuple[Any, torch.Tensor]], version: int,
                            mode: str = "keep") -> None:
        """Swap in a version read tensor by tensor from ``stream`` (``specs``: each one's name,
        shape and dtype, checked before anything is written); as ``load_weights`` otherwise."""
        raise NotImplementedError(f"{type(self).__name__} does not load weights from a stream; "
                                  "send whole state dicts (load_weights)")

    @abstractmethod
    def stats(self) -> dict:
        """Counters: running, waiting, finished, aborted, unknown_aborts, errors, swaps, ..."""

    def new_tokens(self, since: Mapping[RequestId, int]) -> dict[RequestId, tuple[list[int], list[float]]]:
        """For running requests of ``since`` (request id -> tokens already seen), the tokens they
        sampled after those and their behaviour log-probs (call between steps). Requests that are
        not running, or have nothing new, are left out. An engine that cannot tell returns {}: a
        streamed request then gets its tokens when it finishes."""
        return {}


class RolloutEngine(ABC):
    """A generator of responses whose weights the trainer updates in place."""

    version: int  # policy version of the weights now loaded

    @abstractmethod
    def generate(self, prompts: list[torch.Tensor], params: SamplingParams, *, seeds: list[int],
                 max_new_tokens: list[int] | None = None,
                 should_abort: Callable[[], bool] | None = None) -> GenerationOutput:
        """Generate one response per prompt.

        seeds: one per prompt; a row's sample depends on its own seed only.
        max_new_tokens: per-row budget overriding params.max_new_tokens (e.g. what is
            left of an interrupted generation).
        should_abort: polled between decode steps; when it returns True the engine
            returns what each unfinished row has so far, with finish reason "abort".
        """

    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy new weights in place (Hugging Face state_dict names) and set `version`.
        Unknown, missing or shape-mismatched names raise, naming the key."""

    @abstractmethod
    def release_memory(self) -> None:
        """Free what generation holds on the device (weights, KV cache) for the trainer."""

    @abstractmethod
    def resume_memory(self) -> None:
        """Undo release_memory before the next generate."""


def check_generate_args(prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int],
                        max_new_tokens: list[int] | None) -> list[int]:
    """Validate generate()'s arguments the same way in every engine; return the per-row budgets."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    n = len(prompts)
    if len(seeds) != n:
        raise ValueError(f"generate: got {n} prompts but {len(seeds)} seeds (need one seed per prompt)")
    for i, p in enumerate(prompts):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.numel() == 0:
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"generate: prompt {i} must be a non-empty 1-D token tensor, got {shape}")
        if p.dtype.is_floating_point or p.dtype == torch.bool:
            raise ValueError(f"generate: prompt {i} must hold integer token ids, got dtype {p.dtype}")
    if max_new_tokens is None:
        return [params.max_new_tokens] * n
    if len(max_new_tokens) != n:
        raise ValueError(f"generate: got {n} prompts but {len(max_new_tokens)} max_new_tokens entries")
    budgets = [int(b) for b in max_new_tokens]
    for i, b in enumerate(budgets):
        if b < 0:
            raise ValueError(f"generate: max_new_tokens[{i}] must be >= 0, got {b}")
    return budgets

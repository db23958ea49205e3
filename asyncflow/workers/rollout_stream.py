"""Rows streamed through a rollout service into the TransferQueue.

``submit`` turns a BatchMeta's rows into requests on the service; each row's result is
queued as soon as the engine finishes it, and a writer thread puts what finished into the
TransferQueue in one put per batch of finished rows (so downstream stages see rows as they
finish, not when the slowest row of a call does). A finished row waits at most ``linger_s``
for the other rows of its call, so that rows finishing a few decode steps apart share one
put: every put costs the TransferQueue a request, a wake-up of the requests waiting on its
rows and, read back in group order, a gather where one put would leave one run. The stream
counts rows in flight so that the executor can keep the engine's running batch full:
``wait_capacity`` returns once enough rows have been written out.

A stage with the option ``score_into`` (``placement.reward_with=inline``) also scores each
row with the run's rule reward before writing it and writes the score into that column with
the response: no reward stage, no second read of the rows.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import column_names as col
from ..agents.runner import episode_columns, episode_rows
from ..engines.rollout.base import GenerationRequest, RequestResult, SamplingParams
from ..engines.rollout.columns import result_columns
from ..engines.rollout.service import RolloutService
from ..transfer_queue import row_lists
from ..transfer_queue.meta import BatchMeta
from ..transfer_queue.protocol import TransferQueue
from ..workflow.stages import StageIO

__all__ = ["RowStream", "ScoreContext", "group_leaders", "row_inputs", "stage_params"]


ROLLOUT_INPUTS = [col.PROMPT_IDS, col.SEED]
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", col.MAX_NEW_TOKENS)


def row_inputs(data: Any, inputs: list[str] | None = None) -> tuple[list[torch.Tensor], list[int], list[int | None]]:
    """Prompts, seeds and per-row budgets (None: the sampling default) of the rollout stage's
    input columns: [prompt, seed, and optionally a ``max_new_tokens`` column of per-row budgets]."""
    names = ROLLOUT_INPUTS if inputs is None else list(inputs)
    if len(names) < 2:
        raise ValueError(f"a rollout stage reads [prompt, seed] columns first; it declares {names}")
    prompts = row_lists.rows(data[names[0]])
    seeds = [int(s) for s in row_lists.values(data[names[1]])]
    budget = col.MAX_NEW_TOKENS in data.keys()  # the data holds the stage's inputs only
    budgets: list[int | None] = ([int(b) for b in row_lists.values(data[col.MAX_NEW_TOKENS])] if budget
                                 else [None] * len(prompts))
    return prompts, seeds, budgets


def stage_params(params: SamplingParams, options: dict) -> SamplingParams:
    """The instance's sampling parameters with a stage's overrides (e.g. temperature 0 for a
    greedy baseline rollout)."""
    known = [*SAMPLING_OPTIONS, "one_per_group", "episode", "score_into"]
    bad = sorted(set(options) - set(known))
    if bad:
        raise ValueError(f"rollout stage options {bad} are unknown; known: {known}")
    if options.get("episode") and options.get("one_per_group"):
        raise ValueError("rollout stage options: one_per_group does not apply to episodes (one per row)")
    if options.get("episode") and options.get("score_into"):
        raise ValueError("rollout stage options: score_into does not apply to episodes (an episode scores itself)")
    over = {k: options[k] for k in SAMPLING_OPTIONS if k in options}
    return dataclasses.replace(params, **over) if over else params


def group_leaders(groups: list[int] | None, n: int) -> dict[int, list[int]]:
    """Row index of each group's first row -> every row of the group (each row its own group
    when the rows carry none)."""
    if not groups:
        return {i: [i] for i in range(n)}
    out: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    for i, g in enumerate(groups):
        lead = first.setdefault(g, i)
        out.setdefault(lead, []).append(i)
    return out


@dataclass
class ScoreContext:
    """What a rule reward reads of each row beside its response (``score_into`` stages)."""
    answers: list
    prompts: list | None = None
    metadata: list | None = None

    @staticmethod
    def of(data: Any, n: int, stage: str) -> ScoreContext:
        keys = set(data.keys())
        if col.ANSWER not in keys:
            raise ValueError(f"{stage}: a rollout stage with score_into reads the 'answer' column (and "
                             f"optionally 'prompt' and 'metadata'); it reads {sorted(keys)}")
        ctx = ScoreContext(row_lists.values(data[col.ANSWER]),
                           row_lists.values(data[col.PROMPT]) if col.PROMPT in keys else None,
                           row_lists.values(data[col.METADATA]) if col.METADATA in keys else None)
        if len(ctx.answers) != n:
            raise ValueError(f"{stage}: {len(ctx.answers)} answers for {n} rows")
        return ctx

    def select(self, index: list[int]) -> ScoreContext:
        def pick(xs: list | None) -> list | None:
            return None if xs is None else [xs[i] for i in index]

        return ScoreContext([self.answers[i] for i in index], pick(self.prompts), pick(self.metadata))

    def score(self, scorer: Any, responses: list[torch.Tensor]) -> torch.Tensor:
        return scorer.score(responses, self.answers, self.prompts, self.metadata)


def scored_columns(columns: Callable[..., dict], results: list, version: int, outputs: list[str] | None,
                   score_into: str | None, scorer: Any, context: ScoreContext | None, where: str = "") -> dict:
    """The stage's columns of ``results``; with ``score_into``, that column holds their scores
    and the others are the rollout's, in their order."""
    if not score_into:
        return columns(results, version, outputs)
    rest = [o for o in outputs or () if o != score_into]
    if not rest:
        raise ValueError(f"a rollout stage with score_into={score_into!r} must also write the responses")
    if context is None:
        raise ValueError(f"a rollout stage with score_into={score_into!r} needs what the reward reads of each "
                         "row (ScoreContext.of its input columns)")
    cols = columns(results, version, rest)
    try:
        cols[score_into] = context.score(scorer, [r.response_ids for r in results])
    except Exception as e:
        raise RuntimeError(f"scoring {len(results)} rows{where} into {score_into!r} (the reward inline in the "
                           f"rollout) failed: {type(e).__name__}: {e}") from e
    return cols


@dataclass
class _Batch:
    """The rows of one submitted BatchMeta, the columns its stage writes, whether its rows
    are episodes (trajectories) rather than single requests, and with ``score_into`` the
    column of their scores and what the reward reads of each row."""
    meta: BatchMeta
    outputs: list[str] | None = None
    episodes: bool = False
    score_into: str | None = None
    context: ScoreContext | None = None
    unfinished: int = 0  # rows not yet handed to the writer (only the writer counts them down)


class RowStream:
    def __init__(self, service: RolloutService, tq: Callable[[], TransferQueue], params: SamplingParams,
                 capacity: int, version: Callable[[], int], name: str = "rollout", timeout_s: float = 600.0,
                 linger_s: float = 0.0) -> None:
        if not (math.isfinite(linger_s) and linger_s >= 0):  # a queue wait takes no infinite timeout
            raise ValueError(f"{name}: linger_s must be a finite number >= 0 (0: whatever finished meanwhile "
                             f"goes out together), got {linger_s}")
        self.service = service
        self._tq = tq
        self.params = params
        self.capacity = capacity  # rows in flight (running + queued in the engine) at most
        self._version = version
        self.name = name
        self.timeout_s = timeout_s
        self.linger_s = linger_s
        self._ids = itertools.count()
        self._done: queue.SimpleQueue[tuple[_Batch, int, RequestResult] | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self.in_flight = 0
        self._written: dict[str, int] = {}  # partition -> rows written since the last report
        self._tokens: dict[str, int] = {}  # partition -> their generated tokens (to share busy time)
        self._busy_mark = 0.0
        self._error: BaseException | None = None
        self.rows_written = 0
        self.episodes: Any = None  # the instance's EpisodeRunner, for stages with an episode option
        self.scorer: Callable[[], Any] | None = None  # the instance's RowScorer, for score_into stages
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True)
        self._writer.start()

    # ---- the executor's side ---------------------------------------------------------------
    def submit(self, meta: BatchMeta, min_version: int, io: StageIO | None = None) -> None:
        """Queue the meta's rows on the service (fetching their prompts from the TransferQueue).
        ``io``: the stage's columns and options (sampling overrides; ``one_per_group``: one
        response per group, written to every row of the group, as a greedy baseline wants)."""
        self.check()
        if not len(meta):
            return
        inputs = None if io is None else io.inputs
        options = {} if io is None else io.options
        if io is not None and options.get("episode"):  # an episode runner reads the rows as a TensorDict
            return self._submit_episodes(meta, self._tq().get_data(meta, inputs), min_version, io)
        data = self._tq().get_columns(meta, inputs)  # the columns themselves: row_inputs reads them
        prompts, seeds, budgets = row_inputs(data, inputs)
        params = stage_params(self.params, options)
        score_into = options.get("score_into")
        if score_into and self.scorer is None:
            raise RuntimeError(f"{self.name}: a stage asks for scores ({score_into!r}) but this instance has no scorer")
        batch = _Batch(meta, None if io is None else io.outputs, score_into=score_into,
                       context=ScoreContext.of(data, len(prompts), self.name) if score_into else None,
                       unfinished=len(prompts))
        fan = (group_leaders(meta.groups, len(prompts)) if options.get("one_per_group")
               else {i: [i] for i in range(len(prompts))})
        with self._cond:
            self.in_flight += len(prompts)
        for i, members in fan.items():
            req = GenerationRequest((self.name, next(self._ids)), prompts[i], params, seeds[i], budgets[i],
                                    int(min_version))
            self.service.submit(req, on_done=functools.partial(self._finished, batch, members))

    def _finished(self, batch: _Batch, members: list[int], result: RequestResult) -> None:
        """A request's result, for each row it stands for (one_per_group: the whole group)."""
        for j in members:
            self._done.put((batch, j, result))

    def _submit_episodes(self, meta: BatchMeta, data: Any, min_version: int, io: StageIO) -> None:
        """One episode per row (``io.options["episode"]``, run by the instance's EpisodeRunner);
        each row is written when its episode ends."""
        if self.episodes is None:
            raise RuntimeError(f"{self.name}: this instance runs no episodes (no EpisodeRunner)")
        params = stage_params(self.params, {k: v for k, v in io.options.items() if k != "episode"})
        rows = episode_rows(data, len(meta))
        batch = _Batch(meta, io.outputs, episodes=True, unfinished=len(rows))
        with self._cond:
            self.in_flight += len(rows)
        for i, row in enumerate(rows):
            self.episodes.start(io.options["episode"], row, params, int(min_version), (self.name, next(self._ids)),
                                on_done=lambda t, i=i: self._done.put((batch, i, t)))

    def wait_capacity(self, want_free: int, timeout_s: float) -> dict:
        """Block until ``want_free`` rows fit (or the timeout); report what was written since the
        last report: rows and engine seconds per partition."""
        want = min(int(want_free), self.capacity)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.capacity - self.in_flight < want and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
                self.service.check()
            self.check()
            written, tokens = self._written, self._tokens
            self._written, self._tokens = {}, {}
            busy = self.service.busy_s
            share, self._busy_mark = busy - self._busy_mark, busy
        total = sum(tokens.values())
        busy_s = {p: share * tokens[p] / total if total else share / max(len(tokens), 1) for p in written}
        return {"free": self.capacity - self.in_flight, "in_flight": self.in_flight, "written": written,
                "busy_s": busy_s}

    def drain(self, timeout_s: float) -> None:
        """Wait until every submitted row is written (or raise after the timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.in_flight and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name}: {self.in_flight} rows still in flight after {timeout_s:.0f} s")
                self._cond.wait(min(left, 1.0))
                self.service.check()
        self.check()

    def check(self) -> None:
        self.service.check()
        if self._error is not None:
            raise RuntimeError(f"{self.name}: scoring or writing finished rows to the TransferQueue failed: "
                               f"{type(self._error).__name__}: {self._error}") from self._error

    def close(self) -> None:
        self._done.put(None)
        self._writer.join(10)

    # ---- the writer thread -----------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._done.get()
            if item is None:
                return
            try:
                self._write(self._collect(item))
            except BaseException as e:  # noqa: BLE001 - reported to the executor by check()
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return

    def _collect(self, first: tuple[_Batch, int, RequestResult]) -> list[tuple[_Batch, int, RequestResult]]:
        """The finished rows to write together: ``first``, every row finished meanwhile and, while
        a call of theirs still has rows generating, those that finish within ``linger_s`` of it."""
        finished = [first]
        first[0].unfinished -= 1
        open_calls = {id(first[0]): first[0]}  # the calls of the rows collected, until each is complete
        deadline = time.monotonic() + self.linger_s
        while True:
            try:
                more = self._done.get_nowait()
            except queue.Empty:
                open_calls = {k: b for k, b in open_calls.items() if b.unfinished > 0}
                left = deadline - time.monotonic()
                if not open_calls or left <= 0:
                    break
                try:
                    more = self._done.get(timeout=left)
                except queue.Empty:
                    break
            if more is None:  # closing: what is collected goes out, then the loop ends
                self._done.put(None)
                break
            more[0].unfinished -= 1
            open_calls.setdefault(id(more[0]), more[0])
            finished.append(more)
        return finished

    def _write(self, finished: list[tuple[_Batch, int, RequestResult]]) -> None:
        """One put per partition for everything that finished since the last write (rows of
        several submitted batches of a step go out together)."""
        by_part: dict[str, list[tuple[_Batch, int, RequestResult]]] = {}
        for batch, i, r in finished:
            if r.finish_reason == "error":
                what = "failed" if batch.episodes else "was refused"
                raise ValueError(f"{self.name}: row {i} of partition {batch.meta.partition!r} {what}: {r.error}")
            by_part.setdefault(batch.meta.partition, []).append((batch, i, r))
        tq = self._tq()
        version = self._version()
        for part, items in by_part.items():
            per_batch: dict[int, tuple[_Batch, list[tuple[int, RequestResult]]]] = {}
            for batch, i, r in items:
                per_batch.setdefault(id(batch), (batch, []))[1].append((i, r))
            by_outputs: dict[tuple, tuple[list, list, list]] = {}  # rows of stages that write other columns
            for batch, rows in per_batch.values():
                rows.sort(key=lambda x: x[0])
                key = (batch.episodes, tuple(batch.outputs or ()), batch.score_into)
                metas, results, contexts = by_outputs.setdefault(key, ([], [], []))
                index = [i for i, _ in rows]
                metas.append(batch.meta.select(index))
                results += [r for _, r in rows]
                if batch.context is not None:
                    contexts.append(batch.context.select(index))
            for (episodes, outputs, score_into), (metas, results, contexts) in by_outputs.items():
                meta = metas[0] if len(metas) == 1 else BatchMeta.concat(metas)
                columns = episode_columns if episodes else result_columns
                context = _concat_contexts(contexts) if score_into else None
                scorer = self.scorer() if score_into and self.scorer is not None else None
                tq.put(scored_columns(columns, results, version, list(outputs) or None, score_into,
                                      scorer, context, f" of partition {part!r}"),
                       part, meta)
            results = [r for _, rows in per_batch.values() for _, r in rows]
            with self._cond:
                self.in_flight -= len(results)
                self.rows_written += len(results)
                self._written[part] = self._written.get(part, 0) + len(results)
                self._tokens[part] = self._tokens.get(part, 0) + sum(len(r.response_ids) for r in results)
                self._cond.notify_all()


def _concat_contexts(parts: list[ScoreContext]) -> ScoreContext:
    def cat(get: Callable[[ScoreContext], list | None]) -> list | None:
        """The parts' lists end to end; None when a part has none."""
        out: list = []
        for p in parts:
            x = get(p)
            if x is None:
                return None
            out += x
        return out
    return ScoreContext([v for p in parts for v in p.answers], cat(lambda p: p.prompts), cat(lambda p: p.metadata))

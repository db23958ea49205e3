"""What an agent episode's requests recorded, and the trajectory rebuilt from it.

Every request the endpoint served under an episode's key is a ``Turn``: the prompt as the
engine saw it (token ids), the completion, its behaviour log-probs and per-token policy
versions, and where each message starts in the prompt text. An agent sends its whole
conversation each time, so a turn's prompt normally extends the previous turn's prompt and
completion; the trajectory is the chain of turns that extend one another, ending at the last
turn: the text between two model turns (tool results, user text, the template's markers) is
not trained (loss mask 0), the model's tokens are (1). Turns off that chain (an agent that
rewrote its history, or side requests) are counted, not trained. A request refused because
the conversation ran past the token budget leaves its text (tool output, cut to the budget)
at the end, untrained, as ``Conversation.env`` cuts it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..episode import EpisodeLimits, Trajectory

__all__ = ["EpisodeRecord", "Turn", "build_trajectory", "chain"]


@dataclass
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: str  # the engine's: stop | length | abort
    tool_calls: int = 0  # calls parsed from the completion
    prompt_text: str = ""
    message_starts: list[int] = field(default_factory=list)  # character offsets in prompt_text

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class EpisodeRecord:
    prompt_ids: list[int]  # the row's prompt: the trajectory is what follows it
    turns: list[Turn] = field(default_factory=list)
    refused: int = 0  # requests answered with an error (limits, bad input), not recorded
    tail_ids: list[int] | None = None  # the prompt of a request refused for the token budget


def chain(turns: list[Turn]) -> list[Turn]:
    """The last turn and, going back, each latest earlier turn that its prompt extends."""
    if not turns:
        return []
    out = [turns[-1]]
    for t in reversed(turns[:-1]):
        head, ids = out[-1].prompt_ids, t.ids
        if len(ids) <= len(head) and head[:len(ids)] == ids:
            out.append(t)
    return out[::-1]


def build_trajectory(record: EpisodeRecord, reward: float, limits: EpisodeLimits,
                     finish_reason: str | None = None) -> Trajectory:
    """The episode as a trained row (the same one the ``Conversation`` API builds for the same
    turns). ``finish_reason`` overrides the one the limits give (e.g. "time_limit")."""
    turns = chain(record.turns)
    base = len(record.prompt_ids)
    if not turns:
        late = " before its time limit (agent.max_time_s)" if finish_reason == "time_limit" else ""
        raise RuntimeError(f"the agent had no request answered with its episode key{late}: nothing to train")
    if turns[0].prompt_ids[:base] != record.prompt_ids:
        raise RuntimeError("the agent's first request does not start with the row's prompt: its messages must "
                           "render to the row's prompt (check rollout.openai_endpoint.chat_format and "
                           "data.chat_template)")
    ids: list[int] = []
    mask: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    starts: list[int] = []
    last_version = 0
    for t in turns:
        between = t.prompt_ids[base + len(ids):]
        ids += between
        mask += [0] * len(between)
        log_probs += [0.0] * len(between)
        versions += [last_version] * len(between)
        starts.append(len(ids))
        ids += t.completion_ids
        mask += [1] * len(t.completion_ids)
        log_probs += [float(x) for x in t.log_probs]
        versions += [int(v) for v in t.versions]
        if t.versions:
            last_version = int(t.versions[-1])
    tail = record.tail_ids
    if tail is not None and tail[:base + len(ids)] == record.prompt_ids + ids:
        extra = tail[base + len(ids):][:max(0, limits.max_tokens - len(ids))]
        ids += extra
        mask += [0] * len(extra)
        log_probs += [0.0] * len(extra)
        versions += [last_version] * len(extra)
    if finish_reason is None:
        if turns[-1].finish_reason == "abort":
            finish_reason = "abort"
        elif len(turns) >= limits.max_turns:
            finish_reason = "max_turns"
        elif len(ids) >= limits.max_tokens:
            finish_reason = "max_tokens"
        else:
            finish_reason = "stop"
    metrics = {"turns": float(len(turns)), "tool_calls": float(sum(t.tool_calls for t in turns)),
               "tool_errors": 0.0, "requests": float(len(record.turns)),
               "turns_off_chain": float(len(record.turns) - len(turns)), "requests_refused": float(record.refused)}
    return Trajectory(response_ids=torch.tensor(ids, dtype=torch.long), loss_mask=torch.tensor(mask, dtype=torch.int8),
                      log_probs=torch.tensor(log_probs, dtype=torch.float32),
                      token_versions=torch.tensor(versions, dtype=torch.long), turn_starts=starts,
                      reward=float(reward), finish_reason=finish_reason, metrics=metrics)

"""One plan: every candidate placement, the fastest that fits, and what to change if none does."""
from __future__ import annotations

from dataclasses import dataclass

from asyncflow.planning.advice import advice
from asyncflow.planning.split import Candidate, PlanInputs, candidates, with_tensor_parallel

__all__ = ["Plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    source: str  # where the model's shape came from
    candidates: list[Candidate]  # fitting ones first, each group by step time
    advice: list[str]  # empty when a candidate fits

    @property
    def chosen(self) -> Candidate | None:
        """The fastest candidate that fits in memory, if any does."""
        return self.candidates[0] if self.candidates[0].fits else None

    @property
    def shown(self) -> Candidate:
        """The candidate whose memory the report details: the chosen one, else the nearest to fitting."""
        return self.chosen or min(self.candidates, key=lambda c: c.fill)


def make_plan(inputs: PlanInputs, source: str = "") -> Plan:
    found = candidates(inputs)
    nearest = found[0] if found[0].fits else min(found, key=lambda c: c.fill)
    return Plan(inputs, source, found, advice(with_tensor_parallel(inputs, nearest.tensor_parallel), nearest))

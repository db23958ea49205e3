"""upstream_columns: what a stage's rows depend on, back to the prompt source, and nothing a
side branch writes."""
from __future__ import annotations

from asyncflow.workflow.stages import Stage, upstream_columns


def _graph() -> list[Stage]:
    return [Stage("rollout", "rollout", "generate", ["prompt_ids", "seed"], ["response_ids", "gen_version"],
                  kind="rollout"),
            Stage("reward", "reward", "compute", ["response_ids", "answer"], ["scores"]),
            Stage("audit", "reward", "audit", ["response_ids"], ["audit_note"]),  # a side branch
            Stage("adv", "reward", "advantages", ["scores"], ["advantages"]),
            Stage("update", "actor", "update", ["advantages", "gen_version"], kind="update")]


def test_the_update_depends_on_every_stage_on_its_path_and_the_source_columns_they_read():
    stages = _graph()
    assert upstream_columns(stages, stages[-1]) == {
        "advantages", "gen_version", "scores", "response_ids", "answer", "prompt_ids", "seed"}


def test_a_stage_depends_on_its_own_inputs_and_what_they_need():
    stages = _graph()
    assert upstream_columns(stages, stages[1]) == {"response_ids", "answer", "prompt_ids", "seed"}
    assert upstream_columns(stages, stages[0]) == {"prompt_ids", "seed"}

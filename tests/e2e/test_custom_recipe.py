"""A recipe written outside the repository trains end to end: its own worker class, its own
driver-side stage and its own reward, found by directory, without any file in asyncflow/
knowing of them. The reward sees the prompt text and the record's metadata."""
from __future__ import annotations

import json
import textwrap

import pytest
from _run import ok, train

FILES = {
    "__init__.py": "",
    "config.yaml": """
        imports: [lenalgo.rewards]     # every worker imports it: the reward registers there
        reward:
          name: first_digit
          on_error: fail               # a reward that raises stops the run
        algorithm:
          dynamic_sampling: false
        warmup:
          enabled: false
        rollout:
          n: 4
        placement:
          reward_with: rollout
        """,
    "rewards.py": """
        from asyncflow.rewards import register_reward

        @register_reward("first_digit")
        def first_digit(response, answer, *, prompt, level):
            # the prompt text and the record's metadata (the data file's other fields) arrive
            assert isinstance(prompt, str) and prompt.endswith("="), prompt
            assert level in (1, 2), level
            return float(response.strip()[:1] == answer[:1])
        """,
    "workers.py": """
        import torch
        from asyncflow.single_controller import Dispatch, Worker, register
        from asyncflow.workers.common import config_of, rows
        from asyncflow.workflow.stages import StageIO

        class LengthBonus(Worker):
            needs_device = False

            def __init__(self, cfg):
                self.scale = float(config_of(cfg).recipe_options["bonus_scale"])

            @register(Dispatch.DP_COMPUTE)
            def bonus(self, data, io):
                io = StageIO.of(io)  # the stage's declared columns
                lengths = [len(r) for r in rows(data[io.inputs[0]])]
                return {io.outputs[0]: torch.tensor([-self.scale * n for n in lengths], dtype=torch.float32)}
        """,
    "recipe.py": """
        import torch
        from asyncflow.workflow.stages import DRIVER, RecipeSpec, Role, Stage
        from recipes.grpo import recipe as grpo

        def mix(batch):
            return batch["scores"] + batch["bonus"]

        def build(cfg):
            roles = {**grpo.roles(cfg), "bonus": Role("lenalgo.workers:LengthBonus", on="rollout")}
            stages = [grpo.rollout(cfg), grpo.reward(cfg),
                      Stage("bonus", role="bonus", method="bonus", inputs=["response_ids"], outputs=["bonus"],
                            batch_rows=grpo.batch_rows(cfg)),
                      Stage("mix", role=DRIVER, method="", inputs=["scores", "bonus"], outputs=["mixed"],
                            batch_rows=grpo.batch_rows(cfg), fn=mix),
                      grpo.advantage(cfg, ["mixed", "response_ids"], score="mixed"),
                      grpo.update(cfg)]
            return RecipeSpec(roles, stages)
        """,
}


def _write(tmp_path):
    """The recipe folder, and the overrides of a data file whose records carry a level field."""
    d = tmp_path / "lenalgo"
    d.mkdir()
    for name, text in FILES.items():
        (d / name).write_text(textwrap.dedent(text))
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": 1 + (a + b > 9)} for a in range(10)
            for b in range(10)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d, ["data.task=file", f"data.path={data}", "data.num_eval=8", "recipe_options={bonus_scale: 0.01}"]


@pytest.mark.slow
def test_a_recipe_of_your_own_trains(tmp_path):
    d, data = _write(tmp_path)
    out = tmp_path / "run"
    ok(train(out, str(d), "trainer.steps=2", "trainer.eval_every=0", *data))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and summary["recipe"] == "lenalgo" and summary["reward/errors"] == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/grad_norm" in m]
    assert len(steps) == 2 and all("timing_s/mix" in m and "timing_s/bonus" in m for m in steps)
    roles = {r["rank"]: r["roles"] for r in json.loads((out / "ranks.json").read_text())}
    assert "bonus" in roles[1]


@pytest.mark.slow
def test_a_driver_stage_that_raises_stops_the_run_naming_it(tmp_path):
    d, data = _write(tmp_path)
    (d / "recipe.py").write_text((d / "recipe.py").read_text().replace(
        "return batch[\"scores\"] + batch[\"bonus\"]", "raise ArithmeticError('mix failed on purpose')"))
    p = train(tmp_path / "run", str(d), "trainer.steps=2", "trainer.eval_every=0", *data, timeout=180)
    assert p.returncode != 0
    assert "driver stage 'mix'" in p.stderr and "mix failed on purpose" in p.stderr and "step 0" in p.stderr
    assert str(d / "recipe.py") in p.stderr

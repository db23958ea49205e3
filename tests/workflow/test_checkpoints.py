"""Run checkpoints on disk (which is complete, which is resumed from, pruning) and the data
position a resumed run continues from (in-flight prompts first, nothing lost or twice)."""
from __future__ import annotations

import asyncio
import json

import pytest

from asyncflow.metrics.logger import keep_rows
from asyncflow.workflow import checkpoints as ck
from asyncflow.workflow.source import PromptSource, resume_source, skip_records


def _save(out, n, in_flight=()):
    target = ck.step_dir(out, n)
    tmp = ck.begin(target)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "weights").write_text(f"v{n}")
    ck.commit(tmp, target, ck.RunState(steps_done=n, next_uid=4 * n, in_flight=list(in_flight), roles=["actor"]))
    return target


def test_only_complete_checkpoints_count_and_auto_takes_the_newest(tmp_path):
    assert ck.find_resume(tmp_path, "auto") is None and ck.find_resume(tmp_path, "") is None
    _save(tmp_path, 2)
    _save(tmp_path, 10)
    ck.begin(ck.step_dir(tmp_path, 12))  # a crash mid-write: a temp dir
    (ck.root(tmp_path) / "step_11").mkdir()  # a directory without state.json
    assert [p.name for p in ck.complete(tmp_path)] == ["step_2", "step_10"]  # numeric, not text, order
    assert ck.find_resume(tmp_path, "auto").name == "step_10"
    assert ck.load_state(ck.find_resume(tmp_path, "auto")).next_uid == 40
    assert ck.find_resume(tmp_path, str(ck.step_dir(tmp_path, 2))).name == "step_2"


def test_resume_from_an_incomplete_directory_is_refused_with_the_way_out(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(ck.CheckpointError, match="not a complete run checkpoint.*trainer.resume=auto"):
        ck.find_resume(tmp_path, str(tmp_path / "x"))


def test_unknown_format_is_refused(tmp_path):
    target = _save(tmp_path, 1)
    state = json.loads((target / ck.STATE_FILE).read_text())
    (target / ck.STATE_FILE).write_text(json.dumps({**state, "format": 99}))
    with pytest.raises(ck.CheckpointError, match="format 99"):
        ck.load_state(target)


def test_prune_keeps_the_newest_and_removes_failed_writes(tmp_path):
    for n in (1, 2, 3):
        _save(tmp_path, n)
    ck.begin(ck.step_dir(tmp_path, 4))
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [".step_4.tmp", "step_1"]
    assert [p.name for p in ck.complete(tmp_path)] == ["step_2", "step_3"]
    assert (ck.step_dir(tmp_path, 3) / "actor" / "weights").read_text() == "v3"


def test_remove_all_clears_an_earlier_runs_checkpoints(tmp_path):
    _save(tmp_path, 900)
    ck.remove_all(tmp_path)
    assert ck.complete(tmp_path) == [] and ck.find_resume(tmp_path, "auto") is None


def test_saving_the_same_step_again_replaces_it_whole(tmp_path):
    _save(tmp_path, 5)
    _save(tmp_path, 5, in_flight=[19])
    assert ck.load_state(ck.step_dir(tmp_path, 5)).in_flight == [19]
    assert not list(ck.root(tmp_path).glob(".*"))


class _Stream:
    """An iterator that is not a dataset: skipping must walk it."""
    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return {"prompt_ids": [self.i - 1], "answer": str(self.i - 1)}


def _uids(cols):
    return cols["__groups__"][::2]


def test_a_resumed_source_issues_in_flight_prompts_first_with_their_seeds_then_continues():
    straight = PromptSource(_Stream(), group_size=2, seed=7)
    first = asyncio.run(straight(0, 4))  # uids 0-3, trained before the crash
    inflight = asyncio.run(straight(1, 4))  # uids 4-7, in flight at the checkpoint
    later = asyncio.run(straight(2, 3))

    records, replay = resume_source(_Stream(), next_uid=8, in_flight=[4, 5, 6, 7])
    resumed = PromptSource(records, group_size=2, seed=7, start_uid=8, replay=replay)
    again = asyncio.run(resumed(1, 4))
    assert _uids(again) == [4, 5, 6, 7] and _uids(first) == [0, 1, 2, 3]
    assert again["seed"].tolist() == inflight["seed"].tolist()  # same rows as before the crash
    assert again["answer"] == inflight["answer"]
    nxt = asyncio.run(resumed(2, 3))
    assert _uids(nxt) == _uids(later) == [8, 9, 10] and nxt["answer"] == later["answer"]


def test_in_flight_prompts_may_be_split_across_calls_and_interleaved():
    records, replay = resume_source(_Stream(), next_uid=12, in_flight=[3, 9, 10])
    src = PromptSource(records, group_size=1, seed=0, start_uid=12, replay=replay)
    assert asyncio.run(src(0, 2))["__groups__"] == [3, 9]
    assert asyncio.run(src(0, 2))["__groups__"] == [10, 12]


def test_in_flight_uids_must_lie_below_the_data_position():
    with pytest.raises(ValueError, match="below the data position"):
        resume_source(_Stream(), next_uid=4, in_flight=[4])


def test_skipping_a_dataset_jumps_to_the_same_record_as_walking(tmp_path):
    from asyncflow.data.dataset import DataConfig, PromptDataset

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(5)))

    class Tok:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

    walked = PromptDataset(DataConfig(path=str(path), seed=3), Tok())
    expected = [next(walked)["answer"] for _ in range(13)]
    jumped = skip_records(PromptDataset(DataConfig(path=str(path), seed=3), Tok()), 11)
    assert [next(jumped)["answer"] for _ in range(2)] == expected[11:]


def test_keep_rows_drops_what_came_after_the_checkpoint(tmp_path):
    f = tmp_path / "m.jsonl"
    rows = [{"step": 1, "time_s": 1.0}, {"step": 2, "time_s": 2.0}, {"step": 3, "time_s": 3.5}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ti')  # cut short by the crash
    assert keep_rows(f, lambda r: r["step"] <= 2) == 2.0
    assert [json.loads(x)["step"] for x in f.read_text().splitlines()] == [1, 2]
    assert keep_rows(tmp_path / "none.jsonl", lambda r: True) == 0.0


def test_config_changes_name_each_setting_a_resume_changed_except_run_length_and_logging(tmp_path):
    from asyncflow.workflow.checkpoints import config_changes, write_config
    then = {"optim": {"lr": 1e-6, "betas": [0.9, 0.999]}, "rollout": {"n": 8},
            "trainer": {"steps": 100, "resume": "", "wandb": {"project": "a"}, "seed": 0}}
    assert config_changes(tmp_path, then) == []  # a checkpoint that recorded no settings: nothing to say
    write_config(tmp_path, then)
    assert config_changes(tmp_path, then) == []
    now = {"optim": {"lr": 1e-3, "betas": (0.9, 0.999)}, "rollout": {"n": 8, "new_key": 1},
           "trainer": {"steps": 500, "resume": "auto", "wandb": {"project": "b"}, "seed": 1}}
    assert config_changes(tmp_path, now) == ["optim.lr: 1e-06 -> 0.001", "rollout.new_key: (absent) -> 1",
                                             "trainer.seed: 0 -> 1"]

"""The addition task: a fixed held-out set that training never sees."""
from __future__ import annotations

import itertools
import random

import pytest

from asyncflow.data import AdditionTask, addition_record


def test_record_format():
    assert addition_record(1234) == {"prompt": "12+34=", "answer": "46", "index": 1234}
    assert addition_record(0) == {"prompt": "0+0=", "answer": "0", "index": 0}
    assert addition_record(9999) == {"prompt": "99+99=", "answer": "198", "index": 9999}
    with pytest.raises(ValueError, match="outside 0..9999"):
        addition_record(10000)


def test_held_out_set_is_fixed_by_seed_and_disjoint_from_training():
    task = AdditionTask(seed=3, num_eval=256)
    ev = task.eval_records()
    assert len(ev) == 256 and len({r["index"] for r in ev}) == 256
    assert [r["index"] for r in ev] == [r["index"] for r in AdditionTask(seed=3).eval_records()]
    assert {r["index"] for r in ev} != {r["index"] for r in AdditionTask(seed=4).eval_records()}
    held = set(task.eval_indices)
    assert held.isdisjoint(task.train_indices)
    assert len(held) + len(task.train_indices) == 10000
    for r in ev:
        a, b = map(int, r["prompt"][:-1].split("+"))
        assert r["answer"] == str(a + b) and r["index"] == a * 100 + b


def test_training_stream_excludes_held_out():
    task = AdditionTask(seed=0, num_eval=2000)  # a large held-out set makes a leak likely to show
    held = set(task.eval_indices)
    drawn = task.train_records(5000, random.Random(1))
    assert not held & {r["index"] for r in drawn}
    assert drawn[:10] == task.train_records(10, random.Random(1))  # reproducible from the rng
    stream = list(itertools.islice(task.iter_train(seed=5), 3000))
    assert not held & {r["index"] for r in stream}
    assert stream[:20] == list(itertools.islice(task.iter_train(seed=5), 20))


def test_sft_examples():
    task = AdditionTask(seed=0, num_eval=256)
    ex = task.sft_examples()
    assert len(ex) == 10000 - 256
    assert not set(task.eval_indices) & {e["index"] for e in ex}
    e = ex[0]
    assert e["completion"] == e["answer"] + "<eos>" and e["text"] == e["prompt"] + e["completion"]
    assert [x["index"] for x in ex] != sorted(x["index"] for x in ex)  # shuffled
    assert task.sft_examples(eos_token="</s>")[0]["completion"].endswith("</s>")


@pytest.mark.parametrize("n", [0, 10000])
def test_bad_num_eval(n):
    with pytest.raises(ValueError, match="num_eval"):
        AdditionTask(num_eval=n)

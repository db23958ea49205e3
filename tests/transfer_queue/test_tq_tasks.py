"""A partition created with tasks serves only those tasks: a misspelt task name is refused
with an error naming the task, the partition and the declared tasks, and consumes nothing.
Declaring more tasks later adds them; a partition created without tasks serves any task."""
from __future__ import annotations

import _tq_helpers as H
import pytest
import torch

from asyncflow.transfer_queue import UnknownTaskError

REFUSED = (r"unknown task 'trian' for partition 'p': it serves only the tasks declared for it, \['eval', 'train'\]; "
           r"fix the task name, or declare it with create_partition\('p', tasks=\['trian'\]\)")


@pytest.fixture
def declared(tq):
    """Partition 'p' declared for 'train' and 'eval', with 6 rows; 'train' took 2 of them."""
    c = tq.client
    c.create_partition("p", tasks=["train", "eval"])
    put = c.put({"k": torch.arange(6)}, "p")
    assert c.get_meta(["k"], 2, "train", "p", timeout=1).rows == put.rows[:2]
    return tq, put, c.status("p")


@pytest.mark.parametrize("how", ["get_meta", "get_batch", "get_meta_dp", "reset_consumption"])
def test_an_undeclared_task_is_refused_and_consumes_nothing(declared, how):
    tq, put, before = declared
    c = tq.client
    with pytest.raises(UnknownTaskError, match=REFUSED):
        if how == "get_meta":
            c.get_meta(["k"], 2, "trian", "p", timeout=1)
        elif how == "get_batch":
            c.get_batch(["k"], 2, "trian", "p", timeout=1)
        elif how == "get_meta_dp":
            c.get_meta(["k"], 2, "trian", "p", dp_group="g", dp_rank=0, dp_size=2, timeout=1)
        else:
            c.reset_consumption("p", "trian")
    assert c.status("p") == before  # no consumer, subscription or consumption was added
    assert "trian" not in c.status()["tasks"]
    assert c.get_meta(["k"], 4, "train", "p", timeout=1).rows == put.rows[2:]
    assert c.get_meta(["k"], 6, "eval", "p", timeout=1).rows == put.rows


def test_the_async_client_is_refused_alike(declared):
    tq, put, before = declared

    async def main():
        c = tq.async_client()
        try:
            with pytest.raises(UnknownTaskError, match=REFUSED):
                await c.get_batch(["k"], 2, "trian", "p", timeout=1)
        finally:
            await c.close()
    H.run_async(main())
    assert tq.client.status("p") == before


def test_declaring_more_tasks_later_adds_them(declared):
    tq, put, before = declared
    c = tq.client
    c.create_partition("p", tasks=["trian"])  # the same partition: its rows stay
    assert c.status("p")["rows"] == 6
    assert c.status("p")["tasks"] == ["eval", "train", "trian"]
    assert c.get_meta(["k"], 6, "trian", "p", timeout=1).rows == put.rows
    assert c.get_meta(["k"], 4, "train", "p", timeout=1).rows == put.rows[2:]
    c.reset_consumption("p", "trian")
    with pytest.raises(UnknownTaskError, match=r"'other' for partition 'p'.*\['eval', 'train', 'trian'\]"):
        c.get_meta(["k"], 1, "other", "p", timeout=1)


def test_a_partition_without_declared_tasks_serves_any_task(tq):
    c = tq.client
    c.create_partition("p", tasks=["train"])
    c.create_partition("q")
    put = c.put({"k": torch.arange(3)}, "q")
    for task in ("train", "anything", "trian"):
        assert c.get_meta(["k"], 3, task, "q", timeout=1).rows == put.rows
    c.reset_consumption("q", "anything")
    # reset_consumption of a task no partition has seen is still refused.
    with pytest.raises(UnknownTaskError, match=r"unknown task 'nobody'; known tasks: \['anything', 'train', 'trian'\]"):
        c.reset_consumption("q", "nobody")


def test_tasks_given_as_one_string_are_refused(tq):
    with pytest.raises(ValueError, match=r"tasks must be a list of names, got the string 'train'; "
                                         r"write tasks=\['train'\]"):
        tq.client.create_partition("p", tasks="train")
    with pytest.raises(ValueError, match=r"tasks must be a list of non-empty strings"):
        tq.client.create_partition("p", tasks=["train", ""])
    assert tq.client.status()["partitions"] == []

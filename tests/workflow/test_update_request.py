"""The update request: what crosses to the actor's ranks, and the errors a bad one gets."""
from __future__ import annotations

import pytest

from asyncflow.single_controller.wire import from_wire, to_wire
from asyncflow.workflow.update_request import UpdateRequest


def test_round_trip_through_the_worker_wire():
    req = UpdateRequest("step_3", "update", 64, 30.0)
    wire = to_wire(req.to_wire())  # what WorkerGroup.call sends: JSON values only
    assert wire == {"partition": "step_3", "task": "update", "rows": 64, "timeout_s": 30.0}
    assert UpdateRequest.from_wire(from_wire(wire)) == req


def test_an_int_timeout_is_a_float():
    req = UpdateRequest.from_wire({"partition": "p", "task": "t", "rows": 0, "timeout_s": 5})
    assert req.timeout_s == 5.0 and isinstance(req.timeout_s, float)


def test_the_dataclass_itself_is_accepted():
    req = UpdateRequest("p", "t", 1, 1.0)
    assert UpdateRequest.from_wire(req) is req


def test_it_is_frozen():
    req = UpdateRequest("p", "t", 1, 1.0)
    with pytest.raises(AttributeError):
        req.rows = 2


GOOD = {"partition": "p", "task": "update", "rows": 8, "timeout_s": 1.0}


@pytest.mark.parametrize("wire, field, words", [
    ({k: v for k, v in GOOD.items() if k != "rows"}, "rows", "missing field"),
    ({**GOOD, "extra": 1}, "extra", "unknown field"),
    ({**GOOD, "rows": "8"}, "rows", "must be an int"),
    ({**GOOD, "rows": True}, "rows", "must be an int"),
    ({**GOOD, "rows": -1}, "rows", "must be >= 0"),
    ({**GOOD, "partition": 3}, "partition", "must be a str"),
    ({**GOOD, "task": None}, "task", "must be a str"),
    ({**GOOD, "timeout_s": "1"}, "timeout_s", "must be a number"),
    ({**GOOD, "timeout_s": 0}, "timeout_s", "must be > 0"),
])
def test_a_bad_request_names_its_field(wire, field, words):
    with pytest.raises(ValueError, match=f"{words}.*{field!r}|{field!r}.*{words}"):
        UpdateRequest.from_wire(wire)


def test_not_a_dict():
    with pytest.raises(ValueError, match="expected a dict of its fields, got list"):
        UpdateRequest.from_wire(["p", "update", 8, 1.0])

"""Which node this process is on, and which storage unit is local to it.

Set once per process by the launcher (``asyncflow.single_controller.launch``); clients
created afterwards without an explicit ``preferred_unit`` write to the local unit and
label their puts with the node, so each unit can report who wrote into it. Unset (tests,
notebooks), clients spread new rows over the units and label puts with no node.
"""
from __future__ import annotations

_node: int | None = None
_unit: int | None = None


def set_locality(node: int | None, unit: int | None) -> None:
    """This process runs on ``node``; ``unit`` (None: no unit on this node) takes its writes."""
    global _node, _unit
    _node, _unit = node, unit


def local_node() -> int | None:
    return _node


def local_unit() -> int | None:
    return _unit

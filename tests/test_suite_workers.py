"""The suite's two xdist workers (pytest.ini): every multi-process test (marked slow) in one
group, so that they run one after another on one worker, and the single-process tests beside them."""
from __future__ import annotations

import configparser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pytest_ini_runs_two_workers_that_keep_groups_together():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    opts = ini["pytest"]["addopts"].split()
    assert opts[opts.index("-n") + 1] == "2" and opts[opts.index("--dist") + 1] == "loadgroup", opts


def test_every_slow_test_and_no_other_is_in_the_multi_process_group(request: pytest.FixtureRequest):
    items = request.session.items
    grouped = {i.nodeid for i in items if any(m.args == ("multi_process",) for m in i.iter_markers("xdist_group"))}
    slow = {i.nodeid for i in items if i.get_closest_marker("slow") is not None}
    assert grouped == slow
    assert request.node.nodeid not in grouped  # this test itself is single-process

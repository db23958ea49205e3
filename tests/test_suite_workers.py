"""The suite's two xdist workers (pytest.ini): the end-to-end jobs (tests/e2e) and the vLLM tests
in one group, so that they run one after another on one worker, and every other test on
whichever is free."""
from __future__ import annotations

import configparser
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pytest_ini_runs_two_workers_that_keep_groups_together():
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    opts = ini["pytest"]["addopts"].split()
    assert opts[opts.index("-n") + 1] == "2" and opts[opts.index("--dist") + 1] == "loadgroup", opts


def test_every_e2e_and_vllm_test_and_no_other_is_in_the_e2e_group(request: pytest.FixtureRequest):
    items = request.session.items
    grouped = {i.nodeid for i in items if any(m.args == ("e2e_runs",) for m in i.iter_markers("xdist_group"))}
    e2e = {i.nodeid for i in items if i.nodeid.startswith("tests/e2e/") or i.get_closest_marker("vllm")}
    assert grouped == e2e
    assert request.node.nodeid not in grouped


class _Item:
    def __init__(self, path: Path, marker: str = ""):
        self.path, self.marker, self.marks = path, marker, []

    def add_marker(self, mark) -> None:
        self.marks.append(mark)

    def get_closest_marker(self, name: str):
        return name if name == self.marker else None


def test_the_hook_groups_a_test_by_its_folder_or_its_vllm_mark():
    # tests/conftest.py by its path: `import conftest` may find tests/e2e/conftest.py first
    spec = importlib.util.spec_from_file_location("suite_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    e2e, unit = _Item(ROOT / "tests" / "e2e" / "test_x.py"), _Item(ROOT / "tests" / "workflow" / "test_x.py")
    engine = _Item(ROOT / "tests" / "engines" / "test_x.py", marker="vllm")
    conftest.pytest_collection_modifyitems(None, [e2e, unit, engine])
    assert [(m.name, m.args) for m in e2e.marks] == [("xdist_group", ("e2e_runs",))] == \
        [(m.name, m.args) for m in engine.marks]
    assert unit.marks == []

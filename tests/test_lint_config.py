"""The lint configuration CI runs: ruff.toml's rule set and Python version, mypy.ini's checked
packages, the pinned tools, and .ci/run's lint stage in the first run's venv."""
from __future__ import annotations

import configparser
import importlib.util
import re
import tomllib
import types
from pathlib import Path


def _load_packaging_checks() -> types.ModuleType:
    """test_packaging.py's readers of .ci/run and setup.py, loaded from its file: beside verl
    (CI's third stage) verl's own top-level `tests` package hides `tests.test_packaging`."""
    spec = importlib.util.spec_from_file_location("_asyncflow_packaging_checks",
                                                  Path(__file__).with_name("test_packaging.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_PACKAGING = _load_packaging_checks()
_ci_blocks = _PACKAGING._ci_blocks
_setup_kwargs = _PACKAGING._setup_kwargs

ROOT = Path(__file__).resolve().parents[1]
_CI_LINT = "# --- Lint"


def _ruff() -> dict:
    return tomllib.loads((ROOT / "ruff.toml").read_text())


def test_ruff_targets_setup_pys_oldest_python_and_selects_the_rule_set():
    cfg = _ruff()
    floor = re.fullmatch(r">=\s*3\.(\d+)", _setup_kwargs()["python_requires"])
    assert floor, "python_requires is a floor"
    assert cfg["target-version"] == f"py3{floor.group(1)}", "pyupgrade must not use syntax newer than the floor"
    rules = set(cfg["lint"]["select"])
    # pycodestyle, pyflakes, import order, bugbear, pyupgrade, and unused noqa comments.
    assert {"E", "W", "F", "I", "B", "UP", "RUF100"} <= rules, rules
    assert not {"E", "W", "F", "I"} & set(cfg["lint"].get("ignore", [])), "whole families are never ignored"


def test_ruff_per_file_ignores_are_narrow():
    ignores = _ruff()["lint"].get("per-file-ignores", {})
    for pattern, codes in ignores.items():
        assert all(re.fullmatch(r"[A-Z]+[0-9]+", c) for c in codes), (pattern, codes)


def test_lint_tools_are_pinned():
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / "requirements-lint.txt").read_text().splitlines()]
    pins = dict(ln.split("==") for ln in lines if ln)
    assert {"ruff", "mypy"} <= set(pins) and all(re.fullmatch(r"[0-9][\w.]*", v) for v in pins.values()), pins


def test_ci_lints_in_the_first_runs_venv_right_after_its_tests():
    blocks = list(_ci_blocks().items())
    assert blocks[0][1][-1] == "python -m pytest -q tests"
    title, lint = blocks[1]
    assert title.startswith(_CI_LINT), f"the block after the first run is the lint stage, got {title!r}"
    assert lint[0] == "pip install -r requirements-lint.txt"
    assert "ruff check ." in lint and "mypy" in lint
    assert not any(c.startswith(("deactivate", "python3 -m venv", ". ")) for c in lint), "no venv switch before lint"


# strict mode's per-module flags (`mypy --help`, --strict): a section's `strict = True` would set
# them for the whole run, so the strict section names them one by one.
_STRICT_FLAGS = {
    "disallow_any_generics": True, "disallow_subclassing_any": True, "disallow_untyped_calls": True,
    "disallow_untyped_defs": True, "disallow_incomplete_defs": True, "check_untyped_defs": True,
    "disallow_untyped_decorators": True, "warn_unused_ignores": True, "warn_return_any": True,
    "implicit_reexport": False, "strict_equality": True, "extra_checks": True,
}


def _mypy() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "mypy.ini")
    return cfg


def _modules(section: str) -> list[str]:
    return [m.strip() for m in section.removeprefix("mypy-").split(",")]


def _files(cfg: configparser.ConfigParser) -> list[str]:
    return [f.strip() for f in cfg["mypy"]["files"].split(",") if f.strip()]


def _pattern(path: str) -> str:
    """The section pattern that names ``path`` of `files`: a package's modules, or one module."""
    return path.removesuffix(".py").replace("/", ".") if path.endswith(".py") else path.replace("/", ".") + ".*"


def _strict_modules(cfg: configparser.ConfigParser) -> set[str]:
    return {m for s in cfg.sections() if s.startswith("mypy-")
            and all(cfg[s].getboolean(k, fallback=None) is v for k, v in _STRICT_FLAGS.items())
            for m in _modules(s)}


# The sections of lenient packages may set only these (none of them makes mypy check more code).
_LENIENT_ALLOWED = {"warn_unused_ignores": True}
# The packages checked leniently (issue 43: "lenient elsewhere"), added one at a time.
_LENIENT = {
    "asyncflow/engines",
    "asyncflow/simulation",
    "asyncflow/planning",
    "asyncflow/data",
    "asyncflow/rewards",
    "asyncflow/models",
    "asyncflow/algorithms",
    "asyncflow/training",
    "asyncflow/workers",
    "asyncflow/agents",
    "asyncflow/metrics",
    "recipes",
    "asyncflow/config",
    "asyncflow/resolved.py",
    "asyncflow/algorithm_config.py",
    "asyncflow/platform.py",
    "asyncflow/cli.py",
    "asyncflow/launcher.py",
}


def _lenient_modules(cfg: configparser.ConfigParser) -> set[str]:
    return {m for s in cfg.sections() if s.startswith("mypy-") and s != "mypy-asyncflow.*"
            and set(cfg[s]) == set(_LENIENT_ALLOWED)
            and all(cfg[s].getboolean(k) is v for k, v in _LENIENT_ALLOWED.items())
            for m in _modules(s)}


def test_mypy_checks_strict_or_lenient_packages_and_ignores_no_errors():
    cfg = _mypy()
    files = _files(cfg)
    assert files, "mypy checks something"
    strict, lenient = _strict_modules(cfg), _lenient_modules(cfg)
    for f in files:
        assert (_pattern(f) in strict) != (_pattern(f) in lenient), f"{f}: a checked package is strict or lenient"
    # the layers whose seams the rest of the code is written against are held strict
    assert {f"asyncflow/{p}" for p in ("rpc", "weight_sync", "transfer_queue", "single_controller",
                                        "workflow")} <= {f for f in files if _pattern(f) in strict}, files
    assert not any("strict" in cfg[s] for s in cfg.sections()), "strict = True reaches the whole run"
    assert not any(cfg[s].getboolean("ignore_errors", False) for s in cfg.sections()), "no ignore_errors"
    assert "ignore_missing_imports" not in cfg["mypy"], "missing imports are ignored per module only"
    for s in cfg.sections():
        if cfg[s].getboolean("ignore_missing_imports", False):
            assert not any(m.startswith("asyncflow") for m in _modules(s)), s


def test_mypy_checks_the_other_packages_leniently():
    cfg = _mypy()
    lenient = {f for f in _files(cfg) if _pattern(f) in _lenient_modules(cfg)}
    assert lenient == _LENIENT, lenient
    # no lenient section turns a strict flag on or errors off
    for s in cfg.sections():
        if s.startswith("mypy-") and set(_modules(s)) & {_pattern(f) for f in _LENIENT}:
            assert set(cfg[s]) <= set(_LENIENT_ALLOWED), (s, dict(cfg[s]))


# a `# type: ignore` names the codes it silences; in a lenient package it also says why after them,
# on its line (the strict packages give some of their reasons on the line above)
_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[a-z-]+(?:,\s*[a-z-]+)*\])?(?P<rest>.*)")


def test_the_checked_code_ignores_only_named_errors():
    for f in _files(_mypy()):
        path = ROOT / f
        for src in [path] if path.is_file() else sorted(path.rglob("*.py")):
            text = src.read_text()
            assert not re.search(r"#\s*mypy:\s*ignore-errors", text), f"{src}: a whole file unchecked"
            for n, line in enumerate(text.splitlines(), 1):
                m = _IGNORE.search(line)
                if m:
                    where = f"{src.relative_to(ROOT)}:{n}"
                    assert m["codes"], f"{where}: a blanket type: ignore"
                    if f in _LENIENT:
                        assert re.match(r"\s*#\s*\S", m["rest"]), f"{where}: the ignore says why on its line"


def test_mypy_reads_the_projects_unchecked_modules():
    # silent (read, errors not reported) is allowed for imported modules; skip would leave a
    # checked package's calls into them unchecked.
    cfg = _mypy()
    modes = {s: cfg[s]["follow_imports"] for s in cfg.sections() if "follow_imports" in cfg[s]}
    assert set(modes.values()) <= {"normal", "silent"}, modes

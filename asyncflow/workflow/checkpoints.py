"""Run checkpoints: where they live, which one is complete, and the driver's part of the state.

A run checkpoint is a directory ``<out_dir>/checkpoints/step_<n>`` taken after ``n`` RL
updates. The worker groups write their engines' state into it (``actor/``, ``critic/``:
model, optimizer, LR schedule, RNG per rank) and the driver writes ``state.json``: the
policy version, the data position and the prompts that were in flight.

Atomic: everything is written into ``.step_<n>.tmp`` first; ``state.json`` is written
last, then the directory is renamed. A directory named ``step_<n>`` with a ``state.json``
is complete; anything else (a crash mid-write, a failed write) is ignored and cleaned up.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
CONFIG_FILE = "config.json"  # the settings of the run that wrote the checkpoint
# Settings a resumed run may change without comment: how long it runs, what it logs, where it saves.
RESUME_MAY_CHANGE = ("trainer.resume", "trainer.steps", "trainer.time_budget_s", "trainer.progress",
                     "trainer.loggers", "trainer.eval_every", "trainer.save_every", "trainer.keep_checkpoints",
                     "trainer.wandb", "workflow.call_timeout_s")
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT = 1


class CheckpointError(RuntimeError):
    pass


@dataclass
class RunState:
    """What the driver needs, beside the engines' state, to continue a run."""
    steps_done: int  # RL updates so far; the policy version the actor holds
    next_uid: int  # prompts taken from the data stream so far
    in_flight: list[int] = field(default_factory=list)  # uids issued to steps not yet trained: issued again
    prompts_consumed: int = 0  # prompts of trained steps (trained, or dropped by dynamic sampling)
    warmup_steps: int = 0
    accuracy_before_rl: float = float("nan")
    reference: str = ""  # the reference model's directory ("" = the base model)
    roles: list[str] = field(default_factory=list)  # worker groups whose engines are in the checkpoint
    format: int = FORMAT

    @staticmethod
    def from_dict(d: dict[str, Any], where: Path) -> RunState:
        if d.get("format") != FORMAT:
            raise CheckpointError(f"{where}: checkpoint format {d.get('format')!r}, this version reads {FORMAT}")
        known = RunState.__dataclass_fields__
        return RunState(**{k: v for k, v in d.items() if k in known})


def root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir(out_dir: str | Path, steps_done: int) -> Path:
    return root(out_dir) / f"step_{steps_done}"


def tmp_dir(target: Path) -> Path:
    return target.parent / f".{target.name}.tmp"


def complete(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    r = root(out_dir)
    if not r.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in r.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def find_resume(out_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint ``trainer.resume`` names: "" none, "auto" the newest complete one in
    out_dir (none if there is none), else that directory, which must be complete."""
    if not resume:
        return None
    if resume == "auto":
        found = complete(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"trainer.resume={resume!r}: {path / STATE_FILE} does not exist, so this is not a "
                              f"complete run checkpoint (those are {root(out_dir)}/step_<n>); use trainer.resume=auto "
                              "to take the newest complete one")
    return path


def load_state(path: Path) -> RunState:
    try:
        data = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / STATE_FILE}: {e}") from e
    return RunState.from_dict(data, path)


def begin(target: Path) -> Path:
    """A fresh temporary directory for ``target`` (one left by a crash is removed)."""
    tmp = tmp_dir(target)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_config(tmp: Path, config: dict[str, Any]) -> None:
    """The run's settings beside its state (before ``commit``), for a resume to compare with."""
    (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True))


def config_changes(checkpoint: Path, config: dict[str, Any]) -> list[str]:
    """``key: then -> now`` for each setting that differs from the run that wrote ``checkpoint``
    (outside ``RESUME_MAY_CHANGE``); empty when it recorded none (an older checkpoint)."""
    try:
        then = json.loads((checkpoint / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return []
    a, b = _flat(then), _flat(json.loads(json.dumps(config)))  # as written: tuples read back as lists

    def keep(k: str) -> bool:
        return not any(k == m or k.startswith(m + ".") for m in RESUME_MAY_CHANGE)
    missing = object()
    return [f"{k}: {a.get(k, missing)!r} -> {b.get(k, missing)!r}".replace(repr(missing), "(absent)")
            for k in sorted(set(a) | set(b)) if keep(k) and a.get(k, missing) != b.get(k, missing)]


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def commit(tmp: Path, target: Path, state: RunState) -> None:
    """Write state.json (synced) into ``tmp``, then rename ``tmp`` to ``target``."""
    data = json.dumps(asdict(state), indent=1)
    with open(tmp / STATE_FILE, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if target.exists():  # the same step saved again (e.g. the final save right after a periodic one)
        shutil.rmtree(target)
    os.rename(tmp, target)
    try:  # the rename itself must survive a power loss
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory; the rename is still atomic


def abandon(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def prune(out_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` complete checkpoints, and leftovers of failed writes."""
    found = complete(out_dir)
    removed = found[:-keep] if keep > 0 else []
    removed += list(root(out_dir).glob(".step_*.tmp"))
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def remove_all(out_dir: str | Path) -> None:
    shutil.rmtree(root(out_dir), ignore_errors=True)

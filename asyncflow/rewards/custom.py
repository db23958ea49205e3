"""Reward functions from a Python file, written for verl's ``custom_reward_function``.

``reward.custom_path=my_reward.py`` (with ``reward.custom_name``, default ``compute_score``)
scores with that file's function, called the way verl calls it::

    compute_score(data_source=..., solution_str=response, ground_truth=answer, extra_info=...)

``data_source`` and ``extra_info`` are the record's fields of those names (None where the
record has none), ``ground_truth`` is the record's answer (a string). The function returns a
number, or a dict whose ``score`` is the score and whose other numeric keys are logged
(``reward/extra/<key>``, docs/metrics.md). Anything else stops the run at that row, naming
the file, the function and the row, whatever ``reward.on_error`` says.

Workers get the run's reward as a string (``reward_ref``): a registered name, or
``file:<path>::<function>``, which ``resolve_reward`` loads once per process.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import numbers
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.rewards.registry import RewardContractError, RewardFn, get_reward

__all__ = ["DEFAULT_FUNCTION", "CustomRewardError", "FileReward", "check_file_reward", "file_ref",
           "load_file_reward", "parse_file_ref", "resolve_reward", "reward_ref"]

DEFAULT_FUNCTION = "compute_score"  # verl's custom_reward_function.name default
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
_PREFIX, _SEP = "file:", "::"
_KEYS = "reward.custom_path / reward.custom_name"


class CustomRewardError(ValueError):
    """A reward file that cannot be used: missing, not importable, or without the function."""


def file_ref(path: str, name: str = DEFAULT_FUNCTION) -> str:
    """The string naming a file's reward function, as workers and ``resolve_reward`` take it."""
    return f"{_PREFIX}{path}{_SEP}{name or DEFAULT_FUNCTION}"


def parse_file_ref(ref: str) -> tuple[str, str] | None:
    """(path, function) of a ``file_ref`` string; None for a registered name."""
    if not ref.startswith(_PREFIX) or _SEP not in ref:
        return None
    path, name = ref[len(_PREFIX):].rsplit(_SEP, 1)
    return path, name


def reward_ref(reward: Any) -> str:
    """The reward a run scores with (its ``reward`` section): the file's function when
    ``custom_path`` is set, else the registered ``name``."""
    path = getattr(reward, "custom_path", "")
    return file_ref(path, getattr(reward, "custom_name", DEFAULT_FUNCTION)) if path else reward.name


@dataclass(frozen=True)
class FileReward:
    """A verl-style function adapted to AsyncFlow's ``fn(response, answer, **metadata)``."""

    path: str
    name: str
    fn: Callable[..., Any]

    @property
    def display_name(self) -> str:
        return f"{self.name} in {self.path}"

    def __call__(self, response: str, answer: str, **metadata: Any) -> float | dict[str, Any]:
        out = self.fn(data_source=metadata.get("data_source"), solution_str=response, ground_truth=answer,
                      extra_info=metadata.get("extra_info"))
        if isinstance(out, numbers.Real):
            return float(out)
        if isinstance(out, dict) and isinstance(out.get("score"), numbers.Real):
            return {**out, "score": float(out["score"])}
        got = (f"a dict without a numeric 'score' (keys {sorted(out, key=str)})" if isinstance(out, dict)
               else f"{out!r} (type {type(out).__name__})")
        raise RewardContractError(f"reward file {self.path}: {self.name} returned {got} for {_row(metadata)}; "
                                  f"expected a number or a dict with a numeric 'score' ({_KEYS})")


def _row(metadata: dict[str, Any]) -> str:
    """How a row is told apart in messages: its data_source and extra_info's split and index."""
    parts = [f"data_source {metadata['data_source']!r}"] if "data_source" in metadata else []
    info = metadata.get("extra_info")
    if isinstance(info, dict):
        parts += [f"extra_info.{k} {info[k]!r}" for k in ("split", "index") if k in info]
    return "the row with " + ", ".join(parts) if parts else "a row without data_source or extra_info"


_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str], FileReward] = {}


def load_file_reward(path: str, name: str = DEFAULT_FUNCTION) -> FileReward:
    """The function ``name`` of the Python file ``path``, imported once per process."""
    name = name or DEFAULT_FUNCTION
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise CustomRewardError(f"reward file {p} {what}; expected a Python file defining {name}() ({_KEYS})")
    if p.suffix != ".py":
        raise CustomRewardError(f"reward file {p}: not a .py file; expected Python source defining {name}()")
    key = (str(p.resolve()), name)
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = FileReward(str(p), name, _function(_import(p), p, name))
        return _LOADED[key]


def _import(p: Path) -> Any:
    module_name = "asyncflow_reward_file_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise CustomRewardError(f"reward file {p}: Python cannot load it as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # registered first: its dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error is reported with the file named
        del sys.modules[module_name]
        raise CustomRewardError(f"reward file {p}: importing it raised {type(exc).__name__}: {exc}") from exc
    return module


def _function(module: Any, p: Path, name: str) -> Callable[..., Any]:
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise CustomRewardError(f"reward file {p} has no function {name!r} (reward.custom_name); "
                                f"it defines: {', '.join(defined) or 'no functions'}")
    if not callable(fn):
        raise CustomRewardError(f"reward file {p}: {name} is {fn!r} (type {type(fn).__name__}), not a function "
                                "(reward.custom_name)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # no signature to read (a builtin): the first call will tell
    try:
        sig.bind(**dict.fromkeys(VERL_ARGUMENTS))
    except TypeError as exc:
        raise CustomRewardError(f"reward file {p}: {name}{sig} cannot be called as verl calls it, with "
                                f"keywords {', '.join(VERL_ARGUMENTS)} ({exc})") from None
    return fn


def check_file_reward(path: str, name: str = DEFAULT_FUNCTION) -> None:
    """What a run's reward file would fail on, found before any rank starts (the launcher)."""
    load_file_reward(path, name)


def resolve_reward(name_or_fn: str | RewardFn) -> RewardFn:
    """The function for a registered name, a ``file_ref`` string, or a callable (as is)."""
    if isinstance(name_or_fn, str):
        ref = parse_file_ref(name_or_fn)
        if ref is not None:
            return load_file_reward(*ref)
    return get_reward(name_or_fn)

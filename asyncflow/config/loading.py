"""From a recipe yaml and ``key=value`` overrides to a checked RunConfig; and the config to
and from the plain dict that crosses a worker call (no check there: it was checked once)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .checks import check
from .fields import ConfigError, choice_error
from .run import RunConfig


def load_config(yaml_path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults <- recipe yaml <- ``key=value`` overrides; typed and checked."""
    base = OmegaConf.structured(RunConfig)
    layers = []
    try:
        if yaml_path is not None:
            path = Path(yaml_path)
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            layers.append(OmegaConf.load(path))
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value (e.g. trainer.steps=10)")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(base, *layers)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None)
        raise ConfigError(f"config key {key!r}: {str(e).splitlines()[0]}") from None
    error = choice_error(merged, RunConfig())
    if error:
        raise ConfigError(error)
    try:
        cfg = OmegaConf.to_object(merged)
    except ValueError as e:  # a section's own checks (OptimConfig of optim / critic_optim)
        raise ConfigError(f"invalid configuration: {_failing_section(merged)}{e}") from None
    assert isinstance(cfg, RunConfig)
    return check(cfg)


def _failing_section(merged: Any) -> str:
    """``"<section>: "`` of the first top-level section whose dataclass refuses its values."""
    for name in merged:
        try:
            OmegaConf.to_object(merged[name]) if OmegaConf.is_config(merged[name]) else None
        except ValueError:
            return f"{name}: "
    return ""


def from_dict(d: dict[str, Any]) -> RunConfig:
    """A config sent as a dict (to a worker) back as the dataclass tree (already checked)."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), d))
    assert isinstance(cfg, RunConfig)
    return cfg


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if not isinstance(out, dict):  # a structured dataclass config converts to a dict
        raise TypeError(f"to_dict: OmegaConf turned the RunConfig into a {type(out).__name__}, not a dict")
    return {str(k): v for k, v in out.items()}  # its keys are the field names

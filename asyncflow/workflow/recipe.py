"""Finding a recipe: ``recipes/<name>/`` in the repository, or any directory holding a
``config.yaml`` and a ``recipe.py`` whose ``build(cfg)`` returns a ``RecipeSpec``.

A recipe directory is a Python package: it is imported by name (its parent directory goes
on the import path, for the driver and for every worker process), so recipes share code the
Python way (``from recipes.grpo.recipe import build``) and a worker class defined in a
recipe's own module is importable on every rank.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .stages import RecipeSpec, check_graph, check_roles

REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class Recipe:
    name: str
    directory: Path
    config: Path
    module: ModuleType

    @property
    def code(self) -> Path:
        return self.directory / "recipe.py"

    def build(self, cfg: Any, source_columns: list[str]) -> RecipeSpec:
        """The recipe's roles and stages for ``cfg``, checked (errors name the recipe file)."""
        where = f"recipe {self.code}"
        try:
            spec = self.module.build(cfg)
        except (ValueError, TypeError) as e:  # a Stage or Role refused, or the recipe's own checks
            raise type(e)(f"{where}: {e}") from e
        if not isinstance(spec, RecipeSpec):
            raise TypeError(f"{where}: build(cfg) must return a RecipeSpec, got {type(spec).__name__}")
        check_graph(spec.stages, source_columns, where)
        check_roles(spec, where)
        return spec


def available() -> list[str]:
    if not REPO_RECIPES.is_dir():
        return []
    return sorted(p.name for p in REPO_RECIPES.iterdir() if (p / "recipe.py").is_file())


def add_import_path(path: Path) -> None:
    """``path`` on the import path of this process and of the processes it starts."""
    p = str(path.resolve())
    if p not in sys.path:
        sys.path.insert(0, p)
    parts = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    if p not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([p, *parts])


def find_recipe(name_or_path: str) -> Recipe:
    path = Path(name_or_path)
    directory = (path if path.is_dir() else REPO_RECIPES / name_or_path).resolve()
    code, config = directory / "recipe.py", directory / "config.yaml"
    if not code.is_file() or not config.is_file():
        raise FileNotFoundError(
            f"recipe {name_or_path!r}: expected a directory with recipe.py and config.yaml "
            f"(looked in {directory}); built-in recipes: {available()}")
    if not directory.name.isidentifier():
        raise ValueError(f"recipe {directory}: the directory name must be a Python identifier "
                         "(it is imported as a package)")
    if REPO_RECIPES.is_dir():  # every recipe may build on the repository's (recipes.grpo, ...)
        add_import_path(REPO_RECIPES.parent)
    if directory.parent == REPO_RECIPES.resolve():
        module_name = f"recipes.{directory.name}.recipe"
    else:
        add_import_path(directory.parent)
        module_name = f"{directory.name}.recipe"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"recipe {code}: importing it as {module_name!r} failed: {e}") from e
    found = Path(getattr(module, "__file__", "") or "").resolve()
    if found != code:
        raise ImportError(f"recipe {code}: the name {module_name!r} is taken by {found}; rename the "
                          "recipe directory")
    if not callable(getattr(module, "build", None)):
        raise AttributeError(f"recipe {code}: defines no function build(cfg) -> RecipeSpec")
    return Recipe(directory.name, directory, config, module)

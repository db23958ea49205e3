"""Finding a recipe: ``recipes/<name>/`` (a config yaml and a ``recipe.py`` declaring the
stages) in the repository, or any directory holding those two files."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class Recipe:
    name: str
    directory: Path
    config: Path
    module: ModuleType

    def stages(self, cfg: Any) -> list:
        return self.module.stages(cfg)


def available() -> list[str]:
    if not REPO_RECIPES.is_dir():
        return []
    return sorted(p.name for p in REPO_RECIPES.iterdir() if (p / "recipe.py").is_file())


def find_recipe(name_or_path: str) -> Recipe:
    path = Path(name_or_path)
    directory = path if path.is_dir() else REPO_RECIPES / name_or_path
    code, config = directory / "recipe.py", directory / "config.yaml"
    if not code.is_file() or not config.is_file():
        raise FileNotFoundError(
            f"recipe {name_or_path!r}: expected a directory with recipe.py and config.yaml "
            f"(looked in {directory}); built-in recipes: {available()}")
    spec = importlib.util.spec_from_file_location(f"asyncflow_recipe_{directory.name}", code)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    if not callable(getattr(module, "stages", None)):
        raise AttributeError(f"recipe {code}: defines no function stages(cfg) -> list[Stage]")
    return Recipe(directory.name, directory, config, module)

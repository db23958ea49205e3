"""DAPO: GRPO with dynamic sampling (groups whose rewards are all equal are dropped and
refilled from new prompts), asymmetric clip-higher, token-level loss, no KL.
The stage graph is GRPO's; the recipe differs in the names config.yaml gives."""
from pathlib import Path
import importlib.util

_grpo = Path(__file__).resolve().parents[1] / "grpo" / "recipe.py"
_spec = importlib.util.spec_from_file_location("asyncflow_recipe_grpo_for_dapo", _grpo)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)


def stages(cfg):
    if not cfg.algorithm.dynamic_sampling:
        raise ValueError("recipe dapo: algorithm.dynamic_sampling must stay true (it is what DAPO is)")
    return _mod.stages(cfg)

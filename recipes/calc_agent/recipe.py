"""calc_tool's recipe with its episode written as an OpenAI-client agent (``episode.py``):
the rollout instances serve the policy behind an OpenAI-compatible endpoint
(``rollout.openai_endpoint``), every request an episode's agent makes is recorded, and the
row's trajectory is rebuilt from them (asyncflow/agents/serving). The stages are calc_tool's."""
from __future__ import annotations

from asyncflow.workflow.stages import RecipeSpec
from recipes.calc_tool import recipe as calc_tool

EPISODE = "recipes.calc_agent.episode:calc_agent"


def build(cfg) -> RecipeSpec:
    return calc_tool.build(cfg, episode=EPISODE)

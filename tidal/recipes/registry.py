"""The recipes `--algo` can run: one `register` line each."""
from __future__ import annotations

from tidal.algorithms.registry import get_algorithm
from tidal.common.registry import Registry
from tidal.recipes import grpo, ppo
from tidal.recipes.base import Recipe

RECIPES: Registry[Recipe] = Registry("recipe")
RECIPES.register("grpo", grpo.RECIPE)
RECIPES.register("ppo", ppo.RECIPE)


def recipe_for(algo: str) -> Recipe:
    return RECIPES.get(get_algorithm(algo).recipe)

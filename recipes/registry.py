"""The recipes `--algo` can run: one `register` line each."""
from __future__ import annotations

from algorithms.registry import get_algorithm
from common.registry import Registry
from recipes import grpo, ppo
from recipes.base import Recipe

RECIPES: Registry[Recipe] = Registry("recipe")
RECIPES.register("grpo", grpo.RECIPE)
RECIPES.register("ppo", ppo.RECIPE)


def recipe_for(algo: str) -> Recipe:
    return RECIPES.get(get_algorithm(algo).recipe)

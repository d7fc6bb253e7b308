"""Recipes: each algorithm family's graph and the phases of its step, one screen each.

`--algo NAME` finds its recipe through the registries (tidal/recipes/registry.py): the algorithm names
its recipe (`Algorithm.recipe`), RECIPES maps the name to it. An algorithm that needs other
executors (a critic, say) brings its own recipe with one more `register` line.
"""

"""What a recipe is: how to build a graph from a run config, and the phases of its step, in order."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]  # the folder that holds tidal/


@dataclass(frozen=True)
class Phase:
    """One named phase of a step: which executor runs it, and the code that does."""

    name: str
    executor: str
    code: Callable  # the function or method that runs it
    what: str

    @property
    def where(self) -> str:
        """`path/to/module.py:Qualified.name` of `code`, relative to the project root."""
        path = Path(inspect.getsourcefile(self.code)).resolve().relative_to(ROOT)
        return f"{path}:{self.code.__qualname__}"


@dataclass(frozen=True)
class Recipe:
    name: str
    build: Callable  # (RunConfig) -> tidal.controller.graph.Graph, validated; ValueError names the config field at fault
    phases: tuple[Phase, ...]  # in the order they happen within a step
    console: tuple[str, ...]  # metrics columns the console shows per step
    # (records by executor, world_size=, run=) -> step-level figures derived from the executors'
    # records; `run` is a dict the caller keeps across the run's steps, for run-level figures
    derive: Callable[..., dict] | None = None

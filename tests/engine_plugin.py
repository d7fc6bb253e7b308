"""Two test-only engines, each a `generator.engine=tests.engine_plugin:NAME` (tidal/executors/generator/engines.py
EngineKind, named by module:attr: no line added to the registry):

  RECORD  the native engine, writing every group it finishes to generator.replay.dir (step-index.pt)
  REPLAY  no model of its own: it answers each request with the group RECORD wrote for it

Both declare their options, the section generator.replay (ReplayOptions), which the config validates with
that model as it validates vLLM's generator.vllm.

A job on REPLAY is the job on RECORD, group for group, so its weights end bit for bit the same: the
rollouts are the engine's whole contribution to a step (tests/test_layers.py).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from tidal.executors.generator.engines import ENGINES, EngineKind


class ReplayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dir: Path = Field(description="where RECORD saves each group and REPLAY reads it")


class Recording:
    """The engine it wraps, each finished group also saved."""

    def __init__(self, engine, dir: Path) -> None:
        self.engine, self.dir = engine, dir

    def generate(self, requests, params, *, step, **kwargs):
        for group in self.engine.generate(requests, params, step=step, **kwargs):
            assert not group.cut, "RECORD is for groups generated whole"
            torch.save(group, self.dir / f"{step}-{group.index}.pt")
            yield group

    def __getattr__(self, name):  # load_weights, release, wake, close: the engine's own
        return getattr(self.engine, name)


class Replay:
    """Each request's recorded group, in request order; pushed weights land in a model it never runs."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir

    def generate(self, requests, params, *, step, stop=lambda: False, turns=None, budget=None):
        assert turns is None and budget is None, "REPLAY replays single-turn groups generated whole"
        for request in requests:
            if stop():
                return
            group = torch.load(self.dir / f"{step}-{request.index}.pt", weights_only=False)
            assert torch.equal(group.prompt_ids_P, torch.as_tensor(request.prompt_ids).reshape(-1)), request.index
            yield group

    def load_weights(self, shards, specs) -> None:
        pass

    def release(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def _record(spec):
    engine, specs, shards = NATIVE.build(spec)
    return Recording(engine, spec.config.replay.dir), specs, shards


def _replay(spec):
    # the native engine's model only as the push's destination (the WEIGHTS channel's view of this engine)
    _, specs, shards = NATIVE.build(spec)
    return Replay(spec.config.replay.dir), specs, shards


NATIVE = ENGINES.get("native")
RECORD: EngineKind = replace(NATIVE, build=_record, options=ReplayOptions, section="replay")
REPLAY: EngineKind = replace(NATIVE, build=_replay, options=ReplayOptions, section="replay")

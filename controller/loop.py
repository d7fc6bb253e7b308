"""The SPMD controller: the same loop on every rank (LlamaRL Algorithm 1, streamed).

Per step, each rank opens its executor's channel endpoints, runs the executor's step (which streams
items through them), closes its outbound channels (end-of-step markers), waits for its sends, posts
its metrics, and checkpoints on cadence. The step barrier lives in the channels: a lagged channel
(WEIGHTS) is consumed at the start of the next step, so generation of step k+1 waits for the push.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from controller.metrics import post_metrics
from controller.timeline import Timeline
from controller.world import World
from executors.base import StepContext


@dataclass
class Controller:
    world: World
    steps: range
    checkpoint_every: int = 0  # 0: no checkpoints on cadence

    def run(self) -> None:
        executor, env = self.world.local_executor, self.world.env
        executor.init(env)
        timeline = Timeline(executor=env.name, rank=env.rank)
        for step in self.steps:
            inbound, outbound = self.world.endpoints(step, first_step=self.steps.start,
                                                     last_step=self.steps.stop - 1)
            timeline.step = step
            t0 = time.perf_counter()
            with timeline.span("step"):
                metrics = dict(executor.step(StepContext(step, inbound, outbound, timeline)))
                for sender in outbound.values():
                    sender.close_step()
                for sender in outbound.values():
                    sender.flush()
            metrics[f"{env.name}_s"] = time.perf_counter() - t0
            if env.is_leader:
                post_metrics(self.world.store, step=step, executor=env.name, metrics=metrics)
            if self.checkpoint_every and (step + 1) % self.checkpoint_every == 0:
                executor.save_checkpoint(self.checkpoint_dir(step))
        executor.finalize(env.output_dir)
        timeline.save(env.output_dir / "timeline" / f"rank{env.rank:03d}.jsonl")

    def checkpoint_dir(self, step: int) -> Path:
        return self.world.env.output_dir / "checkpoints" / f"step_{step:06d}"

"""The critic's options: its value model's source, and the layout, optimizer and micro-batches of
tidal/executors/learner/config.py with the critic's own values."""
from __future__ import annotations

from pydantic import Field

from tidal.executors.learner.config import LearnerConfig


class CriticConfig(LearnerConfig):
    path: str | None = Field(None, description="HF directory the value model starts from: a causal LM (its "
                             "backbone, with a new value head) or a saved critic (final/critic); None = the "
                             "policy's model.path")
    # the embedded task, 200 steps (docs/algorithms.md, PPO): 3e-4 ended at reward 0.69 (explained variance 0.63),
    # 1e-3 at 0.40-0.56, 3e-3 at 0.28, 1e-4 at 0.65
    lr: float = Field(3e-4, gt=0)

"""What the trainer may call on a backend's models: the one interface between the trainer
(executor.py, barrier.py) and a backend (`trainer.backend`: models.py's TriModel for torch,
megatron_models.py's for megatron, or a user's `module:attr`).

The trainer names no parallelism. Whatever a backend splits (tp, FSDP, expert parallel, pipeline
stages), it answers the same questions: a micro-batch's log-probs; how a training micro-step runs
(at once, or through stages whose backwards finish later: `run`, `end_of_group`, `drain`); which
ranks the loss sums and the gradients are added over (`sums_over`, `grad_layout`, a list of
(what, group) reductions); the step's figures; the push's shards; save and load.
tests/test_layers.py checks that the trainer reaches no member of its models this protocol does not
declare.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tidal.channels.payloads import ScoredGroup
from tidal.modeling.head import Entropy
from tidal.modeling.optim import GradLayout


class TrainerModels(Protocol):
    # ---- built on the trainer's ranks -----------------------------------------------------------
    @classmethod
    def build(cls, *, model_path: str | None, dtype: torch.dtype, env, cfg, temperature: float, reference: bool,
              snapshot: bool, policy_path=None, numerics: str = "default") -> "TrainerModels":
        """The policy (from `policy_path` on a resume), the old policy where `snapshot` (several optimizer steps
        a batch) and the reference where `reference`, laid out over the trainer's ranks."""

    master: nn.Module  # what the optimizer steps and checkpoints save
    policy: nn.Module  # what the forwards and backwards run on: `master`, or its lower-precision copy
    tokenizer: object
    dummy: object  # a micro-batch for lockstep padding: every collective a real one runs, weight 0
    dp_group: dist.ProcessGroup | None  # the dp replicas (lockstep rounds, the step's records)

    def micro_batches(self, group: ScoredGroup) -> list: ...

    def shares_prompt(self, group: ScoredGroup) -> bool: ...

    # ---- a step ---------------------------------------------------------------------------------
    def begin_step(self, timeline) -> None:
        """The step's starting weights become the old policy; the backend's own clocks start."""

    @property
    def computes_loss(self) -> bool:
        """This rank runs the loss (an earlier pipeline stage does not: it has no log-probs)."""

    def run(self, mb, micro_step: Callable[[], tuple], *, after_backward: Callable[[], None], old: bool):
        """One training micro-batch: `micro_step()` (log-probs, loss, backwards) where this rank computes
        the loss, and its result; elsewhere the backend's own part of it, and None. after_backward: called
        once a deferred backward has run (its gradients are on the parameters). old: the old policy's
        forward goes along (later passes)."""

    def end_of_group(self) -> None:
        """A group's micro-batches are all in `run`."""

    def drain(self) -> None:
        """Before an optimizer step: every backward still in flight is done."""

    def policy_logprobs(self, mb, *, entropy: Entropy = False): ...

    def old_logprobs(self, mb, *, policy_NT: torch.Tensor, first_pass: bool) -> torch.Tensor: ...

    def ref_logprobs(self, mbs: list, *, pad_to: int) -> list: ...

    def routing_counts(self) -> tuple[int, int]: ...

    def step_figures(self) -> dict:
        """The backend's figures of the step (TrainerMetrics fields, e.g. pipeline_bubble)."""

    # ---- the barrier ----------------------------------------------------------------------------
    @property
    def sums_over(self) -> tuple[dist.ProcessGroup | None, ...]:
        """The groups the step's loss sums are added over, in order (None: one rank)."""

    def grad_layout(self) -> GradLayout:
        """The gradients' sums at the step as (what, group) reductions, the norm's grid, the optimizer's sharding."""

    def shards(self) -> dict[str, torch.Tensor]: ...

    @property
    def specs(self) -> dict: ...

    def save(self, path, *, leader: bool) -> None: ...

    def finalize(self, path, *, leader: bool) -> None: ...

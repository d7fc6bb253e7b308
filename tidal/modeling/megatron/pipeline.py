"""Pipeline parallel for the trainer (trainer.pp): one stage's side of a 1F1B schedule whose
micro-batches are the step's groups' micro-batches, taken as they arrive.

Why not megatron-core's schedules: they take the number of micro-batches up front and one loss
function per micro-batch. Here a step's micro-batches are known only as its groups arrive (a group
packs into as many as its lengths need), the loss is the trainer's own micro-step (three models'
log-probs, the objective, order-independent accumulators), and the reference's forward travels the
same stages. So the schedule is written against a stream:

- every rank of a unit sees the same groups in the same order (index order: TrainerConfig.index_ordered),
  so every stage makes the same decisions without telling the others;
- stage s keeps at most `stages - s - 1` forwards ahead of its backwards (1F1B's warm-up): after
  forward i it runs the backward of i - warm-up, whose gradient the next stage sends back; the last
  stage runs forward and backward at once (the trainer's micro-step) and sends the input's gradient;
- when the stream ends (the barrier), or after each group with `pp_drain=group`, the stages drain:
  their remaining backwards, in order. A group arriving later simply continues the 1F1B, so the
  pipeline fills once per step, not once per group.

Sends are non-blocking, receives block: the same order of operations on both ends of a link (its
forwards in stream order one way, its backwards in stream order the other) makes it deadlock-free.
Messages travel on the unit's own pipeline group (no tag shared with the channels).
The time blocked in receives is the bubble (`wait_s`; the `pp_wait` spans of the timeline).
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist


class Pipeline:
    def __init__(self, *, group: dist.ProcessGroup, stage: int, stages: int, drain_every_group: bool = False):
        self.group, self.stage, self.stages = group, stage, stages
        ranks = dist.get_process_group_ranks(group)
        self.prev = ranks[stage - 1] if stage > 0 else None
        self.next = ranks[stage + 1] if stage < stages - 1 else None
        self.warmup = stages - stage - 1
        self.drain_every_group = drain_every_group
        # (the received input or None, this stage's output, what to do after its backward)
        self._pending: deque[tuple[torch.Tensor | None, torch.Tensor, Callable[[], None]]] = deque()
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.timeline = None  # the step's timeline (tidal/controller/timeline.py), set by the trainer
        self.reset_clock()

    @property
    def first(self) -> bool:
        return self.prev is None

    @property
    def last(self) -> bool:
        return self.next is None

    def reset_clock(self) -> None:
        self.wait_s, self.busy_s = 0.0, 0.0

    def bubble(self) -> float:
        """This step's bubble over the unit's stages: their time waiting on a neighbour / their time
        in the pipeline's work (both summed over the stages)."""
        t = torch.tensor([self.wait_s, self.busy_s], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t[0].item() / t[1].item() if t[1] > 0 else 0.0

    # ---- links ------------------------------------------------------------------------------------
    def receive(self, shape, *, dtype: torch.dtype, device: torch.device, grad: bool) -> torch.Tensor | None:
        """The previous stage's output for the next micro-batch (None on the first stage); `grad`:
        a leaf whose gradient goes back to it."""
        if self.first:
            return None
        x = torch.empty(shape, dtype=dtype, device=device)
        self._wait(dist.irecv(x, src=self.prev, group=self.group))
        return x.requires_grad_(grad)

    def send(self, y: torch.Tensor) -> None:
        """This stage's output to the next stage."""
        self._post(y.detach(), self.next)

    def _post(self, t: torch.Tensor, dst: int) -> None:
        t = t.contiguous()
        self._sends.append((dist.isend(t, dst=dst, group=self.group), t))
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _wait(self, work: dist.Work) -> None:
        t0 = time.perf_counter()
        with self.timeline.span("pp_wait") if self.timeline is not None else nullcontext():
            work.wait()
        self.wait_s += time.perf_counter() - t0

    # ---- the schedule -------------------------------------------------------------------------------
    def forwarded(self, x: torch.Tensor | None, y: torch.Tensor, *, after_backward: Callable[[], None],
                  also: list[torch.Tensor] = ()) -> None:
        """Stage forward done (not the last stage): send `y` on (then `also`: forward-only models' hidden
        states for the same micro-batch), and run the oldest backward once more than the warm-up are in
        flight. after_backward: the trainer's accumulation of the parameters' gradients."""
        for t in (y, *also):  # all of a micro-batch's forward messages before any wait on this stage
            self.send(t)
        self._pending.append((x, y, after_backward))
        while len(self._pending) > self.warmup:
            self._backward_oldest()

    def backward_done(self, x: torch.Tensor | None) -> None:
        """The last stage's micro-step has run its backward: the input's gradient goes back."""
        if x is not None:
            self._post(x.grad if x.grad is not None else torch.zeros_like(x), self.prev)

    def _backward_oldest(self) -> None:
        x, y, after_backward = self._pending.popleft()
        g = torch.empty_like(y)
        self._wait(dist.irecv(g, src=self.next, group=self.group))
        torch.autograd.backward(y, grad_tensors=g)
        after_backward()
        self.backward_done(x)

    def end_of_group(self) -> None:
        if self.drain_every_group:
            self.drain()

    def drain(self) -> None:
        """The remaining backwards, in order; then every send has completed."""
        while self._pending:
            self._backward_oldest()
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    @contextmanager
    def timed(self):
        """Around the trainer's pipeline work: its time, of which `wait_s` is the bubble."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - t0

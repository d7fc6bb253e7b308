"""A channel: a named, typed, directed link between two executors, and its two endpoints.

Routing is by *unit* (a data-parallel replica of an executor: its ranks all hold the same data).
Only the first rank of a source unit sends; every rank of the chosen destination unit receives.

Transport: an item's small JSON header goes through a queue in the job's rendezvous store, one
queue per (channel, destination rank, step); its body goes straight from the producer rank to the
consumer rank as one p2p message. The store queue gives the receiver the arrival order and the
source rank, so "receive from whichever source is ready first" needs neither `recv(src=None)`
(nccl has none) nor polling `irecv` (gloo never marks a pending irecv complete without wait()).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields, is_dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from tidal.channels import p2p
from tidal.channels.codec import decode, encode
from tidal.channels.kinds import Kind


@dataclass(frozen=True)
class Channel:
    name: str
    src: str  # executor name
    dst: str  # executor name
    kind: Kind
    payload: type
    src_port: object = None  # the source's port (a Port, or its name); defaults to the channel name
    dst_port: object = None
    lag: int | None = None  # 0: consumed in the step it is produced; 1: in the next step (WEIGHTS)
    # a same-step channel that closes a cycle: its consumer reads it only after producing, so the
    # cycle makes progress (e.g. reward -> generator verdicts for dynamic sampling)
    feedback: bool = False
    # the run's schedule (tidal/controller/schedules.py) decides when the consumer sees the items: periodic
    # hands each over as it arrives, sync collects the step first; unscheduled channels always stream
    scheduled: bool = False

    @property
    def out_port(self) -> str:
        return getattr(self.src_port, "name", self.src_port) or self.name

    @property
    def in_port(self) -> str:
        return getattr(self.dst_port, "name", self.dst_port) or self.name

    @property
    def step_lag(self) -> int:
        return self.lag if self.lag is not None else int(self.kind is Kind.WEIGHTS)


@dataclass(frozen=True)
class Route:
    """A channel resolved onto global ranks."""

    channel_id: int
    src_units: tuple[tuple[int, ...], ...]
    dst_units: tuple[tuple[int, ...], ...]
    src_sharded: bool = False  # the source's units hold shards of one model copy (FSDP), not replicas
    src_ep: int = 1  # runs of this many source units split an MoE model's experts (expert parallel)
    src_pp: int = 1  # each source unit is this many pipeline stages, stage-major (tidal/channels/push_plan.py)
    src_cp: int = 1  # each source unit is this many context-parallel copies, cp-major: to the plan, dp copies

    def destinations(self, kind: Kind, item) -> tuple[int, ...]:
        if kind is Kind.BROADCAST:
            return tuple(r for unit in self.dst_units for r in unit)
        if kind is Kind.GATHER:
            return self.dst_units[0]
        assert kind is Kind.SCATTER, kind
        return self.dst_units[item.index % len(self.dst_units)]

    @property
    def all_dst_ranks(self) -> tuple[int, ...]:
        return tuple(r for unit in self.dst_units for r in unit)

    @property
    def src_leaders(self) -> tuple[int, ...]:
        return tuple(unit[0] for unit in self.src_units)


def _queue_key(route: Route, dst: int, step: int) -> str:
    return f"ch{route.channel_id}/{dst}/{step}"


class Sender:
    """Streams items of one step; `close_step` tells every destination rank this source is done."""

    def __init__(self, *, channel: Channel, route: Route, store: dist.Store, rank: int,
                 device: torch.device, on_send=None):
        self.channel, self.route, self.store, self.rank = channel, route, store, rank
        self.device = device
        self.is_leader = rank in route.src_leaders
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._on_send = on_send
        self.step, self.deliverable = -1, True
        self.sent, self.closed = 0, False

    def open_step(self, step: int, *, deliverable: bool = True) -> None:
        """`deliverable=False`: nobody will consume this step (a lagged channel's last step)."""
        self.step, self.sent, self.deliverable, self.closed = step, 0, deliverable, False

    def send(self, item) -> None:
        """`item` is an instance of the channel's payload or of a subclass; only the payload's fields
        travel (the receiver decodes the channel's payload type, never the sender's subclass)."""
        payload = self.channel.payload
        if not isinstance(item, payload):
            why = ""
            if type(item) in payload.__mro__ and is_dataclass(item) and is_dataclass(payload):
                have = {f.name for f in fields(item)}
                missing = ", ".join(f.name for f in fields(payload) if f.name not in have) or "(none)"
                why = f", a base class of {payload.__name__} that lacks its field(s) {missing}"
            raise TypeError(f"channel {self.channel.name!r} carries {payload.__name__}, "
                            f"got {type(item).__name__}{why}")
        assert not self.closed, f"channel {self.channel.name!r}: send after close_step (step {self.step})"
        self.sent += 1
        if not (self.is_leader and self.deliverable):  # the unit's other ranks computed the same item
            return
        header, body = encode(item, payload)
        body = body.to(self.device)
        message = json.dumps({"src": self.rank, "header": header, "nbytes": body.numel()})
        for dst in self.route.destinations(self.channel.kind, item):
            if body.numel():
                work = p2p.isend(body, dst, tag=self.route.channel_id, owned=True)
                self._pending.append((work, body))
            # posted after the isend, so the receiver's recv always finds it
            self.store.queue_push(_queue_key(self.route, dst, self.step), message)
        if self._on_send:
            self._on_send(item)

    def close_step(self) -> None:
        """Idempotent: an executor may end one output's stream early (the controller closes every
        output after the step; a second close sends nothing)."""
        if self.closed:
            return
        self.closed = True
        if self.is_leader and self.deliverable:
            end = json.dumps({"src": self.rank, "end": True})
            for dst in self.route.all_dst_ranks:
                self.store.queue_push(_queue_key(self.route, dst, self.step), end)

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class Receiver:
    """Yields the items of one step in arrival order, until every source unit has closed the step."""

    def __init__(self, *, channel: Channel, route: Route, store: dist.Store, rank: int,
                 device: torch.device):
        self.channel, self.route, self.store, self.rank = channel, route, store, rank
        self.device = device
        self.step = -1
        self.expected = True
        self._open = set(route.src_leaders)

    def open_step(self, step: int, *, expected: bool = True) -> None:
        """`expected=False`: nothing was sent for this step (a lagged channel's first step)."""
        self.step, self.expected = step, expected
        self._open = set(self.route.src_leaders) if expected else set()

    def __iter__(self) -> Iterator:
        """The step's items; an iteration left early is continued by the next one (drain)."""
        key = _queue_key(self.route, self.rank, self.step)
        open_sources = self._open
        while open_sources:
            message = json.loads(self._pop(key, open_sources))
            src = message["src"]
            if message.get("end"):
                open_sources.discard(src)
                continue
            body = torch.empty(message["nbytes"], dtype=torch.uint8, device=self.device)
            if body.numel():
                p2p.recv(body, src, tag=self.route.channel_id)
            yield decode(self.channel.payload, message["header"], body.cpu())

    def _pop(self, key: str, open_sources: set[int]) -> bytes:
        t0 = time.monotonic()
        while True:
            try:
                return self.store.queue_pop(key, block=True)
            except dist.QueueEmptyError:
                # torch 2.13's TCPStore: a blocking pop whose wait has returned can still find the
                # queue empty (once in a CI run, on a 5-rank job under load). The item is still to
                # come: wait again, within the same deadline.
                if time.monotonic() - t0 < self.store.timeout.total_seconds():
                    time.sleep(0.001)
                    continue
                exc_type = "QueueEmptyError"
            except dist.DistStoreError as exc:  # the store's timeout
                exc_type = type(exc).__name__
            raise TimeoutError(
                f"rank {self.rank} ({self.channel.dst}) waited {time.monotonic() - t0:.0f} s on "
                f"channel {self.channel.name!r} (step {self.step}) for {self.channel.src} rank(s) "
                f"{sorted(open_sources)}, which did not finish sending ({exc_type})")

    def drain(self) -> None:
        """Receive and drop what is left of the step: a sender's pending sends complete only when
        they are received (a step dropped by a stop still ends cleanly)."""
        for _ in self:
            pass

"""World -> executor groups: placement, process groups, store clients and channel endpoints.

Every rank runs this identically: groups are created by every rank, in graph order (a mismatch in
`new_group` order silently pairs the wrong ranks).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from channels.channel import Receiver, Route, Sender
from channels.kinds import Kind
from channels.weights import WeightsReceiver, WeightsSender
from controller.devices import attempt
from controller.graph import Graph
from executors.base import ExecutorEnv

ENDPOINTS: dict[Kind, tuple[type, type]] = {  # (sender, receiver) classes per channel kind
    Kind.BROADCAST: (Sender, Receiver),
    Kind.SCATTER: (Sender, Receiver),
    Kind.GATHER: (Sender, Receiver),
    Kind.WEIGHTS: (WeightsSender, WeightsReceiver),
}


class FanOut:
    """One output port feeding several channels: every item goes into each of them."""

    def __init__(self, senders: list):
        self.senders = senders

    def send(self, item) -> None:
        for sender in self.senders:
            sender.send(item)

    def close_step(self) -> None:
        for sender in self.senders:
            sender.close_step()

    def flush(self) -> None:
        for sender in self.senders:
            sender.flush()


def placement(graph: Graph) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Executor name -> global ranks per unit; contiguous ranges in graph order."""
    out, next_rank = {}, 0
    for ex in graph.executors:
        units = []
        for _ in range(ex.units):
            units.append(tuple(range(next_rank, next_rank + ex.ranks_per_unit)))
            next_rank += ex.ranks_per_unit
        out[ex.name] = tuple(units)
    return out


def world_size_of(graph: Graph) -> int:
    return sum(ex.world_size for ex in graph.executors)


def check_world_size(graph: Graph, world_size: int) -> None:
    need = world_size_of(graph)
    if world_size != need:
        parts = " + ".join(f"{ex.name} {ex.world_size}" for ex in graph.executors)
        raise ValueError(f"world size is {world_size} but the placement needs {need} ranks ({parts}); "
                         f"run torchrun --nproc-per-node {need} or change the placement")


def store_client(timeout: timedelta, *, per_attempt: bool = True) -> dist.Store:
    """A fresh client of the job's rendezvous store (one per thread that blocks on it).

    torchrun's store outlives an elastic restart, so the keys of each attempt live under their own
    prefix: a restarted job must not read the previous attempt's failure, queues or metrics.
    per_attempt=False: the run-wide namespace (e.g. the output dir every attempt shares).
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tidal/{attempt()}" if per_attempt else "tidal/run", store)


@dataclass
class World:
    graph: Graph
    units: dict[str, tuple[tuple[int, ...], ...]]
    rank: int
    local_name: str
    env: ExecutorEnv
    store: dist.Store
    control_group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return sum(len(unit) for units in self.units.values() for unit in units)

    def cut_lagged(self, outbound) -> None:
        """The run ends after this step: its lagged outputs (the weight push) have no consumer."""
        lagged = {ch.out_port for ch in self.graph.channels if ch.src == self.local_name and ch.step_lag > 0}
        for port in lagged & outbound.keys():
            senders = getattr(outbound[port], "senders", [outbound[port]])
            for sender in senders:
                if sender.channel.step_lag > 0:
                    sender.deliverable = False

    @property
    def local_executor(self):
        return self.graph.executor(self.local_name)

    @functools.cached_property
    def scheduled_ports(self) -> set[str]:
        """This rank's input ports whose items the run's schedule hands over (controller/schedules.py)."""
        return {ch.in_port for ch in self.graph.channels if ch.dst == self.local_name and ch.scheduled}

    def endpoints(self, step: int, *, first_step: int, last_step: int):
        """Open this rank's inbound/outbound endpoints for `step`, keyed by port."""
        inbound, senders = {}, {}
        for ch, (sender, receiver) in zip(self.graph.channels, self._endpoints):
            if sender is not None:
                sender.open_step(step, deliverable=step + ch.step_lag <= last_step)
                senders.setdefault(ch.out_port, []).append(sender)
            if receiver is not None:
                receiver.open_step(step - ch.step_lag, expected=step - ch.step_lag >= first_step)
                inbound[ch.in_port] = receiver
        # one output port may feed several channels (fan-out)
        outbound = {port: group[0] if len(group) == 1 else FanOut(group) for port, group in senders.items()}
        return inbound, outbound

    def receivers(self) -> list:
        """This rank's receivers of same-step channels (a lagged one's items belong to the next step)."""
        return [rx for ch, (_, rx) in zip(self.graph.channels, self._endpoints) if rx is not None and ch.step_lag == 0]

    def bind_channels(self) -> None:
        self._endpoints = []
        for cid, ch in enumerate(self.graph.channels):
            route = Route(channel_id=cid + 1, src_units=self.units[ch.src], dst_units=self.units[ch.dst],
                          src_sharded=self.graph.executor(ch.src).shards_over_units)
            send_cls, recv_cls = ENDPOINTS[ch.kind]
            common = dict(channel=ch, route=route, store=self.store, rank=self.rank, device=self.env.device)
            sender = send_cls(**common) if ch.src == self.local_name else None
            receiver = recv_cls(**common) if ch.dst == self.local_name else None
            self._endpoints.append((sender, receiver))


def build_world(graph: Graph, *, device: torch.device, seed: int, output_dir: Path,
                timeout: timedelta, resume: Path | None = None) -> World:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_world_size(graph, world_size)
    units = placement(graph)
    local_name, local_group = None, None
    for ex in graph.executors:  # same order on every rank
        ranks = [r for unit in units[ex.name] for r in unit]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            local_name, local_group = ex.name, group
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    unit_group = None
    for ex in graph.executors:  # same order on every rank
        for unit in units[ex.name] if ex.ranks_per_unit > 1 else ():
            group = dist.new_group(list(unit), backend="gloo", timeout=timeout)
            if rank in unit:
                unit_group = group
    assert local_name is not None, f"rank {rank} not placed"
    ex_units = units[local_name]
    env = ExecutorEnv(name=local_name, ranks=tuple(r for u in ex_units for r in u), units=ex_units,
                      rank=rank, group=local_group, device=device, seed=seed, output_dir=output_dir,
                      resume=resume, unit_group=unit_group)
    world = World(graph=graph, units=units, rank=rank, local_name=local_name, env=env,
                  store=store_client(timeout), control_group=control_group)
    world.bind_channels()
    return world


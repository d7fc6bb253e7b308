"""World -> executor groups: placement, process groups, store clients and channel endpoints.

Every rank runs this identically: groups are created by every rank, in graph order (a mismatch in
`new_group` order silently pairs the wrong ranks).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tidal.channels.channel import Channel, Receiver, Route, Sender
from tidal.channels.kinds import Kind
from tidal.channels.weights import WeightsReceiver, WeightsSender, saved_through
from tidal.controller.devices import attempt
from tidal.controller.graph import Graph
from tidal.executors.base import ExecutorEnv

ENDPOINTS: dict[Kind, tuple[type, type]] = {  # (sender, receiver) classes per channel kind
    Kind.BROADCAST: (Sender, Receiver),
    Kind.SCATTER: (Sender, Receiver),
    Kind.GATHER: (Sender, Receiver),
    Kind.WEIGHTS: (WeightsSender, WeightsReceiver),
}


class Outlet:
    """An output port of one step: the senders of every channel it feeds (one, or a fan-out)."""

    def __init__(self, senders: list):
        self.senders = senders

    def send(self, item) -> None:
        for sender in self.senders:
            sender.send(item)

    def push(self, shards, specs) -> None:
        """A WEIGHTS port: push the trainer's shards (tidal/channels/weights.py)."""
        for sender in self.senders:
            sender.push(shards, specs)

    @property
    def bytes_per_push(self) -> int:
        """A WEIGHTS port: what one push carries from the trainer's ranks, over every channel it feeds."""
        return sum(sender.bytes_per_push for sender in self.senders)

    def close_step(self) -> None:
        for sender in self.senders:
            sender.close_step()

    def flush(self) -> None:
        for sender in self.senders:
            sender.flush()

    def cut_lagged(self) -> None:
        """The run ends after this step: what its lagged channels carry has no consumer."""
        for sender in self.senders:
            if sender.channel.step_lag > 0:
                sender.deliverable = False


def placement(graph: Graph) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Executor name -> global ranks per unit; contiguous ranges in graph order; a guest runs on its
    root's ranks, cut into units of its own size."""
    first, next_rank = {}, 0
    for ex in graph.placed:
        first[ex.name] = next_rank
        next_rank += ex.world_size
    return {ex.name: tuple(tuple(range(first[ex.root.name] + u * ex.ranks_per_unit,
                                       first[ex.root.name] + (u + 1) * ex.ranks_per_unit)) for u in range(ex.units))
            for ex in graph.executors}


def device_ranks(graph: Graph) -> set[int]:
    """The global ranks that hold an accelerator: those of a placed executor that, or whose guests,
    need one (rule rewards do not)."""
    units = placement(graph)
    return {r for ex in graph.executors if ex.needs_device for unit in units[ex.root.name] for r in unit}


def rank_plan(graph: Graph, *, nproc_per_node: int | None = None) -> list[tuple[int, str, int | None, str]]:
    """Per global rank: (rank, the executors it runs, its accelerator's index on its node or None,
    the backend of its executor group): what `--dry-run` shows and init_distributed follows.
    nproc_per_node: ranks per node (default: the whole world on one node)."""
    units, holders = placement(graph), device_ranks(graph)
    n = world_size_of(graph)
    per_node = nproc_per_node or n
    rows = []
    for rank in range(n):
        here = [ex.name for ex in graph.executors if any(rank in u for u in units[ex.root.name])]
        group = next(ex for ex in graph.placed if any(rank in u for u in units[ex.name]))
        group_ranks = {r for u in units[group.name] for r in u}
        rows.append((rank, ", ".join(here), device_index(graph, rank=rank, local_rank=rank % per_node),
                     "device" if group_ranks <= holders else "gloo"))
    return rows


def device_index(graph: Graph, *, rank: int, local_rank: int) -> int | None:
    """Which of this node's accelerators `rank` takes: the device ranks of a node take indices 0, 1, ...
    in rank order (torchrun numbers a node's ranks contiguously); None: a rank without one."""
    holders = device_ranks(graph)
    if rank not in holders:
        return None
    return sum(1 for r in range(rank - local_rank, rank) if r in holders)


def titles(graph: Graph) -> dict[str, str]:
    """A placed executor -> what its ranks run, it and then its guests (co-located: "generator + reward +
    trainer"): what a failure report and the progress line call its ranks."""
    return {ex.name: " + ".join(e.name for e in graph.on_ranks_of(ex.name)) for ex in graph.placed}


def roles(graph: Graph) -> dict[int, str]:
    """Global rank -> its executors' title (titles)."""
    units, named = placement(graph), titles(graph)
    return {rank: named[ex.name] for ex in graph.placed for unit in units[ex.name] for rank in unit}


def world_size_of(graph: Graph) -> int:
    return sum(ex.world_size for ex in graph.placed)


def check_world_size(graph: Graph, world_size: int) -> None:
    need = world_size_of(graph)
    if world_size != need:
        parts = " + ".join(f"{ex.name} {ex.world_size}" for ex in graph.placed)
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
    units: dict[str, tuple[tuple[int, ...], ...]]  # every executor's, a guest's being its host's
    rank: int
    host: str  # the executor placed on this rank; its guests run here too
    envs: dict[str, ExecutorEnv]  # of the executors this rank runs
    store: dist.Store
    control_group: dist.ProcessGroup
    resume: Path | None = None  # the checkpoint this attempt continues from (the channels' part of it too)

    @property
    def size(self) -> int:
        return sum(len(unit) for ex in self.graph.placed for unit in self.units[ex.name])

    @property
    def local(self) -> tuple:
        """The executors this rank runs, in order: the one placed here, then its guests."""
        return self.graph.on_ranks_of(self.host)

    @property
    def env(self) -> ExecutorEnv:
        """The placed executor's (its guests' differ only in name)."""
        return self.envs[self.host]

    def endpoints(self, step: int, executor: str, *, first_step: int, last_step: int):
        """Open `executor`'s endpoints on this rank for `step`: {port: receiver}, {port: Outlet}."""
        inbound, senders = {}, {}
        for ch, (sender, receiver) in zip(self.graph.channels, self._endpoints):
            if sender is not None and ch.src == executor:
                if step == first_step and ch.kind is Kind.WEIGHTS:  # a resumed run's pushes in flight
                    sender.restore(self.resume, first_step=first_step, last_step=last_step)
                sender.open_step(step, deliverable=step + ch.step_lag <= last_step)
                senders.setdefault(ch.out_port, []).append(sender)
            if receiver is not None and ch.dst == executor:
                receiver.open_step(step - ch.step_lag, expected=step - ch.step_lag >= self.first_sent(ch, first_step))
                inbound[ch.in_port] = receiver
        return inbound, {port: Outlet(group) for port, group in senders.items()}

    def first_sent(self, ch: Channel, first_step: int) -> int:
        """The first step whose items this attempt's producer sends on `ch`: its first step, or for a
        lagged push restored from the checkpoint (tidal/channels/weights.py) the lag steps before it."""
        return max(0, first_step - ch.step_lag) if self._saved_through.get(ch.name) is not None else first_step

    def scheduled(self, executor: str) -> set[str]:
        """`executor`'s input ports whose items the run's schedule hands over (tidal/controller/schedules.py)."""
        return {ch.in_port for ch in self.graph.channels if ch.dst == executor and ch.scheduled}

    def receivers(self) -> list:
        """This rank's receivers of same-step channels (a lagged one's items belong to the next step)."""
        return [rx for ch, (_, rx) in zip(self.graph.channels, self._endpoints) if rx is not None and ch.step_lag == 0]

    @property
    def ahead(self) -> set[str]:
        """The executors that run a step ahead of the trainer (offpolicy: the consumer of lagged
        weights), and their guests."""
        hosts = {ch.dst for ch in self.graph.channels if ch.kind is Kind.WEIGHTS and ch.step_lag > 1}
        return {ex.name for host in hosts for ex in self.graph.on_ranks_of(host)}

    @property
    def runs_ahead(self) -> bool:
        return self.host in self.ahead

    def close_ahead(self, step: int) -> None:
        """A rank running ahead stopped before `step`: end its outputs' streams of `step`, which the
        consumers drain (`drain_ahead`) as if it had run."""
        for ch, (sender, _) in zip(self.graph.channels, self._endpoints):
            if sender is not None and ch.step_lag == 0:
                sender.open_step(step)
                sender.close_step()

    def drain_ahead(self, step: int) -> None:
        """A stop after the step before `step`: receive and drop what the ranks running ahead sent
        for `step`, so their sends complete."""
        ahead = self.ahead
        for ch, (_, receiver) in zip(self.graph.channels, self._endpoints):
            if receiver is not None and ch.step_lag == 0 and ch.src in ahead:
                receiver.open_step(step)
                receiver.drain()

    def settle_weights(self, *, posted_through: int | None = None, first_step: int = 0, last_step: int = 0) -> None:
        """The run's end: after a stop, the generator takes the lagged pushes the trainer posted (at
        its barriers up to `posted_through`) that no step will; then the trainer's sends are complete."""
        for ch, (sender, receiver) in zip(self.graph.channels, self._endpoints):
            if ch.kind is not Kind.WEIGHTS:
                continue
            if ch.step_lag == 1:  # every push posted was due at a step that ran (co-located: posted, not waited)
                if sender is not None:
                    sender.finish()
                continue
            if receiver is not None and posted_through is not None:
                first = max(self.first_sent(ch, first_step), receiver.received_through + 1)
                receiver.drain(range(first, min(posted_through, last_step - ch.step_lag) + 1))
            if sender is not None:
                sender.finish()

    def samples_before_pushes(self) -> bool:
        """A resumed run whose first step precedes every push that will land here (the checkpoint's
        step + 1 < the lag), so its generator starts from the weights the run started from."""
        return any(self._saved_through.get(ch.name) is not None and self._saved_through[ch.name] + 1 < ch.step_lag
                   for ch in self.graph.channels if ch.kind is Kind.WEIGHTS and ch.dst == self.host)

    def save_channels(self, path: Path) -> None:
        """A checkpoint's part of this rank's channels: the lagged pushes in flight (offpolicy)."""
        for ch, (sender, _) in zip(self.graph.channels, self._endpoints):
            if sender is not None and ch.kind is Kind.WEIGHTS:
                sender.save(path)

    def bind_channels(self) -> None:
        self._endpoints = []
        self._saved_through: dict[str, int | None] = {}  # lagged WEIGHTS: what the checkpoint kept in flight
        here = {ex.name for ex in self.local}
        holders = device_ranks(self.graph)
        for cid, ch in enumerate(self.graph.channels):
            route = Route(channel_id=cid + 1, src_units=self.units[ch.src], dst_units=self.units[ch.dst],
                          src_sharded=self.graph.executor(ch.src).shards_over_units,
                          src_ep=self.graph.executor(ch.src).expert_shards,
                          src_pp=self.graph.executor(ch.src).stages,
                          src_cp=self.graph.executor(ch.src).context_ranks)
            if ch.kind is Kind.WEIGHTS:
                self._saved_through[ch.name] = saved_through(self.resume, ch, route)
            send_cls, recv_cls = ENDPOINTS[ch.kind]
            # bodies travel on the device only between ranks that both hold one (else over gloo)
            ends = {r for unit in route.src_units + route.dst_units for r in unit}
            device = self.env.device if ends <= holders else torch.device("cpu")
            common = dict(channel=ch, route=route, store=self.store, rank=self.rank, device=device)
            sender = send_cls(**common) if ch.src in here else None
            receiver = recv_cls(**common) if ch.dst in here else None
            self._endpoints.append((sender, receiver))


def build_world(graph: Graph, *, device: torch.device, seed: int, output_dir: Path,
                timeout: timedelta, resume: Path | None = None) -> World:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_world_size(graph, world_size)
    units = placement(graph)
    holders = device_ranks(graph)
    host, local_group = None, None
    for ex in graph.placed:  # same order on every rank
        ranks = [r for unit in units[ex.name] for r in unit]
        # ranks without an accelerator cannot join a device communicator
        group = dist.new_group(ranks, timeout=timeout, backend=None if set(ranks) <= holders else "gloo")
        if rank in ranks:
            host, local_group = ex.name, group
    control_group = dist.new_group(backend="gloo", timeout=timeout)
    unit_groups = {}  # a unit's ranks -> its gloo group (guests in a layout of their own have their own units)
    for ex in graph.executors:  # same order on every rank
        for unit in units[ex.name] if ex.ranks_per_unit > 1 else ():
            if unit not in unit_groups:
                unit_groups[unit] = dist.new_group(list(unit), backend="gloo", timeout=timeout)
    assert host is not None, f"rank {rank} not placed"
    local = graph.on_ranks_of(host)
    time_shared = sum(ex.needs_device for ex in local) > 1  # placement=colocated: generator and trainer here

    def env(ex) -> ExecutorEnv:
        # a guest shares its host's ranks and group: it runs between the host's steps, never beside them
        mine = units[ex.name]
        unit = next(u for u in mine if rank in u)
        return ExecutorEnv(name=ex.name, ranks=tuple(r for u in mine for r in u), units=mine, rank=rank,
                           group=local_group, device=device, seed=seed, output_dir=output_dir, resume=resume,
                           weights_from=resume, unit_group=unit_groups.get(unit), time_shared=time_shared)

    envs = {ex.name: env(ex) for ex in local}
    world = World(graph=graph, units=units, rank=rank, host=host, envs=envs, store=store_client(timeout),
                  control_group=control_group, resume=resume)
    world.bind_channels()
    if world.samples_before_pushes():
        # e.g. offpolicy resumed within its first max_lag steps: they sample with the model's own weights
        world.envs = {name: dataclasses.replace(env, weights_from=None) for name, env in envs.items()}
    return world

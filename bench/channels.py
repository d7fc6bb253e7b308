"""Channel throughput on gloo vs. raw torch.distributed p2p of the same bytes between the same ranks.

One spawned world of 3 CPU ranks runs every case: SCATTER and BROADCAST as 1 producer -> 2
consumers, GATHER as 2 producers -> 1 consumer. A channel case goes through the real path
(Graph -> build_world -> endpoints -> send / close_step / flush / iterate), so it pays encode, the
store queue round trip per item and decode; the raw case isends the already-encoded bodies along
the same routes. Each cell is the median of REPEATS timed steps after one warm-up; a step's time is
the slowest rank's, from a shared barrier to its last byte. MB = 1e6 bytes, counted per delivery
(a broadcast item counts once per destination).

    .venv/bin/python bench/channels.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

# run as a script, sys.path[0] is bench/, where this file would shadow the `channels` package
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench")
                         and p != _ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tidal.channels.channel import Channel, Route  # noqa: E402
from tidal.channels.codec import encode  # noqa: E402
from tidal.channels.kinds import Kind  # noqa: E402
from tidal.controller.graph import Graph  # noqa: E402
from tidal.controller.world import build_world  # noqa: E402
from tidal.executors.base import Endpoints, Executor, Input, Output, StepContext
from tidal.common.spawn import spawn  # noqa: E402

WORLD = 3
REPEATS = 5
RAW_TAG = 10_000  # apart from channel tags (channel ids start at 1)
# (bytes per item, items per step): enough items that each step moves a few MiB at least
SIZES = ((64 << 10, 512), (1 << 20, 64), (16 << 20, 8))
LAYOUTS = {Kind.SCATTER: (1, 2), Kind.BROADCAST: (1, 2), Kind.GATHER: (2, 1)}  # (producers, consumers)


@dataclass
class Blob:
    index: int
    data: torch.Tensor
    pieces: list[torch.Tensor]  # ragged: exercises the codec's flatten + lengths path


def make_blob(*, index: int, nbytes: int) -> Blob:
    # 3/4 of the bytes dense float32, 1/4 as 8 ragged int64 pieces; the body is exactly nbytes
    ragged_elems = nbytes // 4 // 8
    cuts = torch.linspace(0, ragged_elems, 9).long().tolist()
    flat = torch.arange(ragged_elems, dtype=torch.int64)
    pieces = [flat[a:b].clone() for a, b in zip(cuts, cuts[1:])]
    dense = torch.rand((nbytes - ragged_elems * 8) // 4)
    return Blob(index=index, data=dense, pieces=pieces)


def blob_bytes(blob: Blob) -> int:
    return blob.data.nbytes + sum(p.nbytes for p in blob.pieces)


class Producer(Executor):
    items = Output(Blob)

    def __init__(self, *, units: int):
        super().__init__(name="producer", units=units)
        self.blobs: list[Blob] = []  # built before the clock starts: we time transport, not rand()

    def step(self, ctx: StepContext):
        for item in self.blobs[self.env.unit_index::self.units]:
            ctx.outbound[self.items].send(item)
        return None


class Consumer(Executor):
    items = Input(Blob)

    def __init__(self, *, units: int):
        super().__init__(name="consumer", units=units)
        self.received_bytes = 0

    def step(self, ctx: StepContext):
        for item in ctx.inbound[self.items]:
            self.received_bytes += blob_bytes(item)
        return None


def _slowest(fn, *, group) -> float:
    """Seconds from a shared barrier until the slowest rank is done with `fn`."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def _total(value: int, *, group) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


class Case:
    """One kind: its graph bound on this rank, plus a raw-p2p twin over the same routes."""

    def __init__(self, *, kind: Kind, timeout: timedelta):
        n_src, n_dst = LAYOUTS[kind]
        self.kind = kind
        self.producer, self.consumer = Producer(units=n_src), Consumer(units=n_dst)
        graph = Graph([self.producer, self.consumer],
                      [Channel("items", "producer", "consumer", kind, Blob)])
        self.world = build_world(graph, device=torch.device("cpu"), seed=0, output_dir=Path("."),
                                 timeout=timeout)
        self.world.local[0].init(self.world.env)
        self.route = Route(channel_id=RAW_TAG, src_units=self.world.units["producer"],
                           dst_units=self.world.units["consumer"])
        self.group = self.world.control_group
        self.bodies: list[torch.Tensor] = []

    def load(self, *, nbytes: int, items: int) -> None:
        self.producer.blobs = [make_blob(index=i, nbytes=nbytes) for i in range(items)]
        self.bodies = [encode(b)[1] for b in self.producer.blobs]

    def channel_step(self, step: int) -> tuple[float, int]:
        ex = self.world.local[0]
        self.consumer.received_bytes = 0

        def run():
            # the controller's per-step sequence, minus metrics and timeline
            inbound, outbound = self.world.endpoints(step, ex.name, first_step=0, last_step=1 << 30)
            ex.step(StepContext(step, Endpoints(inbound), Endpoints(outbound)))
            for sender in outbound.values():
                sender.close_step()
            for sender in outbound.values():
                sender.flush()

        seconds = _slowest(run, group=self.group)
        return seconds, _total(self.consumer.received_bytes, group=self.group)

    def raw_step(self) -> tuple[float, int]:
        rank, items = self.world.rank, self.producer.blobs
        leaders = self.route.src_leaders
        received = 0

        def run():
            nonlocal received
            if rank in leaders:
                unit = leaders.index(rank)
                works = [dist.isend(self.bodies[i], dst, tag=RAW_TAG)
                         for i in range(unit, len(items), len(leaders))
                         for dst in self.route.destinations(self.kind, items[i])]
                for w in works:
                    w.wait()
                return
            for i, item in enumerate(items):  # per source, gloo matches messages in send order
                if rank in self.route.destinations(self.kind, item):
                    body = torch.empty_like(self.bodies[i])
                    dist.recv(body, leaders[i % len(leaders)], tag=RAW_TAG)
                    received += body.numel()

        seconds = _slowest(run, group=self.group)
        return seconds, _total(received, group=self.group)


def _rank_main(repeats: int) -> list[dict] | None:
    torch.set_num_threads(1)  # 2 shared cores: ranks must not oversubscribe them
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout)
    # one step counter for the whole run: every case's channel has id 1 and the same store prefix,
    # so reusing a step number would reuse a store queue
    rows, step = [], 0
    try:
        for kind in LAYOUTS:
            case = Case(kind=kind, timeout=timeout)
            for nbytes, items in SIZES:
                case.load(nbytes=nbytes, items=items)
                chan, raw = [], []
                for rep in range(repeats + 1):  # rep 0 warms up; alternate so drift hits both alike
                    t_chan, b_chan = case.channel_step(step)
                    t_raw, b_raw = case.raw_step()
                    step += 1
                    assert b_chan == b_raw, (kind, nbytes, b_chan, b_raw)
                    if rep:
                        chan.append(b_chan / t_chan)
                        raw.append(b_raw / t_raw)
                chan_mbs, raw_mbs = statistics.median(chan) / 1e6, statistics.median(raw) / 1e6
                rows.append({"kind": kind.value, "nbytes": nbytes, "items": items,
                             "delivered_mb": b_chan / 1e6, "chan": chan_mbs, "raw": raw_mbs})
    finally:
        dist.destroy_process_group()
    return rows if int(os.environ["RANK"]) == 0 else None


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    t0 = time.perf_counter()
    rows = spawn(_rank_main, WORLD, REPEATS, timeout_s=180)[0]
    table = []
    for r in rows:
        # what the channel adds per item on top of the raw transfer, from the two medians
        extra_ms = r["delivered_mb"] * (1 / r["chan"] - 1 / r["raw"]) / r["items"] * 1e3
        table.append([r["kind"], _size(r["nbytes"]), r["items"], f"{r['delivered_mb']:.0f}",
                      f"{r['chan']:.0f}", f"{r['raw']:.0f}", f"{r['chan'] / r['raw']:.2f}",
                      f"{extra_ms:.2f}"])
    print(tabulate(table, headers=["kind", "payload", "items", "MB/step", "MB/s channel",
                                   "MB/s raw p2p", "ratio", "+ms/item"], colalign=("left", "right")))
    print(f"\ngloo, {WORLD} CPU ranks, median of {REPEATS} after 1 warm-up; "
          f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

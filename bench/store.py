"""The rendezvous store as the channels use it: how many item headers per second it carries.

Every channel item's header is one `queue_push` per receiving rank by the sender and one blocking
`queue_pop` by each of those ranks (tidal/channels/channel.py), so an item reaching R ranks costs 2R store
operations; at the end of a step each source unit's leader pushes an end marker to every
destination rank (2 operations each). The bodies go p2p and are not measured here. K client
processes share one TCPStore server (the job's, on rank 0's host); each pushes and pops HEADER-byte
messages on its own queue, as a receiver rank drains its own. Prints the aggregate store operations
per second for each K, and from the best figure the items per second the store carries at R
receiving ranks per item.

    .venv/bin/python bench/store.py [--clients 1,2,4,8] [--ops 4000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from datetime import timedelta
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench") and p != _ROOT]

from tabulate import tabulate  # noqa: E402

from tidal.common.spawn import free_port  # noqa: E402

HEADER = json.dumps({"src": 17, "header": {"index": 123, "prompt_ids": [0, 0], "responses": [[0, 64]] * 16,
                                           "rewards": [0.0] * 16}, "nbytes": 123456})


def client(port: int, k: int, ops: int, start, queue) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    start.wait()
    t0 = time.perf_counter()
    for i in range(ops // 2):
        store.queue_push(f"q/{k}", HEADER)
        store.queue_pop(f"q/{k}", block=True)
    queue.put(time.perf_counter() - t0)


def measure(clients: int, ops: int) -> float:
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=120))  # noqa: F841
    ctx = mp.get_context("spawn")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=client, args=(port, k, ops, start, queue)) for k in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # every client connected
    t0 = time.perf_counter()
    start.set()
    times = [queue.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return clients * (ops // 2) * 2 / max(wall, max(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--ops", type=int, default=4000, help="store operations per client")
    args = p.parse_args()
    rows = []
    for k in [int(x) for x in args.clients.split(",")]:
        rows.append([k, measure(k, args.ops)])
    best = max(r[1] for r in rows)
    print(f"header of {len(HEADER)} bytes; one TCPStore server, clients on the same host")
    print(tabulate(rows, headers=["clients", "store ops/s"], floatfmt=".0f"))
    print(f"best {best:.0f} ops/s: items/s it carries at R receiving ranks per item (2R ops each): "
          + ", ".join(f"R={r}: {best / (2 * r):.0f}" for r in (1, 4, 8, 32)))


if __name__ == "__main__":
    main()

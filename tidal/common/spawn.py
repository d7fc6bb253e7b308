"""Run a function on N local ranks with a deadline and collect what each returns (one machine, no
torchrun: the tests' and the benchmarks' way to a small world); a free local port for a rendezvous."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, queue, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


# imported once by the fork server; each rank forks from it with these in memory (~2 s of imports a rank)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "numpy", "safetensors.torch", "transformers",
           "transformers.models.qwen3.modeling_qwen3", "tidal.modeling.hf", "tidal.controller.devices"]


# "forkserver": fast; "spawn" where a library cleans up at process exit in C++ (vLLM's CPU shared memory,
# a GPU's teardown): a fork server's child ends by os._exit, which skips that (tests_vllm/, tests_gpu/ set it)
START_METHOD = "forkserver"


def spawn(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run `fn(*args)` on `world_size` ranks; return the per-rank results in rank order.

    The ranks are fresh processes forked from multiprocessing's fork server, which imported PRELOAD
    once (single-threaded, so forking it is safe): a rank starts without importing torch again.

    Raises RuntimeError with the failing rank's traceback, or on deadline (children are killed by
    their own handles, never by name).
    """
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first spawn); later calls change nothing
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, queue, args), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                   f"missed the {timeout_s:.0f} s deadline")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited with codes "
                                       f"{[procs[r].exitcode for r in dead]} before returning")
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} raised:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=120)  # a rank that returned may still be tearing its groups down (CI can be loaded)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]

"""The resharding weight push vs. gather-to-one-rank-then-broadcast vs. raw p2p of the same bytes.

One spawned world of 4 CPU gloo ranks: trainer ranks 0-1, generator ranks 2-3. Parameters have
the shapes of Qwen3-like models (built on the meta device, so nothing is initialised); each rank
allocates only its own shards. Per model size and layout:

- direct: the planned push (tidal/channels/push_plan.py, run by tidal/channels/push.py), every piece straight
  from an owning trainer rank to the generator rank that needs it, in buckets;
- gather+bcast: the trainer gathers the full model on trainer rank 0, which broadcasts each full
  parameter to the generator ranks; they keep their slice;
- raw p2p: per (sender, receiver) link of the plan, one isend of that link's bytes from a ready
  buffer: the same bytes on the same links with no packing, the ceiling for `direct`.

A time is the median of REPEATS, each from a shared barrier to the last rank's end (a closing
barrier). MB/s is model MB (1e6 bytes, fp32) per second. Memory: the highest resident set size
sampled (every 2 ms) during the method minus the one just before it (after malloc_trim), per
rank; the direct push grows by its bucket buffers on its first run only and reuses them after.

    .venv/bin/python bench/weight_push.py [--sizes 10M,100M,400M] [--bucket-mb 16]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import threading
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench")
                         and p != _ROOT]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config  # noqa: E402

from tidal.channels.push import WeightPush  # noqa: E402
from tidal.channels.push_plan import GeneratorLayout, TrainerLayout, build_plan  # noqa: E402
from tidal.modeling.parallel import param_specs  # noqa: E402
from tidal.common.spawn import spawn  # noqa: E402

REPEATS = 3
TRAINER, GENERATOR = (0, 1), (2, 3)
# (hidden, layers, heads, kv heads, intermediate, vocab): about 10M, 100M and 400M parameters
MODELS = {"10M": (256, 8, 4, 2, 1024, 8192), "100M": (768, 10, 12, 4, 2560, 32000),
          "400M": (1024, 29, 16, 8, 3072, 32000)}
# name -> (trainer tp, fsdp, generator tp)
LAYOUTS = {"t-tp2 > g-tp2": (2, False, 2), "t-fsdp2 > g-tp2": (1, True, 2)}


def specs_of(size: str):
    hidden, layers, heads, kv, inter, vocab = MODELS[size]
    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=hidden // heads, intermediate_size=inter,
                         vocab_size=vocab, tie_word_embeddings=True)
    with torch.device("meta"):
        return param_specs(AutoModelForCausalLM.from_config(config))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest resident set size while the block runs, minus the one at its start."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.start


def _box_view(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


def _shards(plan, rank: int) -> dict[str, torch.Tensor]:
    """This rank's shards, written once so their pages are resident before anything is measured."""
    tr, gen = plan.trainer, plan.generator
    out = {}
    for name, spec in plan.specs.items():
        if rank in tr.ranks:
            d, t = divmod(tr.ranks.index(rank), tr.tp)
            box = tr.box(spec, d=d, t=t)
        else:
            box = gen.box(spec, t=gen.ranks.index(rank) % gen.tp)
        out[name] = torch.empty([b - a for a, b in box], dtype=spec.dtype).fill_(float(rank + 1))
    return out


def gather_then_broadcast(plan, rank: int, tensors, *, gather_group, bcast_group) -> None:
    """The baseline: the full model on trainer rank 0, then each full parameter to every generator rank."""
    tr, gen = plan.trainer, plan.generator
    root = tr.ranks[0]
    full = {}
    for name, spec in plan.specs.items():  # gather every parameter before sending any: a full state dict
        if rank not in tr.ranks:
            continue
        if spec.tp_dim is None and not tr.fsdp:  # replicated: the root has it already
            if rank == root:
                full[name] = tensors[name]
            continue
        # gather needs equal sizes: tp chunks are (checked divisible), FSDP's last chunks may be short
        # and are padded to the first one, which the root holds
        mine = _padded(tensors[name], rows=_rows(plan, name))
        parts = [torch.empty_like(mine) for _ in tr.ranks] if rank == root else None
        dist.gather(mine, parts, dst=root, group=gather_group)
        if rank == root:
            full[name] = _assemble(plan, name, parts)
    for name, spec in plan.specs.items():
        if rank == root:
            dist.broadcast(full[name], src=root, group=bcast_group)
        elif rank in gen.ranks:
            buf = torch.empty(spec.shape, dtype=spec.dtype)
            dist.broadcast(buf, src=root, group=bcast_group)
            tensors[name].copy_(_box_view(buf, gen.box(spec, t=gen.ranks.index(rank) % gen.tp)))
            del buf


def _rows(plan, name: str) -> int:
    tr, spec = plan.trainer, plan.specs[name]
    base = spec.shape[0] // tr.tp if spec.tp_dim == 0 else spec.shape[0]
    return -(-base // tr.dp) if tr.fsdp else base


def _padded(t: torch.Tensor, *, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _assemble(plan, name: str, parts) -> torch.Tensor:
    tr, spec = plan.trainer, plan.specs[name]
    full = torch.empty(spec.shape, dtype=spec.dtype)
    for i, part in enumerate(parts):
        d, t = divmod(i, tr.tp)
        box = tr.box(spec, d=d, t=t)
        rows = box[0][1] - box[0][0]
        _box_view(full, box).copy_(part[:rows])
    return full


def raw_p2p(plan, rank: int, buffers: dict[int, torch.Tensor]) -> None:
    """Each link's bytes as one message from a ready buffer, all links at once."""
    works = []
    for s in plan.streams:
        if s.sender == rank:
            works.append(dist.isend(buffers[("out", s.receiver)], s.receiver))
        elif s.receiver == rank:
            works.append(dist.irecv(buffers[("in", s.sender)], s.sender))
    for w in works:
        w.wait()


def _raw_buffers(plan, rank: int) -> dict:
    sizes: dict = {}
    for s in plan.streams:
        n = sum(b.nbytes for b in s.buckets)
        if s.sender == rank:
            sizes[("out", s.receiver)] = sizes.get(("out", s.receiver), 0) + n
        elif s.receiver == rank:
            sizes[("in", s.sender)] = sizes.get(("in", s.sender), 0) + n
    return {k: torch.empty(n, dtype=torch.uint8).fill_(1) for k, n in sizes.items()}


_LIBC = ctypes.CDLL("libc.so.6")


def _timed(fn) -> tuple[float, int]:
    # hand freed heap pages back first, or memory freed earlier would be reused without showing
    gc.collect()
    _LIBC.malloc_trim(0)
    dist.barrier()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - t0
    return seconds, mem.growth


def _rank_main(sizes: list[str], bucket_bytes: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gather_group = dist.new_group(list(TRAINER))
    bcast_group = dist.new_group([TRAINER[0], *GENERATOR])
    rows = []
    for size in sizes:
        specs = specs_of(size)
        for layout, (tp_t, fsdp, tp_g) in LAYOUTS.items():
            plan = build_plan(specs=specs, trainer=TrainerLayout(ranks=TRAINER, tp=tp_t, fsdp=fsdp),
                              generator=GeneratorLayout(ranks=GENERATOR, tp=tp_g), bucket_bytes=bucket_bytes)
            tensors = _shards(plan, rank)
            push = WeightPush(plan, rank=rank)
            raw = _raw_buffers(plan, rank)
            cases = {"direct": lambda: push.run(tensors),
                     "gather+bcast": lambda: gather_then_broadcast(plan, rank, tensors, gather_group=gather_group,
                                                                   bcast_group=bcast_group),
                     "raw p2p": lambda: raw_p2p(plan, rank, raw)}
            times = {k: [] for k in cases}
            growth = {k: 0 for k in cases}
            first_push_growth = None
            for rep in range(REPEATS):
                for name, fn in cases.items():
                    seconds, grown = _timed(fn)
                    times[name].append(seconds)
                    if name == "direct" and rep == 0:
                        first_push_growth = grown  # allocates its bucket buffers
                    else:
                        growth[name] = max(growth[name], grown)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            rows.append({"size": size, "layout": layout, "params": sum(_numel(s) for s in specs.values()),
                         "times": {k: statistics.median(v) for k, v in times.items()}, "growth": growth,
                         "first_push_growth": first_push_growth, "shard_bytes": nbytes,
                         "buffer_bytes": push.buffer_bytes})
            del tensors, push, raw, cases
            gc.collect()
    dist.destroy_process_group()
    return rows


def _numel(spec) -> int:
    n = 1
    for x in spec.shape:
        n *= x
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10M,100M,400M")
    parser.add_argument("--bucket-mb", type=float, default=16)
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in MODELS]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; known: {list(MODELS)}")
    bucket = int(args.bucket_mb * (1 << 20))
    t0 = time.perf_counter()
    per_rank = spawn(_rank_main, len(TRAINER) + len(GENERATOR), sizes, bucket, timeout_s=900)
    table, mem = [], []
    for i, row in enumerate(per_rank[0]):
        model_mb = row["params"] * 4 / 1e6
        t = row["times"]
        for name in ("direct", "gather+bcast", "raw p2p"):
            table.append([row["size"], f"{row['params'] / 1e6:.0f}M", row["layout"], name, f"{t[name]:.3f}",
                          f"{model_mb / t[name]:.0f}", f"{t[name] / t['direct']:.2f}"])
        mb = lambda x: f"{x / 1e6:.0f}"  # noqa: E731
        ranks = [r[i] for r in per_rank]
        mem.append([row["size"], row["layout"],
                    " / ".join(mb(r["shard_bytes"]) for r in ranks),
                    " / ".join(mb(r["first_push_growth"]) for r in ranks),
                    " / ".join(mb(r["growth"]["direct"]) for r in ranks),
                    " / ".join(mb(r["growth"]["gather+bcast"]) for r in ranks),
                    " / ".join(mb(r["buffer_bytes"]) for r in ranks)])
    print(f"trainer ranks {TRAINER}, generator ranks {GENERATOR}, fp32, bucket {args.bucket_mb} MiB, "
          f"median of {REPEATS}")
    print(tabulate(table, headers=["size", "params", "layout", "method", "s", "model MB/s", "x direct"]))
    print()
    print("resident memory growth per rank (MB, ranks t0 / t1 / g0 / g1) during a push")
    print(tabulate(mem, headers=["size", "layout", "own shards", "direct, 1st", "direct, later",
                                 "gather+bcast", "push buffers"]))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()

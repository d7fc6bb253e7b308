"""Long rows: context parallel (trainer.cp) on one long packed row, cp = 1, 2, 4 in one run.

Each cp runs on its own world of cp ranks (gloo, one thread a rank): the policy's forward and backward of
one shared-prompt row (a prompt and G long responses), `--repeats` times after a warm-up. Per cp: the
row's tokens per second (the row over the median forward + backward), the activations a rank keeps for
the backward (the bytes autograd saves, the parameters aside: exact, not sampled) and the rank's peak
resident memory, each against cp=1 measured in the same run. On a machine with fewer cores than ranks the
ranks share them: tokens/s then says what the split costs, not what it gains (this machine has 2).

    .venv/bin/python bench/long_tail.py [--model DIR] [--prompt 256] [--responses 4] [--length 1024] [--repeats 3]
    .venv/bin/python bench/long_tail.py --part schedules [bench/partial.py's options]

`--part schedules` runs bench/partial.py: the schedules on a long tail (sync, periodic, periodic + partial
rollouts, offpolicy) with s/step, trained tokens/s and the planner's prediction beside each, in one run.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank(model_path, P: int, G: int, R: int, repeats: int, cp_size: int):
    import torch
    import torch.distributed as dist

    from tidal.modeling.hf import load_model
    from tidal.modeling.packing import pack_group
    from tidal.modeling.parallel.cp import context_groups, forward as cp_forward

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp = context_groups(ranks=range(cp_size), cp=cp_size, tp=1) if cp_size > 1 else None
    model = load_model(model_path)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    (mb,) = pack_group(torch.randint(0, vocab, (P,), generator=g), [torch.randint(0, vocab, (R,), generator=g)
                                                                     for _ in range(G)],
                       token_budget=10 ** 9, pad_id=0, device=torch.device("cpu"), shared_prompt=True)

    def forward():
        if cp is None:
            return mb.forward(model, temperature=1.0, chunk=1024)
        return cp_forward(mb, model, cp=cp, temperature=1.0, chunk=1024)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if i == 0 else _nothing():
            out = forward()
        out.logp_NT.sum().backward()
        dist.barrier()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.destroy_process_group()
    return dict(tokens=mb.tokens, s=statistics.median(times), saved=sum(saved.values()), rss_kb=rss, rss0_kb=rss0)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF model directory (default: the embedded model)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--responses", type=int, default=4)
    p.add_argument("--length", type=int, default=1024, help="tokens per response")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--part", choices=["cp", "schedules"], default="cp")
    args, rest = p.parse_known_args()
    if args.part == "schedules":
        import subprocess

        sys.exit(subprocess.run([sys.executable, str(ROOT / "bench" / "partial.py"), *rest]).returncode)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from tidal.common.spawn import spawn

    results = {}
    for cp in args.cp:
        ranks = spawn(_rank, cp, args.model, args.prompt, args.responses, args.length, args.repeats, cp,
                      timeout_s=3600)
        results[cp] = dict(tokens=ranks[0]["tokens"], s=max(r["s"] for r in ranks),
                           saved=max(r["saved"] for r in ranks), rss=max(r["rss_kb"] for r in ranks) / 2 ** 20)
    base = results[args.cp[0]]
    rows = [[cp, r["tokens"], f"{r['s']:.2f}", f"{r['tokens'] / r['s']:.0f}", f"{base['s'] / r['s']:.2f}",
             f"{r['saved'] / 2 ** 30:.3f}", f"{r['saved'] / base['saved']:.2f}", f"{r['rss']:.2f}",
             f"{r['rss'] / base['rss']:.2f}"] for cp, r in results.items()]
    print(f"model {args.model or 'embedded'}; one shared-prompt row: prompt {args.prompt} + {args.responses} x "
          f"{args.length} tokens; forward + backward, median of {args.repeats}")
    print(tabulate(rows, headers=["cp", "row tokens", "s", "tokens/s", "vs cp=1", "activations GiB / rank",
                                  "vs cp=1", "peak RSS GiB / rank", "vs cp=1"], disable_numparse=True))


if __name__ == "__main__":
    main()

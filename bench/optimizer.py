"""The barrier's optimizer step on a real model's parameters: torch's AdamW as the trainer ran it before
(the per-tensor loop, torch's CPU default), foreach, and fused (the trainer's choice now,
tidal/modeling/optim.py fused_adamw); the gradient clip's norm beside it. One process, no torch.distributed,
median of `--repeats` steps after one warm-up; ratios against the default loop in the same run.

    .venv/bin/python -m bench.optimizer [--model /work/real/smollm2-135m-hf] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tabulate import tabulate


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: AdamW allocates its state on the first step
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/work/real/smollm2-135m-hf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from tidal.modeling.parallel import clip_grad_norm_

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows, base = [], None
    for label, kw in (("default (per-tensor loop)", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-6, **kw)
        s = timed(opt.step, args.repeats)
        base = base or s
        rows.append([f"AdamW {label}", f"{s:.3f}", f"{s / base:.2f}"])
    s = timed(lambda: clip_grad_norm_(params, 1e9, mesh=None), args.repeats)
    rows.append(["grad clip (float64 norm)", f"{s:.3f}", f"{s / base:.2f}"])
    before = timed(lambda: sum(p.grad.double().pow(2).sum() for p in params), args.repeats)
    rows.append(["its norm as before (.double().pow(2).sum())", f"{before:.3f}", f"{before / base:.2f}"])
    n = sum(p.numel() for p in params)
    print(f"{args.model}: {n / 1e6:.0f}M parameters, {args.threads} thread(s), median of {args.repeats}")
    print(tabulate(rows, headers=["step", "s", "vs default"]))


if __name__ == "__main__":
    main()

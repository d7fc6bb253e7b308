"""Continuous admission vs chunked decoding in the native engine: the same samples, generation
speed, and how early finished groups become available to the trainer.

One process, one thread (a generator rank's budget here), the engine's real entry point
`engine.generate(requests, params, step=...)`. The model is the embedded tiny Qwen3 with its EOS
logit raised so each sample ends at a random length (geometric, about `--eos-p` per token), as
RL responses do; the random-init model alone would run every sample to `max_new_tokens`. Each figure
is the median of `--repeats` timed calls after a warm-up call, the two admissions interleaved.

Columns: gen s (the whole generate call), tokens/s (response tokens / gen s), first and median
group (when the first and the median group left, as a fraction of gen s: what a periodic trainer
can start on), and whether the samples are the same.

    .venv/bin/python bench/admission.py [--prompts 32] [--samples 8] [--slots 8] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench") and p != _ROOT]

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from tidal.modeling.tiny.task import embedded_prompts  # noqa: E402
from tidal.executors.generator.contract import PromptRequest, SamplingParams  # noqa: E402
from tidal.executors.generator.native_engine import ADMISSIONS, NativeEngine  # noqa: E402
from tidal.modeling.hf import load_model, load_tokenizer  # noqa: E402


def timed(engine: NativeEngine, requests, params) -> tuple[float, list[float], dict]:
    t0, leave, groups = time.perf_counter(), [], {}
    for g in engine.generate(requests, params, step=0):
        leave.append(time.perf_counter() - t0)
        groups[g.index] = g
    return time.perf_counter() - t0, leave, groups


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--slots", type=int, default=8, help="max_batch_prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--eos-p", type=float, default=0.05, help="about the probability of EOS per token")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    tok, model = load_tokenizer(None), load_model(None, seed=0)
    bias_V = torch.zeros(model.config.vocab_size)
    # the random model's logits are near uniform over V: log-odds of eos_p against the other V-1
    bias_V[tok.eos_token_id] = math.log(args.eos_p * (model.config.vocab_size - 1) / (1 - args.eos_p))
    model.lm_head.register_forward_hook(lambda mod, a, out: out + bias_V)
    requests = [PromptRequest(index=i, prompt_ids=tok(r["prompt"]).input_ids)
                for i, r in enumerate(embedded_prompts(args.prompts, seed=1))]
    params = SamplingParams(n=args.samples, max_new_tokens=args.max_new_tokens, seed=3)
    engines = {a: NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                               max_batch_prompts=args.slots, admission=a) for a in ADMISSIONS}
    runs = {a: [] for a in ADMISSIONS}
    for a, engine in engines.items():
        timed(engine, requests, params)  # warm-up
    for _ in range(args.repeats):
        for a, engine in engines.items():
            runs[a].append(timed(engine, requests, params))
    samples = {a: {i: [r.tolist() for r in g.response_ids] for i, g in runs[a][0][2].items()} for a in ADMISSIONS}
    tokens = sum(len(r) for g in runs["chunked"][0][2].values() for r in g.response_ids)
    lengths = sorted(len(r) for g in runs["chunked"][0][2].values() for r in g.response_ids)
    rows, base = [], statistics.median(run[0] for run in runs["chunked"])
    for a in ADMISSIONS:
        gen_s = statistics.median(run[0] for run in runs[a])
        first = statistics.median(run[1][0] / run[0] for run in runs[a])
        median = statistics.median(statistics.median(run[1]) / run[0] for run in runs[a])
        rows.append([a, gen_s, tokens / gen_s, base / gen_s, first, median,
                     "yes" if samples[a] == samples["chunked"] else "NO"])
    print(f"{args.prompts} prompts x {args.samples} samples, {args.slots} groups at once, response tokens "
          f"{tokens} (length median {lengths[len(lengths) // 2]}, max {lengths[-1]} of {args.max_new_tokens}), "
          f"medians of {args.repeats}")
    print(tabulate(rows, floatfmt=".3f", headers=["admission", "gen s", "tokens/s", "speed vs chunked",
                                                  "first group at", "median group at", "same samples"]))


if __name__ == "__main__":
    main()

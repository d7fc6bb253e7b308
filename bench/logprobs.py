"""Peak memory of the trainer's log-probs + entropy + backward: the LM head whole vs in chunks.

The case the issue names: a 152k vocabulary (Qwen2.5/Qwen3) and 8k response tokens. Only the head
is run (hidden 512: the body's memory is the same either way), on hidden states that need a
gradient, in fp32: forward (log-probs of the targets and the entropy metric), sum, backward.
Each case runs in its own process; its peak resident memory (ru_maxrss) minus the process's
resident memory just before the forward is the figure. The time is the same process's CPU time of
forward + backward (chunks recompute the head in the backward: one more head product).

    .venv/bin/python bench/logprobs.py [--tokens 8192] [--vocab 152064]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 512
CHUNKS = (0, 4096, 1024, 256)  # 0: the whole head at once (the trainer before chunking)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _one(tokens: int, vocab: int, chunk: int) -> dict:
    import torch

    from tidal.modeling.head import head_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, vocab, bias=False)
    h_KH = torch.randn(tokens, HIDDEN, requires_grad=True)
    targets_K = torch.randint(0, vocab, (tokens,))
    before = _rss_mb()
    t0 = time.process_time()
    logp_K, ent_K = head_logprobs(head, h_KH, targets_K, temperature=1.0, chunk=chunk, entropy=True)
    logp_K.sum().backward()
    cpu_s = time.process_time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "cpu_s": cpu_s, "logp_sum": logp_K.sum().item(),
            "grad_norm": h_KH.grad.norm().item(), "entropy_mean": ent_K.mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: run one chunk size
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args.tokens, args.vocab, args.one)))
        return
    rows, base = [], None
    for chunk in CHUNKS:
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                              "--one", str(chunk)], cwd=ROOT, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r
        rows.append([chunk or "whole", f"{r['peak_mb']:.0f}", f"{base['peak_mb'] / r['peak_mb']:.1f}x",
                     f"{r['cpu_s']:.1f}", f"{r['cpu_s'] / base['cpu_s']:.2f}",
                     f"{abs(r['logp_sum'] - base['logp_sum']) / abs(base['logp_sum']):.1e}",
                     f"{abs(r['grad_norm'] - base['grad_norm']) / base['grad_norm']:.1e}"])
    print(f"LM head log-probs + entropy + backward: {args.tokens} tokens, vocab {args.vocab}, hidden {HIDDEN}, fp32, "
          f"1 thread")
    print(tabulate(rows, headers=["chunk", "peak MB", "less memory", "CPU s", "time ratio", "logp rel diff",
                                  "grad rel diff"]))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

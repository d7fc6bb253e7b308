"""Shared-prompt packing vs separate padded rows vs varlen rows: fwd+bwd time of one GRPO group.

Model: a random Qwen3, hidden 256, 4 layers, 4 heads x 64 (2 KV heads), MLP 768, the embedded
512-token vocabulary, fp32, one CPU thread: small enough that the three cases run in under two
minutes, large enough that attention is a real share of the time at these lengths.

Columns, each against the separate padded rows (the reference `split_group`, one micro-batch of G):
token ratio = separate tokens / method tokens, time ratio = separate time / method time,
efficiency = time ratio / token ratio. Median of 3 timed repeats after one warm-up.

    .venv/bin/python bench/shared_prompt.py
"""
from __future__ import annotations

import statistics
import time

import torch
from tabulate import tabulate
from transformers import AutoModelForCausalLM, Qwen3Config

from executors.trainer.batching import split_group
from executors.trainer.packing import pack_group

CASES = [(200, 8, 50), (1000, 8, 100), (100, 8, 1000)]  # (P, G, R)
REPEATS = 3


def bench_model() -> torch.nn.Module:
    config = Qwen3Config(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=768,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def fwd_bwd_s(model, mbs, *, G: int) -> float:
    weights_G = torch.linspace(-1.0, 1.0, G)
    times = []
    for rep in range(REPEATS + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for mb in mbs:
            logp_NT = mb.logprobs(model, temperature=1.0)
            (logp_NT * weights_G[list(mb.samples), None]).sum().backward()
        if rep:  # the first pass warms allocator and caches
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    model = bench_model()
    rows = []
    for P, G, R in CASES:
        g = torch.Generator().manual_seed(P * 7 + R)
        prompt = torch.randint(0, 512, (P,), generator=g)
        responses = [torch.randint(0, 512, (R,), generator=g) for _ in range(G)]
        separate = split_group(prompt, responses, micro_batch_size=G, pad_id=0, device=torch.device("cpu"))
        base_tokens, base_s = sum(mb.tokens for mb in separate), fwd_bwd_s(model, separate, G=G)
        rows.append([f"P={P} G={G} R={R}", "separate padded", base_tokens, f"{base_s * 1e3:.0f}", "1.00", "1.00", "1.00"])
        for name, shared in (("shared prompt", True), ("varlen", False)):
            mbs = pack_group(prompt, responses, token_budget=10 ** 9, pad_id=0, device=torch.device("cpu"),
                             shared_prompt=shared)
            tokens, s = sum(mb.tokens for mb in mbs), fwd_bwd_s(model, mbs, G=G)
            token_ratio, time_ratio = base_tokens / tokens, base_s / s
            print(name, P, G, R, tokens, s, flush=True)
            rows.append(["", name, tokens, f"{s * 1e3:.0f}", f"{token_ratio:.2f}", f"{time_ratio:.2f}",
                         f"{time_ratio / token_ratio:.2f}"])
    print(tabulate(rows, headers=["case", "method", "tokens", "fwd+bwd ms", "token ratio", "time ratio",
                                  "efficiency"], disable_numparse=True))


if __name__ == "__main__":
    main()

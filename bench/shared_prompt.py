"""Shared-prompt packing vs separate padded rows vs varlen rows: fwd+bwd time of one GRPO group.

Model: a random Qwen3, hidden 256, 4 layers, 4 heads x 64 (2 KV heads), MLP 768, the embedded
512-token vocabulary, fp32, one CPU thread: small enough that the three cases run in under two
minutes, large enough that attention is a third or more of the time at these lengths.

Columns, each against the separate padded rows (the reference `split_group`, one micro-batch of G):
token ratio = separate tokens / method tokens, time ratio = separate time / method time,
efficiency = time ratio / token ratio. Each time is the median of 3 runs of the whole group
(forward, sum(logp * w), backward), the methods interleaved, after one small untimed pass of each,
in process CPU time: the bench machine's cores are shared, and wall time measured the neighbours.

`--auto` sweeps the prompt length at G=8, R=500 and prints shared-prompt vs varlen time next to the
token saving (G-1)·P / (G·P + ΣR) that `packing.auto_shared_prompt` thresholds.

    .venv/bin/python bench/shared_prompt.py [--auto]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from tabulate import tabulate
from transformers import AutoModelForCausalLM, Qwen3Config

from tidal.modeling.batching import split_group
from tidal.modeling.packing import auto_shared_prompt, pack_group

CASES = [(200, 8, 50), (1000, 8, 100), (100, 8, 1000)]  # (P, G, R)
AUTO_PROMPTS, AUTO_G, AUTO_R = (10, 25, 50, 100, 200), 8, 500
REPEATS = 3
CPU = torch.device("cpu")


def bench_model() -> torch.nn.Module:
    config = Qwen3Config(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, intermediate_size=768,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def group(P: int, G: int, R: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(P * 7 + R)
    return torch.randint(0, 512, (P,), generator=g), [torch.randint(0, 512, (R,), generator=g) for _ in range(G)]


def fwd_bwd_s(model, mbs, *, G: int) -> float:
    """Process CPU seconds of forward, sum(logp * w), backward over one group's micro-batches."""
    weights_G = torch.linspace(-1.0, 1.0, G)
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    for mb in mbs:
        logp_NT = mb.logprobs(model, temperature=1.0)
        (logp_NT * weights_G[list(mb.samples), None]).sum().backward()
    return time.process_time() - t0


def medians(model, methods: dict, *, G: int) -> dict[str, float]:
    """Median of REPEATS per method, the methods interleaved so a slow spell hits them all alike."""
    times = {name: [] for name in methods}
    for _ in range(REPEATS):
        for name, mbs in methods.items():
            times[name].append(fwd_bwd_s(model, mbs, G=G))
    return {name: statistics.median(t) for name, t in times.items()}


def packed(prompt, responses, *, shared: bool):
    return pack_group(prompt, responses, token_budget=10 ** 9, pad_id=0, device=CPU, shared_prompt=shared)


def main_table(model) -> None:
    rows = []
    for P, G, R in CASES:
        prompt, responses = group(P, G, R)
        methods = {"separate padded": split_group(prompt, responses, micro_batch_size=G, pad_id=0, device=CPU),
                   "shared prompt": packed(prompt, responses, shared=True),
                   "varlen": packed(prompt, responses, shared=False)}
        secs = medians(model, methods, G=G)
        base_tokens, base_s = sum(mb.tokens for mb in methods["separate padded"]), secs["separate padded"]
        for name, mbs in methods.items():
            tokens, s = sum(mb.tokens for mb in mbs), secs[name]
            token_ratio, time_ratio = base_tokens / tokens, base_s / s
            rows.append([f"P={P} G={G} R={R}" if name == "separate padded" else "", name, tokens, f"{s * 1e3:.0f}",
                         f"{token_ratio:.2f}", f"{time_ratio:.2f}", f"{time_ratio / token_ratio:.2f}"])
    print(tabulate(rows, headers=["case", "method", "tokens", "fwd+bwd ms", "token ratio", "time ratio",
                                  "efficiency"], disable_numparse=True))


def auto_table(model) -> None:
    rows = []
    for P in AUTO_PROMPTS:
        prompt, responses = group(P, AUTO_G, AUTO_R)
        saved = (AUTO_G - 1) * P / (AUTO_G * P + AUTO_G * AUTO_R)
        secs = medians(model, {"on": packed(prompt, responses, shared=True),
                               "off": packed(prompt, responses, shared=False)}, G=AUTO_G)
        rows.append([f"P={P} G={AUTO_G} R={AUTO_R}", f"{saved:.3f}", f"{secs['on'] * 1e3:.0f}",
                     f"{secs['off'] * 1e3:.0f}", f"{secs['off'] / secs['on']:.2f}",
                     "on" if auto_shared_prompt(P, [AUTO_R] * AUTO_G) else "off"])
    print(tabulate(rows, headers=["case", "tokens saved", "shared ms", "varlen ms", "varlen / shared", "auto"],
                   disable_numparse=True))


def warm_up(model) -> None:
    """One untimed pass of each method, so first-call costs land on no table row."""
    prompt, responses = group(50, 8, 50)
    for mbs in (split_group(prompt, responses, micro_batch_size=8, pad_id=0, device=CPU),
                packed(prompt, responses, shared=True), packed(prompt, responses, shared=False)):
        fwd_bwd_s(model, mbs, G=8)


def main() -> None:
    torch.set_num_threads(1)
    model = bench_model()
    warm_up(model)
    auto_table(model) if "--auto" in sys.argv[1:] else main_table(model)


if __name__ == "__main__":
    main()

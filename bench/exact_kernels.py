"""What exact numerics' fixed-shape calls cost, per tile size: the choice of ROW_TILE and ATTN_ITEMS.

Exact mode (tidal/modeling/numerics.py) runs every product as library calls of one fixed shape: a linear layer's rows in
tiles of ROW_TILE, attention as items of [ATTN_ROWS x KEY_CHUNK] in calls of ATTN_ITEMS. A small tile wastes
little on the engine's few rows but makes the trainer's thousands of rows many small calls; a large one the
reverse. This measures both sides at a model's widths, each against the default kernels in the same run:

  linear     one decoder layer's products (q/k/v, o, gate/up, down) and the LM head (bf16 model: its float32
             head), forward, at the engine's 8 and 64 rows and the trainer's 1,024 and 4,096
  attention  a decode step of 8 and 64 rows over 256-token caches, and the trainer's shared-prompt row
             (a 256-token prompt and 8 responses of 224), forward

    .venv/bin/python bench/exact_kernels.py --model DIR [--dtype bfloat16] [--threads 1] [--repeats 5]

Times are medians of --repeats; ratios are exact / default.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.modeling import exact_attention, numerics  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def linear_rows(config, dtype, rows: int, tiles: list[int], repeats: int) -> list:
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    kv = config.num_key_value_heads * D
    g = torch.Generator().manual_seed(0)
    shapes = [(H, config.num_attention_heads * D + 2 * kv), (config.num_attention_heads * D, H), (H, 2 * I), (I, H)]
    ws = [torch.randn(N, K, generator=g).to(dtype) for K, N in shapes]
    xs = [torch.randn(rows, K, generator=g).to(dtype) for K, _ in shapes]
    head = torch.randn(V, H, generator=g).to(dtype).float()  # the float32 head of every model's logits
    xh = torch.randn(rows, H, generator=g).to(dtype).float()

    def run(linear):
        return lambda: ([linear(x, w) for x, w in zip(xs, ws)], linear(xh, head))

    base = timed(run(F.linear), repeats)
    out = [rows, f"{base * 1e3:.1f}"]
    for tile in tiles:
        numerics.ROW_TILE = tile
        out.append(f"{timed(run(numerics.exact_linear), repeats) / base:.2f}")
    return out


def attention_case(config, dtype, case: str, items: list[int], repeats: int) -> list:
    from tidal.modeling.packed_attention import PackMask, packed_forward

    Hq, J = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // Hq
    g = torch.Generator().manual_seed(0)

    class Module:  # what the attention interface reads of the layer
        is_causal = True

    if case.startswith("decode"):
        B = int(case.split()[1])
        S = 256
        q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
        k, v = (torch.randn(B, J, S, D, generator=g).to(dtype) for _ in range(2))
        valid = torch.ones(B, S, dtype=torch.bool)
        for b in range(B):  # left padding, as the engine's batch has it
            valid[b, :b % 32] = False

        def default():
            mask = valid[:, None, None, :]
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)

        def exact():  # a new plan per setting (built in timed()'s first call; a forward's layers share it)
            keys = exact_attention._Keys(valid, 1, S)
            return lambda: exact_attention._attention(Module(), q, k, v, keys)

    else:
        P, R, G = 256, 224, 8
        L = P + G * R
        q = torch.randn(1, Hq, L, D, generator=g).to(dtype)
        k, v = (torch.randn(1, J, L, D, generator=g).to(dtype) for _ in range(2))
        spans = ((0, P), *((P + i * R, P + (i + 1) * R) for i in range(G)))
        seg = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(spans)])

        def default():
            from tidal.modeling.packed_attention import _attention

            pack = PackMask(seg, spans, shared=True)
            return _attention(Module(), q, k, v, pack)

        def exact():
            pack = PackMask(seg, spans, shared=True)

            def call():
                with packed_forward(pack):
                    return exact_attention._attention(Module(), q, k, v, pack)
            return call

    with torch.no_grad():
        base = timed(default, repeats)
        out = [case, f"{base * 1e3:.1f}"]
        for n in items:
            exact_attention.ATTN_ITEMS = n
            out.append(f"{timed(exact(), repeats) / base:.2f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (its config.json): the widths (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tiles", default="16,32,64,128")
    p.add_argument("--items", default="32,64,128,256")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from tidal.modeling.hf import load_config

    config = load_config(args.model)
    dtype = getattr(torch, args.dtype)
    tiles = [int(t) for t in args.tiles.split(",")]
    items = [int(n) for n in args.items.split(",")]
    print(f"model: {args.model or 'embedded'} ({config.model_type}, hidden {config.hidden_size}, vocabulary "
          f"{config.vocab_size}); {args.dtype}; {args.threads} thread(s); medians of {args.repeats}")
    rows = [linear_rows(config, dtype, m, tiles, args.repeats) for m in (8, 64, 1024, 4096)]
    print("\nlinear layers of one decoder layer + the float32 head, forward: exact / default by ROW_TILE")
    print(tabulate(rows, headers=["rows", "default ms", *(f"tile {t}" for t in tiles)], tablefmt="github"))
    rows = [attention_case(config, dtype, case, items, args.repeats)
            for case in ("decode 8", "decode 64", "shared-prompt row")]
    print("\nattention, forward: exact / default by ATTN_ITEMS")
    print(tabulate(rows, headers=["case", "default ms", *(f"items {n}" for n in items)], tablefmt="github"))


if __name__ == "__main__":
    main()

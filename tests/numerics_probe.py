"""The checks of exact numerics at published widths, runnable in this process or in a fresh one under another
oneDNN/MKL/ATen instruction set (which those libraries read once, at start): `python -m tests.numerics_probe
CASES_JSON [--short]` prints one JSON line, {case: [what differs]} (--short: without the 2,048-row batch).

A case is (shape, dtype, threads):
  shape    "embedded", "embedded-moe", or a published model's widths and vocabulary at 2 layers, random init
  checks   every module's output (each leaf, attention, MLP, the float32 head) for one prompt alone, then as one
           row of a left-padded batch of 7 prompts (217 rows) and of 8 prompts up to 256 tokens (2,048 rows); and
           every product of the model (the heads included) for a row alone against the same row at three places
           among 2 to 4,096 rows (the heads: to 256).
"""
from __future__ import annotations

import json
import sys

import torch
import transformers

# the published models' widths (the products' shapes a library picks its kernel by) and vocabularies, 2 layers
SHAPES = {
    "smollm2-135m": lambda: transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        num_hidden_layers=2, tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2.5-0.5b": lambda: transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        num_hidden_layers=2, tie_word_embeddings=True),
}
ROWS = (1, 2, 17, 48, 129, 1024, 4096)
HEAD_ROWS = (1, 48, 129)  # the thresholds a Xeon's AMX kernels changed at: 48 rows (bf16), 128 (float32)


def published_model(shape: str, dtype: torch.dtype, *, seed: int = 0):
    """A random-init model of a published model's widths and vocabulary (2 layers), in `dtype`."""
    from tidal.modeling.hf import cast_parameters

    config = SHAPES[shape]()
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return cast_parameters(model, dtype).eval()


def _model(shape: str, dtype: torch.dtype, tmp: str):
    from tidal.modeling.hf import load_model
    from tidal.modeling.tiny.moe import write_embedded_moe

    if shape.startswith("embedded"):
        path = str(write_embedded_moe(f"{tmp}/moe")) if shape == "embedded-moe" else None
        return load_model(path, dtype=dtype, seed=0).eval()
    return published_model(shape, dtype)


def _outputs(model, prompts: list[torch.Tensor], keep: int) -> tuple[dict, int]:
    """Each module's first output of one forward of the left-padded `prompts` ([rows, columns, ...]; the model's
    own head: of the last column), and the float32 head's logits of the last `keep` columns of every row."""
    from tidal.modeling.head import fp32_logits

    seen = {}

    def first(name, out) -> None:  # None: the hook leaves the output as it is
        seen.setdefault(name, out)

    hooks = [m.register_forward_hook(lambda mod, a, out, name=name: first(name, out))
             for name, m in model.named_modules()
             if (not list(m.children()) or name.endswith(("self_attn", "mlp"))) and name and "rotary" not in name]
    S = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(S - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(S) >= S - len(p) for p in prompts]).long()
    with torch.no_grad():
        # the model's own head on the last column (a low-precision head's product is never used at its dtype);
        # the float32 head, which the engine and the trainer compute, on the last `keep`
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    logits_to_keep=1, output_hidden_states=True)
        seen["lm_head.float32"] = fp32_logits(model.get_output_embeddings(), out.hidden_states[-1][:, -keep:])
    for h in hooks:
        h.remove()
    seen = {k: (v[0] if isinstance(v, tuple) else v) for k, v in seen.items()}
    return {k: v for k, v in seen.items() if v.dim() >= 3}, S


def module_differences(model, *, long: bool = True) -> list[str]:
    """The modules whose output for one prompt's tokens differs between the prompt alone and the prompt among
    others (217 rows; 2,048 with `long`)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    mine = torch.randint(3, min(vocab, 500), (31,), generator=g)
    n = len(mine)
    alone, _ = _outputs(model, [mine], n)
    assert len(alone) > 4 * model.config.num_hidden_layers, sorted(alone)  # every layer's modules
    # (prompt lengths, mine's place, head columns): the heads of the 2,048-row batch on its last 4 columns only
    batches = [((9, 23, 14, 5, None, 17, 1), n)] + ([((1, 7, 256, 200, 17, None, 64, 33), 4)] if long else [])
    differ = set()
    for lengths, keep in batches:
        prompts = [mine if k is None else torch.randint(3, min(vocab, 500), (k,), generator=g) for k in lengths]
        at = lengths.index(None)
        batch, S = _outputs(model, prompts, keep)
        for name, out in alone.items():
            m = min(n, batch[name].shape[1])
            if not torch.equal(out[0, -m:], batch[name][at, -m:]):
                differ.add(name)
    return sorted(differ)


def product_differences(model, dtype: torch.dtype) -> list[str]:
    """Every distinct product of the model (each linear layer's shape, and the head in float32): a row alone
    against the same row first, in the middle and last among M rows, M up to 4,096 (the heads: 256)."""
    from tidal.modeling.numerics import exact_linear

    head = tuple(model.get_output_embeddings().weight.shape)
    # a low-precision head's logits are its product in float32 (tidal/modeling/head.py), on both sides
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)} - {head}
    g = torch.Generator().manual_seed(2)
    cases = [(s, dtype) for s in sorted(shapes)] + [(head, torch.float32)]
    differ = []
    for (N, K), dt in cases:
        w = torch.randn(N, K, generator=g).to(dt)
        rows = HEAD_ROWS if N == head[0] else ROWS
        x = torch.randn(max(rows), K, generator=g).to(dt)
        alone = {i: exact_linear(x[i:i + 1], w)[0] for M in rows for i in (0, M // 2, M - 1)}
        for M in rows:
            y = exact_linear(x[:M], w)
            bad = [i for i in {0, M // 2, M - 1} if not torch.equal(y[i], alone[i])]
            if bad:
                differ.append(f"{N}x{K} {str(dt).removeprefix('torch.')} rows {M} at {bad}")
    return differ


def check(case: tuple[str, str, int], tmp: str, *, long: bool = True) -> list[str]:
    from tidal.modeling import numerics

    shape, dtype_name, threads = case
    dtype = getattr(torch, dtype_name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(shape, dtype, tmp)
        numerics.install(model)
        assert numerics.is_exact(model)
        return module_differences(model, long=long and not shape.startswith("embedded")) + \
            product_differences(model, dtype)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    import tempfile

    cases = [tuple(c) for c in json.loads(sys.argv[1])]
    long = "--short" not in sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({" ".join(map(str, c)): check(c, tmp, long=long) for c in cases}))


if __name__ == "__main__":
    main()

"""Where the bf16 log-prob gap between the native engine and the trainer comes from (issue 26).

One process, the real code paths: the model loaded as the generator loads it (bf16) samples G
responses per prompt with the native engine (KV cache, one token at a time); the model loaded as
the trainer loads it (fp32 master, its bf16 compute copy) recomputes their log-probs on its
micro-batches (shared-prompt packing, or the padded [prompt, r_i] rows). Hooks on both record each
decoder layer's output, its attention and MLP outputs and the final norm at the positions that
predict the response tokens. Printed:
  1. weight rounding: the generator's bf16 weights and buffers against the trainer's bf16 compute copy;
  2. per layer: |engine - trainer| / |trainer| of the hidden states (bf16 both), next to the
     trainer's own bf16-vs-fp32 distance (the size of bf16 rounding itself);
  3. the log-prob mismatch (mean, p99, max, KL) as run, and from the recorded final hidden states
     through the LM head in bf16 or fp32 on both sides, and the head's rounding alone.

  .venv/bin/python bench/bf16_gap.py --model <SmolLM2-135M-Instruct dir> --data <humaneval.jsonl>
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

# run as a script, sys.path[0] is bench/, where bench/channels.py would shadow the `channels` package
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [_ROOT] + [p for p in sys.path if Path(p or ".").resolve() != Path(_ROOT, "bench") and p != _ROOT]

from tidal.executors.data import _ChatForm, _tokenize
from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.executors.trainer.accumulate import Mismatch
from tidal.executors.trainer.config import TrainerConfig
from tidal.executors.learner.models import trainable_copy
from tidal.modeling.packing import make_micro_batches


class Taps:
    """Forward hooks that keep every call's output of each tapped module (float32 copies)."""

    def __init__(self, model):
        layers = model.model.layers
        self.modules = {"norm": model.model.norm}
        for i, layer in enumerate(layers):
            self.modules |= {f"layer{i}": layer, f"attn{i}": layer.self_attn, f"mlp{i}": layer.mlp}
        self.calls = defaultdict(list)
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in self.modules.items()]

    def _hook(self, name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.calls[name].append(out.detach().float().clone())
        return hook

    def clear(self):
        self.calls = defaultdict(list)


def engine_rows(engine, taps, prompts, params) -> tuple[list, dict]:
    """Samples [(prompt, responses, logprobs)] and, per tapped module, the hidden states [K, H] that
    predict each response token (sample-major, token order: the trainer's mask order)."""
    samples, rows = [], defaultdict(list)
    for i, prompt in enumerate(prompts):
        taps.clear()
        (done,) = list(engine.generate([PromptRequest(index=i, prompt_ids=prompt)], params, step=0))
        samples.append((done.prompt_ids_P, done.response_ids, done.logprobs))
        for name, calls in taps.calls.items():
            # token 0 is predicted by the prefill's last position, token t by decode forward t (row g)
            for g, r in enumerate(done.response_ids):
                rows[name] += [calls[0][0, -1]] + [calls[t][g, 0] for t in range(1, r.numel())]
    return samples, {name: torch.stack(v) for name, v in rows.items()}


@torch.no_grad()
def trainer_rows(model, taps, samples, *, mode: str, pad_id: int) -> tuple[torch.Tensor, dict]:
    """The trainer's log-probs of the sampled tokens [K] and its hidden states [K, H] per tapped module."""
    logps, rows = [], defaultdict(list)
    for prompt, responses, _ in samples:
        for mb in make_micro_batches(prompt, responses, mode=mode, token_budget=4096, micro_batch_size=8,
                                     pad_id=pad_id, device=torch.device("cpu")):
            taps.clear()
            logps.append(mb.forward(model, temperature=1.0, chunk=1024).logp_NT[mb.mask_NT])
            for name, (h,) in taps.calls.items():
                if hasattr(mb, "rows_K"):  # packed: one row, the rows that predict response tokens
                    rows[name].append(h[0, mb.rows_K])
                else:  # padded [prompt, r_i] rows: token t is predicted at P - 1 + t
                    T = mb.targets_NT.shape[1]
                    rows[name].append(h[:, mb.prompt_len - 1: mb.prompt_len - 1 + T][mb.mask_NT])
    return torch.cat(logps), {name: torch.cat(v) for name, v in rows.items()}


def figures(a_K: torch.Tensor, b_K: torch.Tensor) -> list[float]:
    m = Mismatch()
    m.add(logp_NT=a_K[None], sampled_NT=b_K[None], mask_NT=torch.ones_like(a_K, dtype=torch.bool)[None])
    s = m.summary()
    return [s["logp_mismatch_mean"], s["logp_mismatch_p99"], s["logp_mismatch_max"], s["logp_mismatch_kl"]]


def head_logp(h_KH: torch.Tensor, weight_VH: torch.Tensor, targets_K: torch.Tensor, *, fp32: bool) -> torch.Tensor:
    """log_softmax of the head's logits at the targets, from bf16 hidden states: the head's product in
    bf16 (rounded logits) or in fp32 (the same bf16 inputs, exact in fp32)."""
    h_KH = h_KH.to(torch.bfloat16)
    logits_KV = F.linear(h_KH.float(), weight_VH.float()) if fp32 else F.linear(h_KH, weight_VH).float()
    return torch.log_softmax(logits_KV, dim=-1).gather(-1, targets_K[:, None])[:, 0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    tok = load_tokenizer(args.model)
    rows = [json.loads(line) for line in open(args.data)][: args.prompts]
    prompts = [torch.tensor(_tokenize(tok, r["prompt"], chat=_ChatForm())) for r in rows]

    gen = load_model(args.model, dtype=torch.bfloat16)  # as tidal/executors/generator/executor.py loads it
    master = load_model(args.model, dtype=torch.float32)  # as tidal/executors/trainer/models.py loads it
    policy = trainable_copy(master, TrainerConfig(precision="bf16"))
    gen_p, pol_p = dict(gen.named_parameters()), dict(policy.named_parameters())
    unequal = sum(int((gen_p[n] != p).sum()) for n, p in pol_p.items())
    total = sum(p.numel() for p in pol_p.values())
    print(f"weights: {unequal} of {total} bf16 elements differ between the generator's copy and the "
          f"trainer's compute copy (round(master))")
    gen_b, pol_b = dict(gen.named_buffers()), dict(policy.named_buffers())
    for name, b in pol_b.items():  # RoPE's inv_freq: rounded to bf16 by Module.to, kept by from_pretrained
        print(f"buffer {name}: generator {gen_b[name].dtype}, trainer {b.dtype}, "
              f"equal: {torch.equal(gen_b[name], b)}")

    engine = NativeEngine(gen, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_batch_prompts=1)
    params = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    samples, eng = engine_rows(engine, Taps(gen), prompts, params)
    sampled_K = torch.cat([torch.cat(lp) for _, _, lp in samples])
    targets_K = torch.cat([torch.cat(rs) for _, rs, _ in samples])
    trn_taps, ref_taps = Taps(policy), Taps(master)
    packed_K, trn = trainer_rows(policy, trn_taps, samples, mode="on", pad_id=tok.pad_token_id)
    padded_K, trn_pad = trainer_rows(policy, trn_taps, samples, mode="padded", pad_id=tok.pad_token_id)
    fp32_K, ref = trainer_rows(master, ref_taps, samples, mode="on", pad_id=tok.pad_token_id)
    print(f"{len(samples)} prompts x {args.samples} samples, {targets_K.numel()} response tokens")

    layers = len(gen.model.layers)
    table = [[i, rel(eng[f"layer{i}"], trn[f"layer{i}"]), rel(trn_pad[f"layer{i}"], trn[f"layer{i}"]),
              rel(trn[f"layer{i}"], ref[f"layer{i}"]), rel(eng[f"attn{i}"], trn[f"attn{i}"]),
              rel(eng[f"mlp{i}"], trn[f"mlp{i}"])] for i in range(layers)]
    table.append(["norm", rel(eng["norm"], trn["norm"]), rel(trn_pad["norm"], trn["norm"]),
                  rel(trn["norm"], ref["norm"]), "", ""])
    print(tabulate(table, headers=["layer", "engine vs trainer (bf16)", "padded vs packed (bf16)",
                                   "trainer bf16 vs fp32", "attn out: engine vs trainer", "mlp out: engine vs trainer"],
                   floatfmt=".2e"))

    W = policy.get_output_embeddings().weight.detach()
    logp = {(side, fp32): head_logp(h["norm"], W, targets_K, fp32=fp32)
            for side, h in (("engine", eng), ("trainer", trn)) for fp32 in (False, True)}
    mismatch = [
        ["as run: engine's sampled log-probs vs trainer packed", *figures(packed_K, sampled_K)],
        ["as run: engine vs trainer padded rows", *figures(padded_K, sampled_K)],
        ["as run: trainer packed vs padded", *figures(packed_K, padded_K)],
        ["head bf16 on both sides (from the final hidden states)", *figures(logp["trainer", False], logp["engine", False])],
        ["head fp32 on both sides", *figures(logp["trainer", True], logp["engine", True])],
        ["head rounding alone (trainer's states, bf16 vs fp32 head)", *figures(logp["trainer", False], logp["trainer", True])],
        ["trainer bf16 (as run) vs trainer fp32", *figures(packed_K, fp32_K)],
    ]
    print(tabulate(mismatch, headers=["log-prob |diff| over the sampled tokens", "mean", "p99", "max", "KL (k3)"],
                   floatfmt=".2e"))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()

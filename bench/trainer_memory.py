"""Peak memory of one trainer rank through a GRPO step: precision, LM-head chunks, activation checkpointing.

A random-init model of a real shape (saved once under /tmp), one rank, no torch.distributed: the
trainer executor itself builds policy + reference (beta 0.04) and runs one step (streamed phase and
barrier: the AdamW state is allocated there) on one synthetic group of G responses. Each variant runs
in its own process; the table gives its peak resident memory (ru_maxrss), the resident memory after
the models are built (weights only), and the CPU time of the step. Ratios are against the first row,
the trainer before this change (fp32, whole LM head).

    .venv/bin/python bench/trainer_memory.py [--model 135m|0.6b] [--G 4] [--R 512]
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
# real shapes: SmolLM-135M (Llama, 9 heads / 3 KV heads, 49k vocabulary) and Qwen3-0.6B (152k vocabulary)
MODELS = {
    "135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                 tie_word_embeddings=True)),
    "0.6b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=4096, tie_word_embeddings=True)),
}
VARIANTS = [  # (label, trainer options)
    ("fp32, whole head", dict(logprob_chunk=0)),
    ("fp32, head chunks", dict()),
    ("fp32, chunks + AC", dict(activation_checkpointing=True)),
    ("bf16, chunks", dict(precision="bf16")),
    ("bf16, chunks + AC", dict(precision="bf16", activation_checkpointing=True)),
    ("bf16, chunks + AC, fp32 accum", dict(precision="bf16", activation_checkpointing=True,
                                           fp64_grad_accumulation=False)),
]


def _rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS")


def model_dir(name: str) -> Path:
    path = Path(f"/tmp/tidal-bench-models/{name}")
    if not (path / "model.safetensors").exists():
        import torch
        import transformers

        from tidal.modeling.hf import load_tokenizer, save_hf

        cls, sizes = MODELS[name]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**sizes))
        save_hf(model, load_tokenizer(None), path)
    return path


def _one(name: str, options: dict, G: int, R: int) -> dict:
    import torch

    from tidal.algorithms.grpo import GRPOConfig
    from tidal.algorithms.registry import get_algorithm
    from tidal.channels.payloads import ScoredGroup
    from tidal.controller.timeline import Timeline
    from tidal.executors.base import ExecutorEnv, Endpoints, StepContext
    from tidal.executors.trainer.executor import Trainer, TrainerConfig

    torch.set_num_threads(2)
    path = model_dir(name)
    trainer = Trainer(config=TrainerConfig(lr=1e-6, **options), model_path=str(path), dtype=torch.float32,
                      algorithm=get_algorithm("grpo"), algo_config=GRPOConfig(beta=0.04), temperature=1.0,
                      total_steps=1)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None,
                             device=torch.device("cpu"), seed=0, output_dir=Path("/nonexistent")))
    built = _rss_gb()
    g = torch.Generator().manual_seed(0)
    vocab = MODELS[name][1]["vocab_size"]
    responses = [torch.randint(0, vocab, (R - 16 * i,), generator=g) for i in range(G)]
    group = ScoredGroup(step=0, index=0, prompt="", extras={}, prompt_ids=torch.randint(0, vocab, (64,), generator=g),
                        responses=responses, logprobs=[torch.zeros(r.numel()) for r in responses],
                        finished=torch.ones(G, dtype=torch.bool), rewards=torch.arange(G, dtype=torch.float32),
                        reward_failures=0)

    class Sink:  # the weight push goes nowhere: one rank, no generator
        bytes_per_push = 0  # what a WEIGHTS port reports (tidal/controller/world.py Outlet)
        def push(self, shards, specs):
            pass

        def flush(self):
            pass

    ctx = StepContext(step=0, inbound=Endpoints({"scored": iter([group])}), outbound=Endpoints({"weights": Sink()}),
                      timeline=Timeline(executor="trainer", rank=0))
    t0 = time.process_time()
    record = trainer.barrier(ctx, trainer.step(ctx))
    return {"peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "built_gb": built,
            "cpu_s": time.process_time() - t0, "loss": record.loss, "grad_norm": record.grad_norm}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="135m")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--R", type=int, default=512)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: run VARIANTS[one]
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args.model, VARIANTS[args.one][1], args.G, args.R)))
        return
    model_dir(args.model)
    rows, base = [], None
    for i, (label, _) in enumerate(VARIANTS):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--G", str(args.G), "--R", str(args.R),
                              "--one", str(i)], cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            rows.append([label, "failed", out.stderr.strip().splitlines()[-1][:60], "", "", ""])
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        base = base or r
        rows.append([label, f"{r['peak_gb']:.2f}", f"{r['peak_gb'] / base['peak_gb']:.2f}", f"{r['built_gb']:.2f}",
                     f"{r['cpu_s']:.1f}", f"{r['grad_norm']:.4g}"])
    print(f"one trainer rank, {args.model} ({MODELS[args.model][0]}), GRPO beta 0.04, one group: G={args.G}, "
          f"responses {args.R}..{args.R - 16 * (args.G - 1)} tokens, prompt 64; 2 threads")
    print(tabulate(rows, headers=["variant", "peak GB", "vs first", "after build GB", "step CPU s", "grad norm"]))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()

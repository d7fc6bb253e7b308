"""Mixture of experts on this machine's 2 cores: the tiny Qwen3-MoE (8 experts of 64, 2 per token)
against a dense Qwen3 of the same active size (intermediate 128: the same MLP parameters per token,
the same attention), and expert parallel's exchange.

1. Jobs: the embedded task on 4 ranks (generator, reward, trainer dp 2; sync; 1 thread each), dense,
   MoE with trainer.ep=1 and MoE with trainer.ep=2, each `--steps` steps `--repeats` times
   (alternating); the first 2 steps of each are skipped. tokens/s: the step's tokens / its seconds.
2. The exchange: 2 gloo ranks run the MoE policy's forward and backward on one packed group
   (G=8 responses of 64 tokens) at ep=2, under torch.profiler; the all-to-alls' share of the
   micro-step is their self CPU time over the wall time (every rank waits in its all-to-all for
   the slowest, so the share includes that wait). One rank at ep=1 runs the same micro-step.

    .venv/bin/python bench/moe.py [--repeats 3] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.common.spawn import spawn  # noqa: E402
from tidal.launch import jobs  # noqa: E402

SKIP = 2
CONFIGS = {  # name -> (model, --set overrides)
    "dense (intermediate 128)": ("dense", []),
    "MoE 8x64, top-2, ep=1": ("moe", []),
    "MoE 8x64, top-2, ep=2": ("moe", ["trainer.ep=2"]),
}


def models(root: Path) -> dict[str, Path]:
    from tidal.modeling.tiny import MODEL_SIZES
    from tidal.modeling.tiny.moe import write_embedded_moe
    from tidal.modeling.hf import load_tokenizer, save_hf

    import torch
    import transformers

    tok = load_tokenizer(None)
    config = transformers.Qwen3Config(**{**MODEL_SIZES, "vocab_size": len(tok), "intermediate_size": 128},
                                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.eos_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    save_hf(transformers.AutoModelForCausalLM.from_config(config), tok, root / "dense")
    return {"dense": root / "dense", "moe": write_embedded_moe(root / "moe", seed=0)}


def run(out: Path, model: Path, overrides: list[str], *, steps: int) -> list[dict]:
    cmd = jobs.command("grpo", "--overwrite", "--schedule", "sync", steps=steps, output_dir=out, nproc=4,
                       overrides=[f"model.path={model}", "trainer.dp=2", "generator.max_new_tokens=64",
                                  "logging.samples_every=0", *overrides])
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TIDAL_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _micro_step(model_dir: str, ep: int, iters: int) -> tuple[float, float]:
    """(seconds per forward + backward, of them in all-to-all) on this rank."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from tidal.modeling.hf import load_model
    from tidal.modeling.parallel.ep import apply_ep, expert_mesh
    from tidal.modeling.packing import make_micro_batches

    torch.set_num_threads(1)
    model = load_model(model_dir).train()
    if ep > 1:
        apply_ep(model, mesh=expert_mesh(list(range(ep)), ep=ep, device_type="cpu", parent=None)["ep"])
    g = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    prompt, responses = torch.randint(1, 500, (32,), generator=g), [torch.randint(1, 500, (64,), generator=g)
                                                                     for _ in range(8)]
    (mb,) = make_micro_batches(prompt, responses, mode="on", token_budget=4096, micro_batch_size=8, pad_id=0,
                               device=torch.device("cpu"))

    def once():
        mb.forward(model, temperature=1.0).logp_NT.sum().backward()

    once()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        wall = (time.perf_counter() - t0) / iters
    a2a = sum(e.self_cpu_time_total for e in prof.key_averages() if "all_to_all" in e.key or "alltoall" in e.key)
    return wall, a2a / 1e6 / iters


def _ep2(model_dir: str, iters: int):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _micro_step(model_dir, 2, iters)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        dirs = models(root)
        rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for r in range(args.repeats):
            for name, (model, overrides) in CONFIGS.items():
                rows[name] += run(root / f"run{r}", dirs[model], overrides, steps=args.steps)[SKIP:]
        base = statistics.median(x["step_s"] for x in rows["dense (intermediate 128)"])
        table = []
        for name, xs in rows.items():
            step = statistics.median(x["step_s"] for x in xs)
            table.append([name, f"{step:.3f}", f"{base / step:.2f}x",
                          f"{statistics.median(x['train_s'] for x in xs):.3f}",
                          f"{statistics.median(x['gen_s'] for x in xs):.3f}",
                          f"{statistics.median(x['tokens'] / x['step_s'] for x in xs):.0f}",
                          f"{statistics.median(x['logp_mismatch_max'] for x in xs):.1e}"])
        print(f"jobs: 4 ranks (trainer dp 2), sync, {args.steps} steps x {args.repeats} repeats, first {SKIP} skipped; "
              f"medians")
        print(tabulate(table, headers=["model", "step s", "vs dense", "train s", "gen s", "tokens/s",
                                       "logp gap max"], disable_numparse=True))
        one = [_micro_step(str(dirs["moe"]), 1, args.iters) for _ in range(args.repeats)]
        two = [spawn(_ep2, 2, str(dirs["moe"]), args.iters, timeout_s=600) for _ in range(args.repeats)]
        wall1 = statistics.median(w for w, _ in one)
        wall2 = statistics.median(max(w for w, _ in ranks) for ranks in two)
        a2a = statistics.median(max(a for _, a in ranks) for ranks in two)
        print(f"\nthe exchange: one packed group (prompt 32, G=8 x 64 tokens), forward + backward, {args.iters} "
              f"iterations x {args.repeats}; medians")
        print(tabulate([["ep=1, 1 rank", f"{wall1 * 1e3:.1f}", "-", "-", "1.00x"],
                        ["ep=2, 2 ranks", f"{wall2 * 1e3:.1f}", f"{a2a * 1e3:.1f}", f"{a2a / wall2:.0%}",
                         f"{wall1 / wall2:.2f}x"]],
                       headers=["layout", "micro-step ms", "all-to-all ms", "all-to-all share", "vs ep=1"],
                       disable_numparse=True))


if __name__ == "__main__":
    main()

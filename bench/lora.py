"""LoRA against full fine-tuning on a ~100M-parameter model: what the weight push carries and how long
it takes, and the trainer rank's peak memory.

The model: a random-init Qwen3 of 83M parameters (hidden 768, 12 layers, intermediate 2304) over the
embedded tokenizer, or `--model PATH` (e.g. a SmolLM2-135M-Instruct HF directory).
Each job runs GRPO on the embedded task on 3 ranks (generator, reward, trainer; sync, 1 thread each)
for `--steps` steps, `--repeats` times (alternating); the first step of each is skipped. push_bytes
and push_s are the trainer's metrics; the trainer rank's peak RSS is VmHWM from /proc, read every
50 ms while the job runs. LoRA: rank `--rank` on every q/k/v/o and gate/up/down projection, with a
KL to the reference (GRPO's beta), which LoRA computes on the base with the adapters off.

    .venv/bin/python bench/lora.py [--repeats 3] [--steps 6] [--rank 16] [--model PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.placement import rank_pids  # noqa: E402
from tidal.launch import jobs  # noqa: E402

SIZES = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
             intermediate_size=2304)


def random_model(path: Path) -> Path:
    import torch
    import transformers

    from tidal.modeling.tiny import MODEL_SIZES
    from tidal.modeling.hf import load_tokenizer, save_hf

    tok = load_tokenizer(None)
    config = transformers.Qwen3Config(**{**MODEL_SIZES, **SIZES, "vocab_size": len(tok)}, bos_token_id=tok.eos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    save_hf(transformers.AutoModelForCausalLM.from_config(config), tok, path)
    return path


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run(out: Path, model: Path, overrides: list[str], *, steps: int) -> tuple[list[dict], int]:
    """-> the job's metrics rows and the trainer rank's (rank 2) peak RSS in bytes."""
    cmd = jobs.command("grpo", "--overwrite", "--schedule", "sync", steps=steps, output_dir=out, nproc=3,
                       overrides=[f"model.path={model}", "data.prompts_per_step=4", "generator.samples_per_prompt=4",
                                  "generator.max_new_tokens=32", "algorithm.beta=0.04", "logging.samples_every=0",
                                  "checkpoint_minutes=0", *overrides])
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TIDAL_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            try:
                pid = rank_pids(proc.pid).get(2)
                if pid is not None:
                    peak[0] = max(peak[0], peak_rss(pid))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
            threading.Event().wait(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    thread.join()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], peak[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    configs = {"full fine-tuning": [], f"LoRA rank {args.rank}": [f"trainer.lora.rank={args.rank}"]}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or random_model(Path(tmp) / "model")
        rows: dict[str, list[dict]] = {name: [] for name in configs}
        peaks: dict[str, list[int]] = {name: [] for name in configs}
        for r in range(args.repeats):
            for name, overrides in configs.items():
                metrics, peak = run(Path(tmp) / f"run{r}", model, overrides, steps=args.steps)
                rows[name] += metrics[1:]
                peaks[name].append(peak)
    full = "full fine-tuning"
    base_bytes = statistics.median(x["trainer/push_bytes"] for x in rows[full])
    base_push = statistics.median(x["trainer/push_s"] for x in rows[full])
    base_rss = statistics.median(peaks[full])
    table = []
    for name, xs in rows.items():
        nbytes, push, rss = (statistics.median(x["trainer/push_bytes"] for x in xs), statistics.median(x["trainer/push_s"] for x in xs),
                             statistics.median(peaks[name]))
        table.append([name, f"{nbytes / 1e6:.2f}", f"{nbytes / base_bytes:.4f}", f"{push * 1e3:.1f}",
                      f"{push / base_push:.3f}", f"{rss / 2**20:.0f}", f"{rss / base_rss:.2f}",
                      f"{statistics.median(x['step_s'] for x in xs):.2f}",
                      f"{max(x['logp_mismatch_max'] for x in xs):.1e}"])
    print(f"model {args.model or 'random Qwen3, 83M parameters'}; 3 ranks, sync, {args.steps} steps x {args.repeats} "
          f"repeats (first step skipped); medians")
    print(tabulate(table, headers=["run", "push MB", "vs full", "push ms", "vs full", "trainer peak RSS MiB",
                                   "vs full", "step s", "logp gap max"], disable_numparse=True))


if __name__ == "__main__":
    main()

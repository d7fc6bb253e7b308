"""Tidal against TRL's GRPOTrainer on the same job: s/step, tokens/s and CPU-seconds per step.

The job: the embedded tiny Qwen3 saved as an HF directory, the embedded task's prompts as a JSONL
with its reward, 8 prompts x 4 completions x <= 32 new tokens per step, beta = 0, one optimizer step
per batch, lr 1e-6. TRL runs in one process with torch's default threads (the machine's cores);
Tidal runs `python launch.py --algo grpo` (3 ranks, a thread each), in both schedules.

- s/step: the median step time after the first 2 steps (TRL: between its step-end callbacks; Tidal:
  `step_s`).
- tokens/s: completion tokens per step over s/step.
- CPU-s/step: the whole job's CPU time (every process) for a long run minus a short run, over the
  extra steps, so start-up cancels out.

Runs interleave (TRL, Tidal sync, Tidal periodic) `--repeats` times; medians. TRL is an optional
bench dependency, never a test one; build its venv with `make bench-trl`, then
    .venv-trl/bin/python bench/vs_trl.py [--repeats 3] [--short 6] [--long 16]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, G, NEW_TOKENS, LR = 8, 4, 32, 1e-6


def write_job(tmp: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT))
    from executors.embedded.task import embedded_prompts
    from executors.hf import load_model, load_tokenizer, save_hf

    model_dir, data = tmp / "model", tmp / "prompts.jsonl"
    save_hf(load_model(None, seed=0), load_tokenizer(None), model_dir)
    data.write_text("".join(json.dumps(p) + "\n" for p in embedded_prompts(4096, seed=0)))
    return model_dir, data


def trl_worker(model_dir: str, data: str, steps: int, out: str) -> None:
    """One TRL GRPOTrainer run; writes the time of each step's end and the completion tokens."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    from executors.embedded.task import embedded_reward

    def reward(prompts, completions, answer, **_):
        return [embedded_reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]

    ends, tokens = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                tokens.append(logs["completions/mean_length"] * B * G)

    config = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=B * G, num_generations=G,
                        max_completion_length=NEW_TOKENS, max_steps=steps, beta=0.0, learning_rate=LR,
                        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                        dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config,
                          train_dataset=datasets.load_dataset("json", data_files=data, split="train"),
                          callbacks=[Clock()])
    trainer.train()
    Path(out).write_text(json.dumps({"step_s": [b - a for a, b in zip(ends, ends[1:])], "tokens": tokens}))


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(kind: str, model_dir: Path, data: Path, steps: int) -> tuple[list[float], list[float], float]:
    """(step seconds, completion tokens per step, CPU seconds of the whole job)."""
    with tempfile.TemporaryDirectory() as out:
        if kind == "trl":
            cmd = [sys.executable, __file__, "--trl-worker", str(model_dir), str(data), str(steps), f"{out}/t.json"]
        else:
            cmd = [sys.executable, "launch.py", "--algo", "grpo", "--schedule", kind, "--steps", str(steps),
                   "--output-dir", f"{out}/run", "--set", f"model.path={model_dir}", "--set", f"data.path={data}",
                   "--set", "reward.functions=[embedded]", "--set", f"data.prompts_per_step={B}",
                   "--set", f"generator.samples_per_prompt={G}", "--set", f"generator.max_new_tokens={NEW_TOKENS}",
                   "--set", f"trainer.lr={LR}"]
        cpu0 = _cpu_children()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        cpu = _cpu_children() - cpu0
        if proc.returncode:
            raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
        if kind == "trl":
            got = json.loads(Path(f"{out}/t.json").read_text())
            return got["step_s"][1:], got["tokens"][2:], cpu
        rows = [json.loads(line) for line in Path(f"{out}/run/metrics.jsonl").read_text().splitlines()]
        return [r["step_s"] for r in rows[2:]], [r["response_len_mean"] * B * G for r in rows[2:]], cpu


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        return trl_worker(*sys.argv[2:4], int(sys.argv[4]), sys.argv[5])
    from tabulate import tabulate

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--short", type=int, default=6)
    p.add_argument("--long", type=int, default=16)
    args = p.parse_args()
    if args.long - args.short < 8:  # measured: 2 extra steps leave start-up noise larger than their CPU time
        p.error("--long must exceed --short by 8 or more: the CPU per step is their difference")
    kinds = ("trl", "sync", "periodic")
    step_s, tok_s, cpu_step = ({k: [] for k in kinds} for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = write_job(Path(tmp))
        for _ in range(args.repeats):
            for kind in kinds:
                _, _, cpu_short = run(kind, model_dir, data, args.short)
                steps, tokens, cpu_long = run(kind, model_dir, data, args.long)
                step_s[kind].append(statistics.median(steps))
                tok_s[kind].append(statistics.median(tokens) / statistics.median(steps))
                cpu_step[kind].append((cpu_long - cpu_short) / (args.long - args.short))
    med = {k: (statistics.median(step_s[k]), statistics.median(tok_s[k]), statistics.median(cpu_step[k])) for k in kinds}
    rows = [["TRL GRPOTrainer" if k == "trl" else f"Tidal {k}", *med[k], med[k][0] / med["trl"][0],
             med[k][2] / med["trl"][2]] for k in kinds]
    print(f"{B} prompts x {G} completions x <= {NEW_TOKENS} tokens, beta 0, {os.cpu_count()} cores; "
          f"medians of {args.repeats}")
    print(tabulate(rows, floatfmt=".3f", headers=["", "s/step", "tokens/s", "CPU-s/step", "wall vs TRL",
                                                  "CPU vs TRL"]))


if __name__ == "__main__":
    main()

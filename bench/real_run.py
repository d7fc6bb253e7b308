"""A realistic job, periodic vs sync, at the old decode-slot default of a pretrained model
(generator.max_batch_prompts=16: every prompt of the step at once) and at the new one (decode
slots from the step's shape, tidal/recipes/defaults.py decode_slots), all in one invocation.

The model: --model PATH, or a random-init Llama of SmolLM2-135M's decoder shape (30 layers, hidden
576, 9 heads / 3 kv heads, MLP 1536; the embedded 512-token tokenizer, so the head is smaller)
written here. The prompts: --data FILE (a `prompt` column), or prompts with HumanEval-like token
lengths (median ~130, 40-400). The reward: --reward (module:function, on PYTHONPATH), or a cheap
one here. Each run's first step warms up and is skipped; the configs run in turn, --repeats times,
every other time in reverse order. On a shared CPU the load moves s/step between runs more than the
settings do; `step / (gen + train + push)` (1: one after the other, 0.5: fully overlapped) and
overlap_s hold within a run.

    .venv/bin/python bench/real_run.py [--steps 20] [--repeats 1] [--also-slots 1 ...] [--keep DIR]
    .venv/bin/python bench/real_run.py --forward-cost [--model PATH]   # a decode forward by rows
    PYTHONPATH=<dir of he_reward.py> .venv/bin/python bench/real_run.py --model <SmolLM2-135M-Instruct dir> \
        --data <humaneval.jsonl> --reward he_reward:humaneval --steps 20
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, schedule, what it sets on top of the job): "old" is the pretrained default before issue 26
CONFIGS = [("sync, old (16 slots)", "sync", ["generator.max_batch_prompts=16"]),
           ("periodic, old (16 slots)", "periodic", ["generator.max_batch_prompts=16"]),
           ("sync, new default", "sync", []),
           ("periodic, new default", "periodic", [])]
# HumanEval's prompt lengths in SmolLM2's tokenizer lie between ~40 and ~400 tokens, median ~130
PROMPT_TOKENS = (45, 70, 90, 105, 120, 130, 140, 160, 190, 230, 300, 400)


def distinct_reward(prompt: str, response: str, sample: dict) -> float:
    """A cheap reward for the bench's own data: the share of distinct characters in the response."""
    return len(set(response)) / max(1, len(response))


def smollm2_shaped_model(out: Path) -> str:
    import torch
    import transformers

    from tidal.modeling.hf import load_tokenizer, save_hf

    tok = load_tokenizer(None)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=100000.0, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    save_hf(transformers.LlamaForCausalLM(config), tok, out)
    return str(out)


def humaneval_like_prompts(out: Path, *, n: int = 164) -> str:
    """Prompts of code-like text whose lengths in the embedded tokenizer follow PROMPT_TOKENS."""
    from tidal.modeling.hf import load_tokenizer

    tok, rng = load_tokenizer(None), random.Random(0)
    words = ["def", "return", "list", "int", "numbers", "for", "in", "if", "else", "the", "of", "a", "string",
             ">>>", "(", ")", ":", "\n    ", "[", "]", "0", "1", "True", "False", "given", "check", "value"]
    rows = []
    for i in range(n):
        target, text = PROMPT_TOKENS[i % len(PROMPT_TOKENS)], f"def task_{i}(x):\n    \"\"\""
        while len(tok(text).input_ids) < target:
            text += " " + rng.choice(words)
        rows.append(json.dumps({"prompt": text + '\n    """\n'}))
    out.write_text("\n".join(rows) + "\n")
    return str(out)


def run(name: str, schedule: str, sets: list[str], *, job: list[str], steps: int, out: Path) -> dict:
    from tidal.launch import jobs

    jobs.run("grpo", "--overwrite", "--schedule", schedule, output_dir=out, steps=steps, overrides=[*job, *sets],
             timeout=steps * 600, nproc=3)
    return collect(out)


def collect(out: Path) -> dict:
    """A finished run's steps (the first, warming up, left out), digests and decode slots."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    slots = json.loads((out / "config.json").read_text())["generator"]["max_batch_prompts"]
    return {"rows": rows[1:], "digests": [r["trainer/rollout_digest"] for r in rows], "slots": slots}


def forward_cost(model_dir: str, *, rows=(4, 8, 16), context: int = 150, repeats: int = 9) -> None:
    """One thread, as a generator rank of a 2-core machine has: the median decode forward at each
    row count, over a KV cache of `context` tokens (tidal/recipes/defaults.py SATURATING_ROWS)."""
    import time

    import torch
    import transformers
    from tabulate import tabulate

    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    body = []
    for n in rows:
        with torch.inference_mode():
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=torch.randint(0, 500, (n, context)), past_key_values=cache, use_cache=True, logits_to_keep=1)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model(input_ids=torch.randint(0, 500, (n, 1)), past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
        body.append([n, statistics.median(times) * 1e3])
    print(f"decode forward, one thread, {context}-token cache, median of {repeats}; load average {os.getloadavg()[0]:.2f}")
    print(tabulate(body, floatfmt=(".0f", ".1f"), headers=["rows", "ms"]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="HF model directory (default: a random-init SmolLM2-135M-shaped Llama)")
    p.add_argument("--data", help="JSONL with a prompt column (default: HumanEval-like lengths)")
    p.add_argument("--reward", default="bench.real_run:distinct_reward", help="module:function")
    p.add_argument("--steps", type=int, default=20, help="steps per run (the first is skipped)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each config, interleaved")
    p.add_argument("--prompts", type=int, default=4, help="B")
    p.add_argument("--samples", type=int, default=4, help="G")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--also-slots", type=int, nargs="*", default=[], help="periodic runs at these max_batch_prompts too")
    p.add_argument("--keep", type=Path, help="write the runs here (run-<config>-<repeat>) instead of a temp dir")
    p.add_argument("--only", choices=["periodic", "sync"], help="run only this schedule's configs (the first run is the baseline)")
    p.add_argument("--forward-cost", action="store_true", help="only time a decode forward at 4, 8, 16 rows")
    args = p.parse_args()
    if args.forward_cost:
        with tempfile.TemporaryDirectory() as tmp_dir:
            return forward_cost(args.model or smollm2_shaped_model(Path(tmp_dir) / "model"))
    configs = CONFIGS + [(f"periodic, {n} slots", "periodic", [f"generator.max_batch_prompts={n}"])
                         for n in args.also_slots]
    configs = [c for c in configs if args.only in (None, c[1])]
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="tidal-real-run-") as tmp_dir:
        tmp = args.keep or Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        model = args.model or smollm2_shaped_model(tmp / "model")
        data = args.data or humaneval_like_prompts(tmp / "prompts.jsonl")
        job = [f"model.path={model}", f"data.path={data}", f"reward.functions=[{args.reward}]",
               f"data.prompts_per_step={args.prompts}", f"generator.samples_per_prompt={args.samples}",
               f"generator.max_new_tokens={args.max_new_tokens}", "checkpoint_minutes=0", "logging.samples_every=0"]
        results = {name: [] for name, _, _ in configs}
        for repeat in range(args.repeats):
            # every other repeat in reverse: a load that drifts over the bench then favours no config
            order = list(enumerate(configs))[::-1 if repeat % 2 else 1]
            for i, (name, schedule, sets) in order:
                print(f"real_run: {name} ({repeat + 1}/{args.repeats})", file=sys.stderr, flush=True)
                results[name].append(run(name, schedule, sets, job=job, steps=args.steps,
                                         out=tmp / f"run-{i}-{repeat}"))
                load.append(os.getloadavg())
    table(results, configs, args, load)


def table(results: dict, configs: list, args, load: list[tuple]) -> None:
    from tabulate import tabulate

    def med(name: str, key) -> float:
        return statistics.median(key(r) if callable(key) else r[key] for run in results[name] for r in run["rows"])

    def busy_share(r: dict) -> float:  # 1: generation and training one after the other; 0.5: fully overlapped
        return r["step_s"] / (r["generator/gen_s"] + r["trainer/train_s"] + r["trainer/push_s"])

    base = med(configs[0][0], "step_s")
    digests = {tuple(run["digests"]) for runs in results.values() for run in runs}
    body = [[name, results[name][0]["slots"], med(name, "step_s"), med(name, "overlap_s"), med(name, "gen_idle_frac"),
             med(name, "train_idle_frac"), med(name, busy_share), base / med(name, "step_s")] for name, _, _ in configs]
    print(f"B={args.prompts}, G={args.samples}, max_new_tokens={args.max_new_tokens}, {args.steps - 1} steps x "
          f"{args.repeats} run(s) per config (medians; first step of each run skipped); same rollouts in all: "
          f"{'yes' if len(digests) == 1 else 'NO'}; load average (1 min) "
          f"{min(x[0] for x in load):.2f}-{max(x[0] for x in load):.2f}")
    print(tabulate(body, floatfmt=("", ".0f", ".1f", ".1f", ".2f", ".2f", ".2f", ".2f"), headers=[
        "config", "max_batch_prompts", "s/step", "overlap_s", "generator idle", "trainer idle",
        "step / (gen + train + push)", f"speed-up vs {configs[0][0]}"]))


if __name__ == "__main__":
    main()

"""model.numerics=exact against the default kernels: the engine/trainer log-prob gap, and what exact costs.

Each config is a whole job, as a user runs it (tidal/launch/jobs.py, torchrun, the split placement under the
periodic schedule), `--steps` steps, `--repeats` times alternating; the first step (start-up) is left out and
the figures are medians over the rest. Configs: default and exact numerics, each in float32, bf16 and fp16
(trainer.precision=bf16 / fp16: compute in it with float32 masters, fp16 with a dynamic loss scale; the
engine decodes in it). `--configs` runs a subset (fp16 GEMMs are ~10x slower than bf16 on CPUs without
fp16 arithmetic, as here).

Columns: the per-step log-prob mismatch |trainer - sampler| of the sampled tokens (mean, p99, max and the
per-token KL, trainer/logp_mismatch_*), generation tokens/s (generator/gen_tokens_per_s), training tokens/s
(trainer/tokens / trainer/train_s), s/step, the optimizer steps an fp16 overflow skipped; each row's ratios
against its baseline (exact: the default of its precision; default fp16: default bf16), measured in the
same invocation. Then, in this process, how much a prompt's samples depend on their batch in
each mode: prompt 0's G samples decoded alone and as one of 16 prompts (chunked admission, 4 at a time): the
samples whose tokens differ and the largest log-prob difference over the tokens both wrote alike.

    .venv/bin/python bench/exact.py                              # the embedded model and task
    PYTHONPATH=../shared/real .venv/bin/python bench/exact.py --model DIR --data humaneval.jsonl \\
        --reward he_reward:humaneval                             # e.g. SmolLM2-135M-Instruct (prepare.py)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tidal.launch import jobs  # noqa: E402

CONFIGS = {
    "default fp32": ["model.numerics=default"],
    "default bf16": ["model.numerics=default", "trainer.precision=bf16"],
    "default fp16": ["model.numerics=default", "trainer.precision=fp16"],
    "exact fp32": ["model.numerics=exact"],
    "exact bf16": ["model.numerics=exact", "trainer.precision=bf16"],
    "exact fp16": ["model.numerics=exact", "trainer.precision=fp16"],
}
BASELINE = {"exact fp32": "default fp32", "exact bf16": "default bf16", "exact fp16": "default fp16",
            "default fp16": "default bf16"}
MISMATCH = ("mean", "p99", "max", "kl")


def measure(sets: list[str], common: list[str], *, steps: int, out: Path) -> dict:
    args = [a for s in common + sets for a in ("--set", s)]
    jobs.run("grpo", "--overwrite", *args, steps=steps, output_dir=out, nproc=3, timeout=3600)
    every = jobs.read_metrics(out)
    rows = every[1:]  # step 0 carries the start-up
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"step_s": med("step_s"), "gen_tps": med("generator/gen_tokens_per_s"),
            "train_tps": statistics.median(r["trainer/tokens"] / r["trainer/train_s"] for r in rows),
            "skipped": sum(r["trainer/skipped_steps"] for r in every),
            **{m: max(r[f"trainer/logp_mismatch_{m}"] for r in rows) for m in MISMATCH}}


def batch_dependence(model_path: str | None, data: str | None, *, max_new_tokens: int) -> list[list]:
    """Per mode and dtype: (samples of 8 whose tokens differ, largest |log-prob| difference on the tokens
    before the first difference), prompt 0 alone against prompt 0 among 16."""
    import torch

    from tidal.executors.generator.contract import PromptRequest, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine
    from tidal.modeling.hf import load_model, load_tokenizer
    from tidal.modeling.tiny.task import embedded_prompts

    tok = load_tokenizer(model_path)
    if data:
        import json

        texts = [json.loads(line)["prompt"] for line in Path(data).read_text().splitlines()[:16]]
    else:
        texts = [r["prompt"] for r in embedded_prompts(16, seed=2)]
    reqs = [PromptRequest(index=i, prompt_ids=tok(t)["input_ids"]) for i, t in enumerate(texts)]
    params = SamplingParams(n=8, max_new_tokens=max_new_tokens, seed=5, temperature=1.0)
    out = []
    for numerics in ("default", "exact"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            eng = NativeEngine(load_model(model_path, dtype=dtype, seed=0), eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, max_batch_prompts=4, numerics=numerics)
            alone = next(iter(eng.generate(reqs[:1], params, step=0)))
            among = {g.index: g for g in eng.generate(reqs, params, step=0)}[0]
            differ, gap = 0, 0.0
            for a, b, la, lb in zip(alone.response_ids, among.response_ids, alone.logprobs, among.logprobs):
                n = min(len(a), len(b))
                same = int((a[:n] != b[:n]).nonzero()[0]) if (a[:n] != b[:n]).any() else n
                differ += not torch.equal(a, b)
                gap = max(gap, (la[:same] - lb[:same]).abs().max().item() if same else 0.0)
            out.append([numerics, str(dtype).removeprefix("torch."), f"{differ} of 8", f"{gap:.3g}"])
    return out


def machine() -> str:
    """The CPU and what its kernels may use: the flags that pick oneDNN's and MKL's code paths, the libraries'
    versions and the instruction-set caps in force."""
    import os
    import platform

    import torch

    model, flags = platform.processor() or "?", set()
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")
           if f in flags]
    caps = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
            if k in os.environ]
    config = torch.__config__.show()
    onednn = config.split("MKL-DNN v", 1)[1].split()[0] if "MKL-DNN v" in config else "?"
    return (f"machine: {model}, {os.cpu_count()} cores; flags: {' '.join(isa) or 'none of the AVX-512/AMX ones'}; torch "
            f"{torch.__version__} (ATen {torch.backends.cpu.get_cpu_capability()}), oneDNN {onednn}"
            + (f"; {', '.join(caps)}" if caps else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: the embedded model)")
    p.add_argument("--data", help="JSONL with a prompt column (default: the embedded task)")
    p.add_argument("--reward", help="module:function for --data")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--batch-tokens", type=int, default=64, help="new tokens a sample in the batch comparison (0: skip it)")
    p.add_argument("--set", action="append", default=[], help="more overrides for every config (KEY=VALUE)")
    args = p.parse_args()
    common = ["logging.plots=false", "checkpoint_every=0", *args.set]
    if args.model:
        common.append(f"model.path={args.model}")
    if args.data:
        if not args.reward:
            p.error("--data needs --reward")
        common += [f"data.path={args.data}", f"reward.functions=[{args.reward}]"]
    chosen = [c.strip() for c in args.configs.split(",")]
    if unknown := set(chosen) - set(CONFIGS):
        p.error(f"--configs: unknown {sorted(unknown)}; choose from {list(CONFIGS)}")
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS if name in chosen}
    with tempfile.TemporaryDirectory(prefix="tidal-exact-") as tmp:
        for r in range(args.repeats):
            for name in runs:
                runs[name].append(measure(CONFIGS[name], common, steps=args.steps, out=Path(tmp) / f"{r}-{name.replace(' ', '-')}"))
                print(f"{name} (repeat {r + 1}): {runs[name][-1]}", flush=True)
    fig = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    table = []
    for name, f in fig.items():
        base = fig.get(BASELINE.get(name, ""))
        ratio = (lambda k: f"{f[k] / base[k]:.2f}") if base else (lambda k: "-")  # noqa: E731
        table.append([name, BASELINE.get(name, "-") if base else "-", *(f"{f[m]:.3g}" for m in MISMATCH),
                      f"{f['gen_tps']:.0f}", ratio("gen_tps"), f"{f['train_tps']:.0f}", ratio("train_tps"),
                      f"{f['step_s']:.2f}", ratio("step_s"), f"{f['skipped']:.0f}"])
    print(f"\n{machine()}")
    print(f"model: {args.model or 'embedded'}; {args.steps} steps (the first left out), {args.repeats} repeat(s); "
          f"mismatch: the largest step's; rates and s/step: medians; ratios against the baseline's")
    print(tabulate(table, headers=["config", "baseline", "mismatch mean", "p99", "max", "KL", "gen tok/s", "ratio",
                                   "train tok/s", "ratio", "s/step", "ratio", "skipped steps"], tablefmt="github"))
    if not args.batch_tokens:
        return
    print("\nprompt 0's 8 samples decoded alone and among 16 prompts (native engine, chunked admission, 4 at a time):")
    print(tabulate(batch_dependence(args.model, args.data, max_new_tokens=args.batch_tokens),
                   headers=["numerics", "dtype", "samples whose tokens differ", "max |log-prob| difference before"],
                   tablefmt="github"))


if __name__ == "__main__":
    main()

"""`make gpu-check`: what a lent GPU (or NPU) is for, in one call: the GPU suite, then the figures only a
device gives, written as gpu-report.md (tables) and gpu-report.json into $OUT (the device call's folder
that comes back) or runs/gpu-check/.

Why one script: a session is lent a GPU by chance, 15 minutes of device time in all, on an image with its
own torch and transformers and no package index (docs/gpu.md, "GPU check"). So everything is one command
that ends within --budget-s seconds (default 480, the issue's 8 minutes on one H100); each part runs in
its own process under a deadline, and a part that fails or runs out of time is recorded with its error
while the rest go on (the exit code is then 1, after the report is written).

Without a GPU/NPU the same code runs on the CPU with tiny shapes (the stand-in, which the report says it
is): CI runs it, so a part that breaks fails there before a GPU ever runs it.

The parts, in order:
  suite      tests_gpu/ under pytest: each test's outcome and time
  decode     per shape: the native engine's tokens/s at 1, 16 and 256 rows against HF `generate` at the
             same rows (bf16 weights; random-init models of Qwen2.5-0.5B's and Qwen3-4B's shapes), and
             with model.numerics=exact at 1 and 16 rows (its time a token against the default's)
  train      per shape: a trainer micro-step (forward + backward of the policy over one packed group of 4k and
             of 16k tokens, bf16 compute, the trainer's chunked fp32 head, activation checkpointing off and on):
             tokens/s, MFU against the device's dense bf16 peak, and the device's peak memory
  colocated  the embedded-task GRPO job co-located (sync), bf16 with fp32 masters, on the 0.5B shape:
             step, generate, train and push seconds, train tokens/s, the offload/onload spans, the engine/
             trainer log-prob gap, and the step's peak device memory against --dry-run's estimate
  split      periodic / sync on the split placement, where this machine has an accelerator for every
             device rank; else the rank plan that does not fit, and nothing run
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

# Configs of the published models (config.json's sizes; no weights): random-init, bf16.
SHAPES = {
    "qwen2.5-0.5b": dict(family="Qwen2Config", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6,
                         tie_word_embeddings=True, max_position_embeddings=32768),
    "qwen3-4b": dict(family="Qwen3Config", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960),
}
# the CPU stand-in's tiny versions of both (the same code, seconds instead of minutes)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
ROWS = (1, 16, 256)  # decode rows: 1 prompt x 1 sample, 1 x 16, 16 x 16 (one admission chunk)
PROMPT_TOKENS = 32
# the co-located job: B prompts x G samples x T tokens, steps (the first is start-up: not in the medians)
JOB = dict(prompts=8, samples=8, new_tokens=64, steps=4)


def accelerator() -> torch.device | None:
    from tidal.controller.devices import detect_device

    spec = detect_device()
    return None if spec.type == "cpu" else torch.device(spec.type, 0)


def config_of(shape: str, *, tiny: bool):
    import transformers

    sizes = dict(SHAPES[shape])
    family = sizes.pop("family")
    if tiny:
        sizes.update(TINY)
    return getattr(transformers, family)(**sizes, dtype="float32")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


# ---- the parts that run in a process of their own (`--part NAME --shape SHAPE`) -------------------------

def part_decode(shape: str, device: torch.device, *, tiny: bool) -> list[dict]:
    """Native engine vs HF `generate`, each sample to `new` tokens (random weights seldom sample EOS)."""
    import transformers

    from tidal.executors.generator.contract import PromptRequest, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine

    new = 8 if tiny else 64
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config_of(shape, tiny=tiny), dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    vocab = model.config.vocab_size
    engine = NativeEngine(model, eos_token_id=vocab - 1, pad_token_id=0, max_batch_prompts=16)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in ROWS:
        G = min(n, 16)
        prompts = [torch.randint(1, vocab - 1, (PROMPT_TOKENS,), generator=gen) for _ in range(n // G)]

        def native(tokens: int) -> int:
            params = SamplingParams(n=G, max_new_tokens=tokens, seed=0, temperature=1.0)
            requests = [PromptRequest(index=i, prompt_ids=p) for i, p in enumerate(prompts)]
            return sum(r.numel() for g in engine.generate(requests, params, step=0) for r in g.response_ids)

        def hf(tokens: int) -> int:
            ids = torch.stack(prompts).repeat_interleave(G, dim=0).to(device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=tokens, eos_token_id=None, pad_token_id=0)
            _sync(device)
            return ids.shape[0] * (out.shape[1] - PROMPT_TOKENS)

        rate = {}
        for name, run in (("native", native), ("hf", hf)):
            run(2)  # warm-up: kernels, the allocator's pools, the decode graphs
            t0 = time.perf_counter()
            tokens = run(new)
            rate[name] = tokens / (time.perf_counter() - t0)
        rows.append({"shape": shape, "rows": n, "new tokens": new, "native tok/s": rate["native"],
                     "HF generate tok/s": rate["hf"], "native / HF": rate["native"] / rate["hf"]})
    # model.numerics=exact last: it changes the model's linear layers in place
    engine = NativeEngine(model, eos_token_id=vocab - 1, pad_token_id=0, max_batch_prompts=16, numerics="exact")
    for row in rows[:2]:  # 1 and 16 rows: the exact attention plans its items on the host a step (not in a graph)
        n = row["rows"]
        G = min(n, 16)
        prompts = [torch.randint(1, vocab - 1, (PROMPT_TOKENS,), generator=gen) for _ in range(n // G)]
        requests = [PromptRequest(index=i, prompt_ids=p) for i, p in enumerate(prompts)]
        for tokens in (2, new):  # a warm-up, then the timed call
            t0 = time.perf_counter()
            params = SamplingParams(n=G, max_new_tokens=tokens, seed=0, temperature=1.0)
            written = sum(r.numel() for g in engine.generate(requests, params, step=0) for r in g.response_ids)
        row["exact tok/s"] = written / (time.perf_counter() - t0)
        row["exact: time a token / default's"] = row["native tok/s"] / row["exact tok/s"]
    return rows


# dense bf16 peak of a device, TFLOP/s (the vendors' sheets, without sparsity): what MFU divides by
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def part_train(shape: str, device: torch.device, *, tiny: bool) -> list[dict]:
    """One group through the trainer's micro-step at a realistic token budget: a 32-token prompt and 16
    responses filling 4k and 16k tokens (the stand-in: 64 and 256), the shared-prompt packed row, the policy's
    forward with the chunked fp32 head, the backward; activation checkpointing off and on. MFU: model FLOPs
    (6 x parameters x tokens, the usual count: a checkpointed forward's recompute is not counted) over the
    device's dense bf16 peak."""
    import transformers

    from tidal.modeling.packing import pack_group
    from tidal.modeling.parallel.ac import apply_ac

    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config_of(shape, tiny=tiny), dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    model.train()
    vocab, G = model.config.vocab_size, 16
    params = sum(p.numel() for p in model.parameters())
    peak = peak_tflops(device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=gen)
    rows = []
    groups = []
    for budget in ((64, 256) if tiny else (4096, 16384)):
        R = (budget - PROMPT_TOKENS) // G
        responses = [torch.randint(0, vocab, (R,), generator=gen) for _ in range(G)]
        groups.append(pack_group(prompt, responses, token_budget=10 ** 7, pad_id=0, device=device, shared_prompt=True))
    for checkpointing in (False, True):
        if checkpointing:
            apply_ac(model)  # the trainer's: every decoder layer keeps only its inputs
        for mbs in groups:
            tokens = sum(mb.tokens for mb in mbs)

            def step() -> None:
                model.zero_grad(set_to_none=True)
                sum(mb.logprobs(model, temperature=1.0).sum() for mb in mbs).backward()
                _sync(device)

            step()  # warm-up
            if device.type != "cpu":
                getattr(torch, device.type).reset_peak_memory_stats(device)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            rows.append({"shape": shape, "tokens per micro-step": tokens, "checkpointing": checkpointing,
                         "micro-step s (median of 3)": s, "train tok/s": tokens / s,
                         "MFU": 6 * params * tokens / s / (peak * 1e12) if peak else None,
                         "peak GB": getattr(torch, device.type).max_memory_allocated(device) / 1e9
                         if device.type != "cpu" else None})
    return rows


PARTS = {"decode": part_decode, "train": part_train}


# ---- the orchestrator ------------------------------------------------------------------------------------

class Report:
    """The sections as they come; written whole after each, so a kill still leaves what was done."""

    def __init__(self, out: Path, *, stand_in: bool):
        self.out, self.stand_in = out, stand_in
        self.sections: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu-check.log", "w")

    def add(self, name: str, *, rows: list[dict] | None = None, note: str = "", error: str | None = None,
            seconds: float = 0.0) -> None:
        self.sections.append({"section": name, "rows": rows or [], "note": note, "error": error, "seconds": seconds})
        self.write()

    @property
    def failed(self) -> list[str]:
        return [s["section"] for s in self.sections if s["error"]]

    def write(self) -> None:
        data = {"stand_in": self.stand_in, "sections": self.sections}
        (self.out / "gpu-report.json").write_text(json.dumps(data, indent=2))
        lines = ["# Tidal GPU check" + (" (CPU stand-in: tiny shapes, no device; not a GPU's figures)"
                                          if self.stand_in else ""), ""]
        for s in self.sections:
            lines += [f"## {s['section']} ({s['seconds']:.0f} s)", ""]
            if s["error"]:
                lines += ["FAILED:", "```", s["error"].strip()[-12000:], "```", ""]
            if s["rows"]:
                lines += [tabulate(s["rows"], headers="keys", tablefmt="github", floatfmt=".4g"), ""]
            if s["note"]:
                lines += [s["note"], ""]
        (self.out / "gpu-report.md").write_text("\n".join(lines))


class Clock:
    def __init__(self, budget_s: float):
        self.end = time.monotonic() + budget_s

    def left(self, want: float) -> float:
        """Seconds a part may take: `want`, or what is left of the budget if less."""
        return max(0.0, min(want, self.end - time.monotonic()))


def _run(cmd: list[str], *, timeout: float, report: Report, env: dict | None = None) -> subprocess.CompletedProcess:
    if timeout < 5:
        raise TimeoutError("out of time: the check's budget was spent before this part")
    report.log.write(f"\n$ {' '.join(cmd)}\n")
    report.log.flush()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    except subprocess.TimeoutExpired as exc:
        for text in (exc.stdout, exc.stderr):
            report.log.write(text.decode(errors="replace") if isinstance(text, bytes) else text or "")
        raise TimeoutError(f"out of time: {timeout:.0f} s") from None
    report.log.write(proc.stdout + proc.stderr)
    report.log.flush()
    return proc


def section(report: Report, name: str, fn) -> None:
    t0 = time.monotonic()
    try:
        rows, note = fn()
        if not rows and not note:
            raise RuntimeError("the part gave no figures and said nothing")
        report.add(name, rows=rows, note=note, seconds=time.monotonic() - t0)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 (recorded, and the check goes on)
        error = traceback.format_exc() if not isinstance(exc, (TimeoutError, RuntimeError)) else str(exc)
        report.add(name, error=error, seconds=time.monotonic() - t0)


def environment(device: torch.device | None) -> tuple[list[dict], str]:
    import transformers

    import numpy
    import peft

    row = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "numpy": numpy.__version__,
           "device": "CPU (stand-in)" if device is None else getattr(torch, device.type).get_device_name(device)}
    if device is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        row.update(cuda=torch.version.cuda, memory_gb=total / 1e9, free_gb=free / 1e9)
    return [row], ""


def suite(report: Report, clock: Clock, *, stand_in: bool) -> tuple[list[dict], str]:
    """tests_gpu/ under pytest; each test's outcome comes from tests_gpu/conftest.py's log as it ends, so
    a session the deadline cuts still reports what ran, what failed (with its message) and what was running."""
    log = report.out / "suite.jsonl"
    log.unlink(missing_ok=True)
    cut = None
    try:
        proc = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests_gpu", "--timeout=120"],
                    timeout=clock.left(240), report=report,
                    env={"TIDAL_GPU_SUITE_LOG": str(log), **({"TIDAL_GPU_SUITE_DEVICE": "cpu"} if stand_in else {})})
    except TimeoutError as exc:
        proc, cut = None, str(exc)
    rows = {}
    for line in log.read_text().splitlines() if log.is_file() else ():
        r = json.loads(line)
        rows[r["test"]] = {"test": r["test"].split("::", 1)[-1], "outcome": r["outcome"], "s": r.get("s"),
                           "why": r.get("why", "")}
    log.unlink(missing_ok=True)
    failed = [r for r in rows.values() if r["outcome"] in ("failed", "error", "started")]
    shown = [{**r, "why": r["why"].strip().splitlines()[-1][:160] if r["why"].strip() else ""} for r in rows.values()]
    if cut or proc.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"tests_gpu: {cut or 'failed'}\n" + tabulate(shown, headers="keys", tablefmt="github")
                           + "".join(f"\n\n{r['test']} ({r['outcome']}):\n{r['why']}" for r in failed))
    return shown, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def measured(part: str, shape: str, report: Report, clock: Clock, *, want: float) -> tuple[list[dict], str]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = _run([sys.executable, str(Path(__file__)), "--part", part, "--shape", shape, "--json", f.name],
                    timeout=clock.left(want), report=report)
        if proc.returncode:
            raise RuntimeError(f"{part} {shape} failed:\n{proc.stderr[-3000:]}")
        return json.loads(Path(f.name).read_text()), ""


def _model_dir(work: Path, *, tiny: bool) -> Path:
    """A random-init 0.5B-shaped model saved as an HF directory in `work` with the embedded tokenizer
    (once: the parts that run jobs share it)."""
    import transformers

    from tidal.modeling.hf import load_tokenizer

    path = work / "model"
    if not (path / "config.json").is_file():
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config_of("qwen2.5-0.5b", tiny=tiny)).save_pretrained(path)
        load_tokenizer(None).save_pretrained(path)
    return path


def _job_args(model: Path | None, schedule: str, *extra: str) -> list[str]:
    """The job's flags; model None: the embedded model (the same graph and rank plan)."""
    sets = [*([f"model.path={model}"] if model else []), "trainer.precision=bf16", "trainer.lr=1e-5", f"data.prompts_per_step={JOB['prompts']}",
            f"generator.samples_per_prompt={JOB['samples']}", f"generator.max_new_tokens={JOB['new_tokens']}", *extra]
    return ["--algo", "grpo", "--schedule", schedule, *[a for s in sets for a in ("--set", s)]]


def _spans(run: Path, kind: str) -> list[float]:
    return [e["t1"] - e["t0"] for line in (run / "timeline" / "rank000.jsonl").read_text().splitlines()
            if (e := json.loads(line))["kind"] == kind and e["step"] >= 1]


def colocated(report: Report, clock: Clock, work: Path, *, tiny: bool) -> tuple[list[dict], str]:
    from tidal.launch.cli import parser, resolve
    from tidal.launch.memory import PARTS, Shape, colocated_bytes

    model = _model_dir(work, tiny=tiny)
    run = work / "colocated"
    args = _job_args(model, "sync", "placement=colocated")
    proc = _run([sys.executable, "launch.py", *args, "--steps", str(JOB["steps"]), "--output-dir", str(run),
                 "--overwrite"], timeout=clock.left(240), report=report)
    if proc.returncode:
        raise RuntimeError(f"the co-located job failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    cfg = resolve(parser().parse_args(args))
    device = "cpu" if tiny else (accelerator() or torch.device("cpu")).type
    estimate = colocated_bytes([PARTS[name](cfg, Shape.of(str(model))) for name in ("generator", "trainer")],
                               device=device) / 1e9
    peak = max((r.get("trainer/device_peak_gb") or 0.0) for r in rows) if not tiny else None
    out = [{"step s": med("step_s"), "generate s": med("generator/gen_s"), "train s": med("trainer/train_s"),
            "push s": med("trainer/push_s"), "train tok/s": med("trainer/tokens") / med("trainer/train_s"),
            "offload s": statistics.median(_spans(run, "offload")), "onload s": statistics.median(_spans(run, "onload")),
            "logp gap mean": med("trainer/logp_mismatch_mean"), "logp gap p99": med("trainer/logp_mismatch_p99"),
            "logp gap max": max(r["trainer/logp_mismatch_max"] for r in rows), "KL": med("trainer/logp_mismatch_kl"),
            "peak GB": peak, "--dry-run estimate GB": estimate}]
    note = (f"B={JOB['prompts']} x G={JOB['samples']} x {JOB['new_tokens']} tokens, steps 1-{JOB['steps'] - 1} "
            "(step 0 is start-up); medians; the log-prob gap is |engine - trainer| per token (bf16 engine with an "
            "fp32 head, bf16 trainer forward); peak GB: the step's largest device allocation (trainer/device_peak_gb)")
    return out, note


def split(report: Report, clock: Clock, work: Path, *, tiny: bool) -> tuple[list[dict], str]:
    """The split placement needs one accelerator per device rank (tidal/controller/world.py rank_plan): where
    this machine has them, periodic against sync on the same job; else the plan, and why not."""
    from tidal.controller.devices import detect_device, device_count
    from tidal.controller.world import rank_plan
    from tidal.launch.cli import parser, resolve
    from tidal.recipes.registry import recipe_for

    cfg = resolve(parser().parse_args(_job_args(None, "periodic")))
    plan = rank_plan(recipe_for("grpo").build(cfg))
    need = sum(1 for _, _, index, _ in plan if index is not None)
    have = 0 if detect_device().type == "cpu" else device_count()
    if not tiny and have < need:
        return [], (f"not run: the split placement puts {need} device ranks on {need} accelerators "
                    f"({', '.join(f'rank {r}: {what}' for r, what, i, _ in plan if i is not None)}); this machine has "
                    f"{have}, and nccl cannot place two ranks of one group on one GPU")
    steps, model = {}, _model_dir(work, tiny=tiny)
    for schedule in ("sync", "periodic"):
        run = work / f"split-{schedule}"
        proc = _run([sys.executable, "launch.py", *_job_args(model, schedule), "--steps", str(JOB["steps"]),
                     "--output-dir", str(run), "--overwrite"], timeout=clock.left(180), report=report)
        if proc.returncode:
            raise RuntimeError(f"the split {schedule} job failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
        steps[schedule] = statistics.median(r["step_s"] for r in rows)
    return [{"sync step s": steps["sync"], "periodic step s": steps["periodic"],
             "periodic / sync": steps["periodic"] / steps["sync"]}], f"{len(plan)} ranks, {need} with a device"


def with_wheels(wheels: Path) -> None:
    """The lent machine's image has no package index: Tidal's dependencies it lacks come as wheels
    (`make gpu-wheels`, constraints/gpu-image.txt), installed into a folder of their own; then the check
    starts again in a fresh interpreter that imports that folder first, as every process it starts does
    (the image's own typing_extensions, already imported with torch here, must not serve pydantic)."""
    site = Path(tempfile.gettempdir()) / "tidal-gpu-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))],
                   check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    argv = [a for a in sys.argv[1:] if a != "--wheels" and a != str(wheels) and not a.startswith("--wheels=")]
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's deadline")
    ap.add_argument("--out", type=Path, help="default: $OUT, else runs/gpu-check")
    ap.add_argument("--wheels", type=Path, help="install these wheels first (the lent machine's image: .whl)")
    ap.add_argument("--only", help="comma-separated section names to run (a rerun of what failed): "
                                   "suite, decode, train, colocated, split")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.wheels:
        with_wheels(args.wheels)
    device = accelerator()
    if args.part:  # a child: one measurement, its rows into --json
        rows = PARTS[args.part](args.shape, device or torch.device("cpu"), tiny=device is None)
        args.json.write_text(json.dumps(rows))
        return 0
    out = args.out or Path(os.environ.get("OUT") or ROOT / "runs" / "gpu-check")
    report, clock = Report(out, stand_in=device is None), Clock(args.budget_s)
    tiny = device is None
    print(f"gpu-check: {'CPU stand-in' if tiny else device}, report in {out}", flush=True)
    chosen = set(args.only.split(",")) if args.only else {"suite", "decode", "train", "colocated", "split"}
    section(report, "environment", lambda: environment(device))
    if "suite" in chosen:
        section(report, "suite: tests_gpu", lambda: suite(report, clock, stand_in=tiny))
    for part, want in (("decode", {"qwen2.5-0.5b": 80, "qwen3-4b": 110}), ("train", {"qwen2.5-0.5b": 60, "qwen3-4b": 100})):
        for shape, seconds in want.items() if part in chosen else ():
            section(report, f"{part}: {shape}", lambda: measured(part, shape, report, clock, want=seconds))
    with tempfile.TemporaryDirectory() as tmp:
        if "colocated" in chosen:
            section(report, "colocated: GRPO on the 0.5B shape", lambda: colocated(report, clock, Path(tmp), tiny=tiny))
        if "split" in chosen:
            section(report, "split: periodic / sync", lambda: split(report, clock, Path(tmp), tiny=tiny))
    print((out / "gpu-report.md").read_text())
    for s in report.sections:
        print(f"  {s['section']}: {'FAILED' if s['error'] else 'ok'} ({s['seconds']:.0f} s)", flush=True)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())

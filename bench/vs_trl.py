"""Tidal against TRL's GRPOTrainer on the same job, on equal terms: s/step, tokens/s, CPU-s/step, peak RSS
per process and each side's phase split, with the ratios against TRL measured in the same round.

The job (defaults: the embedded tiny Qwen3 saved as an HF directory, the embedded task's prompts and its
reward): --model PATH (HF directory), --data FILE (JSONL, a prompt column), --reward module:function
(called fn(prompt, response, sample) as Tidal calls a reward: sample = the row's other columns; TRL gets
the same function wrapped into its reward_funcs signature). The rows that pass --min/--max-prompt-tokens
(the model's tokenizer, as Tidal tokenizes: tokenizer(prompt)) are written to one JSONL that both read.
B prompts x G samples x <= --max-new-tokens, temperature, lr, beta 0, one optimizer step per batch, on
both sides.

Precision and recomputation are set explicitly and equally on both sides:
- fp32 (default): TRL bf16=False, fp16=False, gradient_checkpointing=False, model loaded in float32;
  Tidal trainer.precision=fp32, trainer.activation_checkpointing=false, model.dtype=float32.
- --bf16: TRL bf16=True (accelerate wraps the model's forward in CPU bf16 autocast: fp32 weights, grads
  and AdamW state; its generation runs through the same forward, so in autocast too (the run checks
  both and prints it)); Tidal trainer.precision=bf16 (forward and backward on a bf16 copy of fp32
  master weights, AdamW steps the fp32 masters; the generator holds and runs the model in bf16).
  Neither side recomputes activations.

Measured (medians over the steps after the first, then over --repeats):
- s/step: TRL: between its step-end callbacks; Tidal: metrics.jsonl `step_s`.
- trained tokens/step, as each side counts them: TRL: the tokens of its training forward, from a
  forward hook on the policy with grad enabled (attention-mask sum: prompt + completion of each of the
  B x G rows, each prompt G times; its padded [rows x columns] count too); Tidal: `trainer/tokens` (packed,
  each prompt once per group). Completion tokens/step: both sides' mean response length x B x G.
- CPU-s/step: the bench polls every process of the job (psutil, every --poll s: user + system of the
  process and of its reaped children, e.g. a reward's subprocesses) and takes the CPU spent between the
  end of the first step and the end of the last, over the steps between; start-up and shutdown are out.
- peak RSS per process: the kernel's high-water mark (VmHWM) of each process, last polled value (TRL's
  one process: also its rusage max RSS at exit). Tidal: per rank, plus the launcher (torchrun's agent).
- phases: Tidal gen_s, score_s (reward), train_s, push_s from metrics.jsonl (periodic overlaps gen and
  train); TRL from its own profiling timers: transformers.generate, _calculate_rewards, and the rest of
  the step after _prepare_inputs (training forward, backward, optimizer step).
Threads: TRL one process with torch's default intra-op threads (or --trl-threads); Tidal as launched,
its ranks pin cores // ranks threads each (tidal/controller/devices.py pin_threads; 1 each on 2 cores; the
co-located placement is one process with every core, like TRL's).
--systems picks the Tidal runs of a round (default sync, periodic, colocated, default: the plain launch,
no placement, schedule or slot flags, whatever tidal/launch/auto.py chooses; the fixed systems leave the slots
to it too); they interleave with TRL (TRL, Tidal sync, Tidal periodic, Tidal co-located, TRL, ...); the load average is recorded before
and after each run. TRL is an optional bench dependency, never a test one; `make bench-trl` builds
.venv-trl and runs the defaults:
    .venv-trl/bin/python bench/vs_trl.py [--bf16] [--steps 10] [--repeats 3]
    PYTHONPATH=<dir of he_reward.py> .venv-trl/bin/python bench/vs_trl.py --model <SmolLM2-135M-Instruct dir> \
        --data <humaneval.jsonl> --reward he_reward:humaneval --min-prompt-tokens 100 \
        --max-prompt-tokens 130 --prompts 4 --samples 4 --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("trl", "sync", "periodic", "colocated", "default")
NAMES = {"trl": "TRL GRPOTrainer", "sync": "Tidal sync", "periodic": "Tidal periodic",
         "colocated": "Tidal co-located", "default": "Tidal default (the launch's choice)"}
EMBEDDED_REWARD = "tidal.modeling.tiny.task:embedded_reward"


# ---- the job: model, rows in the length band, reward ---------------------------------------------------

def write_job(args, tmp: Path) -> tuple[str, Path, list[int]]:
    """(model directory, the JSONL both sides read, its prompts' token lengths)."""
    sys.path.insert(0, str(ROOT))
    from tidal.modeling.hf import load_tokenizer

    model_dir = args.model
    if model_dir is None:
        from tidal.modeling.hf import load_model, save_hf

        model_dir = str(tmp / "model")
        save_hf(load_model(None, seed=0), load_tokenizer(None), Path(model_dir))
    if args.data:
        rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    else:
        from tidal.modeling.tiny.task import embedded_prompts

        rows = embedded_prompts(4096, seed=0)
    tok = load_tokenizer(model_dir)
    kept, lengths = [], []
    for row in rows:
        row = dict(row)
        row["prompt"] = row.pop(args.prompt_key)
        n = len(tok(row["prompt"])["input_ids"])  # as Tidal's PromptSet and TRL's _tokenize_prompts do
        if args.min_prompt_tokens <= n <= (args.max_prompt_tokens or n):
            kept.append(row)
            lengths.append(n)
    if len(kept) < args.prompts:
        raise SystemExit(f"{len(kept)} of {len(rows)} prompts lie in [{args.min_prompt_tokens}, "
                         f"{args.max_prompt_tokens or 'any'}] tokens; a step needs {args.prompts}")
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return model_dir, data, lengths


def load_reward(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ---- TRL, in its own process ---------------------------------------------------------------------------

def trl_worker(spec_file: str) -> None:
    """One TRL GRPOTrainer run; writes each step's end time, phases and tokens, and what it ran in."""
    spec = json.loads(Path(spec_file).read_text())
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    import datasets
    import trl.extras.profiling as profiling
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    fn = load_reward(spec["reward"])
    columns = [k for k in json.loads(Path(spec["data"]).read_text().splitlines()[0]) if k != "prompt"]

    def reward(prompts, completions, **kw):  # TRL's signature -> fn(prompt, response, sample) as Tidal calls it
        return [float(fn(p, c, {k: kw[k][i] for k in columns})) for i, (p, c) in enumerate(zip(prompts, completions))]

    reward.__name__ = spec["reward"].rpartition(":")[2]
    steps, cur, seen = [], {"phases": defaultdict(float), "tokens": 0, "padded": 0}, set()

    log_metrics = profiling.ProfilingContext._log_metrics

    def record(self, duration):  # TRL's own timers (logged to wandb & co only): keep them per step
        cur["phases"][self.name.rpartition(".")[2] if "._" in self.name else self.name.split(".", 1)[1]] += duration
        log_metrics(self, duration)

    profiling.ProfilingContext._log_metrics = record

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append({"end_t": time.time(), "phases": dict(cur["phases"]), "tokens": cur["tokens"],
                          "padded": cur["padded"]})
            cur.update(phases=defaultdict(float), tokens=0, padded=0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["completion_tokens"] = logs["completions/mean_length"] * spec["B"] * spec["G"]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=spec["B"] * spec["G"], gradient_accumulation_steps=1,
        num_generations=spec["G"], num_iterations=1, max_completion_length=spec["N"], max_steps=spec["steps"],
        temperature=spec["temperature"], top_p=1.0, top_k=0, beta=0.0, loss_type="grpo", scale_rewards="group",
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=spec["bf16"], fp16=False, gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"},
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=config, callbacks=[Clock()],
                          train_dataset=datasets.load_dataset("json", data_files=spec["data"], split="train"))

    def count(module, args, kwargs):  # the training forward (grad on); generation runs under no_grad
        if torch.is_grad_enabled():
            ids, mask = kwargs.get("input_ids", args[0] if args else None), kwargs.get("attention_mask")
            cur["padded"] += ids.numel()
            cur["tokens"] += int(mask.sum()) if mask is not None else ids.numel()

    def probe(module, args):  # inside the (possibly autocast-wrapped) forward: what the matmuls run in
        seen.add(("train" if torch.is_grad_enabled() else "generation", torch.is_autocast_enabled("cpu")))

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)
    next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)).register_forward_pre_hook(probe)
    trainer.train()
    autocast = {phase: sorted({on for ph, on in seen if ph == phase}) for phase, _ in seen}
    Path(spec["out"]).write_text(json.dumps({
        "steps": steps, "threads": torch.get_num_threads(), "autocast": autocast,
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "args": {k: getattr(trainer.args, k) for k in ("bf16", "fp16", "gradient_checkpointing", "loss_type")}}))


# ---- one run of one system, its processes polled ---------------------------------------------------------

class Poller(threading.Thread):
    """Every `interval` s: each process of the job's tree, its CPU (own + reaped children's) and VmHWM."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        import psutil

        self.root, self.interval, self.stop = psutil.Process(pid), interval, threading.Event()
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.hwm: dict[int, int] = {}
        self.rank: dict[int, str | None] = {}
        self.parent: dict[int, int] = {}

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            t, cpu = time.time(), {}
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    with p.oneshot():
                        c = p.cpu_times()
                        cpu[p.pid] = c.user + c.system + c.children_user + c.children_system
                        if p.pid not in self.rank:
                            self.rank[p.pid] = p.environ().get("RANK")
                            self.parent[p.pid] = p.ppid()
                    with open(f"/proc/{p.pid}/status") as f:
                        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
                    self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), hwm)
                except (psutil.Error, OSError, StopIteration):
                    pass
            self.samples.append((t, cpu))
            self.stop.wait(self.interval)

    def cpu_between(self, t0: float, t1: float) -> dict[int, float]:
        """CPU seconds each process spent in [t0, t1] (linear between polls), for the processes polled
        before t0 and after t1 (a short-lived one's CPU is in its parent's once reaped)."""
        def at(series, t):
            for (ta, ca), (tb, cb) in zip(series, series[1:]):
                if ta <= t <= tb:
                    return ca + (cb - ca) * (t - ta) / max(tb - ta, 1e-9)
            return None

        out = {}
        for pid in {pid for _, cpu in self.samples for pid in cpu}:
            series = [(t, cpu[pid]) for t, cpu in self.samples if pid in cpu]
            a, b = at(series, t0), at(series, t1)
            if a is not None and b is not None:
                out[pid] = b - a
        return out


def run(system: str, *, args, job: dict, out: Path) -> dict:
    out.mkdir(parents=True)
    if system == "trl":
        spec = out / "spec.json"
        spec.write_text(json.dumps({**job, "steps": args.steps, "bf16": args.bf16, "threads": args.trl_threads,
                                    "out": str(out / "trl.json")}))
        cmd = [sys.executable, __file__, "--trl-worker", str(spec)]
    else:
        sets = [f"model.path={job['model']}", "model.dtype=float32", f"data.path={job['data']}",
                f"data.max_prompt_tokens={job['max_prompt']}", f"reward.functions=[{job['reward']}]",
                f"data.prompts_per_step={job['B']}", f"generator.samples_per_prompt={job['G']}",
                f"generator.max_new_tokens={job['N']}", f"generator.temperature={job['temperature']}",
                f"trainer.lr={job['lr']}", f"trainer.precision={'bf16' if args.bf16 else 'fp32'}",
                "trainer.activation_checkpointing=false", "trainer.mini_batches=1", "trainer.epochs=1",
                "algorithm.beta=0", "seed=0", "checkpoint_minutes=0", "logging.samples_every=0",
                # TRL feeds a plain-string prompt to the model as it is; a model with a chat template would
                # get it applied by Tidal's pretrained defaults: raw prompts on both sides
                "data.chat_template=false"]
        from tidal.launch import jobs  # TRL's venv also runs this file, for its worker

        # co-located: one process runs every executor, the sync schedule (the only one it takes); sync and
        # periodic: the split placement; default: what the plain launch chooses (tidal/launch/auto.py)
        fixed = {"colocated": ("sync", "colocated"), "sync": ("sync", "split"), "periodic": ("periodic", "split")}
        if system in fixed:
            sets = [*sets, f"schedule={fixed[system][0]}", f"placement={fixed[system][1]}"]
        cmd = jobs.command("grpo", steps=args.steps, output_dir=out / "run", overrides=sets)
    load = [os.getloadavg()[0]]
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=so, stderr=se, start_new_session=True)
    poller = Poller(proc.pid, args.poll)
    poller.start()
    timer = threading.Timer(args.timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    poller.stop.set()
    poller.join()
    load.append(os.getloadavg()[0])
    if proc.returncode:
        raise SystemExit(f"{NAMES[system]} failed (exit {proc.returncode}):\n{(out / 'stderr').read_text()[-3000:]}")
    if system == "trl":
        got = json.loads((out / "trl.json").read_text())
        steps = got["steps"]
        ends = [s["end_t"] for s in steps]
        step_s = [b - a for a, b in zip(ends, ends[1:])]
        later = steps[1:]
        trained = [s["tokens"] for s in later]
        completion = [s.get("completion_tokens", 0.0) for s in later]
        phases = {"generate": [s["phases"].get("transformers.generate", 0.0) for s in later],
                  "reward": [s["phases"].get("_calculate_rewards", 0.0) for s in later],
                  "train (rest of step)": [d - s["phases"].get("_prepare_inputs", 0.0) for d, s in zip(step_s, later)]}
        extra = {"padded": statistics.median(s["padded"] for s in later), "trl": got}
        labels = {proc.pid: "TRL (one process)"}
        threads = {proc.pid: got["threads"]}
    else:
        rows = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
        timeline = [json.loads(line) for line in (out / "run/timeline.jsonl").read_text().splitlines()]
        role = {r["rank"]: r["executor"] for r in timeline if r["kind"] == "step"}
        together = json.loads((out / "run/config.json").read_text())["placement"] == "colocated"
        # the trainer's step ends (co-located: the one rank's, named after its host executor)
        ends = [max(r["t1"] for r in timeline if r["kind"] == "step" and r["step"] == k
                    and (r["executor"] == "trainer" or together)) for k in range(args.steps)]
        later = rows[1:]
        step_s = [r["step_s"] for r in later]
        trained = [r["trainer/tokens"] for r in later]
        completion = [r["trainer/response_len_mean"] * job["B"] * job["G"] for r in later]
        phases = {k.split("/", 1)[1]: [r.get(k, 0.0) for r in later]
                  for k in ("generator/gen_s", "reward/score_s", "trainer/train_s", "trainer/push_s")}
        extra = {"overlap_s": statistics.median(r.get("overlap_s", 0.0) for r in later),
                 "auto": [line for line in (out / "stderr").read_text().splitlines() if line.startswith("tidal: auto")
                          or line.startswith("  predicted s/step")]}
        # a rank's own subprocesses (e.g. a reward that runs code) inherit RANK: a rank is a process with
        # RANK whose parent has none (their CPU is in the total, and in the rank's once reaped)
        ranks = {pid: int(r) for pid, r in poller.rank.items()
                 if r is not None and poller.rank.get(poller.parent.get(pid)) is None}
        labels = {pid: f"rank {r} {role.get(r, '?')}" for pid, r in ranks.items()}
        labels[proc.pid] = "launcher (torchrun agent)"
        cores = len(os.sched_getaffinity(0))
        threads = {pid: max(1, cores // len(ranks)) for pid in ranks}
    cpu = poller.cpu_between(ends[0], ends[-1])
    n = len(ends) - 1
    peak = dict(poller.hwm)
    if system == "trl":
        peak[proc.pid] = max(peak.get(proc.pid, 0), usage.ru_maxrss * 1024)
    procs = [{"label": labels[pid], "threads": threads.get(pid, "-"), "cpu_step": cpu.get(pid, 0.0) / n,
              "peak_gib": peak.get(pid, 0) / 2**30} for pid in sorted(labels, key=lambda p: labels[p])]
    return {"system": system, "load": load, "s_step": statistics.median(step_s), "trained": statistics.median(trained),
            "completion": statistics.median(completion), "cpu_step": sum(cpu.values()) / n,
            "cpu_whole": usage.ru_utime + usage.ru_stime, "procs": procs,
            "phases": {k: statistics.median(v) for k, v in phases.items()}, **extra}


# ---- the tables -----------------------------------------------------------------------------------------

def med(xs):
    return statistics.median(xs)


def report(results: dict[str, list[dict]], args, job: dict, lengths: list[int]) -> None:
    from tabulate import tabulate

    trl = results["trl"][0]["trl"]
    gen_ac, train_ac = trl["autocast"].get("generation"), trl["autocast"].get("train")
    if args.bf16:
        trl_mode = (f"bf16=True: CPU bf16 autocast over fp32 weights ({trl['param_dtype']}), grads and AdamW state; "
                    f"autocast seen in generation: {gen_ac}, in training: {train_ac}")
        tidal_mode = ("trainer.precision=bf16: forward/backward on a bf16 copy of fp32 masters, AdamW on the "
                      "masters; the generator holds and runs a bf16 model")
    else:
        trl_mode = (f"fp32: bf16=False, fp16=False, weights {trl['param_dtype']}; autocast seen in generation: "
                    f"{gen_ac}, in training: {train_ac}")
        tidal_mode = "fp32: trainer.precision=fp32, model.dtype=float32 (trainer and generator)"
    systems = [s for s in SYSTEMS if s in results]
    split = next((s for s in systems if s in ("sync", "periodic")), systems[-1])
    ranks = [p for p in results[split][0]["procs"] if p["label"].startswith("rank")]
    loads = [x for runs in results.values() for r in runs for x in r["load"]]
    print(f"model {job['model']}; {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens (median "
          f"{med(lengths):.0f}) in {job['data_src']}; reward {job['reward']}")
    print(f"B={job['B']} prompts x G={job['G']} samples x <= {job['N']} new tokens, temperature {job['temperature']}, "
          f"lr {job['lr']}, beta 0, one optimizer step per batch; {args.steps} steps per run (the first left out), "
          f"{args.repeats} round(s) interleaved; {len(os.sched_getaffinity(0))} cores; load average (1 min) "
          f"{min(loads):.2f}-{max(loads):.2f}")
    print(f"TRL:   {trl_mode}; gradient_checkpointing={trl['args']['gradient_checkpointing']}, "
          f"loss_type={trl['args']['loss_type']}; one process, {trl['threads']} torch threads")
    print(f"Tidal: {tidal_mode}; trainer.activation_checkpointing=false; {len(ranks)} ranks "
          f"x {ranks[0]['threads']} torch thread(s) (cores // ranks) + the launcher")
    print("tokens/s: trained tokens per step as each side counts them (TRL: prompt + completion of every row, "
          "each prompt G times, padding left out; Tidal: packed, each prompt once per group) over s/step\n")

    tidal_procs = ", ".join(p["label"].split(" (")[0] for p in results[split][0]["procs"])
    body = []
    for i in range(args.repeats):
        for s in systems:
            r = results[s][i]
            body.append([i + 1, NAMES[s], f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}", r["s_step"], r["cpu_step"],
                         r["cpu_whole"], " + ".join(f"{p['peak_gib']:.2f}" for p in r["procs"])])
    print(tabulate(body, floatfmt=".3f", headers=["round", "", "load before -> after", "s/step", "CPU-s/step",
                                                  "CPU-s whole run", f"peak RSS GiB (Tidal: {tidal_procs})"]))
    print()

    def ratio(s, key):  # against TRL of the same round
        return med(results[s][i][key] / results["trl"][i][key] for i in range(args.repeats))

    body = []
    for s in systems:
        runs = results[s]
        s_step = med(r["s_step"] for r in runs)
        trained = med(r["trained"] for r in runs)
        body.append([NAMES[s], s_step, trained, trained / s_step, med(r["completion"] for r in runs) / s_step,
                     med(r["cpu_step"] for r in runs), ratio(s, "s_step"), ratio(s, "cpu_step")])
    print(tabulate(body, floatfmt=("", ".3f", ".0f", ".0f", ".0f", ".3f", ".2f", ".2f"), headers=[
        "", "s/step", "trained tok/step", "tokens/s", "completion tok/s", "CPU-s/step", "wall vs TRL", "CPU vs TRL"]))
    print(f"TRL's training forward also holds {med(r['padded'] for r in results['trl']):.0f} padded tokens/step "
          f"(rows x columns)\n")
    for s in systems:  # what the launch chose, for the keys each system left to it (round 1)
        for line in results[s][0].get("auto", []):
            print(f"{NAMES[s]}: {line.strip()}")
    print()

    body = []
    for s in systems:
        procs = defaultdict(list)
        for r in results[s]:
            for p in r["procs"]:
                procs[p["label"]].append(p)
        for label, ps in procs.items():
            body.append([NAMES[s], label, ps[0]["threads"], med(p["cpu_step"] for p in ps),
                         max(p["peak_gib"] for p in ps)])
    print(tabulate(body, floatfmt=".3f", headers=["", "process", "torch threads", "CPU-s/step", "peak RSS GiB"]))
    print()

    body = []
    for s in systems:
        phases = {k: med(r["phases"][k] for r in results[s]) for k in results[s][0]["phases"]}
        split = ", ".join(f"{k} {v:.3f}" for k, v in phases.items())
        if s != "trl":
            split += f", overlap_s {med(r['overlap_s'] for r in results[s]):.3f}"
        body.append([NAMES[s], med(r["s_step"] for r in results[s]), split])
    print(tabulate(body, floatfmt=".3f", headers=[
        "", "s/step", "phases, s/step (TRL: its profiling timers; Tidal: metrics.jsonl)"]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        return trl_worker(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: the embedded tiny Qwen3, saved as one)")
    p.add_argument("--data", help="JSONL of prompts (default: the embedded task's)")
    p.add_argument("--prompt-key", default="prompt", help="the data file's prompt column")
    p.add_argument("--reward", help=f"module:function, called fn(prompt, response, sample) (default: "
                   f"{EMBEDDED_REWARD}); its module must import on both sides (PYTHONPATH)")
    p.add_argument("--min-prompt-tokens", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="0: no upper bound")
    p.add_argument("--prompts", type=int, default=8, help="B: prompts per step")
    p.add_argument("--samples", type=int, default=4, help="G: samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--bf16", action="store_true", help="both sides in bf16 (see the module's docstring)")
    p.add_argument("--steps", type=int, default=10, help="steps per run; the first is left out")
    p.add_argument("--repeats", type=int, default=3, help="rounds of (TRL and the Tidal --systems)")
    p.add_argument("--systems", default="sync,periodic,colocated,default",
                   help="the Tidal runs of a round, comma-separated: sync, periodic (split placement), colocated "
                        "(co-located placement, sync schedule; one process with every core), default (no placement, "
                        "schedule or slot flags: the launch's own choice, tidal/launch/auto.py)")
    p.add_argument("--trl-threads", type=int, default=0, help="TRL's torch threads; 0: torch's default")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between polls of the processes")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    p.add_argument("--keep", type=Path, help="keep the runs here instead of a temporary directory")
    args = p.parse_args()
    tidal = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not tidal or set(tidal) - set(SYSTEMS[1:]):
        p.error(f"--systems {args.systems!r}: a comma-separated subset of {', '.join(SYSTEMS[1:])}")
    if args.steps < 2:
        p.error("--steps must be 2 or more: the first step is left out")
    if args.reward is None and args.data:
        p.error("--data needs --reward (the embedded reward reads the embedded task's answers)")
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp_dir:
        tmp = args.keep or Path(tmp_dir)
        tmp.mkdir(parents=True, exist_ok=True)
        model, data, lengths = write_job(args, tmp)
        job = {"model": model, "data": str(data), "data_src": args.data or "the embedded task",
               "reward": args.reward or EMBEDDED_REWARD, "max_prompt": max(lengths), "B": args.prompts,
               "G": args.samples, "N": args.max_new_tokens, "temperature": args.temperature, "lr": args.lr}
        results = {s: [] for s in ("trl", *tidal)}
        for i in range(args.repeats):
            for s in results:
                print(f"vs_trl: {NAMES[s]} ({i + 1}/{args.repeats})", file=sys.stderr, flush=True)
                results[s].append(run(s, args=args, job=job, out=tmp / f"{s}-{i}"))
        report(results, args, job, lengths)


if __name__ == "__main__":
    main()

"""placement, schedule and the engine's slots left to the launch: the fastest plan for this job on this
machine, from the step's discrete-event model (tidal/planner/model.py) and rates measured here.

What is chosen, where the user left it unset (or wrote `auto`; explicit settings always win):
  placement  split or colocated, whichever the model predicts faster; under torchrun the world size
             decides (the two never need the same number of ranks: co-located needs as many as the
             generator's, split more)
  schedule   sync for colocated (its only schedule); on split the faster of periodic and sync
  slots      prompt groups a generator replica decodes at once (waves), pretrained model.path only:
             the embedded task keeps its class default (its tests' samples are recorded with it)

Rates: tidal/launch/measure.py at the threads a rank gets under each placement (a CPU's cores shared by a
node's ranks, tidal/controller/devices.py), cached per machine, model and shape in ~/.cache/tidal/rates
($TIDAL_CACHE_DIR), so a second launch measures nothing. Every response is taken to run to the
token cap: the slowest step, and the one where waves cost most. Under torchrun no rank measures (the
ranks would time different things and disagree): the slots come from the cache, else the rule
tidal/recipes/defaults.py decode_slots, and the start says so. A resumed run keeps the choice its config.json
recorded (placement and schedule are not changes a resume takes).

Why a model and not a rule: on a 2-core CPU co-location was 0.61x TRL's step on a 0.5B job where
split+periodic was 1.45x, while on the embedded task split+periodic is the fastest (docs/benchmarks.md);
the rates, not the job's name, tell them apart.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from tidal.planner.model import GenRates, Rates, StepShape, TrainRates, simulate

PLACEMENTS = ("split", "colocated")
# the generator's replicas and the trainer's dp units, left to the launch together on a machine of several
# accelerators (tidal/launch/cli.py auto_keys): the ranks then fill its devices
LAYOUT_KEYS = frozenset({"generator.replicas", "trainer.dp"})
# two busy ranks on a shared CPU keep this much of their solo speed (memory bandwidth; fitted by
# --plan on this project's 2-core machine: docs/benchmarks.md); separate accelerators keep all of it
SHARED_CPU_CONCURRENCY = 0.93
# the push on split ranks: the trainer's copy out, the channel, the generator's copy in, each about a
# parameter copy (the measured copy_s); co-located it is the one local copy (tidal/channels/p2p.py)
SPLIT_PUSH_COPIES = 3
# co-located wins where one process's threads beat split ranks' overlap; for a small model the micro-steps
# overstate a second thread's gain (the embedded model's: 15-25% faster measured, no faster in the job,
# whose co-located step was 0.40 s against split+periodic's 0.28), so it must be predicted clearly faster
COLOCATED_MARGIN = 0.15
# rates measured while other processes kept more than this share of the cores busy are not cached
BUSY_SHARE = 0.2
OFF_BY = 0.25  # learn from the run: a step this far from the plan's prediction ...
OFF_FOR = 3  # ... this many steps in a row is said on the console


class Plan(NamedTuple):
    """A placement, schedule and layout the job takes, and the ranks they need."""
    placement: str
    schedule: str
    ranks: int
    replicas: int
    dp: int


@dataclass(frozen=True, kw_only=True)
class Option:
    """One plan and the model's prediction of its step."""
    placement: str
    schedule: str
    slots: int  # groups a replica decodes at once
    ranks: int
    threads: int
    step_s: float
    gen_s: float
    train_s: float
    replicas: int = 1  # the generator's replicas and the trainer's dp units
    dp: int = 1

    def label(self) -> str:
        layout = (f", {self.replicas} generator replica{'s' * (self.replicas > 1)} + trainer dp {self.dp}"
                  if (self.replicas, self.dp) != (1, 1) else "")
        return f"{self.placement} {self.schedule}{layout}, {self.slots} group{'s' * (self.slots > 1)} at once"


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What the launch chose for the keys left to it, and why (the console's and --dry-run's lines)."""
    settings: dict  # dotted key -> value, only the keys left to auto
    basis: str  # where the rates came from
    unmeasured: bool = False  # the rule decided for want of rates the launching process can measure
    chosen: Option | None = None  # None: no rates (the rule or the world size decided)
    options: tuple[Option, ...] = ()
    rates: dict = field(default_factory=dict)  # what tidal/launch/measure.py measured, for re-planning from a run
    device: str = "cpu"

    def lines(self) -> list[str]:
        keys = " ".join(f"{k}={v}" for k, v in self.settings.items())
        head = f"tidal: auto: {keys} ({self.basis})"
        if self.chosen is None:
            return [head]
        rows = ["  predicted s/step: " + "; ".join(
            f"{o.label()} {o.step_s:.3g}{' <- chosen' if o == self.chosen else ''}" for o in self.options)]
        return [head, *rows]

    def to_json(self) -> str:
        return json.dumps({"settings": self.settings, "basis": self.basis, "device": self.device,
                           "unmeasured": self.unmeasured,
                           "chosen": self.chosen and self.chosen.__dict__,
                           "options": [o.__dict__ for o in self.options], "rates": self.rates})

    @classmethod
    def from_json(cls, text: str) -> "Choice":
        d = json.loads(text)
        return cls(settings=d["settings"], basis=d["basis"], chosen=d["chosen"] and Option(**d["chosen"]),
                   options=tuple(Option(**o) for o in d["options"]), rates=d["rates"], device=d["device"],
                   unmeasured=d["unmeasured"])


# ---- the rates ------------------------------------------------------------------------------------

def cache_dir() -> Path:
    root = os.environ.get("TIDAL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidal"
    return Path(root) / "rates"


def _machine() -> dict:
    import torch

    from tidal.controller.devices import detect_device

    device = detect_device().type
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device == "cuda":
        name += " / " + torch.cuda.get_device_name(0)
    return {"device": device, "name": name, "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__}


def _model_identity(path: str | None) -> str:
    """The model's config and the size and time of its files: another model (or new weights) measures anew."""
    if path is None:
        return "embedded"
    d = Path(path)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in d.iterdir() if p.is_file())
    return json.dumps(files)


def measure_spec(cfg, *, threads: list[int]) -> dict:
    g = cfg.generator
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.trainer.precision)
    return {"model_path": cfg.model.path, "gen_dtype": str(cfg.generator_model.torch_dtype).removeprefix("torch."),
            "train_dtype": compute or str(cfg.model.torch_dtype).removeprefix("torch."),
            "samples": g.samples_per_prompt, "groups": -(-cfg.data.prompts_per_step // g.replicas),
            "response_tokens": cfg.response_tokens, "extra_forwards": int(bool(cfg.algo_config and getattr(
                cfg.algo_config, "needs_reference", False))),
            "threads": sorted(set(threads)),
            "trainer": {k: getattr(cfg.trainer, k) for k in ("shared_prompt", "token_budget", "micro_batch_size",
                                                              "logprob_chunk")},
            "data": {"path": cfg.data.path, "prompt_key": cfg.data.prompt_key,
            "chat_template": cfg.data.chat_template, "max_prompt_tokens": cfg.data.max_prompt_tokens,
            "prompts": cfg.data.prompts_per_step, "seed": cfg.seed, "embedded_prompts": cfg.data.embedded_prompts}}


def cache_key(spec: dict) -> str:
    text = json.dumps({"spec": spec, "machine": _machine(), "model": _model_identity(spec["model_path"])},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def entry_path(spec: dict, threads: int) -> Path:
    """The cache entry of one thread count's rates (a placement's ranks): any plan list that needs it shares it."""
    return cache_dir() / f"{cache_key({**spec, 'threads': [threads]})}.json"


def cached_rates(spec: dict) -> dict | None:
    """The rates at every thread count of `spec`, from their cache entries; None where one is missing."""
    out: dict = {"rates": {}, "measure_s": 0.0}
    for threads in spec["threads"]:
        try:
            entry = json.loads(entry_path(spec, threads).read_text())
        except (OSError, ValueError):
            return None
        out["prompt_len"] = entry["prompt_len"]
        out["rates"][str(threads)] = entry["rates"][str(threads)]
    return out


def measured_rates(spec: dict) -> dict:
    """The thread counts not cached yet, measured in a process of their own (tidal/launch/measure.py), then
    cached, one entry per thread count (each written whole, then renamed)."""
    missing = [t for t in spec["threads"] if not entry_path(spec, t).is_file()]
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tidal-measure-") as tmp:
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "rates.json")
        spec_path.write_text(json.dumps({**spec, "threads": missing}))
        env = {**os.environ, "TIDAL_THREADS": ""}  # the measurement sets its own threads
        proc = subprocess.run([sys.executable, "-m", "tidal.launch.measure", str(spec_path), str(out_path)],
                              cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, env=env)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise ValueError(f"auto: measuring this job's rates failed: {last} (placement, schedule.kind and the "
                             f"slots, all set, skip the measurement)")
        result = json.loads(out_path.read_text())
    if (result.get("others_share") or 0.0) > BUSY_SHARE:  # a busy machine's rates serve this launch only
        known = cached_rates({**spec, "threads": [t for t in spec["threads"] if t not in missing]})["rates"]
        return {**result, "rates": {**known, **result["rates"]}}
    for threads in missing:
        final = entry_path(spec, threads)
        tmp_final = final.with_suffix(f".tmp{os.getpid()}")
        tmp_final.write_text(json.dumps({**result, "rates": {str(threads): result["rates"][str(threads)]}}))
        tmp_final.replace(final)
    return {**cached_rates(spec), "measure_s": result["measure_s"], "others_share": result.get("others_share")}


def measured_basis(measured: dict) -> str:
    """What the choice's first line says of rates measured just now."""
    if (measured.get("others_share") or 0.0) > BUSY_SHARE:
        return (f"rates measured here in {measured['measure_s']:.0f} s, not cached: other processes kept "
                f"{measured['others_share']:.0%} of this machine's cores busy meanwhile, so the choice may be off; "
                "measure again on a quiet machine")
    return f"rates measured here in {measured['measure_s']:.0f} s, cached"


def rates_at(measured: dict, threads: int, *, placement: str, device: str) -> Rates:
    """The planner's Rates for a placement's ranks at `threads` threads each."""
    r = measured["rates"][str(threads)]
    gen = GenRates(forward_s=r["gen"]["forward_s"], row_s=r["gen"]["row_s"], prefill_token_s=r["gen"]["prefill_token_s"])
    t = r["train"]
    copies = 1 if placement == "colocated" else SPLIT_PUSH_COPIES
    train = TrainRates(group_s=t["group_s"], token_s=t["token_s"], barrier_s=t["barrier_s"], push_s=copies * t["copy_s"])
    # co-located on an accelerator the optimizer's two moments go to the host and back each step
    swap = 4 * t["copy_s"] if placement == "colocated" and device != "cpu" else 0.0
    concurrency = SHARED_CPU_CONCURRENCY if device == "cpu" and placement == "split" else 1.0
    return Rates(gen=gen, train=train, concurrency=concurrency, swap_s=swap)


# ---- the choice -----------------------------------------------------------------------------------

def step_shape(cfg, *, prompt_len: int, slots: int, length: int | None = None) -> StepShape:
    """The step as configured, every response at the token cap (or `length`)."""
    B, G, L = cfg.data.prompts_per_step, cfg.generator.samples_per_prompt, length or cfg.response_tokens
    return StepShape(prompt_lens=(prompt_len,) * B, lengths=((L,) * G,) * B, max_batch_prompts=slots,
                     admission=cfg.generator.admission, replicas=cfg.generator.replicas, dp=cfg.trainer.dp,
                     shared_prompt=cfg.trainer.shared_prompt != "off")


def slot_values(cfg) -> list[int]:
    per_replica = -(-cfg.data.prompts_per_step // cfg.generator.replicas)
    return sorted({1 << k for k in range(per_replica.bit_length()) if 1 << k <= per_replica} | {per_replica})


def predict(cfg, rates: Rates, *, placement: str, schedule: str, slots: int, prompt_len: int, ranks: int,
            threads: int, length: int | None = None) -> Option:
    """cfg: the job at the plan's layout (with_layout)."""
    p = simulate(step_shape(cfg, prompt_len=prompt_len, slots=slots, length=length), rates, schedule=schedule)
    return Option(placement=placement, schedule=schedule, slots=slots, ranks=ranks, threads=threads,
                  replicas=cfg.generator.replicas, dp=cfg.trainer.dp,
                  step_s=p.step_s + rates.swap_s, gen_s=p.gen_s, train_s=p.train_end_s - p.first_train_s)


def options(cfg, measured: dict, plans: list[Plan], *, slots_free: bool, device: str, threads_of) -> list[Option]:
    """Every plan at every slot value its layout takes (or the slots as configured), predicted."""
    from tidal.executors.generator.engines import ENGINES

    current = ENGINES.get(cfg.generator.engine).slots(cfg.generator.model_dump())
    out = []
    for plan in plans:
        at = with_layout(cfg, replicas=plan.replicas, dp=plan.dp)
        threads = threads_of(plan.ranks)
        rates = rates_at(measured, threads, placement=plan.placement, device=device)
        for n in slot_values(at) if slots_free else [current]:
            out.append(predict(at, rates, placement=plan.placement, schedule=plan.schedule, slots=n,
                               prompt_len=measured["prompt_len"], ranks=plan.ranks, threads=threads))
    return out


def best(found: list[Option]) -> Option:
    """The fastest; co-located only where it beats every split plan by COLOCATED_MARGIN; within 1% the
    one with fewer waves, then the split placement, so a tie does not flip with noise in the rates."""
    split = [o.step_s for o in found if o.placement == "split"]
    if split:
        found = [o for o in found if o.placement == "split" or o.step_s < (1 - COLOCATED_MARGIN) * min(split)]
    fastest = min(o.step_s for o in found)
    close = [o for o in found if o.step_s <= fastest * 1.01]
    return min(close, key=lambda o: (-o.slots, o.placement != "split", o.step_s))


def threads_for(ranks: int) -> int:
    """The threads each of `ranks` ranks on this machine gets (tidal/controller/devices.py pin_threads)."""
    if os.environ.get("TIDAL_THREADS"):
        return int(os.environ["TIDAL_THREADS"])
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def with_layout(cfg, *, replicas: int, dp: int):
    """The job with `replicas` generator replicas and `dp` trainer units."""
    if (replicas, dp) == (cfg.generator.replicas, cfg.trainer.dp):
        return cfg
    return cfg.model_copy(update={"generator": cfg.generator.model_copy(update={"replicas": replicas}),
                                  "trainer": cfg.trainer.model_copy(update={"dp": dp})})


def layouts_of(cfg, *, free: set[str], devices: int | None) -> list[tuple[int, int]]:
    """(replicas, dp) of every layout to weigh: as configured, or where both are left to the launch on
    `devices` accelerators, every pair up to the step's prompt groups (more would idle) that a plan may fit."""
    if not devices or not LAYOUT_KEYS <= free:
        return [(cfg.generator.replicas, cfg.trainer.dp)]
    most = min(devices, cfg.data.prompts_per_step)
    return [(r, d) for r in range(1, most + 1) for d in range(1, most + 1)]


def plans_of(cfg, *, free: set[str], build, world_size: int | None, devices: int | None = None) -> list[Plan]:
    """Every plan the job takes (and the world size, or the accelerators of a free layout, fits).
    build(placement, schedule, replicas, dp) -> its ranks (ValueError: the job does not take it)."""
    fill = world_size or (devices if LAYOUT_KEYS <= free else None)
    plans = []
    for placement in PLACEMENTS if "placement" in free else (cfg.placement,):
        schedules = (("sync",) if placement == "colocated" else ("periodic", "sync")) \
            if "schedule.kind" in free else (cfg.schedule.kind,)
        for schedule in schedules:
            for replicas, dp in layouts_of(cfg, free=free, devices=devices):
                try:
                    ranks = build(placement, schedule, replicas, dp)
                except ValueError:  # this job does not take the plan (its build's own error says why)
                    continue
                if fill is None or ranks == fill:
                    plans.append(Plan(placement, schedule, ranks, replicas, dp))
    return plans


def settings_of(cfg, *, free: set[str], slots_key: str | None, placement: str, schedule: str,
                slots: int | None, replicas: int = 1, dp: int = 1) -> dict:
    """The values of the free keys that give this plan (the slots as the engine sets them)."""
    from tidal.executors.generator.engines import ENGINES

    out = {"placement": placement, "schedule.kind": schedule, "generator.replicas": replicas, "trainer.dp": dp}
    if slots is not None and slots_key:
        out[slots_key] = ENGINES.get(cfg.generator.engine).slots_setting(slots, samples=cfg.generator.samples_per_prompt)[1]
    return {k: v for k, v in out.items() if k in free}


def rule_choice(cfg, plans: list[Plan], *, settings, slots_free: bool, device: str, basis: str) -> Choice:
    """No rates: split before co-located, periodic before sync, a free layout's devices shared most evenly
    (the generator's side the larger), the slots by tidal/recipes/defaults.py decode_slots."""
    from tidal.recipes.defaults import decode_slots

    plan = min(plans, key=lambda p: (p.placement != "split", p.schedule != "periodic", abs(p.replicas - p.dp),
                                     p.dp > p.replicas))
    slots = decode_slots(prompts=cfg.data.prompts_per_step, samples=cfg.generator.samples_per_prompt,
                         replicas=plan.replicas, device_type=device,
                         overlaps=plan.schedule != "sync" and plan.placement != "colocated")
    return Choice(settings=settings(placement=plan.placement, schedule=plan.schedule,
                                    slots=slots if slots_free else None, replicas=plan.replicas, dp=plan.dp),
                  basis=basis)


def model_choice(cfg, measured: dict, plans: list[Plan], *, settings, slots_free: bool, device: str,
                 basis: str, threads_of=threads_for) -> Choice:
    """Every plan at every slot value (or the slots as configured), predicted; the best chosen."""
    found = options(cfg, measured, plans, slots_free=slots_free, device=device, threads_of=threads_of)
    chosen = best(found)
    per_plan = {}
    for o in sorted(found, key=lambda o: o.step_s):
        per_plan.setdefault((o.placement, o.schedule), o)
    shown = tuple(sorted({chosen, *per_plan.values()}, key=lambda o: o.step_s))
    return Choice(settings=settings(placement=chosen.placement, schedule=chosen.schedule,
                                    slots=chosen.slots if slots_free else None, replicas=chosen.replicas, dp=chosen.dp),
                  basis=basis, chosen=chosen, options=shown, rates=measured, device=device)


def choose(cfg, *, free: set[str], slots_key: str | None, build, world_size: int | None,
           recorded: dict | None = None, rates: str = "rule", devices: int | None = None,
           say=lambda line: None) -> Choice | None:
    """The values of the `free` keys (of "placement", "schedule.kind", slots_key, LAYOUT_KEYS). cfg: the job
    with the classes' values in the free keys; build(placement, schedule, replicas, dp) -> the ranks that plan
    needs (ValueError: the job does not take it); world_size: under torchrun, the ranks there are; devices: the
    accelerators a free layout fills; recorded: a resumed run's config.json (flattened), whose values it keeps.
    rates: "measure" (the launching process: measured unless cached), "cached" (a rank: the cache or the
    rule), "rule" (a library call: the classes' placement and schedule, decode_slots)."""
    if not free:
        return None
    if recorded is not None:
        return Choice(settings={k: recorded[k] for k in sorted(free) if k in recorded},
                      basis="as the resumed run chose")
    plans = plans_of(cfg, free=free, build=build, world_size=world_size, devices=devices)
    if not plans and (world_size is not None or rates == "measure"):
        return None  # the build says why (e.g. a world size no placement fits: tidal/launch/cli.py check_world)
    if not plans:  # a library call on a config no plan builds (e.g. vLLM not installed): the rule's values
        schedule = "sync" if cfg.placement == "colocated" and "schedule.kind" in free else cfg.schedule.kind
        plans, rates = [Plan(cfg.placement, schedule, 1, cfg.generator.replicas, cfg.trainer.dp)], "rule"
    from tidal.controller.devices import detect_device

    settings = functools.partial(settings_of, cfg, free=free, slots_key=slots_key)
    slots_free = slots_key in free
    if len(plans) == 1 and not slots_free:
        plan = plans[0]
        return Choice(settings=settings(placement=plan.placement, schedule=plan.schedule, slots=None,
                                        replicas=plan.replicas, dp=plan.dp),
                      basis=f"world size {world_size}" if world_size else "the only plan this job takes")
    device = detect_device().type
    # a free layout's ranks each drive an accelerator: its rates are the device's, at one thread count
    threads_of = (lambda _: threads_for(devices)) if devices and LAYOUT_KEYS <= free else threads_for
    spec = measure_spec(cfg, threads=[threads_of(p.ranks) for p in plans])
    measured = cached_rates(spec) if rates != "rule" else None
    if measured is None and rates != "measure":  # a rank resolves the config alone: none may time anything
        where = f"world size {world_size}; " if world_size else ""
        return replace(rule_choice(cfg, plans, settings=settings, slots_free=slots_free, device=device,
                                   basis=f"{where}no rates measured for this job on this machine, so the rule "
                                         f"(`python launch.py ... --dry-run` measures them once)"),
                       unmeasured=world_size is None)
    basis = f"rates measured on this machine before, cached in {cache_dir()}"
    if measured is None:
        say("tidal: auto: measuring this job's decode and train micro-steps on this machine (once: cached in "
            f"{cache_dir()}) to choose what placement, schedule and slots leave to it ...")
        measured = measured_rates(spec)
        basis = measured_basis(measured)
    return model_choice(cfg, measured, plans, settings=settings, slots_free=slots_free, device=device, basis=basis,
                        threads_of=threads_of)

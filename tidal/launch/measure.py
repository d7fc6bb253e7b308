"""A few decode and train micro-steps of the job's model at its shape: the rates the launch's choice
of placement, schedule and slots is made from (tidal/launch/auto.py). Seconds, not a run.

Run in a process of its own (`python -m tidal.launch.measure SPEC_JSON OUT_JSON`), so the launcher's
threads and memory are left as they were and an accelerator is free again when it ends. For each
thread count asked (the threads a rank would have under each placement, tidal/controller/devices.py
pin_threads):

  decode    the native engine itself (tidal/executors/generator/native_engine.py), k groups of G samples
            that never sample EOS, over prompts as long as the step's mean context (prompt + half the
            response, at most DECODE_CONTEXT: attention's cost there is folded into the per-row rate). A call of
            2 + D new tokens less one of 2 is D decode forwards, so prefill and set-up cancel out;
            k = 1 and k = K groups give the forward's fixed part and its part per row.
  prefill   the call of 2 tokens less its 2 decode forwards, per prompt token
  train     a group of G responses to a prompt of at most TRAIN_PROMPT tokens, packed as the trainer
            packs it, its forward (the chunked LM head, the entropy) and backward, at two response
            lengths for a fixed part and a per-token part; a forward without grad for the reference where the objective has one
  barrier   the trainer's optimizer step (tidal/modeling/optim.py Optimizer.apply: the gradients normalised,
            their norm clipped, the fused AdamW step, the gradients freed), timed over a part of the
            parameters and scaled by their count: each pass streams every element once, so its time is
            linear in them, and a 0.5B model's whole AdamW state took 14 s to allocate and step here
  copy      parameters copied into a buffer (the push's local part), the same part, scaled the same way

Other processes on the same cores slow every figure (a test job running beside the Qwen job's
measurement made a co-located decode forward 3.5x slower and picked a plan 2x slower than co-location):
the share of this process's cores others kept busy meanwhile (/proc/stat, less this process's own CPU
time) comes back with the rates, and tidal/launch/auto.py caches none measured on a busy machine.

Each figure is timed after a warm-up call of the same kind (the first allocates and picks kernels; at the
second thread count and after, the process is warm and none is made): one
call where it takes REPEAT_S or more (a 0.5B model's micro-steps take seconds on a CPU, and the
choice needs ratios between candidates, not a benchmark's repeats), else the median of up to REPEATS
(the embedded model's calls take milliseconds, and a single one measured at a process's start ran 2x
slow: it once made co-location look 17% faster on the embedded job, which then ran 0.44 s a step
against split + periodic's 0.28).
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPEAT_S, REPEATS = 0.2, 7
DECODE_EXTRA = 8  # the D decode forwards a longer call adds
# a group's responses at two lengths (capped at the job's): far apart, as the per-token part is their difference
# (a 0.5B model's group at 4 and 24 tokens differed by ~1 s at 2 threads, less than this machine's noise)
TRAIN_RESPONSES = (4, 48)
# the measured rows' prompt and the decode calls' context, at most: their cost per token is what is fitted
# (a longer context's attention is a small part of a token's cost at these lengths), and shorter calls
# keep the measurement to seconds
TRAIN_PROMPT, DECODE_CONTEXT = 64, 128
# the elements the barrier's and the copy's part holds, at most (128 MB of float32: far past any cache, so the
# time per element is memory's, as the whole model's is)
STATE_PART = 32 << 20


def _timed(fn, *, setup=lambda: None) -> float:
    """The median of as many calls as fit in REPEAT_S (at most REPEATS): one for a 0.5B model's
    micro-steps, several for a small model's milliseconds, whose first calls in a process run slow.
    setup: run before each call, not timed."""
    times, start = [], time.perf_counter()
    while not times or (time.perf_counter() - start < REPEAT_S and len(times) < REPEATS):
        setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _line(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Intercept and slope (both >= 0) through two (x, y) points."""
    slope = max(0.0, (b[1] - a[1]) / (b[0] - a[0])) if b[0] != a[0] else 0.0
    return max(0.0, a[1] - slope * a[0]), slope


def part_of(params: list, *, most: int = STATE_PART) -> list:
    """Parameters (in order, skipping any that would overflow it) holding at most `most` elements; the smallest
    one where none fits."""
    part, held = [], 0
    for p in params:
        if held + p.numel() <= most:
            part.append(p)
            held += p.numel()
    return part or [min(params, key=lambda p: p.numel())]


def _barrier(part: list) -> float:
    """The trainer's step at the barrier over `part` (their gradients the groups'), each call given them anew."""
    import torch

    from tidal.modeling.optim import GradLayout, Optimizer
    from tidal.modeling.optim_config import OptimConfig

    # a parameter no token reached (an MoE expert the micro-steps did not route to) steps on a zero gradient
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in part]
    optim = Optimizer(torch.nn.ParameterList(part), cfg=OptimConfig(lr=1e-9), total_steps=1, passes=("score",),
                      layout=GradLayout())

    def given() -> None:
        for p, g in zip(part, grads):
            p.grad = g.clone()

    given()
    optim.apply([p.grad for p in part], denom=1.0)  # the first makes AdamW's state
    return _timed(lambda: optim.apply([p.grad for p in part], denom=1.0), setup=given)


def decode_rates(model, *, eos: int, pad: int, samples: int, groups: int, context: int, warm: bool = False) -> dict:
    import torch

    from tidal.executors.generator.contract import PromptRequest, SamplingParams
    from tidal.executors.generator.native_engine import NativeEngine

    engine = NativeEngine(model, eos_token_id=eos, pad_token_id=pad, max_batch_prompts=groups, graphs=False)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, min(vocab, eos) - 1, (context,), generator=gen) for _ in range(groups)]

    def call(k: int, tokens: int) -> float:
        requests = [PromptRequest(index=i, prompt_ids=prompts[i]) for i in range(k)]
        params = SamplingParams(n=samples, max_new_tokens=tokens, seed=0, temperature=1.0)
        return _timed(lambda: list(engine.generate(requests, params, step=0)))

    if not warm:
        call(1, 2)
    points = {}
    for k in sorted({1, groups}, reverse=True):
        short, long = call(k, 2), call(k, 2 + DECODE_EXTRA)
        per_forward = max(0.0, (long - short) / DECODE_EXTRA)
        points[k] = (per_forward, max(0.0, short - 2 * per_forward))
    one, many = points[1], points[groups]
    forward_s, row_s = _line((samples, one[0]), (groups * samples, many[0]))
    prefill_token_s = max(0.0, many[1] - forward_s) / (groups * context)
    return {"forward_s": forward_s, "row_s": row_s, "prefill_token_s": prefill_token_s}


def train_rates(model, *, prompt_len: int, samples: int, response: int, extra_forwards: int, trainer: dict,
                warm: bool = False) -> dict:
    """A group's micro-steps as the trainer runs them (tidal/modeling/packing.py: packed rows under the token
    budget, the chunked LM head with the entropy), at two response lengths: the fixed part per group
    and the part per token; the barrier's step and the push's copy per parameter, from a part of them."""
    import torch

    from tidal.modeling.packing import make_micro_batches

    vocab = model.config.vocab_size
    model.train()
    gen = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    prompt_len = min(prompt_len, TRAIN_PROMPT)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)

    def group(length: int) -> None:
        responses = [torch.randint(0, vocab, (length,), generator=gen) for _ in range(samples)]
        for mb in make_micro_batches(prompt, responses, mode=trainer["shared_prompt"], token_budget=trainer["token_budget"],
                                     micro_batch_size=trainer["micro_batch_size"], pad_id=0, device=device):
            for _ in range(extra_forwards):
                with torch.no_grad():
                    mb.forward(model, temperature=1.0, chunk=trainer["logprob_chunk"])
            mb.forward(model, temperature=1.0, chunk=trainer["logprob_chunk"], entropy=True).logp_NT.sum().backward()

    lengths = sorted({min(n, response) for n in TRAIN_RESPONSES})
    if not warm:
        group(lengths[0])  # its first allocations (the gradients) are the slow ones; the smaller costs least
    measured = [(prompt_len + samples * n, _timed(lambda n=n: group(n))) for n in lengths]
    group_s, token_s = _line(measured[0], measured[-1]) if len(measured) > 1 else (0.0, measured[0][1] / measured[0][0])
    params = list(model.parameters())
    part = part_of(params)
    scale = sum(p.numel() for p in params) / sum(p.numel() for p in part)
    barrier_s = scale * _barrier(part)
    into = [torch.empty_like(p) for p in part]

    def copy() -> None:
        for dst, src in zip(into, part):
            dst.copy_(src.detach())

    copy()  # the pages of the copies' destination
    copy_s = scale * _timed(copy)
    model.zero_grad(set_to_none=False)  # kept: a later thread count's backward finds them allocated, as warm as now
    return {"group_s": group_s, "token_s": token_s, "barrier_s": barrier_s, "copy_s": copy_s}


def prompt_length(tok, data: dict) -> int:
    """The mean token length of the first step's prompts, as the generator tokenizes them (the
    single-turn form; a multi-turn prompt's tools add to it)."""
    from tidal.executors.data import Columns, PromptRow, PromptSet, load_prompts
    from tidal.modeling.tiny.task import embedded_prompts

    if data["path"]:
        rows = load_prompts(data["path"], Columns(prompt=data["prompt_key"]))
    else:
        rows = [PromptRow(prompt=r["prompt"], extras={}) for r in embedded_prompts(64, seed=data["seed"])]
    prompts = PromptSet(rows[:4096], tokenizer=tok, max_prompt_tokens=data["max_prompt_tokens"],
                        apply_chat_template=data["chat_template"])
    step = prompts.prompts(0, range(data["prompts"]), batch_size=data["prompts"], seed=data["seed"], max_topups=0)
    return max(1, round(sum(len(ids) for _, _, ids in step) / len(step)))


def measure(spec: dict) -> dict:
    """spec: model_path (None: the embedded model), gen_dtype, train_dtype, samples, groups,
    response_tokens, extra_forwards, threads (a list), data (the data section's path, prompt_key,
    chat_template, max_prompt_tokens, prompts, seed). -> {prompt_len, rates: {threads: {gen, train}}}."""
    import torch

    from tidal.controller.devices import detect_device
    from tidal.modeling.hf import load_model, load_tokenizer

    device = torch.device(detect_device().type)
    tok = load_tokenizer(spec["model_path"])
    prompt_len = prompt_length(tok, spec["data"])
    context = min(DECODE_CONTEXT, prompt_len + spec["response_tokens"] // 2)
    gen_model = load_model(spec["model_path"], dtype=getattr(torch, spec["gen_dtype"])).to(device)
    # the trainer's model apart from the engine's, as in a job: the engine adapts the model it is given (a
    # bf16 model's head gets an fp32 weight made in inference mode, which no backward may use). A copy,
    # not a second load, where both sides compute in one dtype: loading a 0.5B model again costs seconds
    train_model = copy.deepcopy(gen_model) if spec["train_dtype"] == spec["gen_dtype"] else \
        load_model(spec["model_path"], dtype=getattr(torch, spec["train_dtype"])).to(device)
    never = gen_model.config.vocab_size + 1  # an EOS no sample draws: every call writes all its tokens
    out = {}
    for i, threads in enumerate(spec["threads"]):
        torch.set_num_threads(threads)
        out[str(threads)] = {
            "gen": decode_rates(gen_model, eos=never, pad=tok.pad_token_id or 0, samples=spec["samples"],
                                groups=spec["groups"], context=context, warm=i > 0),
            "train": train_rates(train_model, prompt_len=prompt_len, samples=spec["samples"],
                                 response=spec["response_tokens"], extra_forwards=spec["extra_forwards"],
                                 trainer=spec["trainer"], warm=i > 0),
        }
    return {"prompt_len": prompt_len, "rates": out}


def cores_busy() -> float | None:
    """CPU-seconds this process's cores have been busy since boot (every process, steal included: what
    another VM took from them too), from /proc/stat; None where it cannot be read (not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    busy = 0
    for line in lines:
        name, *ticks = line.split()
        if name in mine:  # user nice system idle iowait irq softirq steal ...: all but idle and iowait
            busy += sum(int(t) for t in ticks[:8]) - int(ticks[3]) - int(ticks[4])
    return busy / os.sysconf("SC_CLK_TCK")


def others_share(fn):
    """fn() and the share of this process's cores that other processes kept busy while it ran (None: unknown)."""
    before, own, t0 = cores_busy(), os.times(), time.perf_counter()
    result = fn()
    after, own_after, wall = cores_busy(), os.times(), time.perf_counter() - t0
    if before is None or after is None:
        return result, None
    mine = own_after.user + own_after.system - own.user - own.system
    return result, max(0.0, after - before - mine) / (wall * len(os.sched_getaffinity(0)))


def main(argv: list[str]) -> int:
    spec_path, out_path = map(Path, argv)
    t0 = time.perf_counter()
    result, others = others_share(lambda: measure(json.loads(spec_path.read_text())))
    out_path.write_text(json.dumps({**result, "measure_s": time.perf_counter() - t0, "others_share": others}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

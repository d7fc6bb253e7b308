"""A discrete-event model of one step: when each group leaves the generator, when the trainer takes
it, and when the step ends, under the sync and the periodic schedule (docs/architecture.md "The step").

    generator replica  replays the native engine's admission (chunked or continuous) over the
                       step's response lengths: each decode forward costs forward_s + row_s * rows
                       + row_col_s * rows * cache columns, each admission a prefill
    reward             a FIFO server: reward_group_s per group, then handoff_s on the way
    trainer dp unit    a FIFO server over the groups routed to it (index % dp):
                       group_s + sample_s * G + token_s * tokens per group; periodic takes them as they arrive,
                       sync only once the whole batch is in, in index order
    barrier            optimizer step + push, after the last unit

Time is solo seconds stretched by the hardware: while two or more generator replicas and trainer
units are busy at once, each runs at `concurrency` of its solo speed (1.0 on separate devices;
measured on a shared CPU). That is the only coupling between executors besides the queues.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field, fields

from tidal.executors.generator.engines import ADMISSIONS, DEFAULT_ADMISSION



@dataclass(frozen=True, kw_only=True)
class GenRates:
    """One generator replica's costs, in seconds."""
    forward_s: float = 0.0  # a forward (a decode step, or an admission's prefill), fixed part
    row_s: float = 0.0  # per sample row in a decode forward
    row_col_s: float = 0.0  # per row and cache column (attention over the context so far)
    prefill_token_s: float = 0.0  # per token of the padded prompt matrix of an admission
    send_s: float = 0.0  # per group handed to the channel
    join_cell_s: float = 0.0  # per KV cell (slot x position) a prompt's prefill copies into its other samples' slots
    # per token a resumed group prefills again (partial rollouts: each sample's prompt and tokens so far); 0:
    # prefill_token_s where given, else a decode row's, row_s (calibration resumes nothing and cannot fit a prompt
    # token's cost: where a forward's cost follows its tokens, as on a CPU, a token costs what a decode row does)
    resume_token_s: float = 0.0

    def cost(self, f: "GenFeatures") -> float:
        resume = self.resume_token_s or self.prefill_token_s or self.row_s
        return (self.forward_s * f.forwards + self.row_s * f.rows + self.row_col_s * f.row_cols
                + self.prefill_token_s * f.prefill_tokens + self.send_s * f.sends + self.join_cell_s * f.join_cells
                + resume * f.resumed_tokens)


@dataclass(frozen=True, kw_only=True)
class TrainRates:
    """One trainer dp unit's costs, in seconds."""
    group_s: float = 0.0  # per group (its micro-steps' fixed part)
    sample_s: float = 0.0  # per response in the group
    token_s: float = 0.0  # per trained token
    barrier_s: float = 0.0  # the end of the batch: optimizer step, records
    push_s: float = 0.0  # weights to the generator

    def cost(self, tokens: int, samples: int) -> float:
        return self.group_s + self.sample_s * samples + self.token_s * tokens


@dataclass(frozen=True, kw_only=True)
class Rates:
    gen: GenRates
    train: TrainRates
    reward_group_s: float = 0.0
    handoff_s: float = 0.0  # a scored group's way to the trainer (channel latency, a pure delay)
    concurrency: float = 1.0  # fraction of solo speed each of several busy executors keeps
    # placement=colocated: the memory moves of one step (the engine's release and wake, the optimizer
    # state out and back: the timeline's offload and onload spans)
    swap_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """One step's work and layout. lengths[i]: prompt i's G response lengths."""
    prompt_lens: tuple[int, ...]
    lengths: tuple[tuple[int, ...], ...]
    max_batch_prompts: int
    admission: str = DEFAULT_ADMISSION
    replicas: int = 1
    dp: int = 1
    shared_prompt: bool = True  # the trainer trains a group's prompt once (else once per sample)

    def __post_init__(self):
        if len(self.prompt_lens) != len(self.lengths) or not self.lengths:
            raise ValueError("prompt_lens and lengths need one entry per prompt, at least one")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if min(self.max_batch_prompts, self.replicas, self.dp) < 1:
            raise ValueError("max_batch_prompts, replicas and dp must be >= 1")

    def group_tokens(self, i: int) -> int:
        prompt = self.prompt_lens[i] * (1 if self.shared_prompt else len(self.lengths[i]))
        return prompt + sum(self.lengths[i])

    @property
    def tokens(self) -> int:
        return sum(self.group_tokens(i) for i in range(len(self.lengths)))

    def replay(self, indices) -> list[tuple[int, "GenFeatures"]]:
        """replay_engine over the prompts `indices` (one replica's, in its order)."""
        prompts = [(i, self.prompt_lens[i], len(self.lengths[i]), max(self.lengths[i])) for i in indices]
        return replay_engine(prompts, max_batch_prompts=self.max_batch_prompts, admission=self.admission)

    # what `simulate` asks of a step (tidal/planner/partial.py's steps answer the same)
    def replica_work(self, r: int) -> list[tuple[int, "GenFeatures"]]:
        """Replica r's groups (prompts r, r + replicas, ... in index order) as they leave it, with their work."""
        return self.replay(range(r, len(self.lengths), self.replicas))

    @property
    def trained(self) -> tuple[int, ...]:
        """The groups the step trains: all of them."""
        return tuple(range(len(self.lengths)))

    def train_work(self, i: int) -> tuple[int, int]:
        """(tokens, samples) the trainer trains of group i."""
        return self.group_tokens(i), len(self.lengths[i])


@dataclass(frozen=True)
class GenFeatures:
    """What a generator replica did up to a point: the terms GenRates prices."""
    forwards: int = 0
    rows: int = 0
    row_cols: int = 0
    prefill_tokens: int = 0
    sends: int = 0
    join_cells: int = 0
    resumed_tokens: int = 0  # prompt and tokens so far that resumed groups prefill (partial rollouts)

    def __add__(self, o: "GenFeatures") -> "GenFeatures":
        return GenFeatures(*(getattr(self, f.name) + getattr(o, f.name) for f in fields(self)))


def replay_engine(prompts: list[tuple], *, max_batch_prompts: int, admission: str) -> list[tuple[int, GenFeatures]]:
    """The native engine's schedule (tidal/executors/generator/native_engine.py `_stream`) over prompts
    (index, prompt length, G, the group's longest response): (index, the work done since the
    previous group left) in leaving order. A group leaves at the decode call that writes its longest
    sample's last token; the forward of that call runs only for the rows still live.
    A prompt may carry two more entries (partial rollouts, tidal/planner/partial.py): the tokens its samples
    wrote in earlier calls (a resumed group: each row prefills its prompt and them, no join; the length is
    then the tokens this call writes) and whether it ends in this call (a cut group leaves unsent)."""
    waiting, live, out = collections.deque(prompts), [], []  # live: [index, P + tokens before, G, L, t, sends]
    pending = GenFeatures()
    while waiting or live:
        free = max_batch_prompts - len(live)
        if waiting and free and (admission == "continuous" or not live):
            new = [(*p, 0, True)[:6] for p in (waiting.popleft() for _ in range(min(free, len(waiting))))]
            fresh = [(p, g) for _, p, g, _, before, _ in new if not before]
            resumed = [g * (p + before) for _, p, g, _, before, _ in new if before]
            if fresh:  # a newcomer's prompt is prefilled once and its KV copied into its other samples' slots
                pending += GenFeatures(forwards=1, prefill_tokens=len(fresh) * max(p for p, _ in fresh),
                                       join_cells=sum((g - 1) * p for p, g in fresh))
            if resumed:  # a resumed group's samples each prefill their prompt and tokens so far (a forward of their own)
                pending += GenFeatures(forwards=1, resumed_tokens=sum(resumed))
            live += [[i, p + before, g, length, 0, sends] for i, p, g, length, before, sends in new]
        for group in live:
            group[4] += 1
        done = [g for g in live if g[4] >= g[3]]
        live = [g for g in live if g[4] < g[3]]
        for g in done:
            out.append((g[0], pending + GenFeatures(sends=int(g[5]))))
            pending = GenFeatures()
        if live:  # the next token's forward, over the rows still decoding
            rows = sum(g[2] for g in live)
            cols = max(g[1] + g[4] for g in live)
            pending += GenFeatures(forwards=1, rows=rows, row_cols=rows * cols)
    return out


@dataclass(eq=False)
class _Server:
    """A FIFO server: items (name, solo work) are served one at a time, in arrival order."""
    counts: bool  # competes for the hardware (generator replicas, trainer units)
    queue: collections.deque = field(default_factory=collections.deque)
    current: tuple | None = None
    left: float = 0.0

    def start(self) -> None:
        if self.current is None and self.queue:
            self.current = self.queue.popleft()
            self.left = self.current[1]


def _advance(busy: list[_Server], *, dt: float, speed: dict, t: float) -> list[tuple[_Server, object]]:
    """Let the busy servers work for dt; -> (server, item name) of the items they finished (at t)."""
    for s in busy:
        s.left -= dt * speed[id(s)]
    done = [(s, s.current[0]) for s in busy if s.left <= 1e-12 * max(1.0, t)]
    for s, _ in done:
        s.current = None
    return done


@dataclass(frozen=True)
class Prediction:
    step_s: float  # generation start to the end of the push
    gen_s: float  # the last group leaves the generator
    train_end_s: float  # the last unit finishes its groups
    first_train_s: float  # the trainer takes its first group
    tokens: int

    @property
    def overlap_s(self) -> float:
        return max(0.0, self.gen_s - self.first_train_s)


def simulate(shape: StepShape, rates: Rates, *, schedule: str) -> Prediction:
    """One step under `schedule` (sync | periodic)."""
    if schedule not in ("sync", "periodic"):
        raise ValueError(f"schedule must be sync or periodic, got {schedule!r}")
    trained = set(shape.trained)  # with partial rollouts a cut group leaves the generator for the next step
    gens = [_Server(counts=True) for _ in range(shape.replicas)]
    for r, server in enumerate(gens):  # replica r samples prompts r, r + replicas, ... in index order
        server.queue.extend((index, rates.gen.cost(work)) for index, work in shape.replica_work(r))
    reward = _Server(counts=False)
    units = [_Server(counts=True) for _ in range(shape.dp)]
    held: list[int] = []  # groups handed to the trainer's side (sync: waiting for the whole batch)
    in_flight: list[tuple[float, int]] = []  # (arrival time, index): scored, on the way to the trainer
    t, gen_end, first_train = 0.0, 0.0, None
    servers = gens + [reward] + units
    while True:
        for s in servers:
            s.start()
        busy = [s for s in servers if s.current is not None]
        if not busy and not in_flight:
            break
        crowded = sum(s.counts for s in busy) > 1
        speed = {id(s): rates.concurrency if crowded and s.counts else 1.0 for s in busy}
        dt = min([s.left / speed[id(s)] for s in busy] + [due - t for due, _ in in_flight])
        t += dt
        held += [index for due, index in in_flight if due <= t + 1e-12]
        in_flight = [(due, index) for due, index in in_flight if due > t + 1e-12]
        for s, index in _advance(busy, dt=dt, speed=speed, t=t):
            if s is reward:
                in_flight.append((t + rates.handoff_s, index))
            elif s in gens:  # by identity (eq=False)
                gen_end = max(gen_end, t)
                if index in trained:
                    reward.queue.append((index, rates.reward_group_s))
        release = held if schedule == "periodic" else (sorted(held) if len(held) == len(trained) else [])
        for index in release:
            units[index % shape.dp].queue.append((index, rates.train.cost(*shape.train_work(index))))
        if release:
            held = []
        if first_train is None and any(u.queue or u.current for u in units):
            first_train = t
    train_end = t
    return Prediction(step_s=train_end + rates.train.barrier_s + rates.train.push_s, gen_s=gen_end,
                      train_end_s=train_end, first_train_s=first_train if first_train is not None else t,
                      tokens=sum(shape.train_work(i)[0] for i in trained))


def simulate_offpolicy(shapes: list[StepShape], rates: Rates, *, max_lag: int) -> list[float]:
    """Consecutive steps under the offpolicy schedule (tidal/controller/schedules.py): the generator takes
    step s's prompts once it is done with step s-1, holds the push of barrier s-1-max_lag, and its
    step s-1's sends are received (the reward takes them only once the trainer has taken every group
    of step s-2: each channel's step ends when its consumer has all of it); the trainer takes step
    s's groups (as they arrive, as periodic does) after barrier s-1. -> the time
    from one barrier's end to the next, per step (the first: from the start). max_lag=0 is a run of
    periodic steps."""
    sim = _Offpolicy(shapes, rates, max_lag=max_lag)
    while sim.advance():
        pass
    assert len(sim.barrier_end) == len(shapes), "every step reaches its barrier"
    ends = [sim.barrier_end[s] for s in range(len(shapes))]
    return [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]


class _Offpolicy:
    """simulate_offpolicy's servers (the generator replicas, the reward, the trainer's units), the
    gates between steps, and the clock; advance() runs to the next event."""

    def __init__(self, shapes: list[StepShape], rates: Rates, *, max_lag: int):
        self.shapes, self.rates, self.max_lag, self.B = shapes, rates, max_lag, len(shapes[0].lengths)
        self.gens = [_Server(counts=True) for _ in range(shapes[0].replicas)]
        for s, shape in enumerate(shapes):
            for r, server in enumerate(self.gens):
                server.queue.extend(((s, index), rates.gen.cost(work))
                                    for index, work in shape.replay(range(r, self.B, shape.replicas)))
        self.reward = _Server(counts=False)
        self.units = [_Server(counts=True) for _ in range(shapes[0].dp)]
        self.barrier_end: dict[int, float] = {}  # step -> when its optimizer step and push are done
        self.trained, self.taken = collections.Counter(), collections.Counter()  # step -> groups trained, and started
        self.all_taken: dict[int, float] = {}  # step -> when the trainer had started every group of it
        self.in_flight: list[tuple[float, tuple[int, int]]] = []
        self.t, self.servers = 0.0, self.gens + [self.reward] + self.units

    def open_at(self, server: _Server) -> float | None:
        """When the head item of `server` may start: None while its gate's barrier is not yet timed."""
        if not server.queue:
            return None
        step = server.queue[0][0][0]
        if server is self.reward:
            return 0.0
        if server not in self.gens:
            return 0.0 if step < 1 else self.barrier_end.get(step - 1)
        held = step - 1 - self.max_lag  # the barrier whose push the generator holds
        gates = [self.barrier_end.get(held, 0.0 if held < 0 else None),
                 self.all_taken.get(step - 2, 0.0 if step < 2 else None)]
        return None if None in gates else max(gates)

    def advance(self) -> bool:
        """Start what may start, then run to the next event (an item done, a hand-off arriving, a gate
        opening); False once nothing is left."""
        t = self.t
        for s in self.servers:
            if s.current is None and (at := self.open_at(s)) is not None and at <= t + 1e-12:
                s.start()
                if s in self.units:
                    self.taken[s.current[0][0]] += 1
                    if self.taken[s.current[0][0]] == self.B:
                        self.all_taken[s.current[0][0]] = t
        busy = [s for s in self.servers if s.current is not None]
        gates = [at for s in self.servers if s.current is None and (at := self.open_at(s)) is not None and at > t + 1e-12]
        if not busy and not self.in_flight and not gates:
            return False
        crowded = sum(s.counts for s in busy) > 1
        speed = {id(s): self.rates.concurrency if crowded and s.counts else 1.0 for s in busy}
        dt = min([s.left / speed[id(s)] for s in busy] + [due - t for due, _ in self.in_flight] + [at - t for at in gates])
        self.t = t + dt
        self._arrive()
        for s, key in _advance(busy, dt=dt, speed=speed, t=self.t):
            self._done(s, key)
        # a unit's queue keeps arrival order, but a step's groups wait for the barrier before it
        for u in self.units:
            u.queue = collections.deque(sorted(u.queue, key=lambda item: item[0][0]))
        return True

    def _arrive(self) -> None:
        """The scored groups whose hand-off is over join their trainer unit's queue."""
        for _, (step, index) in [f for f in self.in_flight if f[0] <= self.t + 1e-12]:
            shape = self.shapes[step]
            self.units[index % shape.dp].queue.append(
                ((step, index), self.rates.train.cost(shape.group_tokens(index), len(shape.lengths[index]))))
        self.in_flight = [f for f in self.in_flight if f[0] > self.t + 1e-12]

    def _done(self, server: _Server, key: tuple[int, int]) -> None:
        if server is self.reward:
            self.in_flight.append((self.t + self.rates.handoff_s, key))
        elif server in self.gens:
            self.reward.queue.append((key, self.rates.reward_group_s))
        else:
            self.trained[key[0]] += 1
            if self.trained[key[0]] == self.B:
                self.barrier_end[key[0]] = self.t + self.rates.train.barrier_s + self.rates.train.push_s

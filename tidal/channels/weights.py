"""The WEIGHTS channel: trainer shards go straight to the generator shards that need them.

Both endpoints build the same `PushPlan` (tidal/channels/push_plan.py) on their first use, from the two
layouts (the executors' units: trainer dp x tp, generator replicas x tp, and whether the trainer
shards one copy over dp with FSDP) and the parameter specs the executors pass in. No rank gathers
the model; bucket buffers are allocated on the first push and reused every step.
Consumed one step later (lag 1): the generator receives at the start of step k+1 what the trainer
pushed at the end of step k, so generation never starts with stale weights. Under the offpolicy
schedule (lag L = max_lag + 1) the trainer posts each push and goes on: the generator takes it at
the start of step k+L. Up to L pushes are in flight, each from a copy of the trainer's pieces; a
stop leaves the ones posted but not yet due, which the generator receives and drops
(`WeightsReceiver.drain`), so no send is left pending when the ranks exit.

The two sides must describe the same model: the trainer leader publishes its specs in the store
and each generator rank compares them with its own before its first receive, so a mismatch is a
named error instead of weights landing in the wrong places.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, MutableMapping

import torch
import torch.distributed as dist

from tidal.channels import p2p
from tidal.channels.channel import Channel, Route
from tidal.channels.payloads import ParamSpec
from tidal.channels.push import WeightPush
from tidal.channels.push_plan import GeneratorLayout, PushPlan, TrainerLayout, build_plan


def _layouts(route: Route) -> tuple[TrainerLayout, GeneratorLayout]:
    # a unit's cp ranks hold what dp copies would (tidal/modeling/parallel/cp.py): the plan counts them as dp
    trainer = TrainerLayout(ranks=tuple(r for u in route.src_units for r in u),
                            tp=len(route.src_units[0]) // (route.src_pp * route.src_cp), fsdp=route.src_sharded,
                            ep=route.src_ep, pp=route.src_pp)
    generator = GeneratorLayout(ranks=tuple(r for u in route.dst_units for r in u), tp=len(route.dst_units[0]))
    return trainer, generator


def _describe(specs: Mapping[str, ParamSpec]) -> dict:
    return {name: [list(s.shape), str(s.dtype), s.tp_dim, s.ep_dim] for name, s in specs.items()}


def _specs_key(route: Route) -> str:
    return f"ch{route.channel_id}/specs"


class _Endpoint:
    side = "both"

    def __init__(self, *, channel: Channel, route: Route, store, rank: int, device: torch.device):
        self.channel, self.route, self.store, self.rank, self.device = channel, route, store, rank, device
        self._push: WeightPush | None = None
        self._built: PushPlan | None = None

    def planned(self, specs: Mapping[str, ParamSpec]) -> PushPlan:
        if self._built is None:
            trainer, generator = _layouts(self.route)
            self._built = build_plan(specs=specs, trainer=trainer, generator=generator)
        return self._built

    def _plan(self, specs: Mapping[str, ParamSpec]) -> None:
        if self._push is None:
            self._push = WeightPush(self.planned(specs), rank=self.rank, device=self.device, tag=self.route.channel_id,
                                    side=self.side)

    @property
    def colocated(self) -> bool:
        """The trainer and the generator share ranks (placement=colocated)."""
        return bool(set(r for u in self.route.src_units for r in u) & set(self.route.all_dst_ranks))

    def _run(self, shards: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> None:
        self._plan(specs)
        self._push.run(shards)

    def close_step(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def flush(self) -> None:
        pass  # a push returns complete: the generator is waiting for it at the start of its next step


class WeightsSender(_Endpoint):
    side = "send"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        # lag > 1: the last `lag` pushes, {step: [(receiver, bytes)]} (those a checkpoint after the
        # newest must keep: the generator of the next step takes the oldest), and the sends in flight
        self._recent: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self._in_flight: list[tuple[int, list[dist.Work]]] = []
        self._specs: dict | None = None
        self.bytes_per_push = 0

    def open_step(self, step: int, *, deliverable: bool = True) -> None:
        self.step, self.deliverable = step, deliverable
        # a push of step j was taken at the start of the generator's step j + lag, before it sent any
        # of that step's rollouts, all of which this rank's executor has consumed by the end of it
        self._wait(lambda pushed: pushed + self.channel.step_lag <= step - 1)

    def push(self, shards: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> None:
        """Send this rank's pieces of `shards` ({name: local shard}); returns when they are sent, or
        with lag > 1 when they are posted (copied: the caller may change `shards` at once)."""
        lag = self.channel.step_lag
        if not self.bytes_per_push:  # the trainer's ranks together (a relay between replicas not counted)
            self.bytes_per_push = sum(p.nbytes for p in self.planned(specs).pieces)
        if not self.deliverable and lag == 1:
            return
        if self._push is None:
            self._specs = _describe(specs)
            if self.deliverable and self.rank == self.route.src_units[0][0]:
                self.store.set(_specs_key(self.route), json.dumps(self._specs))
        if lag == 1 and not self.colocated:
            self._run(shards, specs)
            return
        # posted, not waited for: lagged, or co-located (this rank's generator, or another rank's,
        # receives at the start of the next step, and until then these ranks are all here)
        self._plan(specs)
        # packed even when nobody will take it in this run: a checkpoint of this step keeps it.
        # Co-located with lag 1 (sync), nothing changes the weights before the generator takes them:
        # the messages are views of the shards where they can be (no second copy of the model)
        self._recent = {j: m for j, m in self._recent.items() if j > self.step - lag}
        self._recent[self.step] = self._push.pack(shards, copy=lag > 1)
        if self.deliverable:
            self._post(self.step)

    def _post(self, step: int) -> None:
        works = [p2p.isend(buf, receiver, tag=self.route.channel_id, owned=True) for receiver, buf in self._recent[step]]
        self._in_flight.append((step, works))

    def finish(self) -> None:
        """The run is over (every posted push was received, or drained after a stop)."""
        self._wait(lambda pushed: True)

    def _wait(self, done) -> None:
        for _, works in [f for f in self._in_flight if done(f[0])]:
            for work in works:
                work.wait()
        self._in_flight = [f for f in self._in_flight if not done(f[0])]

    def save(self, path: Path) -> None:
        """A checkpoint after this step keeps the pushes the generator has yet to take (lag > 1)."""
        if self.channel.step_lag == 1 or not self._recent:
            return
        folder = path / _IN_FLIGHT
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({j: [(r, buf.cpu()) for r, buf in m] for j, m in self._recent.items()},
                   folder / f"{self.channel.name}.rank{self.rank}.pt")
        if self.rank == self.route.src_units[0][0]:
            meta = _in_flight_meta(self.channel, self.route, specs=self._specs)
            (folder / f"{self.channel.name}.json").write_text(json.dumps({**meta, "through": max(self._recent)}))

    def restore(self, resume: Path | None, *, first_step: int, last_step: int) -> None:
        """A resumed run: post the saved pushes again (each where the generator of step j + lag takes it)."""
        if saved_through(resume, self.channel, self.route) is None:
            if resume is not None and (resume / _IN_FLIGHT).is_dir() and self.rank == self.route.src_units[0][0]:
                print(f"tidal: warning: {resume} kept the pushes of channel {self.channel.name!r} in flight for "
                      f"another layout; the generator's first {self.channel.step_lag} steps sample with the "
                      f"checkpoint's weights (fresher than max_lag allows, so the run differs from an "
                      f"uninterrupted one)", flush=True)
            return
        saved = torch.load(resume / _IN_FLIGHT / f"{self.channel.name}.rank{self.rank}.pt")
        self._recent = {j: [(r, buf.to(self.device)) for r, buf in m] for j, m in saved.items()}
        self._specs = json.loads((resume / _IN_FLIGHT / f"{self.channel.name}.json").read_text())["specs"]
        if self.rank == self.route.src_units[0][0]:
            self.store.set(_specs_key(self.route), json.dumps(self._specs))
        for j in sorted(self._recent):
            if first_step <= j + self.channel.step_lag <= last_step:
                self._post(j)


class WeightsReceiver(_Endpoint):
    side = "receive"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._into = None  # (shards, specs) of the last receive: where a drain lands
        self.received_through = -1  # the step of the last push received

    def open_step(self, step: int, *, expected: bool = True) -> None:
        """`step`: the step whose push this is (the consumer's step - lag)."""
        self.step, self.expected = step, expected

    def receive_into(self, shards: MutableMapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> bool:
        """Receive this step's weights into `shards` ({name: local shard}, in place; an entry this rank's
        own trainer sends whole is replaced by the trainer's tensor: tidal/channels/push.py); False when
        none are due (the first step)."""
        self._into = (shards, specs)
        if not self.expected:
            return False
        try:
            received = self._receive(shards, specs)
            self.received_through = self.step
            return received
        except RuntimeError as exc:  # a store wait or a gloo recv ran into the job's timeout
            if not (isinstance(exc, dist.DistStoreError) or "Timed out" in str(exc)):
                raise
            senders = [r for unit in self.route.src_units for r in unit]
            raise TimeoutError(f"rank {self.rank} ({self.channel.dst}) waited {self.store.timeout.total_seconds():.0f} s "
                               f"on channel {self.channel.name!r} (step {self.step}) for the weights of "
                               f"{self.channel.src} rank(s) {senders}, which did not send them") from exc

    def drain(self, pushed: range) -> None:
        """A stop: receive and drop the pushes of steps `pushed` (posted, not yet due), so the
        trainer's sends complete. They land in the last receive's shards: nothing samples after a stop."""
        if self._into is None:
            return
        for step in pushed:
            self.open_step(step)
            self.receive_into(*self._into)

    def _receive(self, shards, specs) -> bool:
        if self._push is None:
            # wait() first: after a blocking queue_pop that races with pushes (the dynamic-sampling
            # verdicts), torch 2.13's TCPStore client can return b"" from the next bare get() before
            # the key exists (measured: 1 in 300 in isolation, 0 in 900 with wait() first)
            key = _specs_key(self.route)
            self.store.wait([key])
            raw = self.store.get(key)
            _check_same_model(json.loads(raw), _describe(specs), channel=self.channel.name)
        self._run(shards, specs)
        return True


def _check_same_model(theirs: dict, mine: dict, *, channel: str) -> None:
    if theirs == mine:
        return
    missing, extra = sorted(theirs.keys() - mine.keys()), sorted(mine.keys() - theirs.keys())
    if missing or extra:
        raise ValueError(f"weights channel {channel!r}: the trainer and generator models differ in parameter "
                         f"names (trainer only: {missing[:3]}, generator only: {extra[:3]})")
    name = next(n for n in theirs if theirs[n] != mine[n])
    raise ValueError(f"weights channel {channel!r}: parameter {name!r} is [shape, dtype, tp dim, experts dim] {theirs[name]} "
                     f"on the trainer but {mine[name]} on the generator (model.path / model.dtype must match)")


_IN_FLIGHT = "weights_in_flight"


def _in_flight_meta(channel: Channel, route: Route, *, specs: dict | None) -> dict:
    return {"lag": channel.step_lag, "src_units": [list(u) for u in route.src_units],
            "dst_units": [list(u) for u in route.dst_units], "src_sharded": route.src_sharded, "src_ep": route.src_ep,
            "src_pp": route.src_pp, "src_cp": route.src_cp,
            "specs": specs}


def saved_through(resume: Path | None, channel: Channel, route: Route) -> int | None:
    """The step of the newest push a checkpoint kept in flight for this lagged channel and layout
    (the checkpoint's own step). Both ends ask: a step, and the generator's first steps take the
    saved pushes; None (a fresh run, lag 1, another layout), and it starts from the checkpoint's weights."""
    if resume is None or channel.step_lag == 1:
        return None
    meta = resume / _IN_FLIGHT / f"{channel.name}.json"
    if not meta.is_file():
        return None
    # written before expert / pipeline / context parallel existed: 1
    saved = {"src_ep": 1, "src_pp": 1, "src_cp": 1, **json.loads(meta.read_text())}
    same = {k: v for k, v in saved.items() if k not in ("specs", "through")} == \
        {k: v for k, v in _in_flight_meta(channel, route, specs=None).items() if k != "specs"}
    return saved["through"] if same else None

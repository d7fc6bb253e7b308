"""The executor contract: a self-contained SPMD role on its own ranks.

The controller calls, on every rank of the executor: `init(env)` once; per step `step(ctx)` (the
streamed phase) and `barrier(ctx, state)` (the end of the batch, after its outputs are closed);
`save_checkpoint(path)` on cadence and `finalize(output_dir)` at the end. Concrete executors are
their own classes; there are no role flags, and none knows which schedule runs: the controller
hands each input over as the schedule says (tidal/controller/schedules.py).

Ports are class attributes, `Input(payload)` / `Output(payload)`: the graph checks every channel
against them when it is built, and an executor reads its endpoints by port, `ctx.inbound[self.weights]`.
A port marked optional is connected only in some graphs; `needs` says when this instance needs it.

A *guest* executor (`host=` another executor) holds no ranks of its own: it runs on its
host's ranks, after the host's step (whose outputs are closed by then), with ports and a metrics
record of its own, in a layout of its own over those ranks (by default the host's). Evaluation is
one: a phase of the step, not a branch in the generator or reward. `placement=colocated` makes every
executor a guest of the generator (tidal/controller/colocate.py): one set of ranks, time-shared.

An executor that computes on no accelerator (rule rewards, a CPU environment) says so
(`needs_device = False`): its ranks hold no device and join only gloo groups.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from tidal.common.stop import aborted


@dataclass(frozen=True)
class ExecutorEnv:
    """Where one rank of an executor lives. Built by the controller, identical in shape on all ranks."""

    name: str
    ranks: tuple[int, ...]  # global ranks of this executor
    units: tuple[tuple[int, ...], ...]  # global ranks per data-parallel unit
    rank: int  # this process's global rank
    group: dist.ProcessGroup | None  # the executor's own process group
    device: torch.device
    seed: int
    output_dir: Path
    resume: Path | None = None  # a checkpoint directory to continue from (its parts, as each executor saved them)
    # where this rank's model starts: a resumed run's checkpoint (an HF directory), or None: the model's
    # own weights (a fresh run, and a resumed rank fed by WEIGHTS pushes none of which will have landed
    # by its first step: it samples with the weights the run started from; tidal/controller/world.py)
    weights_from: Path | None = None
    # a gloo group over this rank's unit, when the unit has several ranks: for small agreements (e.g.
    # "stop decoding now") that must not interleave with the unit's own collectives on device
    unit_group: dist.ProcessGroup | None = None
    # several executors time-share this rank's device (placement=colocated): each gives its memory
    # back after its phase (offload) and takes it again before the next (onload)
    time_shared: bool = False

    @property
    def unit_index(self) -> int:
        return next(i for i, unit in enumerate(self.units) if self.rank in unit)

    @property
    def is_leader(self) -> bool:
        """First rank of the executor: the one that reports metrics."""
        return self.rank == self.ranks[0]


@dataclass(frozen=True, eq=False)
class Port:
    """A typed endpoint of an executor class; its name is the attribute's (set by Python)."""

    payload: type
    optional: bool = False  # connected only in some graphs (e.g. dynamic sampling's verdicts)
    name: str = ""

    def __set_name__(self, owner, name: str) -> None:
        object.__setattr__(self, "name", name)


class Input(Port):
    """Items of `payload` (or of a subclass) the executor consumes."""


class Output(Port):
    """Items of `payload` (or of a subclass) the executor produces."""


class Endpoints(Mapping):
    """One side of a step's endpoints, looked up by port (never by a string a recipe also spells)."""

    def __init__(self, by_name: Mapping[str, Any]):
        self._by_name = dict(by_name)

    def __getitem__(self, port: Port):
        assert isinstance(port, Port), f"look endpoints up by port, not {port!r}"
        if port.name not in self._by_name:
            raise KeyError(f"port {port.name!r} has no channel in this graph")
        return self._by_name[port.name]

    def __contains__(self, port) -> bool:
        return isinstance(port, Port) and port.name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def values(self):
        return self._by_name.values()


@dataclass
class StepContext:
    step: int
    inbound: Endpoints  # port -> Receiver (or WeightsReceiver)
    outbound: Endpoints  # port -> Outlet (a sender, or several: tidal/controller/world.py)
    timeline: Any = None  # tidal.controller.timeline.Timeline; records spans for timeline.jsonl


class Executor(ABC):
    # True when the units hold disjoint shards of one model (FSDP) rather than full replicas; the
    # WEIGHTS channel then plans each piece from the one unit that holds it
    shards_over_units: bool = False
    # an MoE model's experts split over each run of this many consecutive units (expert parallel);
    # the WEIGHTS channel plans each expert from a unit that holds it
    expert_shards: int = 1
    # a unit's ranks are this many pipeline stages of ranks_per_unit / stages ranks each (stage-major);
    # the WEIGHTS channel plans each parameter from the stage that holds it
    stages: int = 1
    # a unit's ranks are this many context-parallel copies of ranks_per_unit / context_ranks ranks each (cp-major);
    # the WEIGHTS channel counts them as dp copies (tidal/modeling/parallel/cp.py)
    context_ranks: int = 1
    # False: computes on the CPU only (its ranks hold no accelerator and join only gloo groups)
    needs_device: bool = True

    def __init__(self, *, name: str, units: int | None = None, ranks_per_unit: int | None = None,
                 host: Executor | None = None):
        """host: the executor whose ranks this one runs on, after its step (a guest: no ranks of its own;
        it may use the host's objects once both are initialised, e.g. the generator's engine).
        units, ranks_per_unit: the layout (a guest's over its host's ranks; by default the host's)."""
        units = units if units is not None else host.units if host else 1
        ranks_per_unit = ranks_per_unit if ranks_per_unit is not None else host.ranks_per_unit if host else 1
        if units < 1 or ranks_per_unit < 1:
            raise ValueError(f"executor {name!r}: units and ranks_per_unit must be >= 1, "
                             f"got {units} and {ranks_per_unit}")
        self.name = name
        self.units = units
        self.ranks_per_unit = ranks_per_unit
        self.host = host
        self.env: ExecutorEnv | None = None

    @property
    def world_size(self) -> int:
        """Ranks this executor adds to the world (a guest adds none)."""
        return 0 if self.host else self.ranks

    @property
    def ranks(self) -> int:
        """Ranks this executor runs on (a guest: its host's, in its own layout)."""
        return self.units * self.ranks_per_unit

    @property
    def root(self) -> Executor:
        """The executor that holds the ranks this one runs on (itself, unless a guest)."""
        return self.host.root if self.host else self

    @classmethod
    def ports(cls, kind: type[Port]) -> dict[str, Port]:
        """The class's ports of one kind (Input or Output), by name."""
        return {name: value for klass in reversed(cls.__mro__) for name, value in vars(klass).items()
                if isinstance(value, kind)}

    def needs(self, port: Port) -> bool:
        """Must this instance's port have a channel? By default the non-optional ones."""
        return not port.optional

    def consumes(self, port: Input) -> type:
        """The payload this instance needs on an input: the port's, or a subclass of it."""
        return port.payload

    def describe(self) -> Mapping[str, object]:
        """Parallel sizes shown by --dry-run."""
        return {"units": self.units, "ranks/unit": self.ranks_per_unit}

    def init(self, env: ExecutorEnv) -> None:
        self.env = env

    @abstractmethod
    def step(self, ctx: StepContext) -> Any:
        """The streamed phase of one step; returns the step's state, handed to `barrier`."""

    def barrier(self, ctx: StepContext, state: Any) -> Any:
        """The end of the batch. Returns the step's metrics record (a dataclass or a mapping,
        reported by the leader rank); by default the state `step` returned is that record."""
        return state

    def save_checkpoint(self, path: Path, *, step: int) -> None:
        """Write whatever this executor needs to resume into `path` (a directory every rank of the
        job shares; it may not exist yet); `init` finds it again as `env.resume`. `step`: the step it is
        the checkpoint of (a rank running ahead, offpolicy, may be past it). Default: nothing."""

    def finalize(self, output_dir: Path) -> None:
        """Called once after the last step."""


def unit_aborted(env: ExecutorEnv) -> bool:
    """Is the step being abandoned (tidal/common/stop.py)? A unit's ranks run collectives together, so they
    must all see the same answer at the same point: they agree over the unit's group."""
    if env.unit_group is None:
        return aborted()
    flag = torch.tensor([int(aborted())])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=env.unit_group)
    return bool(flag.item())

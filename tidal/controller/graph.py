"""A graph: executors and the channels between them, validated when built."""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.executors.base import Executor, Input, Output


@dataclass(frozen=True)
class Graph:
    executors: tuple[Executor, ...]
    channels: tuple[Channel, ...]

    def __post_init__(self):
        object.__setattr__(self, "executors", tuple(self.executors))
        object.__setattr__(self, "channels", tuple(self.channels))
        _validate(self)

    def executor(self, name: str) -> Executor:
        return next(e for e in self.executors if e.name == name)

    @property
    def placed(self) -> tuple[Executor, ...]:
        """The executors that hold ranks, in placement order (guests run on their hosts' ranks)."""
        return tuple(e for e in self.executors if e.host is None)

    def on_ranks_of(self, host: str) -> tuple[Executor, ...]:
        """The executors a rank of `host` runs, in order: the host, then its guests."""
        return tuple(e for e in self.executors if e.root.name == host)


def _validate(graph: Graph) -> None:
    by_name: dict[str, Executor] = {}
    for ex in graph.executors:
        if ex.name in by_name:
            raise ValueError(f"graph: two executors are named {ex.name!r}")
        by_name[ex.name] = ex
    known = ", ".join(by_name)
    for ex in graph.executors:
        if ex.host is not None and by_name.get(ex.host.name) is not ex.host:
            raise ValueError(f"executor {ex.name!r}: its host {ex.host.name!r} is not an executor of this graph "
                             f"(known: {known})")
        if ex.host is not None and ex.ranks != ex.root.ranks:
            raise ValueError(f"executor {ex.name!r}: {ex.units} unit(s) x {ex.ranks_per_unit} rank(s) cannot run on "
                             f"the {ex.root.ranks} rank(s) of {ex.root.name!r}, whose guest it is")
    seen_channels, used_ports = set(), set()
    for ch in graph.channels:
        if ch.name in seen_channels:
            raise ValueError(f"graph: two channels are named {ch.name!r}")
        seen_channels.add(ch.name)
        for role, ex_name in (("source", ch.src), ("destination", ch.dst)):
            if ex_name not in by_name:
                raise ValueError(f"channel {ch.name!r}: unknown {role} executor {ex_name!r} (known: {known})")
        if ch.src == ch.dst:
            raise ValueError(f"channel {ch.name!r}: source and destination are both {ch.src!r}")
        if ch.step_lag not in (0, 1) and not (ch.kind is Kind.WEIGHTS and ch.step_lag > 1):
            raise ValueError(f"channel {ch.name!r}: lag {ch.step_lag}; a channel is consumed in the step it is "
                             f"produced (lag 0) or in the next (lag 1); only WEIGHTS may lag more, under the "
                             f"offpolicy schedule (tidal/controller/job.py with_schedule)")
        _check_port(ch, by_name[ch.src], Output, ch.out_port)
        _check_port(ch, by_name[ch.dst], Input, ch.in_port)
        # an output port may fan out to several channels; an input port takes exactly one
        key = (ch.dst, "in", ch.in_port)
        if key in used_ports:
            raise ValueError(f"channel {ch.name!r}: port {ch.dst}.{ch.in_port} already has a channel")
        used_ports.update({key, (ch.src, "out", ch.out_port)})
        indexed = is_dataclass(ch.payload) and "index" in {f.name for f in fields(ch.payload)}
        if ch.kind is Kind.SCATTER and not indexed:
            raise ValueError(f"channel {ch.name!r}: SCATTER routes by `index`, which "
                             f"{ch.payload.__name__} lacks")
        if ch.scheduled and (ch.step_lag or ch.feedback or ch.kind is Kind.WEIGHTS or not indexed):
            raise ValueError(f"channel {ch.name!r}: only a same-step channel of items with an `index` can be "
                             f"scheduled (the sync schedule hands a step's items over in index order)")
    for kind, side, why in ((Input, "in", "it would wait forever"), (Output, "out", "its items would have nowhere to go")):
        for ex in graph.executors:
            for port in ex.ports(kind).values():
                if ex.needs(port) and (ex.name, side, port.name) not in used_ports:
                    raise ValueError(f"executor {ex.name!r}: {kind.__name__.lower()} {port.name!r} has no channel; {why}")
    _check_cycles(graph)


def _check_port(ch: Channel, ex: Executor, kind: type, name: str) -> None:
    ports = ex.ports(kind)
    side = kind.__name__.lower()
    if name not in ports:
        raise ValueError(f"channel {ch.name!r}: executor {ex.name!r} has no {side} port {name!r} "
                         f"(it has: {', '.join(ports) or 'none'})")
    # payload subtyping: a producer may put a subclass of the channel's payload on it (only the
    # payload's fields travel), and a consumer may read a base of it (it gets the payload type)
    port = ports[name]
    declared = ex.consumes(port) if kind is Input else port.payload
    if kind is Output and not _extends(declared, ch.payload):
        raise ValueError(f"channel {ch.name!r} carries {ch.payload.__name__}, but {ex.name}.{name} "
                         f"produces {declared.__name__}, which does not extend {ch.payload.__name__}")
    if kind is Input and not _extends(ch.payload, declared):
        raise ValueError(f"channel {ch.name!r} carries {ch.payload.__name__}, but {ex.name}.{name} "
                         f"consumes {declared.__name__}, which {ch.payload.__name__} does not extend")


def _extends(sub, base) -> bool:
    return sub is base or (isinstance(sub, type) and isinstance(base, type) and issubclass(sub, base))


def _check_cycles(graph: Graph) -> None:
    """A cycle of same-step channels deadlocks: each executor waits for the other within the step.

    Cycles through a lagged channel (WEIGHTS: produced at step k, consumed at step k+1) are fine.
    """
    edges: dict[str, list[str]] = {e.name: [] for e in graph.executors}
    for ch in graph.channels:
        if ch.step_lag == 0 and not ch.feedback:
            edges[ch.src].append(ch.dst)
    state: dict[str, int] = {}  # 1 visiting, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise ValueError("graph: cycle " + " -> ".join(cycle) + " cannot make progress within a "
                                 "step; make one of its channels lagged (lag=1, e.g. WEIGHTS) or a feedback channel "
                                 "read only after producing (feedback=True)")
            if state.get(nxt) is None:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in edges:
        if name not in state:
            visit(name, [name])

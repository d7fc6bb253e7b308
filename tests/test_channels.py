"""Channels over real gloo ranks: exact round trips, broadcast, streaming order, lagged delivery, payload subclasses."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import json

import pytest
import torch

from tidal.channels.channel import Channel, Route, Sender
from tidal.channels.codec import decode, encode, field_kinds
from tidal.channels.kinds import Kind
from tidal.channels.payloads import ScoredGroup
from tidal.controller.graph import Graph
from tidal.controller.job import run_job
from tidal.executors.base import Executor, Input, Output
from tidal.common.spawn import spawn
from tests.toy import Item, Producer, Relay, Sink, make_item


def _run(graph_fn, steps, tmp):
    graph = graph_fn()
    run_job(graph, steps=steps, seed=0, output_dir=tmp, timeout_s=60)
    return {ex.name: ex.received for ex in graph.executors if ex.env is not None and hasattr(ex, "received")}


def _scatter_gather_graph():
    return Graph([Producer(items_per_step=7), Relay(units=3), Sink()],
                 [Channel("items", "producer", "relay", Kind.SCATTER, Item),
                  Channel("back", "relay", "sink", Kind.GATHER, Item)])


def _same(a: Item, b: Item) -> bool:
    return (a.index == b.index and a.tag == b.tag and torch.equal(a.dense_2x3, b.dense_2x3)
            and a.dense_2x3.dtype == b.dense_2x3.dtype and len(a.ragged) == len(b.ragged)
            and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.ragged, b.ragged)))


def test_scatter_then_gather_returns_input(tmp_path):
    results = spawn(_run, 5, _scatter_gather_graph, 2, tmp_path)
    relays, sink = results[1:4], results[4]["sink"]
    for unit, relay in enumerate(relays):  # scatter: item i lands on unit i % 3, nowhere else
        for step, item, _ in relay["relay"]:
            assert item.index % 3 == unit
    for step in range(2):
        got = sorted((it for s, it in sink if s == step), key=lambda it: it.index)
        assert [it.index for it in got] == list(range(7))
        assert all(_same(it, make_item(step, it.index)) for it in got)


def _broadcast_graph():
    return Graph([Producer(items_per_step=4), Relay(units=3, forward=False)],
                 [Channel("items", "producer", "relay", Kind.BROADCAST, Item)])


def test_broadcast_reaches_every_rank_bit_identically(tmp_path):
    results = spawn(_run, 4, _broadcast_graph, 1, tmp_path)
    per_rank = [sorted((it for _, it, _ in r["relay"]), key=lambda it: it.index) for r in results[1:]]
    assert all(len(items) == 4 for items in per_rank)
    for items in per_rank:
        assert all(_same(it, make_item(0, it.index)) for it in items)


def _streaming_graph():
    # unit 0 is slow (0.3 s per item), unit 1 fast: arrival order must follow readiness
    return Graph([Producer(units=2, items_per_step=6, delays=(0.3, 0.0)), Relay(forward=False)],
                 [Channel("items", "producer", "relay", Kind.GATHER, Item)])


def test_streaming_delivers_each_item_once_in_arrival_order(tmp_path):
    results = spawn(_run, 3, _streaming_graph, 2, tmp_path)
    received = results[2]["relay"]
    for step in range(2):
        got = [it for s, it, _ in received if s == step]
        assert sorted(it.index for it in got) == list(range(6))  # exactly once
        origins = [it.origin for it in got]
        # the fast unit's items all arrive before the slow unit's first (0.3 s late)
        assert origins == [1, 1, 1, 0, 0, 0], origins
        times = [t for s, _, t in received if s == step]
        assert times == sorted(times)


def _lagged_graph():
    # a lagged channel forms a legal cycle: relay -> producer is consumed one step later
    return Graph([Producer(items_per_step=3), Relay(), Sink(name="sink")],
                 [Channel("items", "producer", "relay", Kind.SCATTER, Item),
                  Channel("back", "relay", "sink", Kind.BROADCAST, Item, lag=1)])


def test_lagged_channel_delivers_next_step(tmp_path):
    results = spawn(_run, 3, _lagged_graph, 3, tmp_path)
    sink = results[2]["sink"]
    # sent at steps 0 and 1, consumed at steps 1 and 2; step 2's sends are never delivered
    assert sorted((s, it.tag) for s, it in sink) == sorted(
        (s + 1, f"s{s}i{i}") for s in range(2) for i in range(3))


def test_timeline_of_a_user_graph_is_merged_and_drawn(tmp_path):
    spawn(_run, 3, _streaming_graph, 1, tmp_path)
    events = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    # per rank one controller "step" span, and the end-of-run checkpoint
    assert sorted(e["kind"] for e in events if e["step"] >= 0) == ["checkpoint"] * 3 + ["step"] * 3
    assert (tmp_path / "checkpoints/step_000000/manifest.json").is_file()  # the end of a run is a checkpoint
    assert {e["kind"] for e in events if e["step"] < 0} <= {"imports", "connect", "init"}  # start-up
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def _fan_out_graph():
    # one output port, two channels of different kinds to two executors
    return Graph([Producer(items_per_step=5), Relay(name="a", units=2, forward=False),
                  Relay(name="b", forward=False)],
                 [Channel("to_a", "producer", "a", Kind.SCATTER, Item, src_port="items", dst_port="items"),
                  Channel("to_b", "producer", "b", Kind.BROADCAST, Item, src_port="items", dst_port="items")])


def test_one_output_port_fans_out_to_several_channels(tmp_path):
    results = spawn(_run, 4, _fan_out_graph, 1, tmp_path)
    a0, a1, b = (sorted(it.index for _, it, _ in r[name]) for r, name in zip(results[1:], ("a", "a", "b")))
    assert a0 == [0, 2, 4] and a1 == [1, 3] and b == [0, 1, 2, 3, 4]


# --- payload subtyping: a subclass of ScoredGroup with extra fields, as a new executor would produce


@dataclass
class ValuedGroup(ScoredGroup):
    values: list[torch.Tensor]  # extra ragged field
    baseline: torch.Tensor  # extra tensor field
    source: str = "critic"  # extra plain field with a default
    spare: torch.Tensor | None = None  # optional tensor
    bonus: Optional[list[torch.Tensor]] = None  # optional ragged


def make_group(step: int, index: int, cls=ScoredGroup, **extra):
    g = torch.Generator().manual_seed(step * 1000 + index)
    lengths = [int(n) for n in torch.randint(0, 6, (3,), generator=g)]  # includes empty responses
    return cls(step=step, index=index, prompt=f"p{index}", extras={"answer": str(index)},
               prompt_ids=torch.randint(0, 100, (4,), generator=g),
               responses=[torch.randint(0, 100, (n,), generator=g) for n in lengths],
               logprobs=[-torch.rand(n, generator=g) for n in lengths],
               finished=torch.tensor([True, False, True]), rewards=torch.randn(3, generator=g),
               reward_failures=index % 2, **extra)


def make_valued(step: int, index: int) -> ValuedGroup:
    g = torch.Generator().manual_seed(7 + step * 1000 + index)
    odd = index % 2 == 1
    return make_group(step, index, ValuedGroup,
                      values=[torch.randn(n, generator=g) for n in (2, 0, 5)],
                      baseline=torch.randn(2, 3, generator=g, dtype=torch.float64),
                      source=f"critic{index}",
                      spare=torch.randn(4, generator=g).to(torch.bfloat16) if odd else None,
                      bonus=[torch.randint(0, 9, (n,), generator=g, dtype=torch.int32) for n in (1, 3)]
                      if odd else None)


def _same_bits(a, b) -> bool:
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same_bits, a, b))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    return type(a) is type(b) and a == b


def _same_fields(a, b, cls) -> bool:
    return all(_same_bits(getattr(a, f.name), getattr(b, f.name)) for f in fields(cls))


def test_subclass_payload_round_trips_every_field():
    for index in (0, 1):  # even: optional fields None; odd: set
        item = make_valued(3, index)
        out = decode(ValuedGroup, *encode(item))
        assert type(out) is ValuedGroup and _same_fields(out, item, ValuedGroup)
        assert (out.spare is None) == (index == 0) and (out.bonus is None) == (index == 0)
    assert field_kinds(ValuedGroup)["spare"] == "tensor?" and field_kinds(ValuedGroup)["bonus"] == "ragged?"
    # encoded as its base (a subclass item on a ScoredGroup channel): the base's fields, nothing more
    header, body = encode(make_valued(3, 1), ScoredGroup)
    out = decode(ScoredGroup, header, body)
    assert type(out) is ScoredGroup and _same_fields(out, make_valued(3, 1), ScoredGroup)
    assert "values" not in {t[0] for t in header["tensors"]} and "source" not in header["plain"]


def test_unresolvable_tensor_annotation_is_named():
    import torch as th  # a local name the annotation cannot be resolved with

    @dataclass
    class Local(ScoredGroup):
        values: list[th.Tensor]

    with pytest.raises(TypeError, match="payload Local: cannot resolve its field annotations \\(name 'th' is not "
                                        "defined\\)"):
        field_kinds(Local)


def test_sender_refuses_a_base_item_on_a_subclass_channel():
    channel = Channel("valued", "critic", "trainer", Kind.BROADCAST, ValuedGroup)
    sender = Sender(channel=channel, route=Route(0, ((0,),), ((1,),)), store=None, rank=0,
                    device=torch.device("cpu"))
    sender.open_step(0)
    with pytest.raises(TypeError, match="channel 'valued' carries ValuedGroup, got ScoredGroup, a base class "
                                        "of ValuedGroup that lacks its field.s. values, baseline, source, "
                                        "spare, bonus$"):
        sender.send(make_group(0, 0))
    assert sender.sent == 0


class ValuedProducer(Executor):
    groups = Output(ValuedGroup)

    def step(self, ctx):
        for i in range(4):
            ctx.outbound[self.groups].send(make_valued(ctx.step, i))
        return None


class GroupSink(Executor):
    valued = Input(ScoredGroup)  # consumes the base, like the trainer
    scored = Input(ScoredGroup)

    def __init__(self, *, name="sink"):
        super().__init__(name=name)
        self.received: list[tuple[str, int, ScoredGroup]] = []

    def step(self, ctx):
        for port in (self.valued, self.scored):
            self.received += [(port.name, ctx.step, item) for item in ctx.inbound[port]]
        return None


def _subclass_graph():
    # one output port of ValuedGroup, fanned out to a channel of the subclass and one of its base
    return Graph([ValuedProducer(name="critic"), GroupSink()],
                 [Channel("valued", "critic", "sink", Kind.BROADCAST, ValuedGroup, src_port="groups"),
                  Channel("scored", "critic", "sink", Kind.BROADCAST, ScoredGroup, src_port="groups")])


def test_subclass_payload_crosses_ranks_bit_for_bit(tmp_path):
    received = spawn(_run, 2, _subclass_graph, 2, tmp_path)[1]["sink"]
    for step in range(2):
        valued = sorted((it for p, s, it in received if p == "valued" and s == step), key=lambda it: it.index)
        scored = sorted((it for p, s, it in received if p == "scored" and s == step), key=lambda it: it.index)
        assert [it.index for it in valued] == [it.index for it in scored] == [0, 1, 2, 3]
        for got in valued:  # the subclass channel: every field, the extra ones included
            assert type(got) is ValuedGroup and _same_fields(got, make_valued(step, got.index), ValuedGroup)
        for got in scored:  # the base channel: a ScoredGroup with the base fields only
            assert type(got) is ScoredGroup and _same_fields(got, make_valued(step, got.index), ScoredGroup)

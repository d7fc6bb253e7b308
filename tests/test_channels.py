"""Channels over real gloo ranks: exact round trips, broadcast, streaming order, lagged delivery."""
from __future__ import annotations

import torch

from channels.channel import Channel
from channels.kinds import Kind
from controller.graph import Graph
from controller.job import run_job
from controller.spawn import spawn
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
    events = [line for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert len(events) == 3  # one controller "step" span per rank
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

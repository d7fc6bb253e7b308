"""Graph validation: every wiring mistake is refused at build time with a message naming it."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from tidal.channels.channel import Channel
from tidal.channels.kinds import Kind
from tidal.controller.graph import Graph
from tidal.executors.base import Input, Output
from tests.toy import Item, Producer, Relay, Sink


@pytest.fixture
def three():
    return [Producer(), Relay(), Sink()]


def test_valid_graph_with_lagged_cycle(three):
    Graph(three, [Channel("items", "producer", "relay", Kind.SCATTER, Item),
                  Channel("back", "relay", "sink", Kind.GATHER, Item)])


@pytest.mark.parametrize("channels,message", [
    ([Channel("items", "producer", "nobody", Kind.SCATTER, Item)],
     "channel 'items': unknown destination executor 'nobody' (known: producer, relay, sink)"),
    ([Channel("items", "producer", "relay", Kind.SCATTER, dict)],
     "channel 'items' carries dict, but producer.items produces Item"),
    ([Channel("items", "producer", "relay", Kind.SCATTER, Item, dst_port="nope")],
     "channel 'items': executor 'relay' has no input port 'nope' (it has: items)"),
    ([Channel("items", "producer", "relay", Kind.SCATTER, Item)],
     "executor 'sink': input 'back' has no channel; it would wait forever"),
    ([Channel("items", "producer", "relay", Kind.SCATTER, Item),
      Channel("items", "relay", "sink", Kind.GATHER, Item, src_port="back", dst_port="back")],
     "two channels are named 'items'"),
    ([Channel("items", "producer", "relay", Kind.SCATTER, Item, lag=2),
      Channel("back", "relay", "sink", Kind.GATHER, Item)],
     "channel 'items': lag 2; a channel is consumed in the step it is produced (lag 0) or in the next (lag 1)"),
])
def test_wiring_errors(three, channels, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Graph(three, channels)


def test_same_step_cycle_is_refused_and_named():
    a, b = Relay(name="a"), Relay(name="b")
    with pytest.raises(ValueError, match="cycle a -> b -> a cannot make progress"):
        Graph([a, b], [Channel("ab", "a", "b", Kind.GATHER, Item, src_port="back", dst_port="items"),
                       Channel("ba", "b", "a", Kind.GATHER, Item, src_port="back", dst_port="items")])
    # the same cycle with one lagged channel is fine (delivered at the next step)
    Graph([Relay(name="a"), Relay(name="b")],
          [Channel("ab", "a", "b", Kind.GATHER, Item, src_port="back", dst_port="items"),
           Channel("ba", "b", "a", Kind.GATHER, Item, src_port="back", dst_port="items", lag=1)])


def test_scatter_needs_an_index_field():
    from dataclasses import dataclass

    from tidal.executors.base import Executor, Input, Output

    @dataclass
    class NoIndex:
        x: int

    class Out(Executor):
        o = Output(NoIndex)

        def step(self, ctx):
            return None

    class In(Executor):
        o = Input(NoIndex)

        def step(self, ctx):
            return None

    with pytest.raises(ValueError, match="SCATTER routes by `index`, which NoIndex lacks"):
        Graph([Out(name="out"), In(name="in")], [Channel("o", "out", "in", Kind.SCATTER, NoIndex)])


def test_feedback_channel_may_close_a_same_step_cycle():
    Graph([Relay(name="a"), Relay(name="b")],
          [Channel("ab", "a", "b", Kind.GATHER, Item, src_port="back", dst_port="items"),
           Channel("ba", "b", "a", Kind.GATHER, Item, src_port="back", dst_port="items", feedback=True)])


@dataclass
class RichItem(Item):
    """A payload subclass: the toy Item plus one field."""

    score: float = 0.0


class RichProducer(Producer):
    items = Output(RichItem)


class RichRelay(Relay):
    items = Input(RichItem)


@pytest.mark.parametrize("payload", [RichItem, Item])
def test_producer_of_a_subclass_feeds_a_consumer_of_the_base(payload):
    # the channel may carry the subclass (the consumer reads it as an Item) or the base (the
    # subclass's extra field stays behind): both are what the consumer asked for
    graph = Graph([RichProducer(), Relay(forward=False)],
                  [Channel("items", "producer", "relay", Kind.SCATTER, payload)])
    assert graph.channels[0].payload is payload


@pytest.mark.parametrize("payload,message", [
    (Item, "channel 'items' carries Item, but relay.items consumes RichItem, which Item does not extend"),
    (RichItem, "channel 'items' carries RichItem, but producer.items produces Item, which does not extend "
               "RichItem"),
])
def test_consumer_of_a_subclass_is_refused_a_base(payload, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        Graph([Producer(), RichRelay(forward=False)],
              [Channel("items", "producer", "relay", Kind.SCATTER, payload)])

from enum import Enum


class Kind(str, Enum):
    """How items of a channel are routed from source units to destination units."""

    BROADCAST = "broadcast"  # every item to every destination rank
    SCATTER = "scatter"  # item -> destination unit `item.index % n_units` (fixed, never by arrival)
    GATHER = "gather"  # every item to destination unit 0
    WEIGHTS = "weights"  # trainer shards -> generator shards, delivered at the step barrier

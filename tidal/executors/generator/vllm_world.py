"""Build a vLLM engine inside our split world, on the generator's ranks only.

vLLM's `init_distributed_environment` reuses an initialised torch.distributed world and builds its
world, tp and pp groups over `range(get_world_size())`: all our ranks. `new_group` then blocks,
because the reward and trainer ranks never call it (docs/architecture.md "Measured here").
While the engine is built we make vLLM see the generator's ranks as the world: `get_world_size()`
answers their count and every `new_group` synchronises its members only. vLLM's own layout then
reads our replicas as its "external data parallel" dimension (each replica = one tp group of its
own, generating independently), which is exactly a generator of `replicas x tp` ranks.

vLLM's teardown ends by destroying the default process group (its own, in a vLLM-only job);
`keep_default_group` lets it destroy its groups and keeps ours.

Side effects contained here: `LLM(seed=...)` reseeds the process RNGs (restored afterwards).
Not contained, and harmless on a generator rank: vLLM's CPU worker replaces `torch.set_num_threads`
(our ranks pin their threads before), and `external_launcher` sets VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""
from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist


def check_first_ranks(ranks: Sequence[int]) -> None:
    """vLLM numbers its world 0..n-1 with the global ranks: the generator must own the first ranks."""
    if list(ranks) != list(range(len(ranks))):
        raise ValueError(f"generator.engine=vllm needs the generator on the first global ranks 0..{len(ranks) - 1}, "
                         f"but it has {list(ranks)}: list the generator first in the graph's executors")


@contextlib.contextmanager
def generator_world(ranks: Sequence[int]) -> Iterator[None]:
    """Inside: torch.distributed looks like a world of the generator's ranks only (see module doc)."""
    check_first_ranks(ranks)
    size, real_size, real_new_group = len(ranks), dist.get_world_size, dist.new_group

    def get_world_size(group=None):
        return size if group is None else real_size(group)

    def new_group(ranks=None, *args, **kwargs):
        kwargs["use_local_synchronization"] = True  # members only: the other executors never call it
        return real_new_group(list(range(size)) if ranks is None else ranks, *args, **kwargs)

    rng = (torch.random.get_rng_state(), random.getstate(), np.random.get_state())
    world_env = os.environ.get("WORLD_SIZE")
    dist.get_world_size, dist.new_group = get_world_size, new_group
    os.environ["WORLD_SIZE"] = str(size)
    try:
        yield
    finally:
        dist.get_world_size, dist.new_group = real_size, real_new_group
        if world_env is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = world_env
        torch.random.set_rng_state(rng[0])
        random.setstate(rng[1])
        np.random.set_state(rng[2])


@contextlib.contextmanager
def keep_default_group() -> Iterator[None]:
    """Inside: `destroy_process_group()` of the default group does nothing (named groups still go)."""
    real = dist.destroy_process_group

    def destroy_process_group(group=None):
        if group is not None:
            real(group)

    dist.destroy_process_group = destroy_process_group
    try:
        yield
    finally:
        dist.destroy_process_group = real

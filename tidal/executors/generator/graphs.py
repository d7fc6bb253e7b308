"""The decode step in buckets, and on CUDA one captured graph per bucket (nano-vllm's layout).

A decode step's device work (Slots.decode_on_device) has fixed shapes once its rows and its key width are fixed:
so the decoding slots are padded to a bucket (1, 2, 4, 8, ... rows) with the scratch slot, which has always ended
(it feeds pads and writes nothing), and the step reads the store's whole length. On CUDA each bucket's step is
captured once per call and replayed: a replay launches the eager step's kernels on the same addresses, so it
gives the eager step's bits, with the host's work per token down to filling the bucket's row ids. Elsewhere (CPU,
Ascend) the same bucketed step runs eagerly: what the CPU tests check (tests/test_slots.py: a bucketed decode
gives the samples of the plain one).

Not captured: exact numerics (its attention plans its items on the host from the rows' positions) and an MoE
model's routing record (its router hooks append on the host): both decode eagerly.
"""
from __future__ import annotations

import torch

from tidal.executors.generator.slots import Slots

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bucket(rows: int) -> int:
    """The smallest bucket that holds `rows` (a multiple of 1,024 past the largest)."""
    return next((b for b in BUCKETS if b >= rows), -(-rows // BUCKETS[-1]) * BUCKETS[-1])


class DecodeGraphs:
    def __init__(self, slots: Slots, *, capture: bool):
        self.slots, self.capture = slots, capture
        self.rows: dict[int, torch.Tensor] = {}  # bucket -> its static row ids (the graph's input)
        self.fed: dict[int, torch.Tensor] = {}  # bucket -> its step's fed_B (the graph's output)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for every bucket's graph

    def decode(self, slots: list[int]) -> torch.Tensor:
        """Slots.decode for these slots, by their bucket's step: fed_B of the slots."""
        s, n = self.slots, len(slots)
        b = bucket(n)
        s.hpos[slots] += 1
        if b not in self.rows:
            self.rows[b] = torch.full((b,), s.scratch, dtype=torch.long, device=s.engine.device)
            if self.capture:
                try:
                    self._capture(b)
                except RuntimeError as e:  # a step this stack cannot capture decodes eagerly, in the same buckets
                    print(f"tidal: native engine: CUDA graph capture failed, decoding eagerly ({e})", flush=True)
                    self.capture = False
                    self.graphs.pop(b, None)
        ids = torch.tensor(slots + [s.scratch] * (b - n), dtype=torch.long)
        self.rows[b].copy_(ids, non_blocking=True)
        if b in self.graphs:
            self.graphs[b].replay()
        else:
            self.fed[b] = s.decode_on_device(self.rows[b], width=s.S)
        return self.fed[b][:n]

    def _capture(self, b: int) -> None:
        """Capture bucket b's step over scratch rows only (warm-up and capture then change no sample's state)."""
        s = self.slots
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s.decode_on_device(self.rows[b], width=s.S)  # warm-up: the store's layers exist before the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fed[b] = s.decode_on_device(self.rows[b], width=s.S)
        self.pool = graph.pool()
        self.graphs[b] = graph

"""The WEIGHTS channel: trainer ranks push parameters straight to the generator ranks that need them.

The plan is fixed at bind time: generator unit u is fed by trainer unit u % n_trainer_units, and
every rank of that trainer unit holds the full (replicated) parameters, so no rank ever gathers the
model to relay it. Parameters are packed into one persistent flat buffer per dtype on each side,
allocated once and reused every step; one p2p message per dtype.
Consumed one step later (lag 1): the generator receives at the start of step k+1 what the trainer
pushed at the end of step k, so generation never starts with stale weights.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist

from channels.channel import Channel, Route


def _layout(named: Iterable[tuple[str, torch.Tensor]]) -> dict[torch.dtype, list[tuple[str, torch.Size]]]:
    by_dtype = defaultdict(list)
    for name, t in named:
        by_dtype[t.dtype].append((name, t.shape))
    return dict(sorted(by_dtype.items(), key=lambda kv: str(kv[0])))


class WeightsSender:
    def __init__(self, *, channel: Channel, route: Route, store, rank: int, device: torch.device):
        self.channel, self.route, self.rank, self.device = channel, route, rank, device
        n_src = len(route.src_units)
        my_unit = next(i for i, u in enumerate(route.src_units) if rank in u)
        # trainer unit i feeds generator units i, i + n_src, ...; inside a trainer unit its ranks
        # split those generator ranks between them
        targets = [r for u_idx, unit in enumerate(route.dst_units) if u_idx % n_src == my_unit for r in unit]
        mine = route.src_units[my_unit]
        self.targets = targets[mine.index(rank)::len(mine)]
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._pending: list[dist.Work] = []
        self.deliverable = True
        self.bytes_sent = 0

    def open_step(self, step: int, *, deliverable: bool = True) -> None:
        self.step, self.deliverable = step, deliverable

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Pack and isend; returns without waiting (the controller's flush waits)."""
        if not (self.deliverable and self.targets):
            return
        named = [(n, t.detach()) for n, t in named_tensors]
        for dtype, entries in _layout(named).items():
            tensors = [t for n, t in named if t.dtype == dtype]
            numel = sum(t.numel() for t in tensors)
            buf = self._buffers.get(dtype)
            if buf is None or buf.numel() != numel:
                buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
            torch.cat([t.reshape(-1) for t in tensors], out=buf)
            for dst in self.targets:
                self._pending.append(dist.isend(buf, dst, tag=self.route.channel_id))
                self.bytes_sent += buf.numel() * buf.element_size()

    def close_step(self) -> None:
        pass

    def flush(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()


class WeightsReceiver:
    def __init__(self, *, channel: Channel, route: Route, store, rank: int, device: torch.device):
        self.channel, self.route, self.rank, self.device = channel, route, rank, device
        n_src = len(route.src_units)
        my_unit = next(i for i, u in enumerate(route.dst_units) if rank in u)
        src_unit = route.src_units[my_unit % n_src]
        targets = [r for u_idx, unit in enumerate(route.dst_units) if u_idx % n_src == my_unit % n_src
                   for r in unit]
        self.source = src_unit[targets.index(rank) % len(src_unit)]  # mirrors WeightsSender.targets
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self.expected = False

    def open_step(self, step: int, *, expected: bool = True) -> None:
        self.step, self.expected = step, expected

    def receive(self, like: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Receive this step's weights, shaped like `like` (name, tensor); [] when none are due."""
        if not self.expected:
            return []
        like = list(like)
        out = []
        for dtype, entries in _layout(like).items():
            numel = sum(shape.numel() for _, shape in entries)
            buf = self._buffers.get(dtype)
            if buf is None or buf.numel() != numel:
                buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
            dist.recv(buf, self.source, tag=self.route.channel_id)
            offset = 0
            for name, shape in entries:
                out.append((name, buf[offset: offset + shape.numel()].view(shape)))
                offset += shape.numel()
        return out

    def close_step(self) -> None:
        pass

    def flush(self) -> None:
        pass

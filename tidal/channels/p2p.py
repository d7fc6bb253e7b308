"""Point-to-point messages, a rank's messages to itself included.

gloo and nccl refuse a send to one's own rank (gloo: "Pair is not connected"), and executors that
share a rank (`placement=colocated`) send each other items and weights. Such a message is handed
over in process memory: a per-(group, tag) queue, taken in posting order, as p2p matching takes
messages between two ranks. A send to oneself completes at once, so it never waits for its receive.
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
import torch.distributed as dist

_mailbox: dict[tuple, deque] = defaultdict(deque)


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _FromSelf:
    """A receive from this rank: it takes the message when waited on (the send has been posted by then:
    every caller posts a round's sends before waiting on its receives)."""

    def __init__(self, buf: torch.Tensor, key: tuple):
        self.buf, self.key, self.done = buf, key, False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            queue = _mailbox[self.key]
            assert queue, f"rank {dist.get_rank()}: a receive from itself (tag {self.key[1]}) has no message posted"
            _bytes(self.buf).copy_(queue.popleft())  # p2p carries bytes: the two ends' views may differ
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class _TakenFromSelf:
    """A message from this rank, taken as it was posted (no copy into a buffer): `message` once waited."""

    def __init__(self, key: tuple):
        self.key, self.message = key, None

    def wait(self, timeout=None) -> bool:
        if self.message is None:
            queue = _mailbox[self.key]
            assert queue, f"rank {dist.get_rank()}: a take from itself (tag {self.key[1]}) has no message posted"
            self.message = queue.popleft()
        return True

    def is_completed(self) -> bool:
        return self.message is not None


def take_from_self(*, group=None, tag: int = 0) -> _TakenFromSelf:
    """The next message this rank sent itself on (group, tag), the sent bytes themselves: with
    `owned` sends, a view of the sender's tensor. In posting order, among irecvs from itself too."""
    return _TakenFromSelf((group, tag))


def isend(tensor: torch.Tensor, dst: int, *, group=None, tag: int = 0, owned: bool = False):
    """`owned`: nobody writes `tensor` after this (a message packed for it), so a send to oneself keeps
    it instead of a copy."""
    if dst == dist.get_rank():
        _mailbox[(group, tag)].append(_bytes(tensor) if owned else _bytes(tensor).clone())
        return _Done()
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int, *, group=None, tag: int = 0):
    if src == dist.get_rank():
        return _FromSelf(tensor, (group, tag))
    return dist.irecv(tensor, src, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int, *, group=None, tag: int = 0) -> None:
    irecv(tensor, src, group=group, tag=tag).wait()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.is_contiguous(), "p2p messages are contiguous tensors"
    return tensor.reshape(-1).view(torch.uint8)

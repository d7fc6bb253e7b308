"""The resharding weight push's execution: `WeightPush` carries out a `PushPlan`
(tidal/channels/push_plan.py) on one rank.

Buckets received straight into their destination go first, every receive posted at once (they
need no buffer), so the link never waits for the receiver to turn around. The buffered buckets
follow in rounds; each stream has two bucket buffers, allocated on the first push and reused: a
sender packs bucket r while bucket r - 1 is on the wire, a receiver has bucket r + 1 flowing in
while it unpacks bucket r. A relay forwards each bucket as it lands. Messages between two ranks
are posted in the same order on both sides, so p2p matching needs no tags (nccl has none). The
stream graph is acyclic (trainer -> replica -> replica), so no deadlock.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, MutableMapping

import torch
import torch.distributed as dist

from tidal.channels import p2p
from tidal.channels.push_plan import Box, Bucket, Piece, PushPlan, Stream


def _view(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


class WeightPush:
    """Runs a `PushPlan` on one rank. Buffers are allocated on the first `run` and reused.

    Trainer ranks pass {trainer name: local shard} (`to_local()` of DTensor parameters), generator
    ranks {trainer name: local shard to receive into} (a row block of an engine's stacked tensor
    will do: tests/names.py). Ranks in neither layout have nothing to do.
    """

    def __init__(self, plan: PushPlan, *, rank: int, device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, tag: int = 0, side: str = "both"):
        """`tag`: keeps these messages apart from other p2p traffic between the same ranks (gloo
        matches by tag; nccl has none and relies on the same posting order on both sides).
        `side`: "send" (the trainer's pieces), "receive" (a generator's, relays included) or "both";
        a rank that hosts both executors (placement=colocated) runs one of each."""
        assert side in ("send", "receive", "both"), side
        self.plan, self.rank, self.device, self.group, self.tag = plan, rank, torch.device(device), group, tag
        sends, receives = side != "receive", side != "send"
        # a stream whose receiver is its head leaves the trainer; the others are relay legs between
        # replicas (a rank may be both a trainer's and a replica's when they share it)
        self.outgoing = [s for s in plan.sent_by(rank) if s.origin == rank and s.receiver == s.head] if sends else []
        self.incoming = sorted(plan.received_by(rank), key=lambda s: (s.origin, s.sender)) if receives else []
        self.forwards = {s.origin: [f for f in plan.sent_by(rank) if f.origin == s.origin and f.receiver != f.head]
                         for s in self.incoming}
        self._buffers: dict[tuple, torch.Tensor] = {}  # (stream, slot) -> bytes

    @staticmethod
    def _dst_view(tensors, p: Piece) -> torch.Tensor:
        return tensors[p.name][_view(p.dst_slice)]

    def _buffer(self, stream: Stream, slot: int) -> torch.Tensor:
        key = _key(stream, slot)
        if key not in self._buffers:
            size = max(b.nbytes for b in stream.buckets if not (b.src_direct and b.dst_direct))  # either end
            self._buffers[key] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self._buffers[key]

    @property
    def streams(self) -> int:
        """Streams this rank packs or receives; each owns two bucket buffers."""
        return len(self.outgoing) + len(self.incoming)

    @property
    def buffer_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    @torch.no_grad()
    def run(self, tensors: MutableMapping[str, torch.Tensor]) -> None:
        """One push: returns when this rank's sends and receives are complete.

        A receiving rank that is also the sender of a whole destination tensor (placement=colocated,
        same layout and dtype) finds the sender's tensor in its place in `tensors` afterwards, not
        copied into the old one: the sender posted a view of its own shard (WeightsSender), which
        nothing writes until the receiver's next push; its engine then samples with that memory.

        Two phases, in the same order on both ends of every link: first the buckets received
        straight into their destination (every receive posted at once: they need no buffer),
        then the buffered ones in rounds (two buffers per stream)."""
        pending: dict[tuple, list[dist.Work]] = defaultdict(list)  # sends out of a buffer
        try:
            direct = [(s, [b for b in s.buckets if b.dst_direct]) for s in self.incoming]
            posted = [(s, b, self._post_direct(tensors, s, b)) for s, buckets in direct for b in buckets]
            for s in self.outgoing:
                for r, bucket in enumerate(b for b in s.buckets if b.dst_direct):
                    self._send(tensors, s, bucket, slot=r % 2, pending=pending)
            for s, bucket, (buf, work) in posted:
                self._received(tensors, s, bucket, buf, work, key="direct", pending=pending)
            self._buffered_rounds(tensors, pending)
        finally:
            for works in pending.values():
                _wait(works)

    @torch.no_grad()
    def pack(self, tensors: Mapping[str, torch.Tensor], *, copy: bool = True) -> list[tuple[int, torch.Tensor]]:
        """This rank's messages of one push, for a rank that only sends (a trainer rank): [(receiver,
        bytes)] in the order `run` posts them on the other end (per link: the direct buckets, then the
        rounds). copy=True: every message copied out of `tensors` (the lagged push of the offpolicy
        schedule: the weights change before the generator takes them, steps later). copy=False: a
        bucket that is one contiguous run of its source tensor is a view of it, not a copy (the
        co-located sync push: nothing writes the weights before the generator takes them, at its
        next step's start, and a copy would hold a second model's worth of memory until then)."""
        assert not self.incoming, f"rank {self.rank} receives in this push: pack() is for side='send'"
        messages = []
        for s in self.outgoing:
            for bucket in [b for b in s.buckets if b.dst_direct] + [b for b in s.buckets if not b.dst_direct]:
                if bucket.src_direct and not copy:
                    p = self.plan.pieces[bucket.entries[0][0]]
                    view = _contiguous_view(tensors[p.name][_view(p.src_slice)])
                    messages.append((s.receiver, view.reshape(-1).view(torch.uint8)))
                    continue
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
                for i, offset in bucket.entries:
                    p = self.plan.pieces[i]
                    _typed(buf, offset, p).copy_(tensors[p.name][_view(p.src_slice)])
                messages.append((s.receiver, buf))
        return messages

    def _buffered_rounds(self, tensors, pending) -> None:
        incoming = [(s, [b for b in s.buckets if not b.dst_direct]) for s in self.incoming]
        outgoing = [(s, [b for b in s.buckets if not b.dst_direct]) for s in self.outgoing]
        rounds = max((len(b) for _, b in incoming + outgoing), default=0)
        recvs: dict[int, list] = {}

        def post_receives(r: int) -> None:
            slot, recvs[r] = r % 2, []
            for s, buckets in incoming:
                if r < len(buckets):
                    _wait(pending.pop(_key(s, slot), []))  # this buffer's forwards of round r - 2
                    recvs[r].append((s, buckets[r], self._irecv(s, self._buffer(s, slot)[:buckets[r].nbytes])))

        if rounds:
            post_receives(0)
        for r in range(rounds):
            if r + 1 < rounds:  # the next bucket flows in while this one is unpacked
                post_receives(r + 1)
            for s, buckets in outgoing:
                if r < len(buckets):
                    self._send(tensors, s, buckets[r], slot=r % 2, pending=pending)
            for s, bucket, (buf, work) in recvs.pop(r):
                self._received(tensors, s, bucket, buf, work, key=_key(s, r % 2), pending=pending)

    def _post_direct(self, tensors, s: Stream, bucket: Bucket):
        """(buffer, work) of a bucket received straight into its destination. One this rank sends
        itself that is a whole destination tensor (placement=colocated, the same layout and dtype on
        both sides) is taken as sent (buffer None): the destination gets the sender's tensor instead
        of a copy of it, so the process holds the model once (see `run`)."""
        p = self.plan.pieces[bucket.entries[0][0]]
        dst = tensors[p.name]
        if (s.sender == self.rank and len(bucket.entries) == 1 and dst.dtype == p.dtype
                and tuple(dst.shape) == p.shape and p.dst_slice == tuple((0, n) for n in dst.shape)):
            return None, p2p.take_from_self(group=self.group, tag=self.tag)
        return self._irecv(s, self._dst_buffer(tensors, bucket))

    def _irecv(self, s: Stream, buf: torch.Tensor):
        return buf, p2p.irecv(buf, s.sender, group=self.group, tag=self.tag)

    def _dst_buffer(self, tensors, bucket: Bucket) -> torch.Tensor:
        return _contiguous_view(self._dst_view(tensors, self.plan.pieces[bucket.entries[0][0]]))

    def _send(self, tensors, s: Stream, bucket: Bucket, *, slot: int, pending) -> None:
        """isend one bucket: from the source tensor itself, or packed into buffer `slot`."""
        pieces = self.plan.pieces
        if bucket.src_direct:
            p = pieces[bucket.entries[0][0]]
            view = _contiguous_view(tensors[p.name][_view(p.src_slice)])
            pending["direct"].append(p2p.isend(view, s.receiver, group=self.group, tag=self.tag))
            return
        buf = self._buffer(s, slot)
        _wait(pending.pop(_key(s, slot), []))  # this buffer's send of two buckets ago
        for i, offset in bucket.entries:
            p = pieces[i]
            _typed(buf, offset, p).copy_(tensors[p.name][_view(p.src_slice)])
        pending[_key(s, slot)].append(p2p.isend(buf[:bucket.nbytes], s.receiver, group=self.group, tag=self.tag))

    def _received(self, tensors, s: Stream, bucket: Bucket, buf, work, *, key, pending) -> None:
        """Wait for one bucket; forward it down the relay chain first, then unpack it (or, taken from
        this rank itself, put the sent tensor in the destination's place)."""
        work.wait()
        if buf is None:
            p = self.plan.pieces[bucket.entries[0][0]]
            buf = work.message
            tensors[p.name] = _typed(buf, 0, p)
        for f in self.forwards[s.origin]:  # relay first: the next replica waits on it
            pending[key].append(p2p.isend(buf, f.receiver, group=self.group, tag=self.tag))
        if not bucket.dst_direct:
            for i, offset in bucket.entries:
                p = self.plan.pieces[i]
                self._dst_view(tensors, p).copy_(_typed(buf, offset, p))


def _key(stream: Stream, slot: int) -> tuple:
    return stream.origin, stream.sender, stream.receiver, slot


def _contiguous_view(t: torch.Tensor) -> torch.Tensor:
    # the plan only marks pieces that are contiguous in shards laid out row-major
    if not t.is_contiguous():
        raise ValueError("a direct piece is not contiguous: pass row-major local shards (e.g. to_local())")
    return t


def _typed(buf: torch.Tensor, offset: int, piece: Piece) -> torch.Tensor:
    return buf[offset: offset + piece.nbytes].view(piece.dtype).view(piece.shape)


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()

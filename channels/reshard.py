"""The resharding weight push: trainer shards go straight to the generator shards that need them.

A `PushPlan` is built once, from the two layouts and the parameter specs, as a pure function: every
rank builds the same plan locally, with no communication. Coordinates are boxes ([start, stop) per
dim) in a parameter's full tensor:

- trainer rank (d, t) holds the tp chunk t of the split dim, and with FSDP2 the dp chunk d of dim 0
  of that (FSDP2 shards the tp-local tensor again, torch.chunk style: ceil-sized, last ones short);
- generator rank (k, t) of replica k holds the tp chunk t (replicas are identical).

A piece is the intersection of one trainer box and one generator box: (name, slice on the trainer
side, source rank, destination rank, slice on the generator side). Pieces are cut no larger than a
bucket, so no rank ever holds more than its own shards plus a few buckets: no one materialises the
model. Small pieces are packed into buckets (one message each); a big piece is a message of its
own, sent from the source tensor if it is one contiguous run there (whole rows), received into
the destination tensor if it is one there, packed or unpacked through a buffer otherwise.
Among the trainer ranks that own a piece (the dp replicas, or tp ranks for replicated parameters)
the least loaded sends it, which spreads the sending work.

Generator replicas past the trainer's full copies (dp without FSDP, 1 with FSDP) are fed by a peer:
replica k forwards every bucket it receives to replica k + copies, the moment it lands (a
pipelined chain, so each link carries the model once). `relay=False` feeds every replica from
the trainer instead.

Execution (`WeightPush`): buckets received straight into their destination go first, every
receive posted at once (they need no buffer), so the link never waits for the receiver to turn
around. The buffered buckets follow in rounds; each stream has two bucket buffers, allocated on
the first push and reused: a sender packs bucket r while bucket r - 1 is on the wire, a receiver
has bucket r + 1 flowing in while it unpacks bucket r. A relay forwards each bucket as it lands.
Messages between two ranks are posted in the same order on both sides, so p2p matching needs no
tags (nccl has none). The stream graph is acyclic (trainer -> replica -> replica), so no deadlock.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from channels.payloads import ParamSpec, chunk, local_shape  # noqa: F401  (re-exported)

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim

_ALIGN = 16  # byte offsets inside a bucket, so a uint8 slice can be viewed as any dtype


@dataclass(frozen=True)
class Slot:
    """Where a trainer parameter lands on a generator rank (see channels/names.py)."""

    name: str  # engine tensor name
    row_offset: int  # first row of this parameter's tp-local block in that tensor's local shard


def _tp_box(spec: ParamSpec, *, tp: int, t: int) -> list[tuple[int, int]]:
    box = [(0, n) for n in spec.shape]
    if spec.tp_dim is not None:
        box[spec.tp_dim] = chunk(spec.shape[spec.tp_dim], tp, t)
    return box


@dataclass(frozen=True)
class TrainerLayout:
    ranks: tuple[int, ...]  # global ranks, row-major over (dp, tp) like executors/parallel/mesh.py
    tp: int = 1
    fsdp: bool = False

    def __post_init__(self):
        if self.tp < 1 or not self.ranks or len(self.ranks) % self.tp:
            raise ValueError(f"trainer tp={self.tp} must divide its {len(self.ranks)} ranks")

    @property
    def dp(self) -> int:
        return len(self.ranks) // self.tp

    @property
    def copies(self) -> int:
        """Full copies of the model the trainer holds (FSDP2 shards one copy over dp)."""
        return 1 if self.fsdp else self.dp

    def rank(self, d: int, t: int) -> int:
        return self.ranks[d * self.tp + t]

    def box(self, spec: ParamSpec, *, d: int, t: int) -> Box:
        box = _tp_box(spec, tp=self.tp, t=t)
        if self.fsdp:
            lo, hi = box[0]
            start, stop = chunk(hi - lo, self.dp, d)
            box[0] = (lo + start, lo + stop)
        return tuple(box)


@dataclass(frozen=True)
class GeneratorLayout:
    ranks: tuple[int, ...]  # global ranks, replica-major over (replica, tp)
    tp: int = 1
    dtype: torch.dtype | None = None  # engine dtype; None: the trainer's (cast while packing)

    def __post_init__(self):
        if self.tp < 1 or not self.ranks or len(self.ranks) % self.tp:
            raise ValueError(f"generator tp={self.tp} must divide its {len(self.ranks)} ranks")

    @property
    def replicas(self) -> int:
        return len(self.ranks) // self.tp

    def rank(self, k: int, t: int) -> int:
        return self.ranks[k * self.tp + t]

    def box(self, spec: ParamSpec, *, t: int) -> Box:
        return tuple(_tp_box(spec, tp=self.tp, t=t))


@dataclass(frozen=True)
class Piece:
    name: str
    src: int  # trainer rank that sends it
    dst: int  # generator rank it is cut for (the head of a relay chain)
    src_slice: Box  # in the source's local shard
    dst_slice: Box  # in the destination's local shard (trainer naming, see channels/names.py)
    dtype: torch.dtype  # as sent: the generator's dtype
    # a big piece that is one contiguous run in the source shard (and needs no cast) is sent from
    # the tensor itself; one contiguous in the destination shard is received straight into it
    src_direct: bool = False
    dst_direct: bool = False

    @property
    def zero_copy(self) -> bool:
        """No copy on either side."""
        return self.src_direct and self.dst_direct

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.dst_slice)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """One message: pieces packed at byte offsets, or a single piece (offset 0) sent from its
    source tensor and/or received into its destination tensor."""

    entries: tuple[tuple[int, int], ...]  # (piece index, byte offset)
    nbytes: int
    src_direct: bool = False
    dst_direct: bool = False


@dataclass(frozen=True)
class Stream:
    """An ordered sequence of buckets packed by `origin` for `head`, carried sender -> receiver."""

    origin: int  # trainer rank that packs the buckets
    head: int  # generator rank the pieces were cut for
    sender: int  # origin, or the generator rank that forwards them
    receiver: int
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class PushPlan:
    trainer: TrainerLayout
    generator: GeneratorLayout
    specs: Mapping[str, ParamSpec]
    pieces: tuple[Piece, ...]
    streams: tuple[Stream, ...]
    bucket_bytes: int

    def sent_by(self, rank: int) -> list[Stream]:
        return [s for s in self.streams if s.sender == rank]

    def received_by(self, rank: int) -> list[Stream]:
        return [s for s in self.streams if s.receiver == rank]

    def bytes_sent(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for s in self.streams:
            out[s.sender] += sum(b.nbytes for b in s.buckets)
        return dict(out)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _shift(box: Box, origin: Box) -> Box:
    return tuple((lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def _cut(box: Box, max_numel: int) -> Iterator[Box]:
    """Split `box` into row blocks of at most `max_numel` elements (recursing into a row if needed)."""
    if math.prod(hi - lo for lo, hi in box) <= max_numel:
        yield box
        return
    (lo, hi), rest = box[0], box[1:]
    inner = math.prod(b - a for a, b in rest)
    if inner <= max_numel:
        step = max_numel // inner
        for start in range(lo, hi, step):
            yield ((start, min(start + step, hi)), *rest)
    else:
        for row in range(lo, hi):
            for sub in _cut(rest, max_numel):
                yield ((row, row + 1), *sub)


def build_plan(*, specs: Mapping[str, ParamSpec], trainer: TrainerLayout, generator: GeneratorLayout,
               bucket_bytes: int = 16 << 20, relay: bool = True, zero_copy_min_bytes: int | None = 1 << 16) -> PushPlan:
    """The push plan for these layouts: which rank sends which slice to whom, bucketed.

    zero_copy_min_bytes: a piece at least this big that is one contiguous run in the source shard
    (a block of whole rows, typically; and no dtype cast) is sent from the source tensor without
    packing; one that is a contiguous run in the destination shard is received into the destination
    tensor without unpacking. Both: no copy and no buffer at all. (FSDP row halves into tp column
    halves are contiguous on the generator side only.) Smaller pieces share buckets so they cost
    one message. None: bucket everything.
    """
    if set(trainer.ranks) & set(generator.ranks):
        raise ValueError(f"trainer ranks {trainer.ranks} and generator ranks {generator.ranks} overlap")
    if bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least 1024)")
    fed = min(generator.replicas, trainer.copies) if relay else generator.replicas  # by the trainer
    load = {r: 0 for r in trainer.ranks}
    order = {r: i for i, r in enumerate(trainer.ranks)}
    pieces: list[Piece] = []
    for name, spec in specs.items():
        if len(spec.shape) == 0:
            raise ValueError(f"{name!r}: 0-d parameters are not supported")
        dtype = generator.dtype or spec.dtype
        max_numel = max(1, bucket_bytes // dtype.itemsize)
        owners: dict[Box, list[int]] = defaultdict(list)  # identical trainer boxes: the dp replicas
        for d in range(trainer.dp):
            for t in range(trainer.tp):
                owners[trainer.box(spec, d=d, t=t)].append(trainer.rank(d, t))
        for k in range(fed):
            for t in range(generator.tp):
                gbox = generator.box(spec, t=t)
                for tbox, ranks in owners.items():
                    both = _intersect(tbox, gbox)
                    if both is None:
                        continue
                    for sub in _cut(both, max_numel):
                        src = min(ranks, key=lambda r: (load[r], order[r]))
                        src_slice, dst_slice = _shift(sub, tbox), _shift(sub, gbox)
                        big = (zero_copy_min_bytes is not None
                               and math.prod(b - a for a, b in sub) * dtype.itemsize >= zero_copy_min_bytes)
                        piece = Piece(name, src, generator.rank(k, t), src_slice, dst_slice, dtype,
                                      src_direct=big and dtype == spec.dtype and _contiguous(src_slice, tbox),
                                      dst_direct=big and _contiguous(dst_slice, gbox))
                        load[src] += piece.nbytes
                        pieces.append(piece)
    streams = _streams(pieces, generator, fed=fed, bucket_bytes=bucket_bytes)
    return PushPlan(trainer, generator, dict(specs), tuple(pieces), streams, bucket_bytes)


def _contiguous(box: Box, within: Box) -> bool:
    """Is `box` one contiguous run of a row-major tensor shaped like `within`?"""
    extents = [(b - a, hi - lo) for (a, b), (lo, hi) in zip(box, within)]
    first = next((i for i, (e, _) in enumerate(extents) if e > 1), len(extents))
    return all(e == n for e, n in extents[first + 1:])


def _streams(pieces: list[Piece], generator: GeneratorLayout, *, fed: int, bucket_bytes: int) -> tuple[Stream, ...]:
    by_pair: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, p in enumerate(pieces):
        by_pair[(p.src, p.dst)].append(i)
    streams = []
    for (src, dst), indices in sorted(by_pair.items()):
        buckets, entries, offset = [], [], 0
        for i in indices:
            nbytes = pieces[i].nbytes
            if pieces[i].src_direct or pieces[i].dst_direct:  # a message of its own
                buckets.append(Bucket(((i, 0),), nbytes, src_direct=pieces[i].src_direct,
                                      dst_direct=pieces[i].dst_direct))
                continue
            if entries and offset + nbytes > bucket_bytes:
                buckets.append(Bucket(tuple(entries), offset))
                entries, offset = [], 0
            entries.append((i, offset))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        if entries:
            buckets.append(Bucket(tuple(entries), offset))
        streams.append(Stream(origin=src, head=dst, sender=src, receiver=dst, buckets=tuple(buckets)))
    # replica k >= fed: its rank at tp position t gets everything replica k - fed's rank got
    heads = list(streams)
    for k in range(fed, generator.replicas):
        for t in range(generator.tp):
            upstream, me = generator.rank(k - fed, t), generator.rank(k, t)
            head = generator.rank(k % fed, t)
            for s in heads:
                if s.receiver == head:
                    streams.append(Stream(origin=s.origin, head=head, sender=upstream, receiver=me,
                                          buckets=s.buckets))
    return tuple(streams)


def _view(box: Box) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in box)


class WeightPush:
    """Runs a `PushPlan` on one rank. Buffers are allocated on the first `run` and reused.

    Trainer ranks pass {trainer name: local shard} (`to_local()` of DTensor parameters); generator
    ranks pass {engine name: local shard} with `slots` mapping trainer names into engine tensors
    (channels/names.py; identity by default). Ranks in neither layout have nothing to do.
    """

    def __init__(self, plan: PushPlan, *, rank: int, device: torch.device | str = "cpu",
                 slots: Mapping | None = None, group: dist.ProcessGroup | None = None, tag: int = 0):
        """`tag`: keeps these messages apart from other p2p traffic between the same ranks (gloo
        matches by tag; nccl has none and relies on the same posting order on both sides)."""
        self.plan, self.rank, self.device, self.group, self.tag = plan, rank, torch.device(device), group, tag
        self.outgoing = [s for s in plan.sent_by(rank) if s.origin == rank]  # packed here
        self.incoming = sorted(plan.received_by(rank), key=lambda s: (s.origin, s.sender))
        self.forwards = {s.origin: [f for f in plan.sent_by(rank) if f.origin == s.origin]
                         for s in self.incoming}
        if slots is None:
            slots = {name: Slot(name, 0) for name in plan.specs}
        self.slots = slots
        self._buffers: dict[tuple, torch.Tensor] = {}  # (stream, slot) -> bytes

    def _dst_view(self, tensors, p: Piece) -> torch.Tensor:
        where = self.slots[p.name]
        box = ((p.dst_slice[0][0] + where.row_offset, p.dst_slice[0][1] + where.row_offset), *p.dst_slice[1:])
        return tensors[where.name][_view(box)]

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
    def run(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """One push: returns when this rank's sends and receives are complete.

        Two phases, in the same order on both ends of every link: first the buckets received
        straight into their destination (every receive posted at once: they need no buffer),
        then the buffered ones in rounds (two buffers per stream)."""
        pending: dict[tuple, list[dist.Work]] = defaultdict(list)  # sends out of a buffer
        try:
            direct = [(s, [b for b in s.buckets if b.dst_direct]) for s in self.incoming]
            posted = [(s, b, self._irecv(s, self._dst_buffer(tensors, b)))
                      for s, buckets in direct for b in buckets]
            for s in self.outgoing:
                for r, bucket in enumerate(b for b in s.buckets if b.dst_direct):
                    self._send(tensors, s, bucket, slot=r % 2, pending=pending)
            for s, bucket, (buf, work) in posted:
                self._received(tensors, s, bucket, buf, work, key="direct", pending=pending)
            self._buffered_rounds(tensors, pending)
        finally:
            for works in pending.values():
                _wait(works)

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

    def _irecv(self, s: Stream, buf: torch.Tensor):
        return buf, dist.irecv(buf, s.sender, group=self.group, tag=self.tag)

    def _dst_buffer(self, tensors, bucket: Bucket) -> torch.Tensor:
        return _contiguous_view(self._dst_view(tensors, self.plan.pieces[bucket.entries[0][0]]))

    def _send(self, tensors, s: Stream, bucket: Bucket, *, slot: int, pending) -> None:
        """isend one bucket: from the source tensor itself, or packed into buffer `slot`."""
        pieces = self.plan.pieces
        if bucket.src_direct:
            p = pieces[bucket.entries[0][0]]
            view = _contiguous_view(tensors[p.name][_view(p.src_slice)])
            pending["direct"].append(dist.isend(view, s.receiver, group=self.group, tag=self.tag))
            return
        buf = self._buffer(s, slot)
        _wait(pending.pop(_key(s, slot), []))  # this buffer's send of two buckets ago
        for i, offset in bucket.entries:
            p = pieces[i]
            _typed(buf, offset, p).copy_(tensors[p.name][_view(p.src_slice)])
        pending[_key(s, slot)].append(dist.isend(buf[:bucket.nbytes], s.receiver, group=self.group, tag=self.tag))

    def _received(self, tensors, s: Stream, bucket: Bucket, buf, work, *, key, pending) -> None:
        """Wait for one bucket; forward it down the relay chain first, then unpack it."""
        work.wait()
        for f in self.forwards[s.origin]:  # relay first: the next replica waits on it
            pending[key].append(dist.isend(buf, f.receiver, group=self.group, tag=self.tag))
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

"""The resharding weight push's plan: which trainer rank sends which slice of which parameter to which
generator rank, bucketed (tidal/channels/push.py carries it out).

A `PushPlan` is built once, from the two layouts and the parameter specs, as a pure function: every
rank builds the same plan locally, with no communication. Coordinates are boxes ([start, stop) per
dim) in a parameter's full tensor:

- trainer rank (d, t) holds the tp chunk t of the split dim, and with FSDP2 the dp chunk d of dim 0
  of that (FSDP2 shards the tp-local tensor again, torch.chunk style: ceil-sized, last ones short);
- generator rank (k, t) of replica k holds the tp chunk t (replicas are identical);
- with pipeline stages (trainer.pp), trainer rank (d, s, t) holds only the parameters of stage s
  (tidal/modeling/megatron/stages.py: a pure function of the HF name), so only that stage's ranks own them.

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
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from tidal.channels.payloads import ParamSpec, chunk, hf_layers, hf_stage

Box = tuple[tuple[int, int], ...]  # [start, stop) per dim

_ALIGN = 16  # byte offsets inside a bucket, so a uint8 slice can be viewed as any dtype


def _tp_box(spec: ParamSpec, *, tp: int, t: int) -> list[tuple[int, int]]:
    box = [(0, n) for n in spec.shape]
    if spec.tp_dim is not None:
        box[spec.tp_dim] = chunk(spec.shape[spec.tp_dim], tp, t)
    return box


@dataclass(frozen=True)
class TrainerLayout:
    ranks: tuple[int, ...]  # global ranks, row-major over (dp, pp, tp) like tidal/modeling/parallel/mesh.py
    tp: int = 1
    fsdp: bool = False
    ep: int = 1  # dp rank d holds experts chunk d % ep of a parameter with an experts dim (ParamSpec.ep_dim)
    pp: int = 1  # pipeline stages per unit

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1 or not self.ranks or len(self.ranks) % (self.tp * self.pp):
            stages = f" x pp={self.pp}" if self.pp > 1 else ""
            raise ValueError(f"trainer tp={self.tp}{stages} must divide its {len(self.ranks)} ranks")

    @property
    def dp(self) -> int:
        return len(self.ranks) // (self.tp * self.pp)


    @property
    def copies(self) -> int:
        """Full copies of the model the trainer holds (FSDP2 shards one copy over dp)."""
        return 1 if self.fsdp else self.dp

    def rank(self, d: int, t: int, s: int = 0) -> int:
        return self.ranks[(d * self.pp + s) * self.tp + t]

    def box(self, spec: ParamSpec, *, d: int, t: int) -> Box:
        box = _tp_box(spec, tp=self.tp, t=t)
        if spec.ep_dim is not None and self.ep > 1:
            box[spec.ep_dim] = chunk(spec.shape[spec.ep_dim], self.ep, d % self.ep)
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
    dst_slice: Box  # in the destination's local shard
    dtype: torch.dtype  # as sent: the generator's dtype
    # a big piece that is one contiguous run in the source shard (and needs no cast) is sent from
    # the tensor itself; one contiguous in the destination shard is received straight into it
    src_direct: bool = False
    dst_direct: bool = False

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
    if bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes={bucket_bytes} is too small (at least 1024)")
    fed = min(generator.replicas, trainer.copies) if relay else generator.replicas  # by the trainer
    cutter = _Cutter(trainer, generator, bucket_bytes=bucket_bytes, zero_copy_min_bytes=zero_copy_min_bytes)
    layers = hf_layers(specs)
    for name, spec in specs.items():
        if len(spec.shape) == 0:
            raise ValueError(f"{name!r}: 0-d parameters are not supported")
        owners: dict[Box, list[int]] = defaultdict(list)  # identical trainer boxes: the dp replicas
        stage = hf_stage(name, layers=layers, pp=trainer.pp)
        for d in range(trainer.dp):
            for t in range(trainer.tp):
                owners[trainer.box(spec, d=d, t=t)].append(trainer.rank(d, t, stage))
        for k in range(fed):
            for t in range(generator.tp):
                gbox = generator.box(spec, t=t)
                for tbox, ranks in owners.items():
                    if (both := _intersect(tbox, gbox)) is not None:
                        cutter.add(name, spec, both, tbox=tbox, gbox=gbox, ranks=ranks, dst=generator.rank(k, t))
    pieces = cutter.pieces
    streams = _streams(pieces, generator, fed=fed, bucket_bytes=bucket_bytes)
    return PushPlan(trainer, generator, dict(specs), tuple(pieces), streams, bucket_bytes)


class _Cutter:
    """build_plan's pieces: an overlap of a trainer box and a generator box, cut to the buckets' size,
    each part sent by the least-loaded trainer rank that holds it (fewest bytes so far, then rank order)."""

    def __init__(self, trainer: TrainerLayout, generator: GeneratorLayout, *, bucket_bytes: int,
                 zero_copy_min_bytes: int | None):
        self.generator, self.bucket_bytes, self.zero_copy_min_bytes = generator, bucket_bytes, zero_copy_min_bytes
        # shared ranks (placement=colocated): a piece whose destination rank also holds it is taken there,
        # a local copy (tidal/channels/p2p.py), not sent from another rank
        self.shared = set(trainer.ranks) & set(generator.ranks)
        self.load = {r: 0 for r in trainer.ranks}
        self.order = {r: i for i, r in enumerate(trainer.ranks)}
        self.pieces: list[Piece] = []

    def add(self, name: str, spec: ParamSpec, both: Box, *, tbox: Box, gbox: Box, ranks: list[int], dst: int) -> None:
        dtype = self.generator.dtype or spec.dtype
        local = dst in self.shared and dst in ranks
        # a piece a rank sends itself, contiguous on both sides and not cast, is handed over
        # whole (no bucket, no copy: tidal/channels/push.py): not cut to the buckets' size
        whole = (local and dtype == spec.dtype and _contiguous(_shift(both, tbox), tbox)
                 and _contiguous(_shift(both, gbox), gbox))
        for sub in [both] if whole else _cut(both, max(1, self.bucket_bytes // dtype.itemsize)):
            src = dst if local else min(ranks, key=lambda r: (self.load[r], self.order[r]))
            src_slice, dst_slice = _shift(sub, tbox), _shift(sub, gbox)
            big = (self.zero_copy_min_bytes is not None
                   and math.prod(b - a for a, b in sub) * dtype.itemsize >= self.zero_copy_min_bytes)
            piece = Piece(name, src, dst, src_slice, dst_slice, dtype,
                          src_direct=big and dtype == spec.dtype and _contiguous(src_slice, tbox),
                          dst_direct=big and _contiguous(dst_slice, gbox))
            self.load[src] += piece.nbytes
            self.pieces.append(piece)


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

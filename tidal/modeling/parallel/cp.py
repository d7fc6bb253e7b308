"""Context parallel (trainer.cp): the tokens of one packed row split over the cp ranks of a unit.

    cp = context_groups(ranks=env.ranks, cp=cfg.cp, tp=cfg.tp, parent=env.group)
    logps = forward(mb, model, cp=cp, temperature=1.0, chunk=1024, entropy=False)

Split. The row, padded at its end to 2·cp·S tokens, is cut into 2·cp chunks of S; rank c holds chunks
c and 2cp-1-c (zigzag), so under causal attention every rank has about the same number of
query-key pairs (an early chunk sees few keys, its partner at the end many).

What runs where. Everything but attention is per token (embedding, norms, MLP, rotary by each token's
position id), so a rank runs the model on its 2S tokens alone. Attention needs the row's keys: each
layer all-gathers the keys and values of the cp group (their heads only, a GQA model's few), and the
rank's queries attend them through the rows of the pack's own mask (`PackMask.mask_mod`, the
sliding window by position as `_windowed` does) that are theirs. The gather's backward sums over the
group the gradients every rank's queries put on a key, so each rank gets its keys' whole gradient.
The queries go in tiles, each over only the keys it may see (`ContextRows.tiles`): causality hides the
later chunks from an early one and a shared prompt's responses hide each other, so a rank computes about
its share of the single rank's block kernel's scores, not 2S x the row. All-gather rather than a ring of
K/V blocks: on gloo nothing overlaps a send with compute, the keys of a row are small beside its
activations (2·kv_heads·head_dim a token a layer against the hidden states' and the MLP's ~10·hidden),
and a query's arithmetic stays the same sums over the same keys as at cp=1 (masked keys weigh exactly 0).

The head and the loss. Each rank computes the log-probs (and entropy) of the response tokens its own
rows predict; they are gathered into the row's order, so the loss, its statistics and every metric
see the whole row on every cp rank exactly as at cp=1: the objective knows nothing of cp. Because
every cp rank computes the same loss, the gather's backward hands each rank the gradient of its own
tokens alone (summing the cp copies would count the loss cp times).

Gradients. A rank's parameter gradients are then the part of its own tokens. To the layout the cp
ranks are dp ranks: the ("dp", "tp") mesh's dp dimension spans dp x cp, replicas sum their
gradients over it at the step (or FSDP2 shards over it and reduce-scatters with SUM), so the parts
add up to the row's gradient; the WEIGHTS channel sees the same dp x cp copies (one push each).
The step's records sum over `data`, the ranks holding the same place of every unit: cp copies of a
record would count it cp times.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tidal.modeling import moe
from tidal.modeling.batching import ResponseLogprobs
from tidal.modeling.head import Entropy, TokenLogprobs, chunked_head
from tidal.modeling.packed_attention import PackMask, packed_forward
from tidal.modeling.parallel.mesh import check_group_counts, mesh_ranks


@dataclass(frozen=True)
class ContextGroups:
    group: dist.ProcessGroup  # this rank's cp peers: its unit's ranks of its tp index
    data: dist.ProcessGroup  # the ranks at this rank's place in every unit (its cp and tp index)
    rank: int  # this rank's place in `group`
    size: int


def context_groups(*, ranks: Sequence[int], cp: int, tp: int,
                   parent: dist.ProcessGroup | None = None) -> ContextGroups:
    """The cp group and the data group over `ranks` laid out [dp, cp, tp] row-major (a unit is cp x tp
    consecutive ranks), created members-only like tidal/modeling/parallel/mesh.py's: cp column, then data column."""
    grid = mesh_ranks(ranks, tp=cp * tp).view(-1, cp, tp)
    check_group_counts(ranks, parent)
    d, c, t = (grid == dist.get_rank()).nonzero()[0].tolist()
    group = dist.new_group(grid[d, :, t].tolist(), use_local_synchronization=True)
    data = dist.new_group(grid[:, c, t].tolist(), use_local_synchronization=True)
    return ContextGroups(group=group, data=data, rank=c, size=cp)


def chunk_of(L: int, cp: int) -> int:
    """S: the row of L tokens padded to 2·cp·S."""
    return max(1, -(-L // (2 * cp)))


def local_positions(c: int, *, cp: int, S: int) -> torch.Tensor:
    """Rank c's places in the padded row: chunk c, then chunk 2cp-1-c."""
    return torch.cat([torch.arange(c * S, (c + 1) * S), torch.arange((2 * cp - 1 - c) * S, (2 * cp - c) * S)])


def owners(rows_K: torch.Tensor, *, cp: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rank holding each row place, its place among that rank's 2S)."""
    chunk_K = rows_K // S
    late = chunk_K >= cp
    owner_K = torch.where(late, 2 * cp - 1 - chunk_K, chunk_K)
    return owner_K, rows_K - chunk_K * S + late * S


class _GatherKeys(torch.autograd.Function):
    """[1, K, 2S, D] of each rank -> [1, K, cp·2S, D] in rank order; backward: the sum over ranks of the
    gradient on this rank's part (every rank's queries read every key)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter; a row's keys are small
        return grad.chunk(ctx.size, dim=2)[ctx.rank].contiguous(), None, None, None


class _GatherReplicated(torch.autograd.Function):
    """[M] of each rank -> [cp, M], for a computation every rank then repeats alike (the loss): backward
    takes this rank's row of the gradient, the same on every rank, and adds nothing from the others."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank = rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank], None, None, None


TILE = 128  # queries per attention call (tidal/modeling/packed_attention.py's tile, measured there)


@dataclass(eq=False)
class ContextRows:
    """What a layer's attention gets for this rank's share of a packed row (in place of the row's
    PackMask: tidal/modeling/packed_attention.py calls `attend`)."""
    pack: PackMask  # the whole row's
    L: int  # the row's real tokens (the rest is padding at its end)
    mine_Q: torch.Tensor  # this rank's places in the padded row
    keys_K: torch.Tensor  # the place of each gathered key (the ranks' places, in rank order)
    cp: ContextGroups
    _masks: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.mine_Q.numel()

    def mask(self, window: int | None, device) -> torch.Tensor:
        """[2S, cp·2S] bool. Padding sits at the row's end, after every real query, so causality alone
        keeps it from them; a padding query sees the row's last segment and itself (no empty row)."""
        q, k = self.mine_Q.to(device)[:, None], self.keys_K.to(device)[None, :]
        qi, ki = q.clamp(max=self.L - 1), k.clamp(max=self.L - 1)
        m = self.pack.mask_mod(None, None, qi, ki) & (k <= q)
        if window is not None:
            pos = (self.pack.pos_L if self.pack.pos_L is not None else torch.arange(self.L)).to(device)
            m = m & (pos[qi] - pos[ki] < window)
        return m

    def tiles(self, window: int | None, device) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first query, end, the keys any of them sees, their mask) per TILE queries. SDPA computes a masked
        score as it computes any other, so each tile takes only the keys it may see (causality hides the later
        chunks from an early one, a shared prompt's responses hide each other): the scores of the row's
        blocks, about what the single rank's block kernel computes, instead of 2S x cp·2S."""
        key = (window, str(device))
        if key not in self._masks:
            m = self.mask(window, device)
            out = []
            for a in range(0, m.shape[0], TILE):
                sub = m[a:a + TILE]
                keys = sub.any(0).nonzero()[:, 0]
                out.append((a, a + sub.shape[0], keys, sub[:, keys]))
            self._masks[key] = out
        return self._masks[key]

    def attend(self, q_1HQD, k_1KQD, v_1KQD, *, scaling, dropout: float = 0.0, window: int | None = None):
        k_1KLD, v_1KLD = (_GatherKeys.apply(x, self.cp.group, self.cp.rank, self.cp.size) for x in (k_1KQD, v_1KQD))
        # enable_gqa: the row's keys stay at their KV heads (repeat_kv would keep H/K copies of them for the backward)
        gqa = q_1HQD.shape[1] != k_1KLD.shape[1]
        return torch.cat([
            F.scaled_dot_product_attention(q_1HQD[:, :, a:b], k_1KLD.index_select(2, keys), v_1KLD.index_select(2, keys),
                                           attn_mask=m, dropout_p=dropout, scale=scaling, enable_gqa=gqa)
            for a, b, keys, m in self.tiles(window, q_1HQD.device)], dim=2)


def forward(mb, model, *, cp: ContextGroups, temperature: float, chunk: int = 0,
            entropy: Entropy = False) -> ResponseLogprobs:
    """`mb.forward` (a PackedMicroBatch, tidal/modeling/packing.py) with the row's tokens split over cp:
    the same ResponseLogprobs on every cp rank."""
    from tidal.modeling.attention import for_packed_rows

    if mb.routes is not None:
        raise ValueError("trainer.cp > 1 with a mixture-of-experts model's recorded routing is not built; "
                         "set trainer.cp=1")
    device, C, c = mb.input_ids_1L.device, cp.size, cp.rank
    L = mb.input_ids_1L.shape[1]
    S = chunk_of(L, C)
    pad = 2 * C * S - L
    ids_1L = F.pad(mb.input_ids_1L, (0, pad))  # token 0 as padding: no real token attends it
    pos_L = mb.position_ids_1L[0]
    pos_L = torch.cat([pos_L, pos_L[-1] + torch.arange(1, pad + 1, device=device)])
    mine_Q = local_positions(c, cp=C, S=S).to(device)
    rows = ContextRows(pack=mb.pack, L=L, mine_Q=mine_Q, cp=cp,
                       keys_K=torch.cat([local_positions(r, cp=C, S=S) for r in range(C)]).to(device))
    head_rows = HeadRows.of(mb, cp=C, rank=c, S=S)
    for_packed_rows(model)
    out = []
    head = chunked_head(model, select=lambda h_1KH: h_1KH[0], targets_K=head_rows.targets, temperature=temperature,
                        chunk=chunk, entropy=entropy, out=out)
    moe.set_given(model, None)
    with packed_forward(rows), head:
        model(input_ids=ids_1L[:, mine_Q], position_ids=pos_L[mine_Q][None], logits_to_keep=head_rows.keep,
              use_cache=False)
    logp_K = head_rows.gathered(out[0].logp_K, cp)
    ent_K = None
    if out[0].entropy_K is not None:
        with contextlib.nullcontext() if entropy == "grad" else torch.no_grad():
            ent_K = head_rows.gathered(out[0].entropy_K, cp)
    return ResponseLogprobs.scatter(TokenLogprobs(logp_K, ent_K), mb.mask_NT)


@dataclass(frozen=True)
class HeadRows:
    """The response tokens this rank's rows predict (in mask_NT order), and where each of the row's lands among
    the ranks' gathered [cp, M]: its owner's row, its rank among the owner's."""
    keep: torch.Tensor  # this rank's places that reach the LM head (one, dropped after, where it has none)
    targets: torch.Tensor
    n: int  # how many are real
    M: int  # the most any rank has
    src_K: torch.Tensor  # each of the row's K tokens' place in the gathered [cp, M], flattened

    @classmethod
    def of(cls, mb, *, cp: int, rank: int, S: int) -> "HeadRows":
        owner_K, place_K = owners(mb.rows_K, cp=cp, S=S)
        mine_K = owner_K == rank
        keep, targets = place_K[mine_K], mb.targets_NT[mb.mask_NT][mine_K]
        n, M = keep.numel(), max(1, int(torch.bincount(owner_K, minlength=cp).max()))
        if n == 0:  # nothing of this row's responses here: the head runs on one row, dropped below
            keep, targets = keep.new_zeros(1), targets.new_zeros(1)
        within_K = torch.zeros_like(owner_K)
        for r in range(cp):
            at = (owner_K == r).nonzero()[:, 0]
            within_K[at] = torch.arange(at.numel(), device=at.device)
        return cls(keep, targets, n, M, owner_K * M + within_K)

    def gathered(self, x_n: torch.Tensor, cp: ContextGroups) -> torch.Tensor:
        """This rank's values of its tokens -> the row's K, in mask_NT order (the same on every cp rank)."""
        x_M = F.pad(x_n[:self.n], (0, self.M - self.n))
        return _GatherReplicated.apply(x_M, cp.group, cp.rank, cp.size).flatten()[self.src_K]

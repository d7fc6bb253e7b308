"""Log-probs and entropy of target tokens from vocabulary-parallel logits: each tensor-parallel rank
holds logits for its slice of the vocabulary, [C, V/tp], and no rank ever holds [C, V].

    logp(t) = z_t - log sum_v exp(z_v),   z = logits - max
    d logp(t) / d z_v = 1[v = t] - p_v    (local to each rank's slice: no communication backward)

Forward: three all-reduces over tp of [C] vectors (the max, the sum of exponentials, the target's
logit from the rank that holds it). The loss that follows is the same on every tp rank, so each
rank's gradient is that of its own slice (megatron's vocab_parallel_cross_entropy does the same).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None and dist.get_world_size(group) > 1:  # tp=1: nothing to join
        dist.all_reduce(t, op=op, group=group)


class _TargetLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_CV: torch.Tensor, targets_C: torch.Tensor, start: int, group) -> torch.Tensor:
        z_CV = z_CV.detach()
        max_C = z_CV.max(dim=-1).values
        _all_reduce(max_C, group, op=dist.ReduceOp.MAX)
        exp_CV = (z_CV - max_C[:, None]).exp()
        sum_C = exp_CV.sum(dim=-1)
        _all_reduce(sum_C, group)
        local_C = targets_C - start
        mine_C = (local_C >= 0) & (local_C < z_CV.shape[-1])
        local_C = torch.where(mine_C, local_C, 0)
        target_C = torch.where(mine_C, z_CV.gather(-1, local_C[:, None])[:, 0] - max_C, 0.0)
        _all_reduce(target_C, group)
        p_CV = exp_CV.div_(sum_C[:, None])
        ctx.save_for_backward(p_CV, local_C, mine_C)
        return target_C - sum_C.log()

    @staticmethod
    def backward(ctx, grad_C: torch.Tensor):
        p_CV, local_C, mine_C = ctx.saved_tensors
        grad_CV = p_CV * -grad_C[:, None]
        grad_CV.scatter_add_(-1, local_C[:, None], torch.where(mine_C, grad_C, 0.0)[:, None])
        return grad_CV, None, None, None


def target_logprobs(z_CV: torch.Tensor, targets_C: torch.Tensor, *, start: int, group) -> torch.Tensor:
    """log_softmax over the whole vocabulary at `targets_C`, from this rank's logits `z_CV` of
    vocabulary ids [start, start + V/tp); float32 [C], the same on every rank of `group`."""
    return _TargetLogprob.apply(z_CV.float(), targets_C, start, group)


@torch.no_grad()
def entropy(z_CV: torch.Tensor, *, group) -> torch.Tensor:
    """The entropy of softmax over the whole vocabulary, from each rank's slice: [C] float32."""
    z_CV = z_CV.float()
    max_C = z_CV.max(dim=-1).values
    _all_reduce(max_C, group, op=dist.ReduceOp.MAX)
    shifted_CV = z_CV - max_C[:, None]
    exp_CV = shifted_CV.exp()
    # H = log S - sum_v p_v z_v, with S and the sum split over the ranks' slices
    sums_2C = torch.stack([exp_CV.sum(dim=-1), (exp_CV * shifted_CV).sum(dim=-1)])
    _all_reduce(sums_2C, group)
    return sums_2C[0].log() - sums_2C[1] / sums_2C[0]


def chunk_logprobs(head, h_CH: torch.Tensor, targets_C: torch.Tensor, temperature: float, entropy_too: bool, *,
                   start: int, group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tidal/modeling/head.py's per-chunk step on a vocabulary-parallel head: `head(h_CH)` gives
    this rank's logits [C, V/tp] of vocabulary ids from `start`."""
    z_CV = head(h_CH).float() / temperature
    return target_logprobs(z_CV, targets_C, start=start, group=group), entropy(z_CV, group=group) if entropy_too else None

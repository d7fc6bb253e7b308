"""What a trainer step counts (per-group records, loss sums, digests) and the local view of its
optimizer state for checkpoints."""
from __future__ import annotations

import hashlib

import torch

from channels.payloads import ScoredGroup
from executors.parallel import local

# per optimizer step: loss passes and their denominators, all-reduced over dp at each barrier
SUMS = ("loss_score", "loss_one", "loss_zero", "denom", "kl_sum", "clip_sum", "mismatch")
# per step, once per group: what was sampled and scored, and the tokens one pass trains on
RECORD = ("reward_sum", "reward_sq_sum", "samples", "len_sum", "groups", "reward_failures", "tokens")


def record(group: ScoredGroup, *, shared: bool) -> torch.Tensor:
    rewards = group.rewards.double()
    responses = float(sum(r.numel() for r in group.responses))
    # tokens one pass trains on: a shared prompt once per group, else once per sample
    tokens = (1 if shared else len(group.responses)) * group.prompt_ids.numel() + responses
    return torch.tensor([rewards.sum().item(), (rewards ** 2).sum().item(), len(group.responses), responses,
                         1.0, float(group.reward_failures), tokens], dtype=torch.float64)


def local_tensors(tree):
    """Optimizer state with this rank's shards in place of DTensors (a DTensor pickles its mesh)."""
    if isinstance(tree, dict):
        return {k: local_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_tensors(v) for v in tree]
    return local(tree) if isinstance(tree, torch.Tensor) else tree


def merge(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Sums add; the log-prob mismatch is a max."""
    i = SUMS.index("mismatch")
    out = total + part
    out[i] = max(total[i].item(), part[i].item())
    return out


def sampled_logprobs(group: ScoredGroup, idx: list[int], *, like: torch.Tensor) -> torch.Tensor:
    """The generator's sampling log-probs of samples `idx`, padded like a micro-batch's [N, T]."""
    out_NT = torch.zeros_like(like)
    for n, i in enumerate(idx):
        out_NT[n, : group.logprobs[i].numel()] = group.logprobs[i]
    return out_NT


def group_digest(group: ScoredGroup) -> str:
    h = hashlib.sha256(f"{group.index}:{group.prompt_ids.tolist()}".encode())
    for r in group.responses:
        h.update(r.to(torch.int64).numpy().tobytes() + b"|")
    return h.hexdigest()

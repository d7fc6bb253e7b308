"""Micro-batches of one prompt group and their per-token log-probs.

A micro-batch never mixes groups, and a group always splits the same way (by sample index), so the
arithmetic of a sample never depends on arrival order (DESIGN.md determinism rule 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[int, ...]  # sample indices within the group
    input_ids_NL: torch.Tensor  # [prompt, response_i], right-padded
    attention_mask_NL: torch.Tensor
    targets_NT: torch.Tensor  # response tokens, padded with 0
    mask_NT: torch.Tensor  # bool, True on real response tokens
    prompt_len: int

    @property
    def tokens(self) -> int:
        """Tokens the forward actually trains on (prompt counted once per sequence here)."""
        return int(self.attention_mask_NL.sum())

    def logprobs(self, model, *, temperature: float) -> torch.Tensor:
        return response_logprobs(model, self, temperature=temperature)


def split_group(prompt_ids_P: torch.Tensor, responses: list[torch.Tensor], *, micro_batch_size: int,
                pad_id: int, device: torch.device) -> list[MicroBatch]:
    P = prompt_ids_P.numel()
    out = []
    for start in range(0, len(responses), micro_batch_size):
        samples = tuple(range(start, min(start + micro_batch_size, len(responses))))
        resp = [responses[i] for i in samples]
        T = max(1, max(r.numel() for r in resp))
        N = len(resp)
        input_ids = torch.full((N, P + T), pad_id, dtype=torch.long)
        attn = torch.zeros((N, P + T), dtype=torch.long)
        targets = torch.zeros((N, T), dtype=torch.long)
        mask = torch.zeros((N, T), dtype=torch.bool)
        for n, r in enumerate(resp):
            R = r.numel()
            input_ids[n, :P] = prompt_ids_P
            input_ids[n, P:P + R] = r
            attn[n, :P + R] = 1
            targets[n, :R] = r
            mask[n, :R] = True
        out.append(MicroBatch(samples, input_ids.to(device), attn.to(device), targets.to(device),
                              mask.to(device), P))
    return out


def response_logprobs(model, mb: MicroBatch, *, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, [N, T] float32 (0 where masked)."""
    T = mb.targets_NT.shape[1]
    logits_NLV = model(input_ids=mb.input_ids_NL, attention_mask=mb.attention_mask_NL).logits
    # the token at position P + t is predicted by the logits at P + t - 1
    logits_NTV = logits_NLV[:, mb.prompt_len - 1: mb.prompt_len - 1 + T].float() / temperature
    logp_NT = torch.log_softmax(logits_NTV, dim=-1).gather(-1, mb.targets_NT[..., None])[..., 0]
    return logp_NT.masked_fill(~mb.mask_NT, 0.0)

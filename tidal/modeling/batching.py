"""Micro-batches of one prompt group and their per-token log-probs.

A micro-batch never mixes groups, and a group always splits the same way (by sample index), so the
arithmetic of a sample never depends on arrival order (docs/architecture.md, determinism rule 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tidal.modeling import moe
from tidal.modeling.head import Entropy, TokenLogprobs, chunked_head


class Routes(NamedTuple):
    """A group's recorded routing (tidal/modeling/moe.py unpack): long expert ids, UNRECORDED where none."""

    prompt: torch.Tensor  # [P, routed layers, k]
    responses: list[torch.Tensor]  # G x [R_i, routed layers, k]


@dataclass(frozen=True)
class MicroBatch:
    samples: tuple[int, ...]  # sample indices within the group
    input_ids_NL: torch.Tensor  # [prompt, response_i], right-padded
    attention_mask_NL: torch.Tensor
    targets_NT: torch.Tensor  # response tokens, padded with 0
    # bool, True on the response tokens trained: real and, in a multi-turn rollout, sampled by the
    # model (the environment's tokens are input, context only: never a log-prob, never a gradient)
    mask_NT: torch.Tensor
    prompt_len: int
    # an MoE model's recorded expert ids of each input token, [N, P + T, routed layers, k]
    # (UNRECORDED on padding; tidal/modeling/moe.py); None: not recorded
    routes: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Tokens the forward actually trains on (prompt counted once per sequence here)."""
        return int(self.attention_mask_NL.sum())

    def logprobs(self, model, *, temperature: float, chunk: int = 0) -> torch.Tensor:
        return self.forward(model, temperature=temperature, chunk=chunk).logp_NT

    def forward(self, model, *, temperature: float, chunk: int = 0, entropy: Entropy = False) -> ResponseLogprobs:
        """Log-probs (and entropy) of the response tokens, [N, T] float32, 0 where masked; the LM head
        runs on `chunk` tokens at a time (tidal/modeling/head.py)."""
        T = self.targets_NT.shape[1]
        out = []
        # the token at position P + t is predicted by the hidden state at P + t - 1
        keep = torch.arange(self.prompt_len - 1, self.prompt_len - 1 + T, device=self.input_ids_NL.device)
        moe.set_given(model, None if self.routes is None else self.routes.flatten(0, 1))
        with chunked_head(model, select=lambda h_NTH: h_NTH[self.mask_NT], targets_K=self.targets_NT[self.mask_NT],
                          temperature=temperature, chunk=chunk, entropy=entropy, out=out):
            model(input_ids=self.input_ids_NL, attention_mask=self.attention_mask_NL, logits_to_keep=keep, use_cache=False)
        return ResponseLogprobs.scatter(out[0], self.mask_NT)

    def values(self, model) -> torch.Tensor:
        """A one-output head's value (the critic's) at each position that predicts a response token,
        [N, T] float32, 0 where masked: the value of the state "prompt and the tokens before t"."""
        T = self.targets_NT.shape[1]
        out_NL1 = model(input_ids=self.input_ids_NL, attention_mask=self.attention_mask_NL, use_cache=False).logits
        v_NT = out_NL1[:, self.prompt_len - 1: self.prompt_len - 1 + T, 0].float()
        return torch.where(self.mask_NT, v_NT, 0.0)


def check_loss_masks(responses: list[torch.Tensor], loss_masks: list[torch.Tensor] | None) -> None:
    """A loss mask per response, of its length (RolloutGroup.loss_masks); None: every token is the model's."""
    if loss_masks is None:
        return
    if len(loss_masks) != len(responses):
        raise ValueError(f"{len(loss_masks)} loss masks for {len(responses)} responses")
    for i, (r, m) in enumerate(zip(responses, loss_masks)):
        if m.dtype != torch.bool or m.shape != r.shape:
            raise ValueError(f"loss mask {i} must be bool of shape {tuple(r.shape)} (its response's), got "
                             f"{m.dtype} {tuple(m.shape)}")


def split_group(prompt_ids_P: torch.Tensor, responses: list[torch.Tensor], *, micro_batch_size: int,
                pad_id: int, device: torch.device, loss_masks: list[torch.Tensor] | None = None,
                routes: Routes | None = None) -> list[MicroBatch]:
    """loss_masks: G x [R_i] bool, the tokens trained (the model's); None: all of them. routes: an MoE
    model's recorded routing."""
    check_loss_masks(responses, loss_masks)
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
        experts = None if routes is None else torch.full((N, P + T, *routes.prompt.shape[1:]), moe.UNRECORDED)
        for n, r in enumerate(resp):
            R = r.numel()
            input_ids[n, :P] = prompt_ids_P
            input_ids[n, P:P + R] = r
            attn[n, :P + R] = 1
            targets[n, :R] = r
            mask[n, :R] = True if loss_masks is None else loss_masks[samples[n]]
            if experts is not None:
                experts[n, :P], experts[n, P:P + R] = routes.prompt, routes.responses[samples[n]]
        out.append(MicroBatch(samples, input_ids.to(device), attn.to(device), targets.to(device),
                              mask.to(device), P, None if experts is None else experts.to(device)))
    return out


class ResponseLogprobs(NamedTuple):
    logp_NT: torch.Tensor  # float32 log_softmax(logits / T) of each response token, 0 where masked
    # float32 entropy of each response token's distribution; with a gradient only where asked with entropy="grad"
    entropy_NT: torch.Tensor | None

    @classmethod
    def scatter(cls, tokens: TokenLogprobs, mask_NT: torch.Tensor) -> "ResponseLogprobs":
        def place(x_K):
            return torch.zeros(mask_NT.shape, dtype=x_K.dtype, device=x_K.device).masked_scatter(mask_NT, x_K)

        return cls(place(tokens.logp_K), None if tokens.entropy_K is None else place(tokens.entropy_K))


def sampled_logprobs(group, idx: list[int], *, like: torch.Tensor) -> torch.Tensor:
    """The generator's sampling log-probs of samples `idx` of a rollout group, padded like a micro-batch's [N, T]."""
    out_NT = torch.zeros_like(like)
    for n, i in enumerate(idx):
        out_NT[n, : group.logprobs[i].numel()] = group.logprobs[i]
    return out_NT


def sampled_versions(group, idx: list[int], *, like: torch.Tensor) -> torch.Tensor:
    """The policy version that sampled each token of samples `idx` (RolloutGroup.versions, else its
    policy_version), [N, T] long like a micro-batch's; -1 on padding."""
    out_NT = torch.full(like.shape, -1, dtype=torch.long, device=like.device)
    for n, i in enumerate(idx):
        R = group.logprobs[i].numel()
        out_NT[n, :R] = group.versions[i].long() if group.versions is not None else group.policy_version
    return out_NT


def response_logprobs(model, mb: MicroBatch, *, temperature: float, chunk: int = 0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token, [N, T] float32 (0 where masked)."""
    return mb.logprobs(model, temperature=temperature, chunk=chunk)

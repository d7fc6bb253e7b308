"""Unpadded micro-batches of one prompt group: shared-prompt rows and varlen rows.

shared_prompt on:  one row `[prompt, r_1, ..., r_G]`; every response restarts at position P, sees the
                   whole prompt and its own past, nothing of another response (docs/architecture.md).
shared_prompt off: the G rows `[prompt, r_i]` back to back, each its own causal block (varlen).
Either way a group whose row would exceed `token_budget` splits into several rows by sample index
(greedy, in index order, so the split depends only on the group, never on arrival; docs/architecture.md
determinism rule 2), and a shared row repeats the prompt. `PackedMicroBatch` has `MicroBatch`'s
interface, so the trainer treats both alike. In a multi-turn group (loss masks) the environment's
tokens are in the row, as context, but only the model's tokens are in mask_NT and rows_K.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tidal.modeling import moe
from tidal.modeling.batching import MicroBatch, ResponseLogprobs, Routes, check_loss_masks, split_group
from tidal.modeling.head import Entropy, chunked_head
from tidal.modeling.pack_rule import auto_shared_prompt
from tidal.modeling.attention import for_packed_rows
from tidal.modeling.packed_attention import BACKENDS, Backend, PackMask, packed_forward

Mode = Literal["on", "off", "auto", "padded"]
MODES = ("on", "off", "auto", "padded")



@dataclass(frozen=True)
class PackedMicroBatch:
    samples: tuple[int, ...]  # sample indices within the group
    input_ids_1L: torch.Tensor
    position_ids_1L: torch.Tensor
    pack: PackMask
    targets_NT: torch.Tensor  # response tokens, padded with 0
    mask_NT: torch.Tensor  # bool, True on the response tokens trained (real, and the model's)
    rows_K: torch.Tensor  # the row position whose logits predict each trained response token, in mask_NT order
    # an MoE model's recorded expert ids of each row token, [L, routed layers, k] (tidal/modeling/moe.py); None: not recorded
    routes: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Tokens the forward actually trains on (a shared prompt counts once per row)."""
        return self.input_ids_1L.shape[1]

    def logprobs(self, model, *, temperature: float, chunk: int = 0) -> torch.Tensor:
        return self.forward(model, temperature=temperature, chunk=chunk).logp_NT

    def forward(self, model, *, temperature: float, chunk: int = 0, entropy: Entropy = False) -> ResponseLogprobs:
        """Log-probs (and entropy) of the response tokens, [N, T] float32, 0 where masked; the LM head
        runs on `chunk` tokens at a time (tidal/modeling/head.py)."""
        for_packed_rows(model)
        out = []
        head = chunked_head(model, select=lambda h_1KH: h_1KH[0], targets_K=self.targets_NT[self.mask_NT],
                            temperature=temperature, chunk=chunk, entropy=entropy, out=out)
        moe.set_given(model, self.routes)
        with packed_forward(self.pack), head:
            # logits_to_keep: only the K rows that predict response tokens reach the LM head
            model(input_ids=self.input_ids_1L, position_ids=self.position_ids_1L, logits_to_keep=self.rows_K,
                  use_cache=False)
        return ResponseLogprobs.scatter(out[0], self.mask_NT)

    def values(self, model) -> torch.Tensor:
        """A one-output head's value (the critic's) at each position that predicts a response token,
        [N, T] float32, 0 where masked (MicroBatch.values of the unpacked rows)."""
        for_packed_rows(model)
        with packed_forward(self.pack):
            out_1L1 = model(input_ids=self.input_ids_1L, position_ids=self.position_ids_1L, use_cache=False).logits
        v_K = out_1L1[0, self.rows_K, 0].float()
        return torch.zeros(self.mask_NT.shape, dtype=v_K.dtype, device=v_K.device).masked_scatter(self.mask_NT, v_K)


def _chunks(costs: list[int], *, fixed: int, token_budget: int) -> list[tuple[int, ...]]:
    """Greedy in index order: a row takes samples until the next would push it past the budget.

    A single sample over budget still gets a row of its own (a response cannot be split).
    """
    out, cur, used = [], [], fixed
    for i, c in enumerate(costs):
        if cur and used + c > token_budget:
            out.append(tuple(cur))
            cur, used = [], fixed
        cur.append(i)
        used += c
    out.append(tuple(cur))
    return out


def _row(prompt_ids_P, responses, samples, *, shared, backend, device, loss_masks=None,
         routes: Routes | None = None) -> PackedMicroBatch:
    P = prompt_ids_P.numel()
    lens = [responses[i].numel() for i in samples]
    N, T = len(samples), max(1, max(lens))
    ids, pos, seg, rows, spans, experts = [], [], [], [], [], []
    start = 0
    if shared:
        ids.append(prompt_ids_P)
        experts.append(routes and routes.prompt)
        pos.append(torch.arange(P))
        seg.append(torch.zeros(P, dtype=torch.long))
        spans.append((0, P))
        start = P
    for n, (i, R) in enumerate(zip(samples, lens)):
        if shared:
            # the first response token is predicted by the last prompt token, the rest by their own past
            rows.append(torch.arange(start - 1, start + R - 1))
            rows[-1][:1] = P - 1
            ids.append(responses[i])
            experts.append(routes and routes.responses[i])
            pos.append(torch.arange(P, P + R))
            seg.append(torch.full((R,), n + 1, dtype=torch.long))
            end = start + R
        else:
            rows.append(torch.arange(start + P - 1, start + P - 1 + R))
            ids += [prompt_ids_P, responses[i]]
            experts += [routes and routes.prompt, routes and routes.responses[i]]
            pos.append(torch.arange(P + R))
            seg.append(torch.full((P + R,), n, dtype=torch.long))
            end = start + P + R
        if loss_masks is not None:  # only the rows that predict the model's tokens reach the head
            rows[-1] = rows[-1][loss_masks[i]]
        if end > start:
            spans.append((start, end))
        start = end
    targets = torch.zeros((N, T), dtype=torch.long)
    mask = torch.zeros((N, T), dtype=torch.bool)
    for n, (i, R) in enumerate(zip(samples, lens)):
        targets[n, :R] = responses[i]
        mask[n, :R] = True if loss_masks is None else loss_masks[i]
    pos_L = torch.cat(pos).to(device)
    pack = PackMask(seg_L=torch.cat(seg).to(device), spans=tuple(spans), shared=shared, backend=backend, pos_L=pos_L)
    return PackedMicroBatch(samples=tuple(samples), input_ids_1L=torch.cat(ids).long()[None].to(device),
                            position_ids_1L=pos_L[None], pack=pack,
                            targets_NT=targets.to(device), mask_NT=mask.to(device),
                            rows_K=torch.cat(rows).long().to(device),
                            routes=torch.cat(experts).to(device) if routes is not None else None)


def pack_group(prompt_ids_P: torch.Tensor, responses: list[torch.Tensor], *, token_budget: int, pad_id: int,
               device: torch.device, shared_prompt: bool, backend: Backend = "auto",
               loss_masks: list[torch.Tensor] | None = None, routes: Routes | None = None) -> list[PackedMicroBatch]:
    """One group as unpadded rows of at most `token_budget` tokens (a lone over-long sample excepted).

    `pad_id` is unused (nothing is padded); kept so every micro-batcher takes the same arguments.
    loss_masks: G x [R_i] bool, the tokens trained (the model's); None: all of them. The budget
    counts every token of the row (the environment's run through the forward too).
    """
    del pad_id
    P = prompt_ids_P.numel()
    if P == 0:
        raise ValueError("packing needs a non-empty prompt (its last token predicts each response's first)")
    if not responses:
        raise ValueError("packing needs at least one response")
    if token_budget < 1:
        raise ValueError(f"trainer.token_budget must be >= 1, got {token_budget}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {backend!r}; choose one of {BACKENDS}")
    check_loss_masks(responses, loss_masks)
    lens = [r.numel() for r in responses]
    if shared_prompt:
        rows = _chunks(lens, fixed=P, token_budget=token_budget)
    else:
        rows = _chunks([P + R for R in lens], fixed=0, token_budget=token_budget)
    return [_row(prompt_ids_P, responses, samples, shared=shared_prompt, backend=backend, device=device,
                 loss_masks=loss_masks, routes=routes) for samples in rows]


def make_micro_batches(prompt_ids_P: torch.Tensor, responses: list[torch.Tensor], *, mode: Mode, token_budget: int,
                       micro_batch_size: int, pad_id: int, device: torch.device, backend: Backend = "auto",
                       loss_masks: list[torch.Tensor] | None = None,
                       routes: Routes | None = None) -> list[MicroBatch] | list[PackedMicroBatch]:
    """trainer.shared_prompt: on | off | auto pack under `token_budget`; padded is the reference `split_group`.
    loss_masks: the group's (RolloutGroup.loss_masks), None for a single-turn group. routes: an MoE
    model's recorded routing, replayed (or compared) in every forward (tidal/modeling/moe.py)."""
    if mode == "padded":
        return split_group(prompt_ids_P, responses, micro_batch_size=micro_batch_size, pad_id=pad_id, device=device,
                           loss_masks=loss_masks, routes=routes)
    if mode not in MODES:
        raise ValueError(f"trainer.shared_prompt must be one of {MODES}, got {mode!r}")
    shared = mode == "on" or (mode == "auto" and auto_shared_prompt(prompt_ids_P.numel(),
                                                                      [r.numel() for r in responses]))
    return pack_group(prompt_ids_P, responses, token_budget=token_budget, pad_id=pad_id, device=device,
                      shared_prompt=shared, backend=backend, loss_masks=loss_masks, routes=routes)

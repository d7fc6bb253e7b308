"""Log-probs and entropy of the response tokens, computed from the LM head a chunk of tokens at a time.

The full logits of a long response are the trainer's largest tensor: 8k tokens × a 152k vocabulary
is 4.9 GB in fp32, and autograd keeps as much again (the log_softmax output) for the backward.
Here the model's forward runs as usual up to the LM head, on the rows that predict response tokens
only; the head then runs on `chunk` tokens at a time, and under autograd each chunk is recomputed
in the backward (torch.utils.checkpoint), so only the hidden states [K, H] stay alive between
forward and backward. `bench/logprobs.py` measures the peak memory.

The head is reached through hooks on the model's output embeddings, inside the model's own forward:
FSDP has gathered the root's weights by then and tensor parallelism's hooks still apply, so the
chunks see exactly what the unchunked head sees.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class TokenLogprobs(NamedTuple):
    logp_K: torch.Tensor  # float32 log_softmax(logits / T) at the target tokens
    entropy_K: torch.Tensor | None  # float32 entropy of softmax(logits / T), no gradient; None unless asked


def _chunk(head: nn.Module, h_CH: torch.Tensor, targets_C: torch.Tensor, temperature: float,
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp_CV = torch.log_softmax(head(h_CH).float() / temperature, dim=-1)
    ent_C = None
    if entropy:
        with torch.no_grad():
            ent_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logp_CV.gather(-1, targets_C[:, None])[:, 0], ent_C


def head_logprobs(head: nn.Module, h_KH: torch.Tensor, targets_K: torch.Tensor, *, temperature: float,
                  chunk: int, entropy: bool = False, per_chunk: Callable = _chunk) -> TokenLogprobs:
    """The head on `chunk` tokens at a time (chunk 0: all at once, no recompute). per_chunk: one
    chunk's (logp, entropy) from (head, h_CH, targets_C, temperature, entropy); default: a head whose
    output is the whole vocabulary (executors/megatron/vocab_parallel.py has a vocabulary-parallel one)."""
    K = h_KH.shape[0]
    if chunk <= 0 or K <= chunk:  # one chunk: nothing to save by recomputing it
        return TokenLogprobs(*per_chunk(head, h_KH, targets_K, temperature, entropy))
    logps, ents = [], []
    for s in range(0, K, chunk):
        args = (head, h_KH[s:s + chunk], targets_K[s:s + chunk], temperature, entropy)
        logp_C, ent_C = (checkpoint(per_chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                         else per_chunk(*args))
        logps.append(logp_C)
        ents.append(ent_C)
    return TokenLogprobs(torch.cat(logps), torch.cat(ents) if entropy else None)


@contextmanager
def chunked_head(model: nn.Module, *, select: Callable[[torch.Tensor], torch.Tensor], targets_K: torch.Tensor,
                 temperature: float, chunk: int, entropy: bool, out: list):
    """Within this context, the model's forward gives its head a one-row input (its logits output is
    [.., 1, V]) and appends to `out` the TokenLogprobs of the hidden states `select(h)` picks, with
    `targets_K` their target tokens."""
    head = model.get_output_embeddings()
    active = [True]  # off once the forward's own head call is served: the chunks call the head again

    def take_input(module, args):
        if not active[0]:
            return None
        (h,) = args
        active.append(select(h))
        return (h[..., :1, :],)  # one row, not none: DTensor sharding fails on an empty dim

    def compute(module, args, output):
        if not active[0]:
            return None
        active[0] = False
        out.append(head_logprobs(module, active.pop(), targets_K, temperature=temperature, chunk=chunk,
                                 entropy=entropy))
        # tensor parallel gathers the head's (one-row) output asynchronously, and nothing reads it:
        # an op on it waits for the gather, which torch otherwise reports as unwaited at exit
        return output.clone()

    # prepend: see the hidden states before tensor parallelism's input hook turns them into a DTensor
    handles = [head.register_forward_pre_hook(take_input, prepend=True), head.register_forward_hook(compute)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

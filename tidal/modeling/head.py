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

A low-precision head (trainer.precision=bf16) computes its logits in float32 (`fp32_logits`): bf16
logits keep 8 significant bits (0.125 apart near 20), and that rounding alone moved a sampled
token's log-prob by up to 0.12 (mean 0.019) on SmolLM2-135M (bench/bf16_gap.py). The inputs (bf16 hidden states and weights) are exact in float32, so the generator's head
(`Fp32Head`, tidal/executors/generator/native_engine.py) and this one compute the same product.
"""
from __future__ import annotations

import contextlib
from contextlib import contextmanager
from typing import Callable, Literal, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


# a forward's entropy: none, without a gradient (a metric), or "grad": through the logits (an entropy bonus in the loss)
Entropy = Literal[False, True, "grad"]


class TokenLogprobs(NamedTuple):
    logp_K: torch.Tensor  # float32 log_softmax(logits / T) at the target tokens
    # float32 entropy of softmax(logits / T), None unless asked; with a gradient where asked with entropy="grad"
    # (an entropy bonus in the loss, algorithm.entropy_coef), else without
    entropy_K: torch.Tensor | None


def fp32_logits(head: nn.Module, h_CH: torch.Tensor, *, weight_VH: torch.Tensor | None = None) -> torch.Tensor:
    """The head's logits [C, V] in float32. A float32 head runs as itself (bit for bit as before); a
    low-precision nn.Linear head multiplies its inputs cast to float32 (exact), so no logit is
    rounded to bf16. weight_VH: the head's weight already in float32 (the generator caches it).
    Under tensor parallelism (a DTensor weight, vocabulary-sharded) the product is a DTensor
    whose full tensor is gathered, as ColwiseParallel(output_layouts=Replicate()) does."""
    from torch.distributed.tensor import DTensor, Replicate  # here: importing this module stays light

    from tidal.modeling.numerics import linear_for

    w = head.weight
    if w.dtype == torch.float64:  # a float64 model (the tests' references) keeps its precision
        return head(h_CH)
    if w.dtype == torch.float32 or not isinstance(head, nn.Linear):
        return head(h_CH).float()
    linear = linear_for(head)  # exact numerics: rows padded as every other product
    w32 = weight_VH if weight_VH is not None else w.float()
    bias = None if head.bias is None else head.bias.float()
    if isinstance(w, DTensor):
        if not isinstance(h_CH, DTensor):  # replicated over tp, as the module's input hook would make it
            h_CH = DTensor.from_local(h_CH, w.device_mesh, [Replicate()] * w.device_mesh.ndim, run_check=False)
        return linear(h_CH.float(), w32, bias).full_tensor()
    return linear(h_CH.float(), w32, bias)


class Fp32Head:
    """Makes a low-precision LM head return float32 logits (`fp32_logits`) for a model that only runs forward
    (the generator's), in place of its own product: the head's forward is this object's (a hook after it
    would compute the bf16 logits first and throw them away: a 151,936 x 896 product a decode step on
    Qwen2.5). Its float32 weight is cast once and kept, not cast per call (the cast of a 49k x 576 bf16 head
    took 14x its bf16 product here); `refresh()` drops it after a push (the WEIGHTS channel may receive
    straight into the weight's storage, which no version counter sees), and an in-place change through torch
    ops re-casts it too."""

    def __init__(self, head: nn.Module):
        self.head, self._key, self._weight_VH = head, None, None
        head.forward = self.forward  # an instance attribute: nn.Module.__call__ runs it, hooks included

    @classmethod
    def install(cls, model: nn.Module) -> "Fp32Head | None":
        """The replacement, or None where the head is float32 (or float64) already, vocabulary-sharded (DTensor: the
        generator's tp > 1 keeps its bf16 head) or not a Linear."""
        from torch.distributed.tensor import DTensor

        head = model.get_output_embeddings()
        if (head is None or not isinstance(head, nn.Linear) or head.weight.dtype in (torch.float32, torch.float64)
                or isinstance(head.weight, DTensor)):
            return None
        return cls(head)

    def refresh(self) -> None:
        self._key = self._weight_VH = None

    def weight(self) -> torch.Tensor:
        w = self.head.weight
        key = (w.data_ptr(), w._version)
        if key != self._key or self._weight_VH is None:
            self._key, self._weight_VH = key, w.detach().float()
        return self._weight_VH

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return fp32_logits(self.head, h, weight_VH=self.weight())


def _chunk(head: nn.Module, h_CH: torch.Tensor, targets_C: torch.Tensor, temperature: float,
           entropy: Entropy) -> tuple[torch.Tensor, torch.Tensor | None]:
    """entropy: False, True (no gradient), or "grad" (through the logits, for a loss that uses it)."""
    logp_CV = torch.log_softmax(fp32_logits(head, h_CH) / temperature, dim=-1)
    ent_C = None
    if entropy:
        with contextlib.nullcontext() if entropy == "grad" else torch.no_grad():
            ent_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logp_CV.gather(-1, targets_C[:, None])[:, 0], ent_C


def head_logprobs(head: nn.Module, h_KH: torch.Tensor, targets_K: torch.Tensor, *, temperature: float,
                  chunk: int, entropy: Entropy = False, per_chunk: Callable = _chunk) -> TokenLogprobs:
    """The head on `chunk` tokens at a time (chunk 0: all at once, no recompute). per_chunk: one
    chunk's (logp, entropy) from (head, h_CH, targets_C, temperature, entropy); default: a head whose
    output is the whole vocabulary (tidal/modeling/megatron/vocab_parallel.py has a vocabulary-parallel one)."""
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
                 temperature: float, chunk: int, entropy: Entropy, out: list):
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

"""trainer.activation_checkpointing (tidal/modeling/parallel/ac.py): the same log-probs and gradients as
without it, fewer saved activations, and a deep copy (the old policy) that runs its own layers.
Under tensor parallel and FSDP2: tests/test_parallel.py (the `+ac` layouts)."""
from __future__ import annotations

import copy

import pytest
import torch

from tidal.modeling.parallel import apply_ac, has_ac
from tidal.modeling.packing import make_micro_batches
from tests.test_parallel import tiny


def _group():
    g = torch.Generator().manual_seed(5)
    return torch.randint(1, 96, (7,), generator=g), [torch.randint(1, 96, (n,), generator=g) for n in (6, 11, 3, 9)]


def _step(model, mode):
    """Log-probs of a group's micro-batches and the gradient of a weighted sum of them."""
    prompt_P, responses = _group()
    model.zero_grad()
    logps, loss = [], 0
    for mb in make_micro_batches(prompt_P, responses, mode=mode, token_budget=4096, micro_batch_size=8, pad_id=0,
                                 device=torch.device("cpu")):
        logp_NT = mb.logprobs(model, temperature=1.0)
        logps.append(logp_NT.detach())
        loss = loss + (logp_NT * torch.arange(1, logp_NT.shape[1] + 1)).sum()
    loss.backward()
    return torch.cat([l.flatten() for l in logps]), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["padded", "off", "on"])
def test_checkpointing_equals_off(mode):
    plain, checkpointed = tiny("qwen3").train(), apply_ac(tiny("qwen3").train())
    assert has_ac(checkpointed) and not has_ac(plain)
    logp, grads = _step(plain, mode)
    logp_ac, grads_ac = _step(checkpointed, mode)
    assert torch.equal(logp_ac, logp)  # the forward is the same forward
    err = max(((grads_ac[n] - grads[n]).abs().max() / grads[n].abs().max()).item() for n in grads)
    assert err < 1e-6, err


def _saved_bytes(model) -> int:
    prompt_P, responses = _group()
    mb = make_micro_batches(prompt_P, responses, mode="off", token_budget=4096, micro_batch_size=8, pad_id=0,
                            device=torch.device("cpu"))[0]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mb.logprobs(model, temperature=1.0).sum()
    return sum(seen.values())


def test_checkpointing_keeps_fewer_activations():
    plain, checkpointed = _saved_bytes(tiny("qwen3").train()), _saved_bytes(apply_ac(tiny("qwen3").train()))
    assert checkpointed < plain / 2, (checkpointed, plain)


def test_a_deep_copy_runs_its_own_layers():
    policy = apply_ac(tiny("qwen3"))
    old = copy.deepcopy(policy)
    assert has_ac(old)
    with torch.no_grad():
        for p in old.parameters():
            p.mul_(0.5)
    before, _ = _step(policy, "off")
    assert not torch.equal(_step(old, "off")[0], before)  # the copy's weights, not the policy's

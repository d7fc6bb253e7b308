"""The megatron backend's pieces so far (tidal/modeling/megatron/, issue 18): HF <-> megatron conversion
for Qwen3, Qwen2 and Llama; megatron-core's GPTModel against the HF model at tensor-parallel 1 and
2 on gloo, built over 2 of 3 ranks on the trainer's own process groups (a split world); the CPU
shims (each still needed, each working). One spawn of 3 ranks serves every family and layout."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

from tidal.modeling.megatron.convert import Layout, shard, to_hf, to_megatron, unshard
from tidal.common.spawn import spawn


def _configs() -> dict[str, transformers.PretrainedConfig]:
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    return {"qwen3-tied": transformers.Qwen3Config(**small, head_dim=16, tie_word_embeddings=True),
            "qwen2-bias": transformers.Qwen2Config(**small, tie_word_embeddings=False),
            "llama-untied": transformers.LlamaConfig(**small, tie_word_embeddings=False)}


def _hf(config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases start at 1 and 0: make every tensor tell its place
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("family", list(_configs()))
def test_hf_to_megatron_and_back_is_bit_exact(family):
    config = _configs()[family]
    hf = _hf(config).state_dict()
    lay = Layout.of(config)
    meg = to_megatron(hf, lay)
    back = to_hf(meg, lay)
    assert set(back) == set(hf)
    for name, t in hf.items():
        assert torch.equal(back[name], t), name
    # the fused layouts: query group g's q heads, then its k and v; fc1 is [gate; up]
    d, qpg = lay.head_dim, lay.q_per_group
    qkv = meg["decoder.layers.1.self_attention.linear_qkv.weight"]
    group1 = qkv[(qpg + 2) * d:(qpg + 2) * 2 * d]
    assert torch.equal(group1[:qpg * d], hf["model.layers.1.self_attn.q_proj.weight"][qpg * d:2 * qpg * d])
    assert torch.equal(group1[qpg * d:(qpg + 1) * d], hf["model.layers.1.self_attn.k_proj.weight"][d:2 * d])
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:config.intermediate_size], hf["model.layers.0.mlp.gate_proj.weight"])
    assert ("output_layer.weight" in meg) == (not config.tie_word_embeddings)


def test_shards_put_whole_query_groups_and_gate_up_halves_on_each_rank():
    config = _configs()["qwen3-tied"]
    lay = Layout.of(config)
    meg = to_megatron(_hf(config).state_dict(), lay)
    parts = [shard(meg, lay, tp=2, rank=r) for r in (0, 1)]
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([p[name] for p in parts]), meg[name])
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    gate_up = [p[fc1].chunk(2) for p in parts]
    assert torch.equal(torch.cat([g for g, _ in gate_up]), meg[fc1].chunk(2)[0])
    proj = "decoder.layers.0.self_attention.linear_proj.weight"
    assert torch.equal(torch.cat([p[proj] for p in parts], dim=1), meg[proj])
    assert all(torch.equal(a, meg[k]) for k, a in unshard(parts, lay).items())
    with pytest.raises(ValueError, match="must divide"):
        shard(meg, lay, tp=4, rank=0)
    with pytest.raises(ValueError, match="qwen3, qwen2, llama"):
        Layout.of(transformers.GPT2Config())


def causal_mask(seq: int) -> torch.Tensor:
    """megatron's mask convention: True = not attended; [1, 1, S, S]."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]


def _nll(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    logp_BTV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    return -logp_BTV.gather(-1, ids_BT[:, 1:, None]).mean()


def _ranks_main():
    """World of 3: rank 0 stands for another executor; ranks 1-2 are the trainer, at tp=2 (one
    model over both) and at tp=1 (a model each, dp=2), on groups the trainer made itself."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, out, trainer = dist.get_rank(), {}, [1, 2]
    # every rank creates every group, in the same order
    pair = dist.new_group(trainer)
    single = [dist.new_group([r]) for r in range(3)]
    if rank not in trainer:
        dist.barrier()
        return out
    from megatron.core.tensor_parallel import random as mrandom

    from tidal.modeling.megatron import shims
    from tidal.modeling.megatron.groups import process_groups
    from tidal.modeling.megatron.model import build, load_hf

    # each shim is still needed: megatron's own call fails on a CPU-only torch without it
    for name, call in (("current_device", torch.cuda.current_device), ("rng_state", mrandom._get_cuda_rng_state)):
        try:
            call()
            out[f"needs_{name}"] = False
        except (AssertionError, RuntimeError):
            out[f"needs_{name}"] = True
    shims.apply()
    layouts = {1: process_groups(tp=single[rank], dp=pair, single=single[rank]),
               2: process_groups(tp=pair, dp=single[rank], single=single[rank])}
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(13)[None].expand(2, -1)
    for family, config in _configs().items():
        hf = _hf(config)
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
        for tp, groups in layouts.items():
            shims.seed_tracker(0)
            model = build(config, tp=tp, groups=groups, parallel_output=False).eval()
            load_hf(model, hf.state_dict(), config, tp=tp, rank=trainer.index(rank) % tp)
            with torch.no_grad():
                logits = model(input_ids=ids, position_ids=pos, attention_mask=causal_mask(13))
            out[f"{family}/tp{tp}"] = (logits - ref).abs().max().item()
            # one backward of the log-likelihood of the next tokens: megatron's gradients, joined
            # over tp and mapped back to HF names, against HF's
            model.zero_grad()
            _nll(model(input_ids=ids, position_ids=pos, attention_mask=causal_mask(13)), ids).backward()
            mine = {n: p.grad for n, p in model.named_parameters()}
            parts = [None] * tp
            dist.all_gather_object(parts, mine, group=groups.tp)
            grads = to_hf(unshard(parts, Layout.of(config), grads=True), Layout.of(config))
            hf.zero_grad()
            _nll(hf(input_ids=ids).logits, ids).backward()
            ref_grads = {n: p.grad for n, p in hf.named_parameters()}
            if config.tie_word_embeddings:
                grads.pop("lm_head.weight")
            out[f"{family}/tp{tp}/grad"] = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
            out[f"{family}/tp{tp}/grad_scale"] = max(g.abs().max().item() for g in ref_grads.values())
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_ranks_main, 3, timeout_s=300)


def test_cpu_shims_are_needed(ranks):
    """If megatron or torch stops needing a shim, this fails and the shim goes (tidal/modeling/megatron/shims.py)."""
    assert ranks[1]["needs_current_device"] and ranks[1]["needs_rng_state"]


@pytest.mark.parametrize("family", list(_configs()))
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_logits_equal_hf(ranks, family, tp):
    for r in ranks[1:]:  # the trainer's ranks; rank 0 built nothing
        assert r[f"{family}/tp{tp}"] < 1e-5, (family, tp, r[f"{family}/tp{tp}"])


@pytest.mark.parametrize("family", list(_configs()))
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_gradients_equal_hf(ranks, family, tp):
    for r in ranks[1:]:
        assert r[f"{family}/tp{tp}/grad"] < 1e-5 * max(1.0, r[f"{family}/tp{tp}/grad_scale"]), r

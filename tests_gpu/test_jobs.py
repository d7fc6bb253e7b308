"""Whole jobs on one device, co-located (placement=colocated): the embedded GRPO job, bf16 with fp32
master weights on a 0.5B-shaped model, the vLLM engine, the tiny MoE with routing replay and LoRA;
each adds its step times to the table."""
from __future__ import annotations

import json
import statistics

import pytest
import torch
from safetensors import safe_open

from tests.e2e import launch, metrics
from tests_gpu.conftest import STEP_TIMES

COLOCATED = ("--set", "placement=colocated")
SMALL_STEP = ("--set", "data.prompts_per_step=4", "--set", "generator.samples_per_prompt=4")


def _job(name: str, out, device, *args: str, steps: int) -> list[dict]:
    proc = launch(out, *COLOCATED, *args, nproc=1, steps=steps, timeout=1200, defaults=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(steps))
    later = rows[1:] or rows
    STEP_TIMES.append([name, str(device), steps, statistics.median(r["step_s"] for r in later),
                       statistics.median(r["trainer/tokens"] / r["step_s"] for r in later)])
    return rows


def test_colocated_grpo_on_one_device(device, tmp_path):
    """The embedded job on one process and one device for 5 steps: the engine samples with every push
    (the trainer recomputes its log-probs to fp32 rounding), and the memory moves are timed."""
    rows = _job("embedded GRPO, co-located", tmp_path, device, steps=5)
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]
    assert len({r["trainer/rollout_digest"] for r in rows}) == 5
    kinds = {json.loads(line)["kind"] for line in (tmp_path / "timeline" / "rank000.jsonl").read_text().splitlines()}
    assert {"offload", "onload"} <= kinds


def _half_billion(path, device) -> None:
    """A random Qwen2 of Qwen2.5-0.5B's shape (the CPU stand-in: a tiny one) with the embedded tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tidal.modeling.hf import load_tokenizer

    big = device.type != "cpu"
    config = Qwen2Config(vocab_size=151936 if big else 512, hidden_size=896 if big else 64,
                         intermediate_size=4864 if big else 128, num_hidden_layers=24 if big else 2,
                         num_attention_heads=14 if big else 4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(None).save_pretrained(path)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_bf16_with_fp32_masters_on_a_half_billion_model(device, tmp_path, precision):
    """bf16, and fp16 with its loss scale (tidal/modeling/loss_scale.py), on fp32 masters."""
    model = tmp_path / "model"
    _half_billion(model, device)
    out = tmp_path / "run"
    rows = _job(f"0.5B-shaped GRPO, {precision} + fp32 masters, co-located", out, device, "--set", f"model.path={model}",
                "--set", f"trainer.precision={precision}", *SMALL_STEP, "--set", "generator.max_new_tokens=32",
                "--set", "trainer.lr=1e-5", steps=3)
    # the engine samples in bf16/fp16 with an fp32 head, the trainer recomputes in it: close, not equal
    assert all(0 <= r["trainer/logp_mismatch_max"] < 0.5 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]
    if precision == "fp16":  # reported each step; a skipped step (an overflow) trained nothing
        assert all(r["trainer/loss_scale"] > 0 for r in rows) and sum(r["trainer/skipped_steps"] for r in rows) < 3
    with safe_open(out / "final" / "model.safetensors", "pt") as f, safe_open(model / "model.safetensors", "pt") as g:
        name = next(n for n in f.keys() if n.endswith("mlp.down_proj.weight"))
        trained, init = f.get_tensor(name), g.get_tensor(name)
    assert trained.dtype == torch.float32 and not torch.equal(trained, init)  # the fp32 masters, stepped


def test_vllm_engine_colocated_reloads_every_push(device, tmp_path):
    if device.type != "cuda":
        pytest.skip("vLLM's sleep mode (placement=colocated) needs CUDA")
    pytest.importorskip("vllm")
    rows = _job("embedded GRPO, vLLM engine, co-located", tmp_path, device, "--set", "generator.engine=vllm",
                steps=3)
    # a wrong or missing weight reload shows as a gap of whole nats
    assert all(r["trainer/logp_mismatch_max"] < 0.05 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]
    assert len({r["trainer/rollout_digest"] for r in rows}) == 3


def test_moe_with_routing_replay_on_one_device(device, tmp_path):
    """The tiny Qwen3-MoE co-located, replaying the engine's routing: on a device the engine's decode
    and the trainer's packed forward round differently, so some tokens may route otherwise
    (routing_mismatch_frac, recorded in the table's run); replay keeps the log-probs close."""
    from tidal.modeling.tiny.moe import write_embedded_moe

    model = write_embedded_moe(tmp_path / "moe", seed=0)
    rows = _job("tiny MoE, routing replay, co-located", tmp_path / "run", device, "--set", f"model.path={model}",
                "--set", "trainer.routing_replay=true", *SMALL_STEP, "--set", "generator.max_new_tokens=32", steps=3)
    assert all(0 <= r["trainer/routing_mismatch_frac"] < 0.5 for r in rows), [r["trainer/routing_mismatch_frac"] for r in rows]
    assert all(r["trainer/logp_mismatch_max"] < 1e-3 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]


def test_lora_on_one_device(device, tmp_path):
    """LoRA co-located: the adapters alone are pushed and the engine samples with them."""
    rows = _job("embedded GRPO, LoRA rank 8, co-located", tmp_path, device, "--set", "trainer.lora.rank=8",
                "--set", "trainer.lr=1e-2", steps=3)
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]
    assert len({r["trainer/rollout_digest"] for r in rows}) == 3 and (tmp_path / "final" / "adapter_model.safetensors").is_file()
    from tidal.modeling.hf import load_model

    assert rows[0]["trainer/push_bytes"] < 0.2 * sum(t.numel() * 4 for t in load_model(None).parameters())

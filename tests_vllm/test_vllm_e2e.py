"""Whole GRPO jobs under torchrun with `generator.engine=vllm`: sync == periodic, the same seed gives
the same rollouts, and every push lands in the engine for generator tp=1/tp=2 fed by trainer
tp=1/tp=2/FSDP (the trainer's recomputed log-probs equal the engine's at every step)."""
from __future__ import annotations

import pytest

from tests.e2e import launch, metrics

VLLM = ("--set", "generator.engine=vllm")
TIMEOUT = 600  # a hang guard: a 3-step run takes ~40 s on a quiet 2-core machine


def _run(out, *args, nproc=3):
    proc = launch(out, *VLLM, *args, nproc=nproc, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return metrics(out)


@pytest.fixture(scope="module")
def periodic(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_periodic")
    return out, _run(out, "--schedule", "periodic", "--set", "checkpoint_every=1")


def test_run_trains_with_exact_logprobs(periodic):
    _, rows = periodic
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["trainer/tokens"] > 0 and row["trainer/groups"] == 4
        # after each push the engine samples with the trainer's weights: the trainer recomputes
        # what vLLM sampled, to fp32 rounding
        assert row["trainer/logp_mismatch_max"] < 1e-4, row["trainer/logp_mismatch_max"]
    assert len({r["trainer/rollout_digest"] for r in rows}) == 3


def test_sync_equals_periodic_and_seed_repeats(periodic, tmp_path):
    out, rows = periodic
    sync = _run(tmp_path, "--schedule", "sync")
    assert [r["trainer/rollout_digest"] for r in sync] == [r["trainer/rollout_digest"] for r in rows]
    assert (tmp_path / "final/model.safetensors").read_bytes() == (out / "final/model.safetensors").read_bytes()


def test_resume_equals_uninterrupted_run(periodic, tmp_path):
    """The generator starts from the checkpoint's weights (an HF directory vLLM loads) instead of a push."""
    out, rows = periodic
    proc = launch(tmp_path, *VLLM, "--resume", str(out / "checkpoints/step_000001"), nproc=3, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["trainer/rollout_digest"] for r in metrics(tmp_path)] == [rows[2]["trainer/rollout_digest"]]
    assert (tmp_path / "final/model.safetensors").read_bytes() == (out / "final/model.safetensors").read_bytes()


@pytest.mark.parametrize("layout", [
    ("generator.tp=2", "trainer.tp=2"),
    ("generator.replicas=2", "trainer.dp=2", "trainer.fsdp=true"),
], ids=["gen_tp2-trainer_tp2", "gen_2replicas-trainer_fsdp2"])
def test_pushes_reach_every_layout(periodic, tmp_path, layout):
    _, single = periodic
    rows = _run(tmp_path, *[a for kv in layout for a in ("--set", kv)], nproc=5)
    for row in rows:
        assert row["trainer/logp_mismatch_max"] < 1e-4, (layout, row["step"], row["trainer/logp_mismatch_max"])
    # per-sample seeds: the same tokens whatever the generator's layout (measured, see docs/engines.md)
    assert [r["trainer/rollout_digest"] for r in rows][0] == single[0]["trainer/rollout_digest"]


def test_vocabulary_vllm_cannot_split_is_refused_before_start(tmp_path):
    import subprocess
    import sys

    from transformers import Qwen3Config

    from tests.e2e import ROOT

    Qwen3Config(vocab_size=500, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128).save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--dry-run", "--set", "generator.engine=vllm",
                           "--set", "generator.tp=2", "--set", f"model.path={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "generator.engine=vllm with generator.tp=2 needs a vocabulary size that is a multiple of 64; this " \
           "model's is 500" in proc.stderr


def test_ppo_with_the_vllm_engine(tmp_path):
    """The critic needs nothing of the engine: `--algo ppo` on vLLM trains both models with exact log-probs."""
    proc = launch(tmp_path, *VLLM, "--set", "reward.functions=[tests.rewards:length_parity]", nproc=4, algo="ppo",
                  timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 and r["critic/value_loss"] > 0 for r in rows)
    assert (tmp_path / "final/critic/model.safetensors").is_file()


def test_multi_turn_rollouts_with_vllm(tmp_path):
    """The embedded lookup task with vLLM: each turn after the first is a new request of the sample's
    whole token sequence (prefix caching finds its KV); the trainer recomputes vLLM's log-probs of the
    model's tokens, observations are masked out, and sync equals periodic: the periodic run's environment
    answers off the engine's loop (each next turn submitted as its answer arrives), the sync run's inline
    (multi_turn.env_workers=0). The digests hash the tokens, which fp32 keeps across the batches' changes."""
    mt = ("--set", "rollout=multi_turn")
    rows = _run(tmp_path / "periodic", *mt, "--schedule", "periodic", "--set", "multi_turn.env=tests.envs:SlowLookup")
    for row in rows:
        assert 1.5 < row["generator/turns_mean"] <= 3 and row["generator/env_errors"] == 0
        assert row["trainer/logp_mismatch_max"] < 1e-4, row["trainer/logp_mismatch_max"]
    sync = _run(tmp_path / "sync", *mt, "--schedule", "sync", "--set", "multi_turn.env_workers=0")
    assert [r["trainer/rollout_digest"] for r in sync] == [r["trainer/rollout_digest"] for r in rows]
    import json

    lines = [json.loads(line) for line in (tmp_path / "periodic/samples.jsonl").read_text().splitlines()]
    # the look is one token: the environment's cap reaches vLLM's request (max_tokens)
    assert all(line["turns"][0]["role"] == "assistant" and line["turns"][0]["tokens"] == 1 for line in lines)
    assert any(t["role"] == "tool" for line in lines for t in line["turns"])


def test_partial_rollouts_resume_equals_the_whole_run(tmp_path):
    """vLLM resumes a cut group as a new request of its prompt and tokens so far; a checkpoint keeps
    the groups in flight, and the resumed run equals the whole one."""
    args = ("--set", "generator.max_new_tokens=8", "--set", "generator.partial_rollout_tokens=3",
            "--set", "checkpoint_every=2")
    whole = tmp_path / "whole"
    proc = launch(whole, *VLLM, *args, steps=4, nproc=3, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = metrics(whole)
    assert rows[1]["generator/partial_groups"] > 0 and max(r["trainer/staleness_max"] for r in rows) >= 1
    resumed = tmp_path / "resumed"
    proc = launch(resumed, *VLLM, *args, "--resume", str(whole / "checkpoints/step_000001"), steps=4, nproc=3,
                  timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["trainer/rollout_digest"] for r in metrics(resumed)] == [r["trainer/rollout_digest"] for r in rows[2:]]
    assert (resumed / "final/model.safetensors").read_bytes() == (whole / "final/model.safetensors").read_bytes()


def test_lora_adapters_reach_vllm_and_resume(tmp_path):
    """trainer.lora: each push is the adapters alone, loaded by vLLM's LoRA (a new adapter id per push).
    The engine's log-probs equal the trainer's every step while the policy moves away from the base
    (the KL to the reference, the base with the adapters off, grows), and a resumed run starts vLLM
    from the checkpoint's adapter: its last steps sample what the whole run did."""
    lora = ("--set", "trainer.lora.rank=8", "--set", "trainer.lr=1e-2", "--set", "algorithm.beta=0.04",
            "--set", "checkpoint_every=1", "--set", "checkpoint_keep=0")
    rows = _run(tmp_path / "whole", "--schedule", "sync", *lora)
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 for r in rows), [r["trainer/logp_mismatch_max"] for r in rows]
    assert rows[-1]["trainer/kl"] > 1e-4 and len({r["trainer/rollout_digest"] for r in rows}) == 3
    assert len({r["trainer/push_bytes"] for r in rows}) == 1 and rows[0]["trainer/push_bytes"] < 400_000  # adapters: 311 KB
    proc = launch(tmp_path / "resumed", *VLLM, "--schedule", "sync", *lora[:6], "--resume",
                  str(tmp_path / "whole" / "checkpoints" / "step_000001"), nproc=3, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = metrics(tmp_path / "resumed")
    assert [r["trainer/rollout_digest"] for r in resumed][-1:] == [r["trainer/rollout_digest"] for r in rows][-1:]
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 for r in resumed)

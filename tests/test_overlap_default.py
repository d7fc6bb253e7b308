"""Periodic asynchrony overlaps at a pretrained model's defaults (issue 26): when every sample
reaches the token cap, the groups decoded together leave together, so the decode slots a
model.path gets by default must make waves: here the rule (tidal/recipes/defaults.py decode_slots), which a
rank under torchrun takes where no rates were measured for the job (tidal/launch/auto.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.modeling.hf import load_model, load_tokenizer, save_hf
from tidal.recipes.defaults import decode_slots
from tests.e2e import launch, metrics

# B=4, G=4 on CPU: 2 groups at once, 2 waves
JOB = ["--set", "data.prompts_per_step=4", "--set", "generator.samples_per_prompt=4",
       "--set", "generator.max_new_tokens=32"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The embedded model as a pretrained HF directory (so it gets the pretrained defaults) whose
    tokenizer's EOS is a token added past the model's vocabulary: never sampled, every sample runs
    to the cap. Sync and periodic, 3 steps each (~20 s each on a quiet 2-core machine)."""
    model = tmp_path_factory.mktemp("model")
    tok = load_tokenizer(None)
    tok.add_special_tokens({"eos_token": "<|never|>"})  # id 512; the model's logits cover 0-511
    save_hf(load_model(None), tok, model)
    out = {}
    for schedule in ("sync", "periodic"):
        out[schedule] = tmp_path_factory.mktemp(schedule)
        proc = launch(out[schedule], "--schedule", schedule, "--set", f"model.path={model}", *JOB, defaults=True,
                      timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_every_sample_hits_the_cap_and_the_default_makes_waves(runs):
    config = json.loads((runs["periodic"] / "config.json").read_text())
    assert config["generator"]["max_batch_prompts"] == 2 == decode_slots(prompts=4, samples=4, replicas=1,
                                                                         device_type="cpu")
    assert config["_sources"]["generator.max_batch_prompts"] == "auto"
    for row in metrics(runs["sync"]) + metrics(runs["periodic"]):
        assert row["trainer/response_len_mean"] == 32  # the case that overlapped nothing at 16 slots


def test_periodic_overlaps_with_the_rollouts_of_sync(runs):
    sync, periodic = metrics(runs["sync"]), metrics(runs["periodic"])
    assert [r["trainer/rollout_digest"] for r in sync] == [r["trainer/rollout_digest"] for r in periodic]
    # the first wave is trained while the second decodes (about half of generation), in every step
    # after the first (its trainer warms up: 0.0 s of a 0.06 s generation once on a busy CI machine);
    # at 16 slots all 4 groups left in the last decode call: 0.0-0.01 s of 0.2 s here
    assert all(r["overlap_s"] > 0.2 * r["generator/gen_s"] for r in periodic[1:]), [(r["overlap_s"], r["generator/gen_s"]) for r in periodic]
    assert all(r["overlap_s"] == 0 for r in sync)

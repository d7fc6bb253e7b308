"""`--algo ppo` end to end under torchrun: four executors (generator, reward, critic, trainer), sync ==
periodic bit for bit for the policy and the critic, critic layouts against one rank, exact resume of
both, and the embedded task learnt.

Runs use a reward with a signal on the untrained model and AdamW eps=1e-3 for both learners (see
test_e2e_parallel.py): every weight moves in every step, so equal finals mean something.
"""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForTokenClassification

from tidal.launch import jobs
from tests.e2e import ROOT, launch, max_abs_diff, metrics, weights

SIGNAL = ["--set", "reward.functions=[tests.rewards:length_parity]", "--set", "trainer.adam_eps=1e-3",
          "--set", "critic.adam_eps=1e-3", "--set", "checkpoint_every=2"]
CASES = {  # name: (options, ranks)
    "periodic": (["--schedule", "periodic"], 4),
    "sync": (["--schedule", "sync"], 4),
    "critic_dp2": (["--set", "critic.dp=2"], 5),
    "critic_tp2": (["--set", "critic.tp=2"], 5),
    "mini_batches": (["--set", "critic.mini_batches=2", "--set", "critic.epochs=2", "--set", "critic.dp=2"], 5),
    "fsdp_mini_batches": (["--set", "critic.mini_batches=2", "--set", "critic.epochs=2", "--set", "critic.dp=2",
                           "--set", "critic.fsdp=true"], 5),
}
KEYS = {"critic/value_loss", "critic/value_clipfrac", "critic/explained_variance", "critic/values_mean",
        "critic/returns_mean", "critic/value_grad_norm", "critic/value_lr", "trainer/reward_mean", "trainer/loss",
        "trainer/rollout_digest"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's 4-step run (checkpoints after steps 1 and 3), and periodic resumed from step 1."""
    root, out = tmp_path_factory.mktemp("ppo"), {}
    for name, (opts, nproc) in CASES.items():
        proc = launch(root / name, *SIGNAL, *opts, nproc=nproc, steps=4, algo="ppo", timeout=600)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = root / name
    proc = launch(root / "resumed", *SIGNAL, "--resume", str(out["periodic"] / "checkpoints/step_000001"), nproc=4,
                  steps=4, algo="ppo", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["resumed"] = root / "resumed"
    return out


def _bytes(run, part: str) -> bytes:
    return (run / part / "model.safetensors").read_bytes()


def test_a_ppo_run_writes_policy_critic_and_metrics(runs):
    run, rows = runs["periodic"], metrics(runs["periodic"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(KEYS <= r.keys() for r in rows)
    assert all(r["trainer/logp_mismatch_max"] < 1e-4 and r["critic/value_clipfrac"] == 0 for r in rows)  # one pass: nothing clips
    assert json.loads((run / "config.json").read_text())["critic"]["adam_eps"] == 1e-3
    critic = AutoModelForTokenClassification.from_pretrained(run / "final/critic")
    assert type(critic).__name__ == "Qwen3ForTokenClassification" and critic.config.num_labels == 1
    start = AutoModelForTokenClassification.from_pretrained(run / "checkpoints/step_000001/critic")
    assert not torch.equal(critic.score.weight, start.score.weight)  # the critic trained
    ckpt = run / "checkpoints/step_000003"
    assert (ckpt / "critic/optimizer/.metadata").is_file() and (ckpt / "critic/optimizer/schedule.json").is_file()
    assert "critic/model.safetensors" in json.loads((ckpt / "manifest.json").read_text())["files"]


def test_sync_equals_periodic_bit_for_bit_policy_and_critic(runs):
    a, b = runs["periodic"], runs["sync"]
    assert [r["trainer/rollout_digest"] for r in metrics(a)] == [r["trainer/rollout_digest"] for r in metrics(b)]
    assert _bytes(a, "final") == _bytes(b, "final") and _bytes(a, "final/critic") == _bytes(b, "final/critic")


@pytest.mark.parametrize("layout", ["critic_dp2", "critic_tp2"])
def test_critic_layouts_equal_one_rank(runs, layout):
    """dp: replicas summing gradients; tp: the trainer's plan, with the value head replicated and an
    untied embedding whose gradient must be resharded (tidal/modeling/parallel/tp.py)."""
    one, two = runs["periodic"], runs[layout]
    assert [r["trainer/rollout_digest"] for r in metrics(one)][:2] == [r["trainer/rollout_digest"] for r in metrics(two)][:2]
    start = weights(one / "checkpoints/step_000001/critic")
    assert max_abs_diff(weights(one / "final/critic"), start) > 2e-4  # 20x the bound below: it can fail
    assert max_abs_diff(weights(two / "final/critic"), weights(one / "final/critic")) < 1e-5
    assert max_abs_diff(weights(two / "final"), weights(one / "final")) < 1e-5


def test_critic_fsdp_mini_batches_and_epochs_equal_replicas(runs):
    """Critic FSDP over dp=2 with 2 mini-batches x 2 epochs (lockstep rounds, forward-only rounds, a
    clipped value loss after the first step) against the same passes on two replicas (a mini-batch
    holds groups (i // dp) % mini_batches, so dp fixes the partition)."""
    one, two = runs["mini_batches"], runs["fsdp_mini_batches"]
    assert all(r["critic/value_clipfrac"] > 0 for r in metrics(one))  # later passes clip against the start values
    assert max_abs_diff(weights(two / "final/critic"), weights(one / "final/critic")) < 1e-5
    assert max_abs_diff(weights(two / "final"), weights(one / "final")) < 1e-5


def test_resume_equals_uninterrupted_run_for_policy_and_critic(runs):
    whole, resumed = runs["periodic"], runs["resumed"]
    assert [r["step"] for r in metrics(resumed)] == [2, 3]
    assert ([r["trainer/rollout_digest"] for r in metrics(resumed)] == [r["trainer/rollout_digest"] for r in metrics(whole)][2:])
    assert _bytes(resumed, "final") == _bytes(whole, "final")
    assert _bytes(resumed, "final/critic") == _bytes(whole, "final/critic")


def test_the_hand_written_example_is_the_recipe(tmp_path):
    """examples/ppo_critic.py wires by hand the graph `--algo ppo` builds: the same rollouts and
    byte-identical policy and critic after 2 steps."""
    example = tmp_path / "example"
    code, _, err = jobs.run_script(ROOT / "examples/ppo_critic.py", "--steps", "2", "--output-dir", str(example),
                                   nproc=4, timeout=600)
    assert code == 0, err[-3000:]
    recipe = launch(tmp_path / "recipe", nproc=4, steps=2, algo="ppo", timeout=600)
    assert recipe.returncode == 0, recipe.stderr[-3000:]
    assert [r["trainer/rollout_digest"] for r in metrics(example)] == [r["trainer/rollout_digest"] for r in metrics(tmp_path / "recipe")]
    assert _bytes(example, "final") == _bytes(tmp_path / "recipe", "final")
    assert _bytes(example, "final/critic") == _bytes(tmp_path / "recipe", "final/critic")


def test_ppo_learns_the_embedded_task(tmp_path):
    """The default job, 60 steps: the reward rises and the critic explains more of the returns."""
    proc = launch(tmp_path, nproc=4, steps=60, algo="ppo", defaults=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)

    def mean(key, part):  # explained variance is None (NaN) in a step whose returns are all equal
        values = [r[key] for r in part if r[key] is not None]
        return sum(values) / len(values)

    first, last = rows[:20], rows[-20:]
    assert mean("trainer/reward_mean", last) > 2 * mean("trainer/reward_mean", first) + 0.03, (mean("trainer/reward_mean", first),
                                                                                  mean("trainer/reward_mean", last))
    assert mean("critic/explained_variance", last) > mean("critic/explained_variance", first)

"""Parallel layouts end to end under torchrun: trainer tp, FSDP over dp, generator tp, and the
resharding weight push between them, against the single-rank run with the same seed.

Every comparison uses a reward with a signal on the untrained model (tests.rewards:length_parity)
and AdamW eps=1e-3: Adam's first update is lr*g/(|g|+eps), so with the default eps=1e-8 an entry
whose gradient is within float32 summation noise of 0 moves by a sizeable fraction of lr either way
(measured: 2.1e-5 for tp=2 after one step). eps=1e-3 keeps the update linear in such gradients, so
the comparison measures the parallel arithmetic.
"""
from __future__ import annotations

import pytest

from tidal.modeling.hf import load_model
from tests.e2e import launch, max_abs_diff, metrics, weights

TOL = 1e-5
SIGNAL = ["--set", "reward.functions=[tests.rewards:length_parity]", "--set", "trainer.adam_eps=1e-3",
          "--set", "checkpoint_every=1"]
STEP0 = "checkpoints/step_000000"  # the weights after one optimizer step


def _run(out, *args, nproc: int, **kw):
    proc = launch(out, *SIGNAL, *args, nproc=nproc, steps=2, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # every collective is waited for (an unread tp gather of the chunked LM head's output was not)
    assert "unwaited collective" not in proc.stderr, proc.stderr[-3000:]
    return out


def _digests(out) -> list[str]:
    return [r["trainer/rollout_digest"] for r in metrics(out)]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), nproc=3)


def _same_training(run, single) -> None:
    assert _digests(run) == _digests(single)  # step 1 sampled by weights pushed after one step
    init, after = load_model(None, seed=0).state_dict(), weights(single / STEP0)
    moved = max_abs_diff(after, {k: init[k] for k in after})  # the tied lm_head is stored once
    assert moved > 50 * TOL  # a real step (lr 1e-3), so the bound below can fail
    assert max_abs_diff(weights(run / STEP0), weights(single / STEP0)) < TOL
    assert max_abs_diff(weights(run / "final"), weights(single / "final")) < TOL


def test_trainer_tp2_equals_tp1(single, tmp_path):
    _same_training(_run(tmp_path, "--set", "trainer.tp=2", nproc=4), single)


def test_multi_turn_under_trainer_tp2_and_dp2_equals_one_rank(tmp_path):
    """Loss masks with holes (the observations) train the same on every layout."""
    mt = ["--set", "rollout=multi_turn"]
    single = _run(tmp_path / "single", *mt, nproc=3)
    _same_training(_run(tmp_path / "tp2", *mt, "--set", "trainer.tp=2", nproc=4), single)
    _same_training(_run(tmp_path / "dp2", *mt, "--set", "trainer.dp=2", nproc=4), single)


def test_fsdp_and_tp_trainer_with_tp_generator_equal_single_rank(single, tmp_path):
    # 7 ranks: generator tp=2, reward, trainer dp=2 x tp=2 with FSDP; every push is a reshard
    run = _run(tmp_path, "--set", "trainer.tp=2", "--set", "trainer.dp=2", "--set", "trainer.fsdp=true",
               "--set", "generator.tp=2", nproc=7, timeout=360)
    _same_training(run, single)
    # torch.distributed.checkpoint: each trainer rank writes its own optimizer shard, beside one index
    assert sorted(p.name for p in (run / STEP0 / "trainer").glob("*.distcp")) == [f"__{i}_0.distcp" for i in range(4)]
    assert (run / STEP0 / "trainer/.metadata").is_file() and (run / STEP0 / "manifest.json").is_file()


def test_context_parallel_inside_fsdp_dp_equals_single_rank(single, tmp_path):
    """6 ranks: trainer dp=2 x cp=2 with FSDP over the four (tidal/modeling/parallel/cp.py); each group's packed
    row splits over its unit's two cp ranks, and the push reshards from the four FSDP shards."""
    run = _run(tmp_path, "--set", "trainer.dp=2", "--set", "trainer.cp=2", "--set", "trainer.fsdp=true", nproc=6,
               timeout=360)
    _same_training(run, single)


LOCKSTEP = ["--set", "data.prompts_per_step=5", "--set", "trainer.dp=2", "--set", "trainer.mini_batches=2",
            "--set", "trainer.epochs=2", "--set", "algorithm.beta=0.04"]


@pytest.mark.parametrize("algo, extra", [("grpo", []), ("reinforce_pp", ["--set", "algorithm.kl_in=reward"])])
def test_fsdp_lockstep_rounds_equal_replicated_dp(tmp_path, algo, extra):
    """5 groups over 2 FSDP ranks: the last round is padded with dummies, 2 mini-batches x 2 epochs
    use the old policy, beta > 0 the reference; REINFORCE++ (batch scope) recomputes the forward
    per loss pass. Sync and periodic agree bit for bit (rounds pair groups by index, never by
    arrival), and both agree with replicated dp=2 (the same mini-batches) within 1e-5."""
    runs = {}
    for name, opts in (("replicated", []), ("fsdp", ["--set", "trainer.fsdp=true"]),
                       ("fsdp_sync", ["--set", "trainer.fsdp=true", "--schedule", "sync"])):
        runs[name] = _run(tmp_path / name, *LOCKSTEP, *extra, *opts, nproc=4, algo=algo)
    assert _digests(runs["fsdp"]) == _digests(runs["fsdp_sync"]) == _digests(runs["replicated"])
    assert (runs["fsdp"] / "final/model.safetensors").read_bytes() == \
        (runs["fsdp_sync"] / "final/model.safetensors").read_bytes()
    assert max_abs_diff(weights(runs["fsdp"] / "final"), weights(runs["replicated"] / "final")) < TOL
    rows = metrics(runs["fsdp"])
    assert all(r["trainer/groups"] == 5 and r["trainer/optimizer_steps"] == 4 and r["trainer/kl"] != 0 for r in rows)


def test_megatron_trainer_equals_the_torch_backend(single, tmp_path):
    """trainer.backend=megatron at tp=2 x pp=2 (two pipeline stages of two tp ranks, the 1F1B schedule
    across the groups) feeding a tp=2 generator: the weights its stages push, save and sample with equal
    the torch backend's single-rank run within 1e-5 (the same rollouts). (Sync and periodic push the
    same bits at megatron tp=2, dp=2 and pp=2: tests/test_megatron_trainer.py; dp with ZeRO-1 and
    resume: tests/test_resume.py's megatron case.)"""
    opts = ["--set", "trainer.backend=megatron", "--set", "trainer.tp=2", "--set", "trainer.pp=2",
            "--set", "generator.tp=2"]
    run = _run(tmp_path / "periodic", *opts, nproc=7, timeout=360)
    _same_training(run, single)
    assert sorted(p.name for p in (run / STEP0 / "trainer").glob("optimizer.rank*.pt")) == \
        [f"optimizer.rank{i}.pt" for i in range(4)]  # each rank its stage's share of AdamW's state
    bubble = [r["trainer/pipeline_bubble"] for r in metrics(run)]
    assert all(0 < b < 1 for b in bubble), bubble


def test_the_demo_learns_with_the_megatron_backend(tmp_path):
    """The embedded job (make demo), 50 steps, trainer.backend=megatron: the reward rises (measured: the first
    20 steps' mean 0.021, the last 20's 0.14 at 50 steps, 0.20 at 60, 0.39 at 80; the bar is 0.093)."""
    proc = launch(tmp_path, "--set", "trainer.backend=megatron", steps=50, timeout=900, defaults=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [r["trainer/reward_mean"] for r in metrics(tmp_path)]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last > 2 * first + 0.05, (first, last)


@pytest.mark.parametrize("algo, extra, nproc", [
    ("reinforce_pp", ["--set", "algorithm.baseline=true"], 3),  # batch scope: three loss passes per micro-batch
    ("grpo", ["--set", "algorithm.beta=0.05", "--set", "algorithm.kl_in=reward", "--set", "trainer.mini_batches=2",
              "--set", "trainer.epochs=2"], 3),  # the reference, and the old-policy snapshot of later passes
    ("ppo", [], 4),  # a critic (torch backend) beside the megatron policy
])
def test_megatron_equals_the_torch_backend_for_each_kind_of_algorithm(tmp_path, algo, extra, nproc):
    """3 steps with each backend: the same rollouts every step, and final weights within 1e-5."""
    runs = {backend: launch(tmp_path / backend, *SIGNAL, *extra, "--set", f"trainer.backend={backend}", nproc=nproc,
                            steps=3, algo=algo, timeout=360) for backend in ("torch", "megatron")}
    for proc in runs.values():
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert _digests(tmp_path / "torch") == _digests(tmp_path / "megatron")
    assert max_abs_diff(weights(tmp_path / "torch/final"), weights(tmp_path / "megatron/final")) < TOL

"""A graph wired by hand (examples/two_rewards.py): a rule and a reward model, combined per prompt."""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from tidal.channels.payloads import RolloutGroup, ScoredGroup
from tidal.controller.graph import Graph
from tidal.executors.base import ExecutorEnv
from tidal.executors.reward.combine import combine, pair_by_index
from tidal.executors.reward.config import RewardModelConfig
from tidal.executors.reward.model import RewardModel
from tests.e2e import launch, metrics
from tidal.launch import jobs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "two_rewards.py"


def _example():
    spec = importlib.util.spec_from_file_location("two_rewards", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_rewards")
    code, _, err = jobs.run_script(EXAMPLE, "--steps", "2", "--output-dir", str(out), nproc=5, timeout=400)
    assert code == 0, err[-3000:]
    return out


def test_example_trains_on_combined_rewards(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["trainer/groups"] == 4
        # the example's weights: 1.0 * rule + 0.5 * model, and the model's share is not zero
        assert row["trainer/reward_mean"] == pytest.approx(row["combine/rule_reward_mean"] + 0.5 * row["combine/model_reward_mean"],
                                                   abs=1e-6)
        assert row["combine/model_reward_mean"] != 0.0
        # the rule alone gives multiples of 0.5, so its mean over 16 samples is a multiple of 1/32
        assert abs(row["trainer/reward_mean"] * 32 - round(row["trainer/reward_mean"] * 32)) > 1e-4
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert type(model).__name__ == "Qwen3ForCausalLM"


def test_wrong_wiring_is_refused_with_the_port_named():
    graph = _example().build_graph(steps=1)
    # the second rollouts channel without dst_port: its default port is the channel's own name
    channels = [dataclasses.replace(ch, dst_port=None) if ch.name == "rollouts_rm" else ch for ch in graph.channels]
    with pytest.raises(ValueError, match=r"executor 'reward_model' has no input port 'rollouts_rm' "
                                         r"\(it has: rollouts\)"):
        Graph(graph.executors, channels)


def test_reward_model_section_runs_the_same_graph_from_launch_py(tmp_path):
    """`--set reward.model.scale=2`: launch.py wires what the example wires by hand, on 5 ranks; the
    trainer's reward is the rule's plus the model's (scale 2), per step."""
    dry = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--dry-run", "--set", "reward.model.scale=2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    assert "world size 5" in dry.stdout and "reward_model.scored -> combine.model" in dry.stdout
    assert next(line for line in dry.stdout.split("memory per rank")[1].splitlines()
                if line.startswith("reward_model ")).split()[1:3] == ["weights", "3"]
    proc = launch(tmp_path, "--set", "reward.model.scale=2", nproc=5, steps=2, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["combine/rule_reward_mean"] == row["combine/rule_reward_mean"]
        assert row["trainer/reward_mean"] == pytest.approx(row["combine/rule_reward_mean"] + row["combine/model_reward_mean"], abs=1e-6)
        assert row["combine/model_reward_mean"] == pytest.approx(row["reward_model/rm_reward_mean"], abs=1e-6)
        assert row["combine/model_reward_mean"] != 0.0 and row["trainer/reward_mean"] != row["combine/rule_reward_mean"]


# ---- CombineRewards ---------------------------------------------------------------------------

def _scored(index: int, rewards: list[float], *, G: int = 3) -> ScoredGroup:
    return ScoredGroup(step=0, index=index, prompt=f"p{index}", extras={}, prompt_ids=torch.tensor([1, 2]),
                       responses=[torch.tensor([3 + g]) for g in range(G)],
                       logprobs=[torch.zeros(1) for _ in range(G)], finished=torch.ones(G, dtype=torch.bool),
                       rewards=torch.tensor(rewards, dtype=torch.float32), reward_failures=0)


def test_combine_weights_and_order_independence():
    gen = torch.Generator().manual_seed(0)
    rule = [_scored(i, torch.randint(0, 3, (3,), generator=gen).mul(0.5).tolist()) for i in range(4)]
    model = [_scored(i, torch.randn(3, generator=gen).tolist()) for i in range(4)]
    out = combine(rule[1], model[1], rule_weight=1.0, model_weight=0.25)
    assert torch.allclose(out.rewards, rule[1].rewards + 0.25 * model[1].rewards)
    assert out.index == 1 and out.prompt == "p1"
    # a failure on either input is counted, and its message reaches the trainer's warning
    failed = dataclasses.replace(rule[1], reward_failures=2, first_error="reward 'r' failed on prompt 1, sample 0")
    both = combine(failed, model[1], rule_weight=1.0, model_weight=1.0)
    assert (both.reward_failures, both.first_error) == (2, failed.first_error)
    assert combine(model[1], failed, rule_weight=1.0, model_weight=1.0).first_error == failed.first_error
    assert out.first_error is None
    results = set()
    for rule_order, model_order in itertools.product(itertools.permutations(range(4)), [(0, 1, 2, 3), (3, 1, 0, 2)]):
        pairs = list(pair_by_index([model[i] for i in model_order], [rule[i] for i in rule_order]))
        assert [m.index for m, _ in pairs] == list(model_order)  # emitted as the second score lands
        combined = {m.index: combine(r, m, rule_weight=0.3, model_weight=0.7).rewards for m, r in pairs}
        results.add(tuple(combined[i].numpy().tobytes() for i in range(4)))
    assert len(results) == 1  # same bits whatever arrived first


def test_combine_refuses_a_score_on_one_input_only():
    with pytest.raises(ValueError, match=r"prompts \[2\] were scored on one input only"):
        list(pair_by_index([_scored(0, [0, 0, 0])], [_scored(2, [0, 0, 0]), _scored(0, [0, 0, 0])]))
    with pytest.raises(ValueError, match="prompt 1 was scored on one input only"):
        list(pair_by_index([_scored(1, [0, 0, 0])], [_scored(0, [0, 0, 0])]))
    with pytest.raises(ValueError, match="scores of different groups"):
        combine(_scored(0, [0, 0, 0]), _scored(0, [0, 0], G=2), rule_weight=1, model_weight=1)


# ---- RewardModel ------------------------------------------------------------------------------

def _rollouts(responses: list[list[int]]) -> RolloutGroup:
    return RolloutGroup(step=0, index=0, prompt="p", extras={}, prompt_ids=torch.tensor([40, 41, 42]),
                        responses=[torch.tensor(r) for r in responses],
                        logprobs=[torch.zeros(len(r)) for r in responses],
                        finished=torch.zeros(len(responses), dtype=torch.bool))


def _reward_model(tmp_path: Path, **cfg) -> RewardModel:
    rm = RewardModel(config=RewardModelConfig(**cfg))
    rm.init(ExecutorEnv(name="reward_model", ranks=(0,), units=((0,),), rank=0, group=None,
                        device=torch.device("cpu"), seed=0, output_dir=tmp_path))
    return rm


def test_reward_model_is_deterministic_and_reads_its_input(tmp_path):
    # responses of different lengths (one ending in EOS = pad id 0) share one padded batch
    group = _rollouts([[50, 51, 0], [60], [70, 71, 72, 73, 74]])
    a, b = _reward_model(tmp_path, seed=3), _reward_model(tmp_path, seed=3)
    scores_G = a.score(group)
    assert scores_G.shape == (3,) and scores_G.dtype == torch.float32
    assert torch.equal(scores_G, b.score(group))
    assert not torch.equal(scores_G, _reward_model(tmp_path, seed=4).score(group))
    assert len(set(scores_G.tolist())) == 3
    assert a.score(_rollouts([[50, 51, 1], [60], [70, 71, 72, 73, 74]]))[0] != scores_G[0]
    for g in range(3):  # padding does not leak into a score
        alone = a.score(_rollouts([group.responses[g].tolist()]))
        assert alone.item() == pytest.approx(scores_G[g].item(), abs=1e-5)
    scaled = _reward_model(tmp_path, seed=3, scale=-2.0).score(group)
    assert torch.allclose(scaled, -2.0 * scores_G)


def test_reward_model_path(tmp_path):
    with pytest.raises(ValueError, match="no Hugging Face model directory"):
        RewardModel(config=RewardModelConfig(path=str(tmp_path / "missing")))
    saved = _reward_model(tmp_path, seed=5)
    saved.model.save_pretrained(tmp_path / "rm")
    loaded = _reward_model(tmp_path, path=str(tmp_path / "rm"))
    assert isinstance(loaded.model, transformers.Qwen3ForSequenceClassification)
    group = _rollouts([[50, 51], [60]])
    assert torch.equal(loaded.score(group), saved.score(group))
    with pytest.raises(ValueError, match="outside its vocabulary"):
        loaded.score(_rollouts([[10_000]]))

"""LoRA (trainer.lora): adapters alone train and travel; the base stays bit for bit; the reference is
the base; the generator's low-rank add equals the merged model; PEFT's format on disk."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.algorithms.grpo import GRPOConfig
from tidal.algorithms.registry import get_algorithm
from tidal.channels.payloads import ScoredGroup
from tidal.controller.schedules import Periodic
from tidal.controller.timeline import Timeline
from tidal.executors.base import Endpoints, ExecutorEnv, StepContext
from tidal.modeling.hf import load_model
from tidal.modeling.lora import LoraConfig, adapter_params, apply_lora, merged_state
from tidal.executors.trainer.executor import Trainer, TrainerConfig
from tidal.modeling.packing import make_micro_batches
from tidal.launch.cli import parser, resolve
from tidal.recipes.grpo import build
from tests.e2e import launch, metrics

torch.set_num_threads(1)
CPU = torch.device("cpu")
LORA = LoraConfig(rank=4, alpha=8.0)
SAME_THREADS = {"TIDAL_THREADS": "1"}


class _Pushed:
    """The trainer's WEIGHTS port, in-process: what one push carried."""

    bytes_per_push = 0

    def push(self, shards, specs):
        assert shards.keys() == specs.keys()
        self.named = {n: t.detach().clone() for n, t in shards.items()}

    def flush(self):
        pass


def _groups(vocab: int, n: int = 2) -> list[ScoredGroup]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        responses = [torch.randint(1, vocab, (int(torch.randint(2, 9, (), generator=g)),), generator=g) for _ in range(4)]
        out.append(ScoredGroup(step=0, index=i, prompt="p", extras={}, prompt_ids=torch.randint(1, vocab, (6,), generator=g),
                               responses=responses, logprobs=[torch.zeros(r.numel()) for r in responses],
                               finished=torch.ones(4, dtype=torch.bool), rewards=torch.tensor([1.0, 0.0, 0.5, 0.25]) + i,
                               reward_failures=0))
    return out


@pytest.fixture(scope="module")
def trained():
    """A LoRA trainer (GRPO with a KL to the reference) after 3 steps, and what its last push carried."""
    trainer = Trainer(config=TrainerConfig(lr=5e-2, lora=LORA), model_path=None, dtype=torch.float32,
                      algorithm=get_algorithm("grpo"), algo_config=GRPOConfig(beta=0.1), temperature=1.0, total_steps=3)
    trainer.init(ExecutorEnv(name="trainer", ranks=(0,), units=((0,),), rank=0, group=None, device=CPU, seed=0,
                             output_dir=Path("/nonexistent")))
    pushed = _Pushed()
    vocab = trainer.models.tokenizer.vocab_size
    for step in range(3):
        ctx = StepContext(step=step, inbound=Endpoints({"scored": Periodic()(iter(_groups(vocab)))}),
                          outbound=Endpoints({"weights": pushed}), timeline=Timeline(executor="trainer", rank=0))
        metrics_ = trainer.barrier(ctx, trainer.step(ctx))
    return trainer, pushed, metrics_


def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(trained):
    trainer, _, record = trained
    base = load_model(None, seed=0)
    model = trainer.models.master
    stepped = {n for n, p in model.named_parameters() if p.requires_grad}
    assert stepped == set(adapter_params(model)) and stepped  # lora_A / lora_B of every target module
    assert {id(p) for group in trainer.optim.opt.param_groups for p in group["params"]} == \
        {id(p) for p in adapter_params(model).values()}
    mine = {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}  # q_proj.base_layer.weight
    for name, p in base.named_parameters():
        assert torch.equal(mine[name], p), name
    assert all(p.abs().max() > 0 for n, p in adapter_params(model).items() if ".lora_B." in n)  # B left 0: trained
    assert record.stats["kl"] > 0  # the policy moved away from the reference, the base


def test_the_reference_is_the_base_model(trained):
    trainer, _, _ = trained
    group = _groups(trainer.models.tokenizer.vocab_size)[0]
    mbs = make_micro_batches(group.prompt_ids, group.responses, mode="on", token_budget=4096, micro_batch_size=8,
                             pad_id=0, device=CPU)
    refs = trainer.models.ref_logprobs(mbs, pad_to=len(mbs))
    base = load_model(None, seed=0)
    with torch.no_grad():
        assert all(torch.equal(r, mb.forward(base, temperature=1.0).logp_NT) for r, mb in zip(refs, mbs))
        policy = trainer.models.policy_logprobs(mbs[0]).logp_NT
    assert not torch.allclose(policy, refs[0])  # the adapters are back on after the reference
    assert trainer.models.reference is None  # no second copy of the model


def test_the_push_carries_the_adapters_alone_and_lands_as_the_merged_model(trained):
    trainer, pushed, record = trained
    adapters = adapter_params(trainer.models.master)
    assert pushed.named.keys() == adapters.keys()
    assert sum(t.numel() * t.element_size() for t in pushed.named.values()) == \
        sum(p.numel() * 4 for p in adapters.values())
    # the generator: the base with the same adapters, the pushed tensors copied in
    generator = apply_lora(load_model(None, seed=0), LORA, seed=1)
    with torch.no_grad():
        for name, p in adapter_params(generator).items():
            p.copy_(pushed.named[name])
    merged = load_model(None, seed=0)
    missing, unexpected = merged.load_state_dict(merged_state(trainer.models.master), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding: stored once
    group = _groups(trainer.models.tokenizer.vocab_size)[1]
    for mb in make_micro_batches(group.prompt_ids, group.responses, mode="padded", token_budget=4096,
                                 micro_batch_size=8, pad_id=0, device=CPU):
        with torch.no_grad():
            a, b = mb.forward(generator, temperature=1.0).logp_NT, mb.forward(merged, temperature=1.0).logp_NT
        assert (a - b).abs().max() < 1e-6


def test_final_holds_the_adapter_in_peft_format(trained, tmp_path):
    from peft import PeftModel

    trainer, _, _ = trained
    trainer.models.finalize(tmp_path / "final", leader=True)
    assert {p.name for p in (tmp_path / "final").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert not (tmp_path / "final" / "model.safetensors").exists()
    peft_model = PeftModel.from_pretrained(load_model(None, seed=0), str(tmp_path / "final"))
    ids = torch.randint(1, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, trainer.models.policy(input_ids=ids).logits,
                              atol=1e-6, rtol=0)


# ---- whole jobs ------------------------------------------------------------------------------------
LORA_ARGS = ("--set", "trainer.lora.rank=8", "--set", "trainer.lr=1e-2", "--set", "trainer.lora.merged=true",
             "--set", "checkpoint_every=1", "--set", "checkpoint_keep=0")
RUNS = {"split": (("--schedule", "sync", *LORA_ARGS), 3),
        "colocated": (("--set", "placement=colocated", *LORA_ARGS), 1),
        "full": (("--schedule", "sync"), 3)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runs")
    for name, (args, nproc) in RUNS.items():
        proc = launch(root / name, *args, nproc=nproc, steps=4, timeout=400, env=SAME_THREADS)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return root


def test_lora_jobs_sample_with_the_pushed_adapters(runs):
    """Every step's log-probs agree with the trainer's (the generator applied each push); co-located on
    one rank gives the split placement's bits; the push is the adapters' size, every step."""
    split, colocated, full = metrics(runs / "split"), metrics(runs / "colocated"), metrics(runs / "full")
    assert max(r["trainer/logp_mismatch_max"] for r in split + colocated) < 1e-5
    assert [r["trainer/rollout_digest"] for r in split] == [r["trainer/rollout_digest"] for r in colocated]
    assert len({r["trainer/rollout_digest"] for r in split}) == 4
    adapter = load_file(runs / "split" / "final" / "adapter_model.safetensors")
    assert {r["trainer/push_bytes"] for r in split + colocated} == {sum(t.numel() * 4 for t in adapter.values())}
    assert {r["trainer/push_bytes"] for r in full} == {sum(t.numel() * 4 for t in load_model(None).parameters())}
    a, b = (load_file(runs / name / "final" / "adapter_model.safetensors") for name in ("split", "colocated"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    merged = load_file(runs / "split" / "final" / "merged" / "model.safetensors")
    assert merged.keys() == load_model(None).state_dict().keys() - {"lm_head.weight"}  # tied: stored once


def test_a_lora_run_resumes_bit_for_bit(runs, tmp_path):
    ckpt = runs / "colocated" / "checkpoints" / "step_000001"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    proc = launch(tmp_path, "--set", "placement=colocated", *LORA_ARGS[:4], "--resume", str(ckpt), nproc=1, steps=4,
                  timeout=300, env=SAME_THREADS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = load_file(runs / "colocated" / "final" / "adapter_model.safetensors")
    resumed = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert [r["trainer/rollout_digest"] for r in metrics(tmp_path)][-2:] == \
        [r["trainer/rollout_digest"] for r in metrics(runs / "colocated")][-2:]


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (("trainer.lora.target_modules=[q_proj,qkv]",), "trainer.lora.target_modules: 'qkv' is not a Linear module"),
    (("trainer.precision=bf16",), "trainer.lora.rank=8 with trainer.precision=bf16"),
    (("trainer.backend=megatron",), "that backend trains no LoRA adapters"),
    (("trainer.tp=2",), "LoRA runs with tp=1 and without fsdp"),
])
def test_bad_lora_settings_are_refused_before_any_rank_starts(args, message):
    sets = [x for a in ("trainer.lora.rank=8", *args) for x in ("--set", a)]
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(["--algo", "grpo", *sets])))
    assert message in str(err.value)

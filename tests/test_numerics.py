"""Exact numerics (model.numerics=exact, tidal/modeling/numerics.py): every op of a forward gives a row the same bits
alone and in any batch; the engine's samples do not depend on their batch; the engine's log-probs are the
trainer's, bit for bit, in float32 and bf16, through each of the trainer's layouts."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.modeling import numerics
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.modeling.packing import make_micro_batches
from tidal.modeling.tiny.task import embedded_prompts
from tests import numerics_probe
from tests.numerics_probe import SHAPES

ROOT = Path(__file__).resolve().parents[1]


# (shape, dtype, threads): the embedded models and the published widths and vocabularies (tests/numerics_probe.py);
# 2 threads: a co-located rank's
CASES = [(shape, dtype, 1) for shape in ("embedded", "embedded-moe", *SHAPES) for dtype in ("float32", "bfloat16")] + [
    ("smollm2-135m", "bfloat16", 2), ("embedded", "float32", 2)]
# another machine's instruction sets, as far as this one can stand in: oneDNN's (the bf16 products), MKL's (the
# float32 ones) and ATen's own kernels (norms, activations, softmax) held to AVX2, then to AVX-512 without bf16
ISAS = {"AVX2": dict(ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2", ATEN_CPU_CAPABILITY="avx2"),
        "AVX512_CORE": dict(ONEDNN_MAX_CPU_ISA="AVX512_CORE", MKL_ENABLE_INSTRUCTIONS="AVX512",
                            ATEN_CPU_CAPABILITY="avx512")}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_every_op_gives_a_row_the_same_bits_alone_and_in_a_batch(case, tmp_path):
    """Each module's output for one prompt (every leaf module, a mixture-of-experts router and experts included,
    every attention, the float32 head) alone, then as one row of a left-padded batch of 217 rows and of 2,048;
    and each product of the model for a row alone and at three places among 1 to 4,096 rows (the heads: 256):
    equal bit for bit. An op falling back to a stock kernel (which rounds by the rows around it) fails it."""
    assert numerics_probe.check(case, str(tmp_path)) == []


def test_every_op_the_same_under_other_instruction_sets():
    """The same checks (one thread, the published widths; the model's batches up to 217 rows, its products up to
    4,096) in processes whose libraries are held to other instruction sets: other kernels, the same invariance.
    Qwen2.5's widths in bf16 (oneDNN's products; its float32 head is MKL's, as SmolLM2's float32 layers). One
    process per instruction set, side by side (one thread each)."""
    cases = [("smollm2-135m", "float32", 1), ("smollm2-135m", "bfloat16", 1), ("qwen2.5-0.5b", "bfloat16", 1)]
    procs = {isa: subprocess.Popen([sys.executable, "-m", "tests.numerics_probe", json.dumps(cases), "--short"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, **caps}) for isa, caps in ISAS.items()}
    for isa, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=900)
        finally:
            proc.kill()  # ours, by its handle (a no-op once it exited)
        assert proc.returncode == 0, (isa, err[-3000:])
        assert json.loads(out.splitlines()[-1]) == {" ".join(map(str, c)): [] for c in cases}, isa


def test_exact_mode_holds_under_a_gemm_that_rounds_by_shape(tmp_path):
    """Under a test double GEMM that sums each call's reduction in blocks chosen by the call's shape (what oneDNN
    with AMX or cuBLAS may do, tests/shape_keyed_gemm.py), the default kernels give a row other bits in a batch,
    and exact mode still does not: its invariance comes from the fixed shapes, not from this machine's GEMM."""
    from tests.shape_keyed_gemm import ShapeKeyedGemm

    with ShapeKeyedGemm():
        default = load_model(None, dtype=torch.float32, seed=0).eval()
        assert numerics_probe.module_differences(default, long=False) != []
        for model in (default, numerics_probe.published_model("smollm2-135m", torch.bfloat16)):
            numerics.install(model)
            assert numerics_probe.module_differences(model, long=False) == []


def test_the_default_kernels_are_not_batch_invariant():
    """What exact mode is for: the stock float32 product rounds a row differently by the rows around it (1
    row against 16 here: a matrix-vector kernel against a matrix one), so the per-op test above can fail."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 1536, generator=g), torch.randn(576, 1536, generator=g)
    alone = [torch.nn.functional.linear(x[i:i + 1], w) for i in range(16)]
    assert any(not torch.equal(a[0], b) for a, b in zip(alone, torch.nn.functional.linear(x, w)))
    assert all(torch.equal(numerics.exact_linear(x[i:i + 1], w)[0], numerics.exact_linear(x, w)[i]) for i in range(16))


def _engine(model, tok, **kw):
    return NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, numerics="exact", **kw)


@pytest.fixture(scope="module")
def requests(tok):
    return [PromptRequest(index=i, prompt_ids=tok(p["prompt"]).input_ids) for i, p in enumerate(embedded_prompts(16, seed=5))]


@pytest.mark.parametrize("dtype, admission", [(torch.float32, "continuous"), (torch.bfloat16, "chunked")])
def test_a_prompts_samples_do_not_depend_on_their_batch(dtype, admission, tok, requests):
    """Prompt 5's samples decoded alone, and among batches of 2, 7 and 16 prompts (5 at different places,
    different neighbours, left padding and admission order): the same tokens and log-probs, bit for bit."""
    model = load_model(None, dtype=dtype, seed=0)
    params = SamplingParams(n=4, max_new_tokens=24, seed=7, temperature=1.0)
    eng = _engine(model, tok, max_batch_prompts=4, admission=admission)
    alone = next(iter(eng.generate([requests[5]], params, step=3)))
    for batch in ([requests[5], requests[0]], requests[2:9][::-1], requests):
        got = {g.index: g for g in eng.generate(batch, params, step=3)}[5]
        assert all(torch.equal(a, b) for a, b in zip(alone.response_ids, got.response_ids))
        assert all(torch.equal(a, b) for a, b in zip(alone.logprobs, got.logprobs))
    assert max(len(r) for r in alone.response_ids) > 8  # long enough for the batch's rows to come and go


@pytest.mark.parametrize("dtype, mode", [(torch.float32, "on"), (torch.bfloat16, "on"), (torch.bfloat16, "off"),
                                         (torch.bfloat16, "padded")])
def test_the_trainers_logprobs_are_the_engines_bit_for_bit(dtype, mode, tok, requests):
    """The trainer's forward of each group (shared-prompt row, varlen rows, padded rows; its chunked head)
    against the log-probs the engine sampled with, in exact mode: equal, not close."""
    model = load_model(None, dtype=dtype, seed=0)
    params = SamplingParams(n=4, max_new_tokens=20, seed=1, temperature=0.9)
    groups = list(_engine(model, tok, max_batch_prompts=3).generate(requests[:6], params, step=0))
    with torch.no_grad():
        for g in groups:
            for mb in make_micro_batches(g.prompt_ids_P, g.response_ids, mode=mode, token_budget=48,
                                         micro_batch_size=3, pad_id=tok.pad_token_id, device=torch.device("cpu")):
                logp_NT = mb.forward(model, temperature=0.9, chunk=7).logp_NT
                for n, i in enumerate(mb.samples):
                    assert torch.equal(logp_NT[n, :len(g.logprobs[i])], g.logprobs[i]), (g.index, i)


def test_exact_mode_refuses_what_it_does_not_cover(tmp_path):
    from tidal.modeling.tiny.moe import write_embedded_moe
    from tidal.recipes.checks import check_numerics
    from tests.fixtures import small_config

    def cfg(**sets):
        return small_config(**{"model": {"numerics": "exact"}, **sets})

    check_numerics(cfg())
    with pytest.raises(ValueError, match=r"model.numerics=exact with generator.engine=vllm: .*use generator.engine=native"):
        check_numerics(cfg(generator={"engine": "vllm"}))
    with pytest.raises(ValueError, match=r"model.numerics=exact with trainer.tp=2: .*all-reduce"):
        check_numerics(cfg(trainer={"tp": 2}))
    with pytest.raises(ValueError, match=r"with trainer.backend=megatron"):
        check_numerics(cfg(trainer={"backend": "megatron"}))
    check_numerics(cfg(model={"path": str(write_embedded_moe(tmp_path / "moe")), "numerics": "exact"}))
    gemma = transformers.Gemma3TextConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"sliding-window attention layers \(gemma3_text\)"):
        numerics.check_model(gemma)
    numerics.check_model(transformers.Qwen3Config())
    with pytest.raises(ValueError, match=r"sliding-window attention layers \(mistral\)"):
        numerics.check_model(transformers.MistralConfig())
    numerics.check_model(transformers.MistralConfig(sliding_window=None))
    with pytest.raises(ValueError, match=r"attention logit soft-capping \(gemma2\)"):
        numerics.check_model(transformers.Gemma2Config(num_hidden_layers=2, layer_types=["full_attention"] * 2))


# ---- whole jobs: the mismatch of every step is exactly 0 --------------------------------------------------

EXACT = ("--set", "model.numerics=exact")


def _key(shape: str) -> str:  # a str.format field name: no dots ("qwen2.5" would read as an attribute)
    return shape.replace(".", "_").replace("-", "_")


JOBS = {  # name: (arguments, ranks); between them: the three precisions, both admissions, every trainer layout kind
    "bf16 periodic, 2 replicas, continuous, varlen rows": (
        ("--set", "trainer.precision=bf16", "--set", "generator.replicas=2", "--set", "generator.admission=continuous",
         "--set", "trainer.shared_prompt=off"), 4),
    "fp32 sync, FSDP over 2 ranks, multi-turn": (
        ("--schedule", "sync", "--set", "trainer.dp=2", "--set", "trainer.fsdp=true", "--set", "rollout=multi_turn"), 4),
    "bf16 co-located, LoRA": (
        ("--set", "placement=colocated", "--schedule", "sync", "--set", "model.dtype=bfloat16",
         "--set", "trainer.lora.rank=8", "--set", "trainer.lr=1e-2"), 1),
    "fp16 offpolicy, lag 1": (("--schedule", "offpolicy", "--set", "schedule.max_lag=1", "--set",
                               "trainer.precision=fp16"), 3),
    "bf16 mixture of experts, no replay": (("--set", "model.path={moe}", "--set", "trainer.precision=bf16"), 3),
    # random models of the published widths and vocabularies (2 layers, tests/numerics_probe.py): the products a
    # real job makes, a float32 head over 49,152 and 151,936 columns (2 prompts, 4 tokens, one step: each decode
    # step's head costs ~1 s here; the steps after a push are the other jobs')
    **{f"bf16 at {shape}'s widths": (("--set", f"model.path={{{_key(shape)}}}", "--set", "trainer.precision=bf16",
                                      "--set", "data.prompts_per_step=2", "--set", "generator.max_new_tokens=4"), 3)
       for shape in SHAPES},
}
STEPS = {name: 1 if "widths" in name else 3 for name in JOBS}


@pytest.fixture(scope="module")
def exact_jobs(tmp_path_factory):
    from tests.e2e import launch, metrics

    from tidal.modeling.tiny.moe import write_embedded_moe

    from tidal.modeling.hf import save_hf

    paths = {"moe": write_embedded_moe(tmp_path_factory.mktemp("moe") / "tiny", seed=0)}
    for shape in SHAPES:
        paths[_key(shape)] = tmp_path_factory.mktemp("published") / shape
        save_hf(numerics_probe.published_model(shape, torch.float32), load_tokenizer(None), paths[_key(shape)])
    rows = {}
    for name, (args, nproc) in JOBS.items():
        out = tmp_path_factory.mktemp("exact")
        proc = launch(out, *EXACT, *(a.format(**paths) for a in args), nproc=nproc, steps=STEPS[name], timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        # the run says its numerics before anything else of its own
        assert proc.stderr.find("tidal: ") == proc.stderr.find("tidal: numerics exact (") >= 0, proc.stderr[:500]
        rows[name] = metrics(out)
        # only the metrics are read: the widths' checkpoints and weights are GBs of the CI machine's disk
        shutil.rmtree(out)
    for shape in SHAPES:
        shutil.rmtree(paths[_key(shape)])
    return rows


@pytest.mark.parametrize("name", [n for n in JOBS if "offpolicy" not in n])
def test_exact_jobs_have_no_mismatch_on_any_step(exact_jobs, name):
    rows, n = exact_jobs[name], STEPS[name]
    assert len(rows) == n and all(r["trainer/tokens"] > 0 for r in rows)
    for key in ("max", "mean", "p99", "kl", "fresh_max"):
        assert [r[f"trainer/logp_mismatch_{key}"] for r in rows] == [0.0] * n, key
    if "experts" in name:  # the trainer routes every token as the generator did, without replaying it
        assert [r["trainer/routing_mismatch_frac"] for r in rows] == [0.0] * n


def test_offpolicy_tokens_of_staleness_0_have_no_mismatch(exact_jobs):
    """The generator runs a step ahead: most tokens were sampled by the weights before the ones that score
    them, a difference of staleness rather than numerics; the tokens of staleness 0 alone match exactly."""
    rows = exact_jobs["fp16 offpolicy, lag 1"]
    assert max(r["trainer/staleness_max"] for r in rows) == 1
    # fp16 compute, its loss scaled (the default's headroom: no step skipped) and the engine in fp16
    assert [(r["trainer/loss_scale"], r["trainer/skipped_steps"]) for r in rows] == [(256.0, 0)] * 3
    assert [r["trainer/logp_mismatch_fresh_max"] for r in rows] == [0.0] * 3

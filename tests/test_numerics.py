"""Exact numerics (model.numerics=exact, modeling/numerics.py): every op of a forward gives a row the same bits
alone and in any batch; the engine's samples do not depend on their batch; the engine's log-probs are the
trainer's, bit for bit, in float32 and bf16, through each of the trainer's layouts."""
import pytest
import torch
import transformers

from executors.generator.contract import PromptRequest, SamplingParams
from executors.generator.native_engine import NativeEngine
from modeling import numerics
from modeling.hf import cast_parameters, load_model, load_tokenizer
from modeling.packing import make_micro_batches
from modeling.tiny.task import embedded_prompts


DTYPES = [torch.float32, torch.bfloat16]
# random-init, two layers, the published models' widths (the products' shapes the GEMM picks its kernel by)
SHAPES = {
    "smollm2-135m": lambda: transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
        num_hidden_layers=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": lambda: transformers.Qwen2Config(  # its vocabulary cut to 32k: the init took seconds
        vocab_size=32768, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        num_hidden_layers=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _random_model(shape: str, dtype):
    config = SHAPES[shape]()
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return cast_parameters(model, dtype).eval()


def _exact(model):
    numerics.install(model)
    return model


@pytest.mark.parametrize("shape, dtype, threads", [
    (shape, dtype, 1) for shape in ("embedded", "embedded-moe", *SHAPES) for dtype in DTYPES] + [
    ("smollm2-135m", torch.bfloat16, 2), ("embedded", torch.float32, 2)])  # 2: a co-located rank's threads
def test_every_op_gives_a_row_the_same_bits_alone_and_in_a_batch(shape, dtype, threads, tmp_path):
    """Each module's output for one prompt: run alone, then as the last row of a left-padded batch of 7 prompts of
    other lengths; every leaf module (a mixture-of-experts router and experts included) and every attention
    must agree bit for bit on the prompt's tokens, so an op falling back to a stock kernel (which rounds by
    the rows around it: next test) fails it."""
    from modeling.tiny.moe import write_embedded_moe

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if shape.startswith("embedded"):
        path = str(write_embedded_moe(tmp_path / "moe")) if shape == "embedded-moe" else None
        model = load_model(path, dtype=dtype, seed=0).eval()
    else:
        model = _random_model(shape, dtype)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, min(vocab, 500), (n,), generator=g) for n in (9, 23, 14, 5, 31, 17, 1)]
    mine = 6  # 1 token: alone, products of 1 row (matrix-vector kernels: others than the batch's 217 rows)

    def outputs(model, batch):
        seen = {}  # a module's first output of the forward ([batch, tokens, ...]: a token's own row)
        def keep(name, out) -> None:  # None: the hook leaves the output as it is
            seen.setdefault(name, out)

        hooks = [m.register_forward_hook(lambda mod, a, out, name=name: keep(name, out))
                 for name, m in model.named_modules()
                 if (not list(m.children()) or name.endswith(("self_attn", "mlp"))) and name and "rotary" not in name]
        S = max(len(p) for p in batch)
        ids = torch.stack([torch.cat([torch.zeros(S - len(p), dtype=torch.long), p]) for p in batch])
        mask = torch.stack([torch.arange(S) >= S - len(p) for p in batch]).long()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        for h in hooks:
            h.remove()
        seen = {k: (v[0] if isinstance(v, tuple) else v) for k, v in seen.items()}
        return {k: v for k, v in seen.items() if v.dim() >= 3 or k.endswith("lm_head")}, S

    def differing(model):
        alone, _ = outputs(model, [prompts[mine]])
        batch, S = outputs(model, prompts)
        n = len(prompts[mine])
        assert len(alone) > 8 * model.config.num_hidden_layers // 2, sorted(alone)  # every layer's modules
        return [name for name, out in alone.items() if not torch.equal(out[0, -n:], batch[name][mine, S - n:])]

    try:
        assert differing(_exact(model)) == [] and numerics.is_exact(model)
    finally:
        torch.set_num_threads(before)


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
    from modeling.tiny.moe import write_embedded_moe
    from recipes.checks import check_numerics
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


# ---- whole jobs: the mismatch of every step is exactly 0 --------------------------------------------------

EXACT = ("--set", "model.numerics=exact")
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
}


@pytest.fixture(scope="module")
def exact_jobs(tmp_path_factory):
    from tests.e2e import launch, metrics

    from modeling.tiny.moe import write_embedded_moe

    moe = write_embedded_moe(tmp_path_factory.mktemp("moe") / "tiny", seed=0)
    rows = {}
    for name, (args, nproc) in JOBS.items():
        out = tmp_path_factory.mktemp("exact")
        proc = launch(out, *EXACT, *(a.format(moe=moe) for a in args), nproc=nproc, steps=3, timeout=600)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        rows[name] = metrics(out)
    return rows


@pytest.mark.parametrize("name", [n for n in JOBS if "offpolicy" not in n])
def test_exact_jobs_have_no_mismatch_on_any_step(exact_jobs, name):
    rows = exact_jobs[name]
    assert len(rows) == 3 and all(r["trainer/tokens"] > 0 for r in rows)
    for key in ("max", "mean", "p99", "kl", "fresh_max"):
        assert [r[f"trainer/logp_mismatch_{key}"] for r in rows] == [0.0] * 3, key
    if "experts" in name:  # the trainer routes every token as the generator did, without replaying it
        assert [r["trainer/routing_mismatch_frac"] for r in rows] == [0.0] * 3


def test_offpolicy_tokens_of_staleness_0_have_no_mismatch(exact_jobs):
    """The generator runs a step ahead: most tokens were sampled by the weights before the ones that score
    them, a difference of staleness rather than numerics; the tokens of staleness 0 alone match exactly."""
    rows = exact_jobs["fp16 offpolicy, lag 1"]
    assert max(r["trainer/staleness_max"] for r in rows) == 1
    # fp16 compute, its loss scaled (the default's headroom: no step skipped) and the engine in fp16
    assert [(r["trainer/loss_scale"], r["trainer/skipped_steps"]) for r in rows] == [(256.0, 0)] * 3
    assert [r["trainer/logp_mismatch_fresh_max"] for r in rows] == [0.0] * 3

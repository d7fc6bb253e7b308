"""The native engine: exact log-probs, per-sample determinism, streaming, weight updates."""
import pytest
import torch

from tidal.modeling.tiny.task import embedded_prompts
from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.executors.generator.sampling import _top_k_mask, _top_p_mask, sample_tokens
from tidal.modeling.hf import load_model, load_tokenizer
from tests.tolerances import LOGP_OF_FLOAT64

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def model():
    return load_model(None, seed=1)


@pytest.fixture(scope="module")
def model64():
    """The same model in float64, for comparisons of the engine's batching with a reference: its logits agree
    across batch compositions to ~1e-15, so their float32 casts agree on any machine (tests/tolerances.py)."""
    return load_model(None, seed=1, dtype=torch.float64)


@pytest.fixture(scope="module")
def requests(tok):
    # Prompts of different lengths, so chunks differ in left padding.
    return [PromptRequest(index=i, prompt_ids=tok(p["prompt"]).input_ids)
            for i, p in enumerate(embedded_prompts(12, seed=3))]


def _engine(model, tok, **kw):
    return NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def _run(engine, requests, params, step=0):
    return {g.index: g for g in engine.generate(requests, params, step=step)}


def _same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(x, y) for i in a for x, y in zip(a[i].response_ids, b[i].response_ids))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_teacher_forcing(model64, tok, requests, temperature):
    model = model64
    params = SamplingParams(n=3, max_new_tokens=6, seed=0, temperature=temperature, top_p=0.9)
    groups = _run(_engine(model, tok, max_batch_prompts=5), requests[:6], params)
    scale = temperature if temperature > 0 else 1.0  # greedy reports raw-logit log-probs
    with torch.no_grad():
        for g in groups.values():
            for resp, logp in zip(g.response_ids, g.logprobs):
                P = len(g.prompt_ids_P)
                logits_TV = model(torch.cat([g.prompt_ids_P, resp])[None]).logits[0, P - 1 : -1]
                ref = torch.log_softmax(logits_TV.float() / scale, -1).gather(-1, resp[:, None])[:, 0]
                assert logp.dtype == torch.float32 and logp.shape == resp.shape
                torch.testing.assert_close(logp, ref, **LOGP_OF_FLOAT64)


def test_samples_do_not_depend_on_chunking_or_rank_split(model64, tok, requests):
    # float64: the float32 logits the sampler draws from agree across batch compositions but for a cast that
    # straddles a rounding boundary (one ulp, ~1e-14 of a chance per logit), so exact equality of the tokens
    # holds on any machine's kernels; in float32 the kernels' order could move a boundary past a uniform.
    model = model64
    params = SamplingParams(n=4, max_new_tokens=8, seed=11)
    one = _run(_engine(model, tok, max_batch_prompts=1), requests, params, step=3)
    all16 = _run(_engine(model, tok, max_batch_prompts=16), requests, params, step=3)
    eng = _engine(model, tok, max_batch_prompts=16)
    ranks = {**_run(eng, requests[1::2], params, step=3), **_run(eng, requests[0::2], params, step=3)}
    assert _same(one, all16) and _same(one, ranks)


def test_samples_are_per_prompt_and_seeded(model, tok, requests):
    params = SamplingParams(n=4, max_new_tokens=8, seed=5)
    eng = _engine(model, tok)
    base = _run(eng, requests, params, step=1)
    assert _same(base, _run(eng, requests, params, step=1))  # same seed, same samples
    changed = list(requests)
    changed[3] = PromptRequest(index=3, prompt_ids=tok("a completely different prompt").input_ids)
    other = _run(eng, changed, params, step=1)
    assert not _same({3: base[3]}, {3: other[3]})
    assert _same({i: g for i, g in base.items() if i != 3}, {i: g for i, g in other.items() if i != 3})
    for different in (_run(eng, requests, params, step=2),
                      _run(eng, requests, SamplingParams(n=4, max_new_tokens=8, seed=6), step=1)):
        assert all(not torch.equal(x, y) for i in base for x, y in zip(base[i].response_ids, different[i].response_ids))
    g = base[0]  # the G samples of one prompt differ from each other
    assert len({tuple(r.tolist()) for r in g.response_ids}) == params.n


def test_eos_stops_samples_and_groups_stream_early(model, tok, requests):
    greedy = SamplingParams(n=2, max_new_tokens=8, seed=0, temperature=0.0)
    free = _run(_engine(model, tok), requests, greedy)
    # Declare the 3rd greedy token of prompt 5 to be EOS: prompt 5's group must now stop there,
    # finish first, and be yielded before the other groups of its chunk.
    eos = int(free[5].response_ids[0][2])
    eng = NativeEngine(model, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    order = [g for g in eng.generate(requests, greedy, step=0)]
    groups = {g.index: g for g in order}
    for i, g in groups.items():
        for resp, done in zip(g.response_ids, g.finished_G):
            ref = free[i].response_ids[0]
            hits = (ref == eos).nonzero()
            cut = int(hits[0]) + 1 if len(hits) else len(ref)
            assert torch.equal(resp, ref[:cut]) and bool(done) == bool(len(hits))
    assert len(groups[5].response_ids[0]) <= 3 and groups[5].finished_G.all()
    # One chunk: a group comes out at the step its last sample finishes, ties in index order.
    finish = {i: max(len(r) for r in g.response_ids) for i, g in groups.items()}
    assert [g.index for g in order] == sorted(groups, key=lambda i: (finish[i], i)) != sorted(groups)


def test_sampled_eos_pads_nothing_into_responses(model, tok, requests):
    # With sampling, samples of one group end at different lengths; each ends at its first EOS.
    eos = int(_run(_engine(model, tok), requests[:1], SamplingParams(n=1, max_new_tokens=1, seed=0, temperature=0.0))[0].response_ids[0][0])
    eng = NativeEngine(model, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    params = SamplingParams(n=8, max_new_tokens=12, seed=2, temperature=0.3)
    for g in eng.generate(requests, params, step=0):
        for resp, done in zip(g.response_ids, g.finished_G):
            assert (resp == eos).sum() == int(done) and (not done or resp[-1] == eos)
            assert done or len(resp) == params.max_new_tokens


def test_tiny_top_p_is_greedy(model, tok, requests):
    greedy = _run(_engine(model, tok), requests, SamplingParams(n=2, max_new_tokens=6, seed=0, temperature=0.0))
    nucleus = _run(_engine(model, tok), requests, SamplingParams(n=2, max_new_tokens=6, seed=9, top_p=1e-6))
    assert _same(greedy, nucleus)
    for i in greedy:  # T=1 log-probs, not renormalised by top-p, so they match greedy's raw ones
        torch.testing.assert_close(greedy[i].logprobs[0], nucleus[i].logprobs[0], atol=1e-6, rtol=0)


def test_greedy_equals_argmax_decoding(model, tok, requests):
    """temperature=0 is plain argmax decoding: each token is the argmax of a full forward of the text so
    far (no cache, no batch), every sample of a group is that one text, and the seed does not matter."""
    params = SamplingParams(n=2, max_new_tokens=6, seed=0, temperature=0.0)
    groups = _run(_engine(model, tok, max_batch_prompts=4), requests[:5], params)
    assert _same(groups, _run(_engine(model, tok), requests[:5], SamplingParams(n=2, max_new_tokens=6, seed=7,
                                                                               temperature=0.0)))
    with torch.no_grad():
        for r in requests[:5]:
            ids = torch.as_tensor(r.prompt_ids)
            for _ in range(params.max_new_tokens):
                nxt = model(ids[None]).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt[None]])
                if nxt == tok.eos_token_id:
                    break
            expect = ids[len(r.prompt_ids):]
            for resp in groups[r.index].response_ids:
                assert torch.equal(resp, expect)


def test_top_k_mask_and_sampling():
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    assert _top_k_mask(z, 1).tolist() == [[False, True, True, True, True]]
    assert _top_k_mask(z, 2).tolist() == [[False, False, False, True, True]]  # a tie with the k-th stays in
    assert _top_k_mask(z, 10).tolist() == [[False] * 5]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    R = 20000
    tok_R, logp_R = sample_tokens(probs.log().expand(R, 4), seeds_R=torch.arange(R) * 7919 + 13, t=4,
                                  temperature=1.0, top_p=1.0, top_k=2)
    freq = torch.bincount(tok_R, minlength=4).float() / R
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.015, rtol=0)
    torch.testing.assert_close(logp_R, probs.log()[tok_R], atol=1e-6, rtol=0)  # not renormalised


def test_top_k_1_is_greedy(model, tok, requests):
    greedy = _run(_engine(model, tok), requests, SamplingParams(n=2, max_new_tokens=6, seed=0, temperature=0.0))
    top1 = _run(_engine(model, tok), requests, SamplingParams(n=2, max_new_tokens=6, seed=3, top_k=1))
    assert _same(greedy, top1)


def test_top_p_mask_and_sampling_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _top_p_mask(probs.log(), 0.7).tolist() == [[False, False, True, True]]
    assert _top_p_mask(probs.log(), 0.79).tolist() == [[False, False, True, True]]
    assert _top_p_mask(probs.log(), 0.81).tolist() == [[False, False, False, True]]
    # The hash noise must give softmax frequencies (20k rows, one per seed) and respect top-p.
    R = 20000
    logits_RV = probs.log().expand(R, 4)
    for top_p, expect in ((1.0, probs[0]), (0.7, torch.tensor([0.625, 0.375, 0.0, 0.0]))):
        tok_R, logp_R = sample_tokens(logits_RV, seeds_R=torch.arange(R) * 7919 + 13, t=4, temperature=1.0, top_p=top_p)
        freq = torch.bincount(tok_R, minlength=4).float() / R
        torch.testing.assert_close(freq, expect, atol=0.015, rtol=0)
        torch.testing.assert_close(logp_R, probs[0].log()[tok_R], atol=1e-6, rtol=0)


def test_no_inference_mode_leaks_to_the_consumer(model, tok, requests):
    for g in _engine(model, tok).generate(requests, SamplingParams(n=2, max_new_tokens=4, seed=0), step=0):
        assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
        assert not g.response_ids[0].is_inference() and not g.logprobs[0].is_inference()


def test_bad_arguments(model, tok, requests):
    for bad in (dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(n=0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**{"n": 2, "max_new_tokens": 4, "seed": 0, **bad})
    with pytest.raises(ValueError, match="duplicate"):
        _engine(model, tok).generate([requests[0], requests[0]], SamplingParams(n=1, max_new_tokens=2, seed=0), step=0)
    with pytest.raises(ValueError, match="empty"):
        _engine(model, tok).generate([PromptRequest(index=0, prompt_ids=[])], SamplingParams(n=1, max_new_tokens=2, seed=0), step=0)


def test_sampling_uses_no_float64():
    """The sampler's arithmetic is float32 after the integer hash (Ascend kernels often lack float64);
    a row's uniform is the same computed alone or in a batch, and uniform on (0, 1)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tidal.executors.generator.sampling import uniforms

    class Dtypes(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.seen.add(t.dtype)
            return out

    seeds_R = torch.arange(6) * 104729 + 3
    logits_RV = torch.randn(6, 1000)
    with Dtypes() as mode:
        for top_p in (1.0, 0.9):
            sample_tokens(logits_RV, seeds_R=seeds_R, t=2, temperature=0.8, top_p=top_p)
    assert torch.float64 not in mode.seen and torch.float32 in mode.seen, mode.seen
    u_R = uniforms(seeds_R, 2)
    assert u_R.dtype == torch.float32 and bool(((u_R > 0) & (u_R < 1)).all())
    for r in range(6):
        assert torch.equal(uniforms(seeds_R[r:r + 1], 2), u_R[r:r + 1])
    many = torch.cat([uniforms(torch.arange(1000) * 7919 + 1, t) for t in range(1000)]).double()  # 1M draws
    assert abs(many.mean().item() - 0.5) < 0.002 and abs(many.var().item() - 1 / 12) < 0.001
    counts = torch.histc(many, bins=100, min=0, max=1)  # and flat: chi-square over 100 bins (df 99, p=0.001: 148.2)
    assert ((counts - 1e4) ** 2 / 1e4).sum().item() < 148.2


@pytest.mark.parametrize("top_p, top_k", [(1.0, 0), (0.9, 0), (1.0, 50), (0.8, 20)])
def test_a_rows_token_is_the_same_alone_and_in_any_batch(top_p, top_k):
    """One uniform a row: sample r's token at position t is the same drawn alone and inside batches of
    2, 7 and 16 rows (other rows' logits and seeds around it), at any of its positions."""
    gen = torch.Generator().manual_seed(0)
    logits_RV = torch.randn(16, 5000, generator=gen) * 3
    seeds_R = torch.randint(0, 2**62, (16,), generator=gen)
    t_R = torch.randint(0, 500, (16,), generator=gen)
    alone = [sample_tokens(logits_RV[r:r + 1], seeds_R=seeds_R[r:r + 1], t=t_R[r:r + 1], temperature=0.7,
                           top_p=top_p, top_k=top_k) for r in range(16)]
    for size in (2, 7, 16):
        for first in range(0, 16 - size + 1, size):
            rows = slice(first, first + size)
            tok_R, logp_R = sample_tokens(logits_RV[rows], seeds_R=seeds_R[rows], t=t_R[rows], temperature=0.7,
                                          top_p=top_p, top_k=top_k)
            for i, r in enumerate(range(first, first + size)):
                assert torch.equal(tok_R[i:i + 1], alone[r][0]) and torch.equal(logp_R[i:i + 1], alone[r][1])


@pytest.mark.parametrize("top_p, top_k, expect", [
    (1.0, 0, [0.4, 0.3, 0.15, 0.1, 0.05]),
    (1.0, 3, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    (0.75, 0, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),  # the nucleus: the fewest tokens with >= 0.75
    (0.6, 2, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0]),
])
def test_sampled_frequencies_pass_a_chi_square_test(top_p, top_k, expect):
    """50k samples (one per seed) of a fixed distribution, after top-p and top-k: Pearson's chi-square
    against the renormalised probabilities under the 0.001 critical value; masked tokens never drawn."""
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    R, expect = 50_000, torch.tensor(expect)
    tok_R, _ = sample_tokens(probs.log().expand(R, 5), seeds_R=torch.arange(R) * 7919 + 13, t=4, temperature=1.0,
                             top_p=top_p, top_k=top_k)
    seen = torch.bincount(tok_R, minlength=5).double()
    kept = expect > 0
    assert seen[~kept].sum() == 0
    chi2 = ((seen[kept] - R * expect[kept]) ** 2 / (R * expect[kept])).sum().item()
    critical = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}[int(kept.sum()) - 1]
    assert chi2 < critical, (chi2, seen.tolist())


def test_draw_never_picks_a_token_without_mass():
    from tidal.executors.generator.sampling import draw

    probs_RV = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0, 0.0]])
    for u in (1e-7, 0.25, 0.5, 0.75, 1 - 2.0**-23, 1.0):  # 1.0: u x total rounded up to the total
        tok_R = draw(probs_RV, torch.full((3,), u))
        assert bool((probs_RV.gather(1, tok_R[:, None]) > 0).all()), (u, tok_R)
    assert draw(probs_RV, torch.tensor([0.4, 0.9, 0.9])).tolist() == [1, 2, 0]


@pytest.fixture(scope="module")
def ending(tok):
    """An engine factory over a model that ends each sample at a random length: its EOS logit is
    raised to about 0.2 probability per token (the random model's others are near uniform), so
    groups finish at different times."""
    model = load_model(None, seed=1, dtype=torch.float64)  # machine-independent batching (see model64)
    bias_V = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    bias_V[tok.eos_token_id] = 5.0
    model.lm_head.register_forward_hook(lambda mod, args, out: out + bias_V)
    return lambda **kw: NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


ENDING = SamplingParams(n=2, max_new_tokens=12, seed=4)


def test_continuous_admission_keeps_every_sample(ending, requests):
    """Prompts entering a running batch (left-padded to its length, the cache trimmed as groups
    leave) get the samples they get alone, in any admission order."""
    def run(reqs, **kw):
        return {g.index: g for g in ending(**kw).generate(reqs, ENDING, step=2)}

    alone = run(requests, max_batch_prompts=1)
    lengths = {max(len(r) for r in g.response_ids) for g in alone.values()}
    assert len(lengths) >= 5, lengths  # groups do finish at different times
    for got in (run(requests, max_batch_prompts=3, admission="continuous"),
                run(requests[::-1], max_batch_prompts=5, admission="continuous"),
                run(requests, max_batch_prompts=3, admission="chunked")):
        assert _same(alone, got)
        for i in alone:
            for a, b in zip(alone[i].logprobs, got[i].logprobs):
                torch.testing.assert_close(a, b, **LOGP_OF_FLOAT64)


def _finish_order(durations: dict[int, int], slots: int, *, continuous: bool) -> list[int]:
    """The engine's yield order by hand: a group admitted before decode call s that needs d tokens
    leaves after call s + d - 1; ties leave in admission order."""
    waiting, live, out, s = list(durations), [], [], 0
    while waiting or live:
        if waiting and (continuous or not live):
            while waiting and len(live) < slots:
                live.append((waiting.pop(0), s))
        left = [i for i, start in live if start + durations[i] - 1 == s]
        out += left
        live = [(i, start) for i, start in live if i not in left]
        s += 1
    return out


def test_groups_leave_as_they_finish_and_slots_refill(ending, requests):
    order = [g.index for g in ending(max_batch_prompts=3, admission="continuous").generate(requests, ENDING, step=2)]
    chunked = [g for g in ending(max_batch_prompts=3, admission="chunked").generate(requests, ENDING, step=2)]
    durations = {g.index: max(len(x) for x in g.response_ids) for g in sorted(chunked, key=lambda g: g.index)}
    assert order == _finish_order(durations, 3, continuous=True)
    assert [g.index for g in chunked] == _finish_order(durations, 3, continuous=False) != order
    # a group overtakes a slower one that started ahead of it, beyond what a chunk allows
    assert any(order.index(b) < order.index(a) for a in range(12) for b in range(12) if b // 3 > a // 3)


def test_the_planner_replays_this_engine(ending, requests):
    """tidal/planner/model.py replay_engine, given each group's longest response, leaves in this engine's order."""
    from tidal.planner.model import replay_engine

    for admission in ("continuous", "chunked"):
        groups = list(ending(max_batch_prompts=3, admission=admission).generate(requests, ENDING, step=2))
        longest = {g.index: max(len(x) for x in g.response_ids) for g in groups}
        prompts = [(r.index, len(r.prompt_ids), ENDING.n, longest[r.index]) for r in requests]
        replayed = [i for i, _ in replay_engine(prompts, max_batch_prompts=3, admission=admission)]
        assert replayed == [g.index for g in groups], admission


def test_admission_is_checked():
    with pytest.raises(ValueError, match="admission must be one of"):
        NativeEngine(torch.nn.Linear(1, 1), eos_token_id=0, pad_token_id=0, admission="eager")


def test_stop_ends_the_stream_at_the_next_decode_iteration(model, tok, requests):
    """A stop request abandons the step: `stop()` is asked before every decode iteration, and once it
    says True no further token is decoded and the groups in flight are dropped; the groups finished
    before it are the same as without a stop."""
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    whole = [g.index for g in _engine(model, tok, max_batch_prompts=2).generate(requests[:6], params, step=0)]
    asked = []

    def stop():  # True from the 7th iteration on: the first chunk of 2 groups (6 tokens) is done by then
        asked.append(len(asked))
        return len(asked) > 7

    got = [g.index for g in _engine(model, tok, max_batch_prompts=2).generate(requests[:6], params, step=0, stop=stop)]
    assert len(asked) == 8  # asked once more, then nothing decoded
    assert got == whole[:len(got)] and 0 < len(got) < len(whole), (got, whole)

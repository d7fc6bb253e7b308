"""The native engine's fixed slots (tidal/executors/generator/slots.py): a sample is the same in any number of slots,
nothing on the decode path is reallocated, and reading the samples' ends every k steps changes no sample."""
import pytest
import torch

from tidal.executors.generator import native_engine
from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.executors.generator.slots import Slots
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.modeling.tiny.task import embedded_prompts
from tests.tolerances import LOGP_OF_FLOAT64

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def requests(tok):
    return [PromptRequest(index=i, prompt_ids=tok(p["prompt"]).input_ids) for i, p in enumerate(embedded_prompts(64, seed=5))]


def _engine(model, tok, **kw):
    return NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw)


def _ending(dtype, eos: int):
    """A model whose EOS is raised to ~0.1 probability a token, so samples end at different times and slots come
    and go."""
    model = load_model(None, seed=1, dtype=dtype)
    bias_V = torch.zeros(model.config.vocab_size, dtype=dtype)
    bias_V[eos] = 4.0
    model.lm_head.register_forward_hook(lambda mod, args, out: out + bias_V)
    return model


# (samples a prompt, prompts at once, prompts in the call): 2, 7, 16 and 256 slots
SLOTS = [(2, 1, 1), (1, 7, 9), (4, 4, 16), (4, 64, 64)]


@pytest.mark.parametrize("numerics, dtype", [("exact", torch.bfloat16), ("default", torch.float64)])
@pytest.mark.parametrize("admission", ["chunked", "continuous"])
def test_a_sample_is_the_same_in_any_number_of_slots(numerics, dtype, admission, tok, requests):
    """Sample 0 of prompt 5 decoded alone in one slot, then in 2, 7, 16 and 256 slots beside other prompts (its
    slot, its neighbours and when they leave all differ): exact numerics gives the same tokens and log-probs bit
    for bit, the default the same tokens and log-probs within float64's rounding."""
    model = _ending(dtype, tok.eos_token_id)

    def sample0(n, prompts, count):
        eng = _engine(model, tok, max_batch_prompts=prompts, admission=admission, numerics=numerics)
        batch = [requests[5]] + [r for r in requests[:count + 1] if r.index != 5][:count - 1]
        params = SamplingParams(n=n, max_new_tokens=24, seed=7)
        got = {g.index: g for g in eng.generate(batch[::-1] if count > 1 else batch, params, step=3)}
        assert len(got) == count
        return got[5].response_ids[0], got[5].logprobs[0], got

    ids, logp, _ = sample0(1, 1, 1)
    ended = set()
    for n, prompts, count in SLOTS:
        got_ids, got_logp, groups = sample0(n, prompts, count)
        ended |= {len(r) for g in groups.values() for r in g.response_ids}
        assert torch.equal(got_ids, ids), (n, prompts)
        if numerics == "exact":
            assert torch.equal(got_logp, logp), (n, prompts)
        else:
            torch.testing.assert_close(got_logp, logp, **LOGP_OF_FLOAT64)
    assert len(ended) >= 8  # samples did end at many lengths: slots were freed and taken at many steps


class _Watched(Slots):
    """The engine's own Slots, recording where its tensors live after every decode step."""
    seen: list = []

    def _addresses(self):
        state = [t.data_ptr() for t in (self.seed_N, self.pos_N, self.len_N, self.stop_N, self.eos_N, self.ended_N,
                                         self.tokens_NT, self.logp_NT, self.sampled_NT, self.next_tok_N)]
        return state + [t.data_ptr() for kv in self.store.kv.values() for t in kv]

    def decode(self, slots, rows_B):
        fed_B = super().decode(slots, rows_B)
        type(self).seen.append((id(self), tuple(self._addresses()), len(self.store.kv)))
        return fed_B


def test_nothing_on_the_decode_path_is_reallocated(tok, requests, monkeypatch):
    """Over a whole call, with groups leaving and prompts taking their slots (continuous admission), every state
    tensor and every layer's KV stays where it was allocated: tokens are written into them, never concatenated."""
    monkeypatch.setattr(native_engine, "Slots", _Watched)
    _Watched.seen = []
    eng = _engine(_ending(torch.float32, tok.eos_token_id), tok, max_batch_prompts=3, admission="continuous")
    groups = list(eng.generate(requests[:10], SamplingParams(n=2, max_new_tokens=16, seed=1), step=0))
    assert len(groups) == 10
    calls = {call for call, _, _ in _Watched.seen}
    assert len(calls) == 1 and len(_Watched.seen) > 16  # one call, more steps than a sample's tokens
    layers = eng.model.config.num_hidden_layers
    assert {addresses for _, addresses, _ in _Watched.seen} == {_Watched.seen[0][1]}
    assert {n for _, _, n in _Watched.seen} == {layers}


@pytest.mark.parametrize("numerics, dtype", [("exact", torch.bfloat16), ("default", torch.float64)])
@pytest.mark.parametrize("way", ["every 5th step", "bucketed"])
def test_reading_ends_late_or_decoding_in_buckets_changes_no_sample(way, numerics, dtype, tok, requests):
    """check_every=5: the host learns which samples ended every 5th step (an ended one feeds pads meanwhile, its
    group is handed out up to 4 steps later). graphs=True on CPU: the CUDA graphs' step without the capture, its
    rows padded to a bucket with the scratch slot and its keys the store's whole length. Either way the same
    groups, tokens and log-probs as the plain engine (exact: bit for bit)."""
    model = _ending(dtype, tok.eos_token_id)
    params = SamplingParams(n=3, max_new_tokens=20, seed=2)

    def run(**kw):
        eng = _engine(model, tok, max_batch_prompts=3, admission="continuous", numerics=numerics, **kw)
        return {g.index: g for g in eng.generate(requests[:8], params, step=1)}

    every, fifth = run(), run(**({"check_every": 5} if way == "every 5th step" else {"graphs": True}))
    assert every.keys() == fifth.keys()
    for i in every:
        for a, b in zip(every[i].response_ids, fifth[i].response_ids):
            assert torch.equal(a, b)
        for a, b in zip(every[i].logprobs, fifth[i].logprobs):
            if numerics == "exact":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, **LOGP_OF_FLOAT64)
        assert torch.equal(every[i].finished_G, fifth[i].finished_G)
    with pytest.raises(ValueError, match="check_every must be >= 1"):
        _engine(model, tok, check_every=0)


def test_with_graphs_the_next_call_decodes_in_the_same_slots(tok, requests):
    """graphs=True: the engine keeps a call's slots (and their captured steps) for the next call of the same shape;
    a call then gives what a fresh engine gives, and a stream that starts while another holds them gets its own."""
    model = _ending(torch.float64, tok.eos_token_id)
    params = SamplingParams(n=2, max_new_tokens=12, seed=3)
    eng = _engine(model, tok, max_batch_prompts=3, admission="continuous", graphs=True)
    first = [g.index for g in eng.generate(requests[:6], params, step=0)]
    kept = eng._kept[1]
    again = {g.index: g for g in eng.generate(requests[6:12], params, step=1)}
    assert eng._kept[1] is kept and first
    fresh = {g.index: g for g in _engine(model, tok, max_batch_prompts=3, admission="continuous", graphs=True)
             .generate(requests[6:12], params, step=1)}
    assert all(torch.equal(a, b) for i in fresh for a, b in zip(fresh[i].response_ids, again[i].response_ids))
    one, two = eng.generate(requests[:6], params, step=0), eng.generate(requests[:6], params, step=0)
    a, b = next(one), next(two)  # both streams under way: the second has slots of its own
    assert torch.equal(a.response_ids[0], b.response_ids[0]) and eng._kept[1] is not kept
    assert len(list(one)) == len(list(two)) == 5
    eng.release()
    assert eng._kept is None


def test_buckets():
    from tidal.executors.generator.graphs import bucket

    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17, 1000, 1025)] == [1, 2, 4, 8, 16, 32, 1024, 2048]


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_layers_decode_as_the_model_computes_them(family):
    """A window of 3 positions, shorter than every prompt and response: the slots' attention limits a sliding
    layer's keys by position, so the engine's log-probs equal the model's own forward over prompt + response
    (transformers' sliding-window mask), sample by sample (that the window changes them: tests/test_packing.py)."""
    from tests.test_packing import _sliding

    model = _sliding(family, 3)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(index=i, prompt_ids=torch.randint(1, 96, (n,), generator=g).tolist())
            for i, n in enumerate((6, 9, 7, 8))]
    params = SamplingParams(n=3, max_new_tokens=10, seed=5)
    eng = NativeEngine(model, eos_token_id=95, pad_token_id=0, max_batch_prompts=2, admission="continuous")
    groups = list(eng.generate(reqs, params, step=0))
    assert len(groups) == 4
    with torch.no_grad():
        for grp in groups:
            P = len(grp.prompt_ids_P)
            for resp, logp in zip(grp.response_ids, grp.logprobs):
                logits_TV = model(torch.cat([grp.prompt_ids_P, resp])[None]).logits[0, P - 1:-1]
                ref = torch.log_softmax(logits_TV.float(), -1).gather(-1, resp[:, None])[:, 0]
                torch.testing.assert_close(logp, ref, **LOGP_OF_FLOAT64)


class _Sized(Slots):
    sizes: list = []

    def __init__(self, engine, params, *, slots, length, response):
        type(self).sizes.append((slots, length))
        super().__init__(engine, params, slots=slots, length=length, response=response)


def test_a_kv_budget_bounds_the_slots_and_admission_waits_for_them(tok, requests, monkeypatch):
    """kv_budget_tokens for two slots (one group of G=2): four prompts decode one group at a time, in order, into
    a store of at most the budget's positions, with the samples the unbounded engine gives; a budget that holds
    no group is refused, naming the setting."""
    monkeypatch.setattr(native_engine, "Slots", _Sized)
    model = _ending(torch.float64, tok.eos_token_id)
    params = SamplingParams(n=2, max_new_tokens=10, seed=6)
    reqs = requests[:4]
    length = max(len(r.prompt_ids) for r in reqs) + params.max_new_tokens
    _Sized.sizes = []
    bounded = list(_engine(model, tok, max_batch_prompts=4, admission="continuous",
                           kv_budget_tokens=2 * length + 1).generate(reqs, params, step=0))
    assert _Sized.sizes == [(2, length)]
    assert [g.index for g in bounded] == [0, 1, 2, 3]  # one group at a time: they leave in admission order
    free = {g.index: g for g in _engine(model, tok, max_batch_prompts=4).generate(reqs, params, step=0)}
    assert _Sized.sizes[1] == (8, length)
    for g in bounded:
        assert all(torch.equal(a, b) for a, b in zip(g.response_ids, free[g.index].response_ids))
    with pytest.raises(ValueError, match=r"generator.kv_budget_tokens=10 holds no group: one group is 2 samples"):
        _engine(model, tok, kv_budget_tokens=10).generate(reqs, params, step=0)


class _Kept(_Sized):
    made: list = []

    def __init__(self, engine, params, *, slots, length, response):
        super().__init__(engine, params, slots=slots, length=length, response=response)
        type(self).made.append(self)


def test_a_memory_fraction_bounds_the_store_by_its_bytes(tok, requests, monkeypatch):
    """kv_memory_fraction: a position's bytes, counted from the model's key projections, are what a store the engine
    made holds a position; a fraction of the free memory that holds two slots (one group of G=2) decodes four prompts
    one group at a time, with the unbounded engine's samples; read once, at the first call; one that holds no group is
    refused, naming the setting."""
    from tidal.executors.generator.slots import kv_bytes_per_position

    monkeypatch.setattr(native_engine, "Slots", _Kept)
    model = _ending(torch.float64, tok.eos_token_id)
    params = SamplingParams(n=2, max_new_tokens=10, seed=6)
    reqs = requests[:4]
    length = max(len(r.prompt_ids) for r in reqs) + params.max_new_tokens
    _Kept.sizes, _Kept.made = [], []
    free = {g.index: g for g in _engine(model, tok, max_batch_prompts=4).generate(reqs, params, step=0)}
    (store,) = [s.store for s in _Kept.made]
    held = sum(k.nbytes + v.nbytes for k, v in store.kv.values())
    per = kv_bytes_per_position(model)
    assert held == per * (store.N * (store.S + 1)) and per > 0
    reads = []
    monkeypatch.setattr(native_engine, "free_memory_bytes", lambda device: reads.append(device) or 4 * per * (2 * length + 1))
    engine = _engine(model, tok, max_batch_prompts=4, kv_memory_fraction=0.25)
    for _ in range(2):
        bounded = list(engine.generate(reqs, params, step=0))
        assert [g.index for g in bounded] == [0, 1, 2, 3]  # one group at a time: they leave in admission order
        for g in bounded:
            assert all(torch.equal(a, b) for a, b in zip(g.response_ids, free[g.index].response_ids))
    assert _Kept.sizes[1:] == [(2, length)] * 2 and len(reads) == 1
    monkeypatch.setattr(native_engine, "free_memory_bytes", lambda device: per * length)
    with pytest.raises(ValueError, match=r"generator.kv_memory_fraction=0.5 of the 0.00 GiB free \(\d+ positions\) holds "
                                         r"no group: one group is 2 samples"):
        _engine(model, tok, kv_memory_fraction=0.5).generate(reqs, params, step=0)


def test_a_kv_budget_that_cannot_hold_a_group_is_refused_before_any_rank_starts():
    from tidal.recipes.checks import check_engine
    from tests.fixtures import small_config

    gen = {"samples_per_prompt": 4, "max_new_tokens": 16}
    check_engine(small_config(data={"max_prompt_tokens": 48}, generator={**gen, "kv_budget_tokens": 256}))
    with pytest.raises(ValueError, match=r"kv_budget_tokens=255 cannot hold one group: G=4 samples x "
                                         r"\(data.max_prompt_tokens=48 \+ 16 response tokens\) = 256"):
        check_engine(small_config(data={"max_prompt_tokens": 48}, generator={**gen, "kv_budget_tokens": 255}))
    with pytest.raises(ValueError, match="is the native engine's; generator.engine=vllm"):
        check_engine(small_config(generator={**gen, "engine": "vllm", "kv_budget_tokens": 10 ** 6}))

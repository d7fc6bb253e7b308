"""Multi-turn rollouts at the engine and rollout level: token in, token out; the KV kept across turns
gives the log-probs of a fresh forward over the whole sequence; per-sample determinism; observation
rendering through a chat template; and every bad input of an environment."""
from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import torch

from tidal.executors.data import PromptRow
from tidal.modeling.tiny.task import embedded_prompts, hide_digit
from tidal.executors.environments.base import EnvStep
from tidal.executors.generator.config import MultiTurnConfig
from tidal.executors.generator.contract import AnsweredTurns, PromptRequest, SamplingParams
from tidal.executors.generator.rollouts import EnvError, MultiTurn, ObservationRenderer

from tests.test_engine import _engine, model, model64, tok  # noqa: F401 (fixtures: the embedded model and tokenizer)
from tests.tolerances import LOGP_OF_FLOAT64


class Echo(AnsweredTurns):
    """Observations of varying length: turn k of sample j of prompt i gets (i + j + k) % 4 + 1 tokens
    derived from what the model wrote; the episode ends after the third turn, turn k capped at caps[k]."""

    def __init__(self, max_total_tokens=64, caps=(5, 5, 5)):
        self.max_total_tokens, self.caps = max_total_tokens, caps
        self.calls = {}

    def max_tokens(self, *, index, sample):
        return self.caps[len(self.calls.get((index, sample), []))]

    def answer(self, *, index, sample, turn_ids, ended):
        turns = self.calls.setdefault((index, sample), [])
        turns.append(turn_ids.clone())
        if len(turns) == 3:
            return None
        n = (index + sample + len(turns)) % 4 + 1
        return [(int(turn_ids[-1]) + 7 * k) % 500 + 1 for k in range(n)]


def _requests(tok, n=6):
    return [PromptRequest(index=i, prompt_ids=tok(p["prompt"]).input_ids) for i, p in enumerate(embedded_prompts(n, seed=3))]


def _turn_runs(mask):
    """[(sampled?, start, stop)] runs of a loss mask."""
    runs, start = [], 0
    for t in range(1, len(mask) + 1):
        if t == len(mask) or bool(mask[t]) != bool(mask[start]):
            runs.append((bool(mask[start]), start, t))
            start = t
    return runs


@pytest.mark.parametrize("admission", ["chunked", "continuous"])
def test_turns_are_sampled_ids_and_kv_across_turns_is_exact(model64, tok, admission):
    """The response is the turns exactly as sampled with the observations between them; the log-probs
    the engine reports with its kept KV equal a fresh forward over prompt + response."""
    model, turns = model64, Echo()
    params = SamplingParams(n=3, max_new_tokens=5, seed=4)
    groups = list(_engine(model, tok, max_batch_prompts=2, admission=admission).generate(
        _requests(tok), params, step=0, turns=turns))
    assert sorted(g.index for g in groups) == list(range(6))
    for g in groups:
        for j, (resp, logp, mask) in enumerate(zip(g.response_ids, g.logprobs, g.loss_masks)):
            seen = turns.calls[(g.index, j)]
            model_runs = [(a, b) for sampled, a, b in _turn_runs(mask) if sampled]
            assert [resp[a:b].tolist() for a, b in model_runs] == [t.tolist() for t in seen]
            assert len(seen) == 3 and bool(g.finished_G[j])
            assert (logp[~mask] == 0).all()
            P = len(g.prompt_ids_P)
            with torch.no_grad():
                logits_TV = model(torch.cat([g.prompt_ids_P, resp])[None]).logits[0, P - 1:-1]
            ref = torch.log_softmax(logits_TV.float(), -1).gather(-1, resp[:, None])[:, 0]
            torch.testing.assert_close(logp[mask], ref[mask], **LOGP_OF_FLOAT64)


def test_multi_turn_samples_do_not_depend_on_batching(model64, tok):
    model = model64  # float64: batching cannot move a float32 logit on any machine (tests/tolerances.py)
    params = SamplingParams(n=2, max_new_tokens=4, seed=9)

    def run(**kw):
        return {g.index: g.response_ids for g in _engine(model, tok, **kw).generate(_requests(tok), params, step=2,
                                                                                    turns=Echo(caps=(4, 4, 4)))}
    one, many, cont = run(max_batch_prompts=1), run(max_batch_prompts=6), run(max_batch_prompts=2, admission="continuous")
    for i in one:
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(one[i], many[i], cont[i]))


def test_a_turn_that_never_ends_is_cut_at_the_budget(model, tok):
    class Never(AnsweredTurns):  # always answers, never ends the episode
        max_total_tokens = 20

        def answer(self, **_):
            return [5, 6]

        def max_tokens(self, **_):
            return 4

    params = SamplingParams(n=2, max_new_tokens=4, seed=1)
    for g in _engine(model, tok).generate(_requests(tok, 2), params, step=0, turns=Never()):
        assert all(len(r) <= 20 for r in g.response_ids) and not g.finished_G.any()


@pytest.mark.parametrize("admission", ["chunked", "continuous"])
def test_each_turn_stops_at_the_cap_the_rollout_gives_it(model, tok, admission):
    """Turn k of every sample ends at its own cap (1, then 3, then 2 tokens) unless the model ends it
    first; a cut turn is handed to the rollout as not ended."""
    turns = Echo(caps=(1, 3, 2))
    cut = 0
    for g in _engine(model, tok, max_batch_prompts=2, admission=admission).generate(
            _requests(tok), SamplingParams(n=3, max_new_tokens=5, seed=4), step=0, turns=turns):
        for j in range(3):
            for cap, ids in zip(turns.caps, turns.calls[(g.index, j)], strict=True):
                eos = int(ids[-1]) == tok.eos_token_id
                assert len(ids) == cap or (eos and len(ids) < cap), (cap, ids)
                cut += not eos
    assert cut > 0


class Delayed(Echo):
    """Echo's answers, each held back for 0-4 of the engine's iterations (a function of the sample and turn):
    rows leave the batch and come back in another order, next to other rows, at other cache widths."""

    held: list = []

    def submit(self, *, index, sample, turn_ids, ended):
        obs = self.answer(index=index, sample=sample, turn_ids=turn_ids, ended=ended)
        self.held.append([(index * 7 + sample * 3 + len(turn_ids)) % 5, index, sample, obs])

    def ready(self, *, wait_s=0.0):
        for held in self.held:
            held[0] -= 1
        out = [(i, j, obs) for n, i, j, obs in self.held if n < 0]
        self.held = [h for h in self.held if h[0] >= 0]
        return out


@pytest.mark.parametrize("admission", ["chunked", "continuous"])
def test_with_exact_numerics_answers_late_change_no_token_or_logprob(tok, admission):
    """The environment's answers held back by 0-4 iterations against answered at once: with
    model.numerics=exact every sample's tokens and log-probs are the same bit for bit (what lets a tool's
    latency change nothing: issue 45)."""
    from tidal.executors.generator.native_engine import NativeEngine
    from tidal.modeling.hf import load_model

    engine = NativeEngine(load_model(None, seed=0), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          max_batch_prompts=2, admission=admission, numerics="exact")
    params = SamplingParams(n=3, max_new_tokens=5, seed=4)
    now = {g.index: g for g in engine.generate(_requests(tok), params, step=0, turns=Echo())}
    delayed = Delayed()
    delayed.held = []
    late = {g.index: g for g in engine.generate(_requests(tok), params, step=0, turns=delayed)}
    assert now.keys() == late.keys() == set(range(6))
    for i, g in now.items():
        for name in ("response_ids", "logprobs", "loss_masks"):
            assert all(torch.equal(a, b) for a, b in zip(getattr(g, name), getattr(late[i], name))), (i, name)


# ---- the rollout: environments, rendering, errors ---------------------------------------------------


def _rows(n=4):
    return [PromptRow(prompt=r["prompt"], extras={k: v for k, v in r.items() if k != "prompt"})
            for r in map(hide_digit, embedded_prompts(n, seed=0))]


def _rollout(tok, **cfg):
    return MultiTurn(tokenizer=tok, config=MultiTurnConfig(**cfg), max_new_tokens=6, max_prompt_tokens=256)


def _run_rollout(rollout, model, tok, rows, *, n=2):
    prompts = [(i, row, tok(row.prompt).input_ids) for i, row in enumerate(rows)]
    return {g.index: g for g in rollout.run(_engine(model, tok), prompts, SamplingParams(n=n, max_new_tokens=6, seed=0),
                                            step=0, stop=lambda: False)}


def test_lookup_rollout_shows_the_hidden_digit_after_a_look(model, tok):
    groups = _run_rollout(_rollout(tok), model, tok, _rows())
    looked = 0
    for g in groups.values():
        assert "?" in g.prompt and g.extras["answer"] not in g.prompt.split(".")[0]
        for i, episode in enumerate(g.episodes):
            roles = [role for role, _ in g.turns(i)]
            assert roles[0] == "assistant" and episode["turns"] == roles.count("assistant") and episode["error"] is None
            assert len(g.turns(i)[0][1]) == 1  # the look: reset() caps the first turn at one token
            for role, ids in g.turns(i):
                if role == "tool":
                    looked += 1
                    assert tok.decode(ids) == g.extras["reveal"]
    assert looked > 0


class Scores:
    """Never done: pays 1 for each turn it steps, 10 more for the turn it is told is the last."""
    deterministic = True

    def __init__(self, sample):
        self.seen = []

    def reset(self):
        return None

    def step(self, turn):
        self.seen.append(turn.last)
        return EnvStep(observation=" again", reward_parts={"turns": 1.0, "last": 10.0 * turn.last})


def test_the_turn_that_reaches_max_turns_is_stepped_and_scored_its_observation_unread(model, tok):
    """max_turns=3, an environment that never says done: three model turns, three steps (the third told it is
    the last, and its reward parts count), two observations in the response."""
    groups = _run_rollout(_rollout(tok, env="tests.test_multi_turn:Scores", max_turns=3), model, tok, _rows(2))
    for g in groups.values():
        for i, episode in enumerate(g.episodes):
            assert episode["error"] is None and episode["turns"] == 3
            assert episode["reward_parts"] == {"turns": 3.0, "last": 10.0}
            assert [role for role, _ in g.turns(i)] == ["assistant", "tool"] * 2 + ["assistant"]


class Raises:
    deterministic = True

    def __init__(self, sample, *, fail_at=0, what="raise"):
        self.fail_at, self.what, self.n = fail_at, what, 0

    def reset(self):
        return None

    def step(self, turn):
        self.n += 1
        if self.n <= self.fail_at:
            return EnvStep(observation=" ok")
        if self.what == "raise":
            raise RuntimeError("the tool broke")
        if self.what == "hang":
            time.sleep(30)
        if self.what == "type":
            return EnvStep(observation=3.5)
        if self.what == "huge":
            return EnvStep(observation=" a" * 400)
        if self.what == "not_a_step":
            return "text"
        if self.what == "cap":
            return EnvStep(observation=" ok", max_tokens=0)
        raise AssertionError(self.what)


@pytest.mark.parametrize("what, message", [
    ("raise", "step() raised RuntimeError: the tool broke"),
    ("hang", "step() timed out after 0.5 s"),
    ("type", "observation is a float, not text or a list of token ids"),
    ("huge", "its observation of 400 tokens leaves no room for a turn in multi_turn.max_total_tokens=64"),
    ("not_a_step", "step() returned str, not an EnvStep"),
    ("cap", "step() asked for max_tokens=0; a turn's token cap is an int >= 1"),
])
def test_environment_errors_end_the_sample_named_or_stop_the_run(model, tok, what, message):
    kw = dict(env="tests.test_multi_turn:Raises", env_args={"fail_at": 1, "what": what}, max_total_tokens=64,
              timeout_s=0.5, max_turns=4)
    groups = _run_rollout(_rollout(tok, **kw), model, tok, _rows(2))
    for g in groups.values():
        for i, episode in enumerate(g.episodes):
            head = f"environment 'tests.test_multi_turn:Raises' failed at step 0, prompt {g.index}, sample {i}: "
            assert episode["error"].startswith(head) and message in episode["error"], episode["error"]
            assert episode["turns"] == 2  # the turn before the failure kept its observation
            assert [r for r, _ in g.turns(i)] == ["assistant", "tool", "assistant"]
    with pytest.raises(EnvError, match=r"failed at step 0, prompt \d, sample \d: " + re.escape(message)):
        _run_rollout(_rollout(tok, **kw, on_error="fail"), model, tok, _rows(2))


class Caps:
    """Caps its turns at 2, then 3, then 100 tokens (more than generator.max_new_tokens: 6 apply)."""
    deterministic = True

    def __init__(self, sample, *, at_reset=EnvStep(max_tokens=2)):
        self.at_reset, self.n = at_reset, 0

    def reset(self):
        return self.at_reset

    def step(self, turn):
        self.n += 1
        return EnvStep(observation=" ok", max_tokens={1: 3, 2: 100}.get(self.n))  # 3: the last, nothing follows


def test_the_environment_caps_each_turn(model, tok):
    groups = _run_rollout(_rollout(tok, env="tests.test_multi_turn:Caps", max_turns=3), model, tok, _rows(2), n=4)
    lengths = set()
    for g in groups.values():
        for i, episode in enumerate(g.episodes):
            assert episode["error"] is None
            model_turns = [ids for role, ids in g.turns(i) if role == "assistant"]
            for cap, ids in zip((2, 3, 6), model_turns):
                assert len(ids) == cap or (len(ids) < cap and int(ids[-1]) == tok.eos_token_id)
                lengths.add(len(ids))
    assert {2, 3, 6} <= lengths  # every cap was reached by some turn

    bad = [(EnvStep(max_tokens=True), "reset() asked for max_tokens=True; a turn's token cap is an int >= 1"),
           (EnvStep(done=True), "reset() returned an EnvStep with done or reward_parts; before the first turn only "
                                "its observation and max_tokens apply")]
    for at_reset, message in bad:
        groups = _run_rollout(_rollout(tok, env="tests.test_multi_turn:Caps", env_args={"at_reset": at_reset}),
                              model, tok, _rows(1))
        assert [ep["error"].endswith(message) for ep in groups[0].episodes] == [True, True], groups[0].episodes


class Waits:
    """The first step() of all waits (60 s at most) until another sample's second step() has come: only an
    engine that decodes the other samples while an environment call runs gets past it at once."""
    deterministic = True
    lock, gate, log, waiter = threading.Lock(), threading.Event(), [], None

    def __init__(self, sample):
        self.n = 0

    def reset(self):
        return None

    def step(self, turn):
        self.n += 1
        with Waits.lock:  # the checks and the gate together: two samples' second steps may run at once
            first = Waits.waiter is None
            Waits.waiter = Waits.waiter or self
            if not first and self.n == 2 and not Waits.gate.is_set():
                Waits.log.append(("another sample's second step", True))
                Waits.gate.set()
        if first:
            Waits.log.append(("waiter released", Waits.gate.wait(60)))
        return EnvStep(observation=" ok")


def test_the_other_samples_decode_while_an_environment_call_waits(model, tok):
    Waits.gate.clear()
    Waits.log, Waits.waiter = [], None
    groups = _run_rollout(_rollout(tok, env="tests.test_multi_turn:Waits", max_turns=3, timeout_s=120), model, tok,
                          _rows(2))
    assert Waits.log == [("another sample's second step", True), ("waiter released", True)]
    assert all(ep["error"] is None and ep["turns"] == 3 for g in groups.values() for ep in g.episodes)


class SlowToOpen:
    """The first prompt's environments open only when the test says (their reset() waits, 60 s at most); every
    prompt opens with ` go`, and its episodes end at their first turn."""
    deterministic = True
    gate, gated = threading.Event(), None

    def __init__(self, sample):
        self.wait = sample["prompt"] == SlowToOpen.gated

    def reset(self):
        if self.wait:
            assert SlowToOpen.gate.wait(60)
        return " go"

    def step(self, turn):
        return EnvStep(done=True, reward_parts={"waited": float(self.wait)})


def test_the_engine_decodes_the_opened_prompts_while_others_are_reset(model64, tok):
    """The first prompt's reset() blocks until another prompt's group has come out: only an engine that decodes
    the prompts already opened while the others' environments are made gets past it. Its group then opens with its
    first observation and is the group of a run where nothing waited (the same tokens, masks and log-probs)."""
    rows = _rows(3)
    SlowToOpen.gated = rows[0].prompt
    prompts = [(i, row, tok(row.prompt).input_ids) for i, row in enumerate(rows)]
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    rollout = _rollout(tok, env="tests.test_multi_turn:SlowToOpen", timeout_s=120)
    SlowToOpen.gate.clear()
    order = []
    for g in rollout.run(_engine(model64, tok, max_batch_prompts=3), prompts, params, step=0, stop=lambda: False):
        order.append((g.index, SlowToOpen.gate.is_set()))
        SlowToOpen.gate.set()
        if g.index == 0:
            late = g
    assert order[0] == (1, False) or order[0] == (2, False)
    assert sorted(i for i, _ in order) == [0, 1, 2]
    assert late.prompt_ids[-len(rollout.render(" go")):].tolist() == rollout.render(" go")
    assert [ep["reward_parts"] for ep in late.episodes] == [{"waited": 1.0}] * 2
    whole = _run_rollout(_rollout(tok, env="tests.test_multi_turn:SlowToOpen", timeout_s=120), model64, tok, rows)[0]
    assert torch.equal(whole.prompt_ids, late.prompt_ids)
    for a, b, ma, mb, la, lb in zip(whole.responses, late.responses, whole.loss_masks, late.loss_masks,
                                    whole.logprobs, late.logprobs, strict=True):
        assert torch.equal(a, b) and torch.equal(ma, mb)
        torch.testing.assert_close(la, lb, **LOGP_OF_FLOAT64)


def test_a_first_observation_past_max_prompt_tokens_fails_its_episodes_named(model, tok):
    rows = _rows(1)
    fits = len(tok(rows[0].prompt).input_ids)
    rollout = MultiTurn(tokenizer=tok, config=MultiTurnConfig(env="tests.test_multi_turn:SlowToOpen"),
                        max_new_tokens=6, max_prompt_tokens=fits)
    SlowToOpen.gated = None
    groups = _run_rollout(rollout, model, tok, rows)
    n = len(rollout.render(" go"))
    message = (f"environment 'tests.test_multi_turn:SlowToOpen' failed at step 0, prompt 0, sample 0: reset()'s "
               f"observation of {n} tokens makes the prompt {fits + n} tokens, over data.max_prompt_tokens={fits}")
    assert groups[0].episodes[0]["error"] == message and len(groups[0].prompt_ids) == fits


class Async:
    """`async def step`: its calls run as coroutines on the pool's event loop, several at once."""
    deterministic = True
    running = peak = 0

    def __init__(self, sample):
        pass

    def reset(self):
        return None

    async def step(self, turn):
        Async.running += 1  # one event loop: no lock needed
        Async.peak = max(Async.peak, Async.running)
        await asyncio.sleep(0.02)
        Async.running -= 1
        return EnvStep(observation=" ok", done=turn.index == 1)


def test_an_async_step_runs_on_the_event_loop(model, tok):
    Async.peak = 0
    groups = _run_rollout(_rollout(tok, env="tests.test_multi_turn:Async", max_turns=4), model, tok, _rows(2))
    assert all(ep["error"] is None and ep["turns"] == 2 for g in groups.values() for ep in g.episodes)
    assert Async.peak > 1  # the calls of several samples were in flight together


class Hangs(Waits):
    def step(self, turn):
        Waits.log.append("called")
        Waits.gate.wait(60)
        Waits.log.append("returned")
        return EnvStep(observation=" ok")


def test_a_stop_abandons_the_calls_in_flight(model, tok):
    """A stop while every sample's call hangs: the stream ends without waiting for them, nothing is
    handed out, and the rollout runs again afterwards (the abandoned answers are dropped)."""
    Waits.gate.clear()
    Waits.log = []
    rollout = _rollout(tok, env="tests.test_multi_turn:Hangs", timeout_s=120)
    prompts = [(i, row, tok(row.prompt).input_ids) for i, row in enumerate(_rows(2))]
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    out = list(rollout.run(_engine(model, tok), prompts, params, step=0, stop=lambda: "called" in Waits.log))
    assert out == [] and "returned" not in Waits.log  # ended with the calls still running
    Waits.gate.set()
    again = _run_rollout(rollout, model, tok, _rows(2))
    assert sorted(again) == [0, 1] and all(ep["error"] is None for g in again.values() for ep in g.episodes)


def test_unknown_environment_and_nondeterministic_refusal(tok):
    with pytest.raises(ValueError, match="unknown environment 'nope'; known: calculator, lookup, python"):
        _rollout(tok, env="nope")
    with pytest.raises(ValueError, match="cannot import module .tests.no_such_module."):
        _rollout(tok, env="tests.no_such_module:Env")

    class Clock(Raises):
        deterministic = False
    globals()["Clock"] = Clock
    with pytest.raises(ValueError, match="not deterministic"):
        _rollout(tok, env="tests.test_multi_turn:Clock", require_deterministic=True)
    _rollout(tok, env="tests.test_multi_turn:Clock")  # allowed when equivalence is not asked for


# Qwen3's shape, with the embedded tokenizer's EOS as the end of a message (Qwen3's EOS is <|im_end|>)
QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|endoftext|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_observations_render_as_tool_messages_and_are_never_retokenised(tok):
    """With a chat template, an observation becomes the template's tool message, closed by the model's
    own end-of-turn token. Re-tokenising the conversation as text drifts from what was sampled: a
    model may sample a word as pieces the tokenizer would merge; Tidal keeps the sampled ids."""
    import copy

    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = QWEN_LIKE_TEMPLATE
    render = ObservationRenderer(chat_tok)
    eot = chat_tok.eos_token
    assert chat_tok.decode(render("42")) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|endoftext|>\n"
                                            "<|im_start|>assistant\n")
    assert chat_tok.decode(render("42", closed=False)).startswith(eot + "\n<|im_start|>user")
    assert ObservationRenderer(tok)(" 7 cats") == tok.encode(" 7 cats", add_special_tokens=False)  # no template
    # the sampled ids of a turn: "apples" as single letters, which decode to the same text
    sampled = [tok.convert_tokens_to_ids(c) for c in "apples"] + [tok.eos_token_id]
    retokenised = tok.encode(tok.decode(sampled), add_special_tokens=False)
    assert tok.decode(retokenised) == tok.decode(sampled) and retokenised != sampled

"""Partial rollouts (generator.partial_rollout_tokens): a group cut at a step's token budget is
resumed in a later step, keeping its tokens, log-probs and seeds."""
import threading
from pathlib import Path

import pytest
import torch

from tidal.modeling.tiny.task import embedded_prompts
from tidal.executors.generator.contract import AnsweredTurns, PromptRequest, Resume, SamplingParams
from tidal.executors.data import PromptRow
from tidal.executors.generator.config import MultiTurnConfig
from tidal.executors.generator.native_engine import NativeEngine
from tidal.executors.generator.partial import PartialRollouts
from tidal.executors.generator.rollouts import MultiTurn
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.recipes.grpo import build
from tests.e2e import launch, max_abs_diff, metrics, weights
from tests.envs import Tally
from tests.tolerances import LOGP_OF_FLOAT64

torch.set_num_threads(1)

PARAMS = SamplingParams(n=3, max_new_tokens=12, seed=4)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def ending(tok):
    """A model whose samples end at random lengths (EOS logit raised), and a factory of engines over it."""
    model = load_model(None, seed=1, dtype=torch.float64)  # batching-independent logits (tests/tolerances.py)
    bias_V = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    bias_V[tok.eos_token_id] = 4.0
    model.lm_head.register_forward_hook(lambda mod, args, out: out + bias_V)
    return model, (lambda **kw: NativeEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **kw))


@pytest.fixture(scope="module")
def requests(tok):
    return [PromptRequest(index=i, prompt_ids=tok(p["prompt"]).input_ids)
            for i, p in enumerate(embedded_prompts(8, seed=3))]


def _in_pieces(engine, requests, budget):
    """Generate with a token budget per call, resuming every cut group in the next call (new
    indices, as the generator gives them) until all are done: {original index: completion}."""
    done, calls, origin = {}, 0, {r.index: r.index for r in requests}
    while requests:
        cut = []
        for g in engine.generate(requests, PARAMS, step=5, budget=budget):
            if g.cut:
                assert all(r.numel() <= (calls + 1) * budget for r in g.response_ids)
                cut.append(g)
            else:
                done[origin[g.index]] = g
        calls += 1
        # the resumed groups get fresh indices, as a later step gives them; the seeds stay their origin's
        requests = [PromptRequest(index=100 * calls + k, prompt_ids=g.prompt_ids_P,
                                  resume=Resume(step=5, index=origin[g.index], response_ids=g.response_ids,
                                                logprobs=g.logprobs, finished_G=g.finished_G))
                    for k, g in enumerate(cut)]
        origin.update({r.index: r.resume.index for r in requests})
    return done, calls


@pytest.mark.parametrize("admission", ["chunked", "continuous"])
def test_resumed_samples_equal_uninterrupted_ones(ending, requests, admission):
    """With the weights unchanged, a sample generated in pieces of 3 tokens (its KV computed again
    at every resume) is the sample generated in one go: the same tokens, the same log-probs within
    float noise, the same finished flags."""
    _, engine = ending
    whole = {g.index: g for g in engine(max_batch_prompts=3, admission=admission).generate(requests, PARAMS, step=5)}
    pieces, calls = _in_pieces(engine(max_batch_prompts=3, admission=admission), requests, budget=3)
    assert calls >= 3  # some groups did need several pieces
    assert pieces.keys() == whole.keys()
    for i, g in whole.items():
        assert torch.equal(g.finished_G, pieces[i].finished_G)
        for a, b, la, lb in zip(g.response_ids, pieces[i].response_ids, g.logprobs, pieces[i].logprobs):
            assert torch.equal(a, b)
            torch.testing.assert_close(la, lb, **LOGP_OF_FLOAT64)


def test_resume_after_a_weight_change_keeps_earlier_tokens(ending, requests):
    """Resumed after the weights changed, a sample keeps its earlier tokens and log-probs exactly;
    the tokens after the cut are sampled (and scored) by the new weights."""
    model, engine = ending
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        eng = engine(max_batch_prompts=8)
        cut = [g for g in eng.generate(requests, PARAMS, step=5, budget=4) if g.cut]
        assert cut
        first = {g.index: g for g in cut}
        with torch.no_grad():  # a push: the weights change between the cut and the resume
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        resumed = [PromptRequest(index=g.index, prompt_ids=g.prompt_ids_P,
                                 resume=Resume(step=5, index=g.index, response_ids=g.response_ids,
                                               logprobs=g.logprobs, finished_G=g.finished_G)) for g in cut]
        after = {g.index: g for g in eng.generate(resumed, PARAMS, step=6, budget=100)}
        assert after.keys() == first.keys() and not any(g.cut for g in after.values())
        changed = 0
        for i, g in after.items():
            for a, b, la, lb, end in zip(first[i].response_ids, g.response_ids, first[i].logprobs, g.logprobs,
                                         first[i].finished_G):
                assert torch.equal(b[:a.numel()], a) and torch.equal(lb[:a.numel()], la)
                if end:  # an ended sample writes nothing more
                    assert b.numel() == a.numel()
                # the new tokens are scored by the new weights: teacher forcing reproduces them
                with torch.no_grad():
                    P = len(g.prompt_ids_P)
                    logits_TV = model(torch.cat([g.prompt_ids_P, b])[None]).logits[0, P - 1:-1]
                ref = torch.log_softmax(logits_TV.float(), -1).gather(-1, b[:, None])[:, 0]
                torch.testing.assert_close(lb[a.numel():], ref[a.numel():], **LOGP_OF_FLOAT64)
                changed += int(not torch.allclose(la, ref[:a.numel()], atol=1e-4))
        assert changed  # the earlier log-probs are the old weights', not the new ones'
    finally:
        model.load_state_dict(saved)


class Told(AnsweredTurns):
    """Episodes keyed by their origin (a resumed group takes a new index): after turn k a sample is told 1-4
    tokens made from its turn; the episode ends after its third turn; every turn is capped at 4 tokens."""

    max_total_tokens = 40

    def __init__(self):
        self.calls, self.origin = {}, {}

    def max_tokens(self, *, index, sample):
        return 4

    def answer(self, *, index, sample, turn_ids, ended):
        first = self.origin.get(index, index)
        turns = self.calls.setdefault((first, sample), [])
        turns.append(turn_ids.clone())
        if len(turns) == 3:
            return None
        return [(int(turn_ids[-1]) + 7 * k) % 500 + 1 for k in range((first + sample + len(turns)) % 4 + 1)]


def _turns_in_pieces(engine, requests, budget):
    """_in_pieces with turns: a cut group resumes with its samples' loss masks, ends and turn starts."""
    done, calls, turns = {}, 0, Told()
    while requests:
        cut = []
        for g in engine.generate(requests, PARAMS, step=5, turns=turns, budget=budget):
            (cut.append(g) if g.cut else done.__setitem__(turns.origin.get(g.index, g.index), g))
        calls += 1
        requests = [PromptRequest(index=100 * calls + k, prompt_ids=g.prompt_ids_P, resume=Resume(
            step=5, index=turns.origin.get(g.index, g.index), response_ids=g.response_ids, logprobs=g.logprobs,
            finished_G=g.finished_G, loss_masks=g.loss_masks, over_G=g.over_G, turn_starts=g.turn_starts))
            for k, g in enumerate(cut)]
        turns.origin.update({r.index: r.resume.index for r in requests})
    return done, calls, turns


@pytest.mark.parametrize("budget", [1, 3])
def test_cut_episodes_resume_where_they_stopped(ending, requests, budget):
    """Multi-turn episodes written `budget` tokens a call (cut within a turn, or after its answer, its observation
    fed by the next call) are the episodes written in one go, with the weights unchanged: the same turns given to
    the environment, tokens, loss masks and ends, log-probs within float noise."""
    _, engine = ending
    whole_turns = Told()
    whole = {g.index: g for g in engine(max_batch_prompts=3).generate(requests, PARAMS, step=5, turns=whole_turns)}
    pieces, calls, turns = _turns_in_pieces(engine(max_batch_prompts=3), requests, budget)
    assert calls > 3 and pieces.keys() == whole.keys()
    assert {k: [t.tolist() for t in v] for k, v in turns.calls.items()} == \
        {k: [t.tolist() for t in v] for k, v in whole_turns.calls.items()}
    for i, g in whole.items():
        assert torch.equal(g.finished_G, pieces[i].finished_G) and not pieces[i].cut
        for a, b, ma, mb, la, lb in zip(g.response_ids, pieces[i].response_ids, g.loss_masks, pieces[i].loss_masks,
                                        g.logprobs, pieces[i].logprobs, strict=True):
            assert torch.equal(a, b) and torch.equal(ma, mb)
            torch.testing.assert_close(la, lb, **LOGP_OF_FLOAT64)
        assert any(not m.all() for m in g.loss_masks)  # observations are in the responses


class Locked(Tally):
    def __init__(self, sample):
        super().__init__(sample)
        self.lock = threading.Lock()  # cannot be pickled


def _keeper(tok, env: str, budget: int):
    rollout = MultiTurn(tokenizer=tok, config=MultiTurnConfig(env=env, max_turns=5), max_new_tokens=PARAMS.max_new_tokens,
                        max_prompt_tokens=256)
    return rollout, PartialRollouts(rollout=rollout, prompts_per_step=8, unit=0, units=1, budget=budget)


def _prompts(tok):
    rows = [PromptRow(prompt=r["prompt"], extras={}) for r in embedded_prompts(8, seed=3)]
    return [(i, row, tok(row.prompt).input_ids) for i, row in enumerate(rows)]


def _steps(keeper, engine, prompts, *, first: int, last: int, origin: dict) -> dict:
    """Steps first..last of a keeper whose weights never change: {first index: group} of those that ended."""
    out = {}
    for step in range(first, last + 1):
        for g in keeper.run(engine, prompts if step == 0 else [], PARAMS, step=step, stop=lambda: False, version=step):
            out[origin[g.index] if step == 0 else keeper.origin(g.index, step)[1]] = g
        keeper.end(step)
    return out


def test_cut_episodes_keep_their_environment_across_steps_and_a_checkpoint(ending, tok, tmp_path):
    """A multi-turn rollout written 2 tokens a step, its episodes cut and their environments saved and restored
    every step (and through a checkpoint after step 1), is the rollout written whole: the same responses, loss
    masks and episodes (turns, reward parts), with the weights unchanged."""
    _, engine = ending
    prompts = _prompts(tok)
    rollout, keeper = _keeper(tok, "tests.envs:Tally", budget=2)
    whole = {g.index: g for g in rollout.run(engine(max_batch_prompts=3), prompts, PARAMS, step=0, stop=lambda: False)}
    ident = {i: i for i in whole}
    early = _steps(keeper, engine(max_batch_prompts=3), prompts, first=0, last=1, origin=ident)
    assert keeper.carried and all(c.prompt_ids[-1] == tok(" read").input_ids[-1] for c in keeper.carried)
    keeper.save(tmp_path, step=1)
    _, resumed = _keeper(tok, "tests.envs:Tally", budget=2)
    resumed.load(tmp_path, prompt_of=lambda step, index: (prompts[index][1], prompts[index][2]))
    late = _steps(resumed, engine(max_batch_prompts=3), [], first=2, last=40, origin=ident)
    assert not resumed.carried and early.keys().isdisjoint(late.keys())
    pieces = early | late
    assert pieces.keys() == whole.keys()
    for i, g in whole.items():
        p = pieces[i]
        assert [e["turns"] for e in g.episodes] == [e["turns"] for e in p.episodes]
        assert [e["reward_parts"] for e in g.episodes] == [e["reward_parts"] for e in p.episodes]
        assert torch.equal(g.finished, p.finished) and torch.equal(g.prompt_ids, p.prompt_ids)
        for a, b, ma, mb in zip(g.responses, p.responses, g.loss_masks, p.loss_masks, strict=True):
            assert torch.equal(a, b) and torch.equal(ma, mb)
    assert max(e["turns"] for g in whole.values() for e in g.episodes) >= 3


def test_an_environment_that_cannot_be_saved_stops_the_run_named(ending, tok):
    _, engine = ending
    _, keeper = _keeper(tok, "tests.test_partial_rollouts:Locked", budget=2)
    with pytest.raises(ValueError, match=r"environment Locked at step 0, prompt \d+, sample \d+ cannot be saved "
                                         r"\(pickling it raised TypeError: cannot pickle '_thread.lock' object\)"):
        list(keeper.run(engine(max_batch_prompts=3), _prompts(tok), PARAMS, step=0, stop=lambda: False, version=0))


# ---- whole jobs ------------------------------------------------------------------------------------

B, MAX, N = 4, 8, 3  # 4 prompts per step; samples of up to 8 tokens written 3 a step: cut at most twice
PART = ["--set", "reward.functions=[tests.rewards:length_parity]", "--set", "trainer.adam_eps=1e-3",
        "--set", f"generator.max_new_tokens={MAX}", "--set", f"generator.partial_rollout_tokens={N}"]
EVERY2 = ["--set", "checkpoint_every=2"]  # checkpoints after steps 1, 3, 5
OFF1 = ["--schedule", "offpolicy", "--set", "schedule.max_lag=1"]
TURNS = ["--set", "rollout=multi_turn", "--set", "multi_turn.env=tests.envs:Tally"]  # a stateful environment


def _final(out: Path) -> bytes:
    return (out / "final/model.safetensors").read_bytes()


def _digests(out: Path) -> list[str]:
    return [r["trainer/rollout_digest"] for r in metrics(out)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    jobs = {
        "sync": ([*PART, "--schedule", "sync"], 3),
        "periodic": ([*PART, *EVERY2, "--set", "logging.samples_every=1"], 3),
        "replicas2": ([*PART, "--set", "generator.replicas=2"], 4),
        "dp2": ([*PART, "--set", "trainer.dp=2"], 4),
        "off1": ([*PART, *OFF1, *EVERY2], 3),
        "turns": ([*PART, *TURNS, *EVERY2], 3),
        "turns_sync": ([*PART, *TURNS, "--schedule", "sync"], 3),
    }
    out = {}
    for name, (args, nproc) in jobs.items():
        proc = launch(root / name, *args, nproc=nproc, steps=6, timeout=400)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        out[name] = root / name
    return out


def test_every_prompt_is_trained_once_when_its_group_ends(runs):
    """Groups cut in a step are resumed in the next; every step's B prompts are trained exactly once,
    in the step their last sample ends; a step in which none ended trains nothing."""
    rows = metrics(runs["periodic"])
    cut, resumed, groups = ([r[k] for r in rows] for k in ("generator/partial_groups", "generator/resumed_groups", "trainer/groups"))
    assert any(cut) and resumed == [0] + cut[:-1]
    assert [g + c for g, c in zip(groups, cut)] == [B + r for r in resumed]  # nothing lost, nothing twice
    assert sum(groups) == B * len(rows) - cut[-1]
    for r in rows:
        assert 0 <= r["trainer/staleness_max"] <= 2  # periodic: a token is behind only by the cuts of its group
        assert (r["trainer/reward_mean"] is None) == (r["trainer/groups"] == 0) and (r["trainer/optimizer_steps"] == 0) == (r["trainer/groups"] == 0)
    assert max(r["trainer/staleness_max"] for r in rows) >= 1


def test_samples_say_which_versions_wrote_them(runs):
    """A group resumed c times has index c * B + its first index, and its samples' first tokens were
    written c versions back (each sample writes in its group's first step); their newest at most by
    the step's (a sample that ended early wrote nothing after)."""
    import json

    lines = [json.loads(line) for line in (runs["periodic"] / "samples.jsonl").read_text().splitlines()]
    assert any(r["prompt_index"] >= B for r in lines)
    for r in lines:
        oldest, newest = r["policy_versions"]
        assert oldest == r["step"] - r["prompt_index"] // B and oldest <= newest <= r["step"], r
    assert any(r["policy_versions"] == [r["step"] - 2, r["step"]] for r in lines)


def test_sync_and_periodic_cut_and_train_the_same(runs):
    assert _digests(runs["sync"]) == _digests(runs["periodic"])
    assert _final(runs["sync"]) == _final(runs["periodic"])


def test_two_generator_replicas_cut_and_resume_the_same(runs):
    assert _digests(runs["replicas2"]) == _digests(runs["periodic"])
    assert _final(runs["replicas2"]) == _final(runs["periodic"])


def test_two_trainer_dp_ranks_train_what_one_does(runs):
    """Resumed groups take indices past B; their dp rank follows the index like any other's."""
    assert _digests(runs["dp2"]) == _digests(runs["periodic"])
    assert max_abs_diff(weights(runs["dp2"] / "final"), weights(runs["periodic"] / "final")) < 1e-5


def test_offpolicy_staleness_adds_the_cuts_to_the_lag(runs):
    rows = metrics(runs["off1"])
    assert all(r["trainer/staleness_max"] <= 1 + 2 for r in rows)
    assert max(r["trainer/staleness_max"] for r in rows) > 1


def test_multi_turn_episodes_are_cut_and_resumed_the_same_by_sync_and_periodic(runs):
    """Episodes cut within their turns at 3 tokens a step: sync and periodic cut and train the same, every group
    ends within ceil(max_total_tokens / 3) steps, and a token is at most its group's cuts old."""
    rows = metrics(runs["turns"])
    assert all(r["generator/partial_groups"] > 0 for r in rows) and max(r["trainer/staleness_max"] for r in rows) >= 2
    assert any(r["trainer/groups"] > 0 and r["generator/turns_mean"] > 1.5 for r in rows)
    assert _digests(runs["turns_sync"]) == _digests(runs["turns"])
    assert _final(runs["turns_sync"]) == _final(runs["turns"])


@pytest.mark.parametrize("run,extra,nproc", [("periodic", [], 3), ("periodic", ["--set", "generator.replicas=2"], 4),
                                             ("off1", [], 3), ("turns", [], 3)],
                         ids=["periodic", "periodic-2-replicas", "offpolicy", "multi-turn"])
def test_resume_with_groups_in_flight_equals_the_whole_run(runs, tmp_path, run, extra, nproc):
    """The checkpoint of step 3 keeps the groups cut by then; the resumed run resumes them (shared
    out over 2 replicas where it has 2) and equals the whole run bit for bit. Offpolicy: the
    generator was a step ahead when step 3 was saved; it saves its groups as they were after step 3.
    Multi-turn: episodes cut mid-turn or after an answer, their environments' state in the checkpoint."""
    ckpt = runs[run] / "checkpoints/step_000003"
    assert [p.name for p in (ckpt / "generator").iterdir()] == ["partial_rollouts.unit0.pt"]
    assert metrics(runs[run])[3]["generator/partial_groups"] > 0  # groups are in flight at the checkpoint
    args = [*PART, *EVERY2, *(OFF1 if run == "off1" else []), *(TURNS if run == "turns" else []), *extra]
    proc = launch(tmp_path, *args, "--resume", str(ckpt), steps=6, nproc=nproc, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [4, 5]
    assert _digests(tmp_path) == _digests(runs[run])[4:]
    assert _final(tmp_path) == _final(runs[run])


@pytest.mark.parametrize("args,message", [
    (["--set", "generator.partial_rollout_tokens=8"], "is not below generator.max_new_tokens=8: no sample would ever be cut"),
    (["--set", "rollout=multi_turn", "--set", "multi_turn.env=tests.envs:Unsaveable"],
     "with multi_turn.env=tests.envs:Unsaveable: that environment says it cannot be saved and restored "
     "(resumable = False)"),
    (["--set", "rollout=multi_turn", "--set", "multi_turn.max_total_tokens=3"],
     "is not below a response's 3 tokens (multi_turn.max_total_tokens): no sample would ever be cut"),
    (["--set", "rollout=multi_turn", "--set", "generator.engine=vllm"],
     "with rollout=multi_turn and generator.engine=vllm: its turns are requests submitted as answers arrive"),
    (["--set", "trainer.mini_batches=2"], "with trainer.mini_batches=2: the groups a step trains are the ones that ended"),
    (["--algo", "dapo"], "with dynamic sampling (algorithm.dynamic_sampling=true)"),
])
def test_bad_partial_rollout_settings_are_refused_before_any_rank_starts(args, message):
    from tidal.launch.cli import parser, resolve

    base = ["--algo", "grpo", "--set", "generator.max_new_tokens=8", "--set", "generator.partial_rollout_tokens=3"]
    with pytest.raises(ValueError) as err:
        build(resolve(parser().parse_args(base + args)))
    assert message in str(err.value)
    with pytest.raises(ValueError, match="partial_rollout_tokens.*greater than or equal to 1"):
        resolve(parser().parse_args([*base, "--set", "generator.partial_rollout_tokens=0"]))


def test_dry_run_states_how_stale_a_token_may_be():
    import subprocess
    import sys

    from tests.e2e import ROOT

    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", "--dry-run", "--schedule", "offpolicy",
                           "--set", "generator.max_new_tokens=64", "--set", "generator.partial_rollout_tokens=16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("partial rollouts: at most 16 tokens a sample per step, so a group spans up to 4 steps; a trained "
            "token is at most 4 policy versions old (3 cuts + max_lag 1)") in proc.stdout

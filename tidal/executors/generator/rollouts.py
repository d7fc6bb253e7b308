"""Rollouts (`rollout`): how the generator turns a step's prompts into responses with its engine.

    single_turn   one completion per sample, up to generator.max_new_tokens: the engine's stream as is
    multi_turn    the model writes a turn, an environment answers (tidal/executors/environments), the model
                  writes again, until the environment says done or multi_turn's limits end it

Token in, token out: a multi-turn response is one token sequence, the model's turns exactly as
sampled and each observation rendered once and appended; nothing is decoded and encoded again, so
the trainer sees the ids the engine sampled (re-tokenising a conversation each turn is how peers'
multi-turn runs drifted). The engine keeps every sample's KV across its turns. `loss_masks` marks
the model's tokens, the only ones trained; `episodes` carries each sample's turns, environment time,
reward parts and error, for the reward and metrics.

Under partial rollouts (tidal/executors/generator/partial.py) a rollout's `complete` runs the step: the groups cut
in the step before are resumed first, and a cut group comes back with what its next step needs (multi-turn: each
episode saved, its environment with it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Protocol

import torch

from tidal.channels.payloads import RolloutGroup
from tidal.common.registry import Registry
from tidal.common.stop import StepAborted, aborted
from tidal.common.timeout import CallTimeout
from tidal.executors.data import PromptRow
from tidal.modeling.tiny.task import hide_digit
from tidal.executors.environments.base import EnvStep, ModelTurn, env_class, restore_env, save_env
from tidal.executors.environments.pool import EnvPool
from tidal.executors.generator.config import MultiTurnConfig
from tidal.executors.generator.contract import GroupCompletion, PromptRequest, SamplingParams, room_for_a_turn

if TYPE_CHECKING:
    from tidal.executors.generator.partial import Carried

Prompts = list[tuple[int, PromptRow, list[int]]]  # (index in the step, data row, token ids)


class Rollout(Protocol):
    tools: list[dict] | None  # JSON schemas of the environment's tools, for the chat template's prompts
    embedded_reward: str  # the reward of the embedded task as this rollout poses it
    env_wait_s: float  # seconds the engine waited for an environment with nothing else to do, so far

    @staticmethod
    def response_tokens(config: MultiTurnConfig, max_new_tokens: int) -> int:
        """The longest response this rollout writes (memory estimates, vLLM's context, Dr. GRPO)."""

    def embedded(self, row: dict) -> dict:
        """An embedded-task row as this rollout poses it (the multi-turn task hides its digit)."""

    def run(self, engine, prompts: Prompts, params: SamplingParams, *, step: int,
            stop: Callable[[], bool]) -> Iterator[RolloutGroup]:
        """Each prompt's group, the moment its G samples are done."""

    def complete(self, engine, prompts: Prompts, params: SamplingParams, *, step: int, stop: Callable[[], bool],
                 budget: int | None = None,
                 resumed: Mapping[int, Carried] | None = None) -> Iterator[tuple[GroupCompletion, dict]]:
        """The engine's groups, each with this rollout's part of it: a finished group's extra payload fields
        (rollout_group's keywords), a cut one's state for its next step (Carried.episodes). `resumed`: the
        groups cut in an earlier step, by their index in this one; `budget`: tokens a sample writes in this
        step (partial rollouts)."""


class EnvError(ValueError):
    """An environment failed under multi_turn.on_error=fail."""


class _Runs:
    """A rollout's `run`: its `complete` with no budget, each group as the channel's payload."""

    def run(self, engine, prompts, params, *, step, stop):
        rows = {i: row for i, row, _ in prompts}
        for done, extras in self.complete(engine, prompts, params, step=step, stop=stop):
            yield rollout_group(step, rows[done.index], done, **extras)


def _requests(prompts, resumed) -> list[PromptRequest]:
    """The step's requests: the resumed groups' first (their prompts as they were cut), then the new prompts."""
    return ([PromptRequest(index=i, prompt_ids=c.prompt_ids, resume=c.resume) for i, c in (resumed or {}).items()] +
            [PromptRequest(index=i, prompt_ids=ids) for i, _, ids in prompts])


class SingleTurn(_Runs):
    tools = None
    embedded_reward = "embedded"
    env_wait_s = 0.0

    @staticmethod
    def response_tokens(config: MultiTurnConfig, max_new_tokens: int) -> int:
        return max_new_tokens

    def __init__(self, *, tokenizer, config: MultiTurnConfig, max_new_tokens: int, max_prompt_tokens: int):
        del tokenizer, config, max_new_tokens, max_prompt_tokens

    def embedded(self, row: dict) -> dict:
        return row

    def complete(self, engine, prompts, params, *, step, stop, budget=None, resumed=None):
        for done in engine.generate(_requests(prompts, resumed), params, step=step, stop=stop, budget=budget):
            yield done, {}


def rollout_group(step: int, row: PromptRow, done: GroupCompletion, **multi_turn) -> RolloutGroup:
    """The engine's finished group as the channel's payload, with its data row."""
    return RolloutGroup(step=step, index=done.index, prompt=row.prompt, extras=row.extras, prompt_ids=done.prompt_ids_P,
                        responses=done.response_ids, logprobs=done.logprobs, finished=done.finished_G,
                        data_row=row.line, loss_masks=done.loss_masks, routing=done.routing, **multi_turn)


@dataclass
class _Episode:
    env: object
    where: str  # "step 3, prompt 5 (data row 17), sample 2": named by every error
    max_new_tokens: int  # generator.max_new_tokens: every turn's cap
    cap: int  # the current turn's cap: max_new_tokens, or lower where the environment asked
    turns: int = 0
    tokens: int = 0  # response tokens so far, model's and observations'
    env_s: float = 0.0
    reward_parts: dict = field(default_factory=dict)
    error: str | None = None
    ended: bool = False  # the turn with the environment ended with the model's end-of-turn token
    last: bool = False  # it is the max_turns-th: no turn follows its answer

    def record(self) -> dict:
        return {"turns": self.turns, "env_s": self.env_s, "reward_parts": self.reward_parts, "error": self.error}

    def save(self, *, over: bool) -> dict:
        """The episode at a cut (partial rollouts), as plain data: its environment saved (save_env), unless the
        episode is over (or failed) and calls it no more."""
        env = None if over or self.error is not None else save_env(self.env, where=self.where)
        return {**vars(self), "env": env, "reward_parts": dict(self.reward_parts)}


class MultiTurn(_Runs):
    embedded_reward = "embedded_lookup"

    @staticmethod
    def response_tokens(config: MultiTurnConfig, max_new_tokens: int) -> int:
        return config.total_tokens(max_new_tokens)  # model turns and observations together

    def __init__(self, *, tokenizer, config: MultiTurnConfig, max_new_tokens: int, max_prompt_tokens: int):
        self.cfg, self.tokenizer, self.spec = config, tokenizer, config.env or "lookup"
        self.max_prompt_tokens = max_prompt_tokens  # a prompt with its first observation: vLLM's context is sized so
        self.env_cls = env_class(self.spec)
        if config.require_deterministic and not getattr(self.env_cls, "deterministic", True):
            raise ValueError(f"multi_turn.env={self.spec!r} says it is not deterministic (deterministic = False), "
                             f"and multi_turn.require_deterministic is set: sync and periodic runs would differ")
        self.max_total_tokens = self.response_tokens(config, max_new_tokens)
        self.render = ObservationRenderer(tokenizer)
        # every environment call (constructor, reset, step) runs here, off the engine's decode loop; those
        # of an environment whose calls take microseconds (inline = True) on it
        inline = getattr(self.env_cls, "inline", False)
        self.pool = EnvPool(workers=0 if inline else config.env_workers, timeout_s=config.timeout_s)
        # the tools a chat template describes in each prompt (data.chat_template=true)
        self.tools = getattr(self.env_cls, "TOOLS", None) or None

    def embedded(self, row: dict) -> dict:
        return hide_digit(row)  # the embedded multi-turn task: its digit is behind a tool

    def complete(self, engine, prompts, params, *, step, stop, budget=None, resumed=None):
        """Every sample an episode: a new prompt's environments made and reset on the pool while the engine decodes
        the prompts already opened (its first observation joins the prompt), a resumed group's restored where they
        were cut; the engine runs the turns, the pool the calls."""
        wheres = {index: f"step {step}, prompt {index}" + (f" (data row {row.line})" if row.line else "")
                  for index, row, _ in prompts}
        episodes = {(index, j): _Episode(env=None, where=f"{wheres[index]}, sample {j}",
                                         max_new_tokens=params.max_new_tokens, cap=params.max_new_tokens)
                    for index, _, _ in prompts for j in range(params.n)}
        self._restore(resumed or {}, episodes)
        turns = _Turns(self, episodes, samples=params.n, wheres=wheres)
        fresh = turns.open(prompts)  # the requests, those whose environments are not yet reset waiting for them
        for done in engine.generate(_requests([], resumed) + fresh, params, step=step, stop=stop, turns=turns,
                                    budget=budget):
            eps = [episodes.pop((done.index, j)) for j in range(params.n)]
            if done.cut:  # saved: the next step restores them (a checkpoint writes them as they are)
                yield done, {"episodes": [ep.save(over=bool(over)) for ep, over in zip(eps, done.over_G)]}
            else:
                yield done, {"episodes": [ep.record() for ep in eps]}

    def _restore(self, resumed: Mapping[int, Carried], episodes: dict) -> None:
        """The episodes of the groups cut in an earlier step, as they were saved; their environments restored on
        the pool (one that fails to restore fails its episode, named)."""
        calls = {}
        for index, carried in resumed.items():
            for j, saved in enumerate(carried.episodes):
                saved = dict(saved)
                env = saved.pop("env")
                episodes[(index, j)] = _Episode(env=None, **saved)
                if env is not None:
                    calls[(index, j)] = (restore_env, (self.env_cls, env))
        for key, env in self._gather(calls, episodes).items():
            episodes[key].env = env

    def first_observation(self, ep: _Episode, first) -> list[int]:
        """reset()'s value as the token ids it appends to the prompt (its cap applied); _Failed where it is wrong."""
        if isinstance(first, EnvStep):
            if first.done or first.reward_parts:
                raise _Failed("reset() returned an EnvStep with done or reward_parts; before the first turn "
                              "only its observation and max_tokens apply")
            self._cap(ep, first.max_tokens, "reset()")
            first = first.observation
        return [] if first is None else self._tokens(first, closed=True)

    def _gather(self, calls: dict, episodes: dict) -> dict:
        """{key: (fn, args)} submitted together; the values of those that succeeded (the others' episodes
        fail, named). A stop abandons them."""
        for key, (fn, args) in calls.items():
            self.pool.submit(key, fn, *args)
        out, left = {}, set(calls)  # nothing else is in flight: every answer is one of these
        while left:
            if aborted():
                self.pool.abandon()
                raise StepAborted()
            for answer in self.pool.ready(wait_s=0.1):
                left.discard(answer.key)
                try:
                    out[answer.key] = self._value(episodes[answer.key], calls[answer.key][0], answer)
                except _Failed as failed:
                    self._failed(episodes[answer.key], str(failed))
        return out

    @property
    def env_wait_s(self) -> float:
        return self.pool.blocked_s

    def submit(self, key, ep: _Episode, turn_ids: torch.Tensor, ended: bool) -> bool:
        """A model turn ended: its step() goes to the pool (True), or the episode is over without one."""
        ep.turns += 1
        ep.tokens += turn_ids.numel()
        if ep.error is not None:
            return False
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        # the turn that reaches max_turns is stepped too (its reward parts count); the answer ends the episode
        ep.ended, ep.last = ended, ep.turns >= self.cfg.max_turns
        self.pool.submit(key, ep.env.step, ModelTurn(index=ep.turns - 1, ids=turn_ids, text=text, ended=ended,
                                                     last=ep.last))
        return True

    def answer(self, ep: _Episode, answer) -> list[int] | None:
        """The environment's answer to a model turn as token ids, or None: the episode is over."""
        try:
            result = self._value(ep, ep.env.step, answer)
            if not isinstance(result, EnvStep):
                raise _Failed(f"step() returned {type(result).__name__}, not an EnvStep")
            self._cap(ep, result.max_tokens, "step()")
            for name, value in result.reward_parts.items():
                ep.reward_parts[name] = ep.reward_parts.get(name, 0.0) + float(value)
            if result.done or ep.last:
                return None
            ids = [] if result.observation is None else self._tokens(result.observation, closed=ep.ended)
            if not room_for_a_turn(used=ep.tokens, observation=len(ids), total=self.max_total_tokens):
                raise _Failed(f"its observation of {len(ids)} tokens leaves no room for a turn in "
                              f"multi_turn.max_total_tokens={self.max_total_tokens} ({ep.tokens} used)")
        except _Failed as failed:
            self._failed(ep, str(failed))
            return None
        ep.tokens += len(ids)
        return ids

    @staticmethod
    def _cap(ep: _Episode, max_tokens, call: str) -> None:
        if max_tokens is None:
            ep.cap = ep.max_new_tokens
        elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1:
            ep.cap = min(max_tokens, ep.max_new_tokens)
        else:
            raise _Failed(f"{call} asked for max_tokens={max_tokens!r}; a turn's token cap is an int >= 1")

    def _value(self, ep: _Episode, fn, answer):
        """A call's return value from its pool Answer, or _Failed naming what went wrong."""
        ep.env_s += answer.seconds
        name = "its constructor" if isinstance(fn, type) else f"{getattr(fn, '__name__', 'call')}()"
        if answer.ok:
            return answer.value
        if isinstance(answer.value, CallTimeout):
            raise _Failed(f"{name} timed out after {self.cfg.timeout_s:g} s")
        exc = answer.value  # any failure of user code is reported the same way
        raise _Failed(f"{name} raised {type(exc).__name__}: {' '.join(str(exc).split())}") from exc

    def _tokens(self, observation, *, closed: bool) -> list[int]:
        if isinstance(observation, str):
            return self.render(observation, closed=closed)
        if isinstance(observation, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in observation):
            vocab = len(self.tokenizer)
            bad = [t for t in observation if not 0 <= t < vocab]
            if bad:
                raise _Failed(f"observation token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            return list(observation)
        raise _Failed(f"observation is a {type(observation).__name__}, not text or a list of token ids")

    def _failed(self, ep: _Episode, message: str) -> None:
        message = f"environment {self.spec!r} failed at {ep.where}: {message}"
        if self.cfg.on_error == "fail":
            raise EnvError(message)
        ep.error = message


class _Failed(Exception):
    pass


class _Turns:
    """The engine's side of a multi-turn rollout (tidal/executors/generator/contract.py Turns): every environment
    call goes to the rollout's pool and its answer comes back as the engine asks. A new prompt opens when its G
    environments are made and reset (`opened`: its first observation, which joins the prompt); a turn goes to
    its environment's step() (`submit`), and its answer comes back from `ready`. The pool's answers are sorted by
    the call they answer, so an opening waits for `opened` and a turn's answer for `ready`."""

    def __init__(self, rollout: MultiTurn, episodes: dict, *, samples: int, wheres: dict):
        self.rollout, self.episodes, self.G, self.wheres = rollout, episodes, samples, wheres
        self.max_total_tokens, self.max_prompt_tokens = rollout.max_total_tokens, rollout.max_prompt_tokens
        self.answers: list = []  # (index, sample, answer) of turns answered, or needing no call (a failed episode)
        self.firsts: dict[int, dict[int, list[int]]] = {}  # per prompt not yet opened, its samples' first observations
        self.prompt_len: dict[int, int] = {}
        self.openings: dict[int, list[int]] = {}  # opened since `opened` was last asked

    def open(self, prompts) -> list[PromptRequest]:
        """Each prompt's G environments made (then reset) on the pool; its request, which waits for `opened`
        where the calls have not answered by the time this returns (an inline environment's always have)."""
        cfg = self.rollout.cfg
        make = functools.partial(self.rollout.env_cls, **cfg.env_args) if cfg.env_args else self.rollout.env_cls
        for index, row, ids in prompts:
            self.firsts[index], self.prompt_len[index] = {}, len(ids)
            for j in range(self.G):
                self.rollout.pool.submit(("make", index, j), make, {"prompt": row.prompt, **row.extras})
        self._pump(wait_s=0.0)
        opened, self.openings = self.openings, {}
        return [PromptRequest(index=i, prompt_ids=list(ids) + opened[i]) if i in opened else
                PromptRequest(index=i, prompt_ids=ids, opening=True) for i, _, ids in prompts]

    def opened(self, *, wait_s: float = 0.0) -> dict[int, list[int]]:
        if not self.openings:
            self._pump(wait_s=wait_s)
        out, self.openings = self.openings, {}
        return out

    def max_tokens(self, *, index: int, sample: int) -> int:
        return self.episodes[(index, sample)].cap

    def submit(self, *, index: int, sample: int, turn_ids: torch.Tensor, ended: bool) -> None:
        if not self.rollout.submit(("step", index, sample), self.episodes[(index, sample)], turn_ids, ended):
            self.answers.append((index, sample, None))

    def ready(self, *, wait_s: float = 0.0) -> list[tuple[int, int, list[int] | None]]:
        self._pump(wait_s=0.0 if self.answers else wait_s)
        out, self.answers = self.answers, []
        return out

    def abandon(self) -> None:
        self.answers, self.openings = [], {}
        self.rollout.pool.abandon()

    def _pump(self, *, wait_s: float) -> None:
        """Every answer the pool has (waiting up to `wait_s` for one), each to its call's next move; an inline
        environment answers at once, so a make's reset answers within the same pump."""
        answers = self.rollout.pool.ready(wait_s=wait_s)
        while answers:
            chained = False  # a reset submitted: an inline environment's answer is there already
            for answer in answers:
                kind, index, sample = answer.key
                ep = self.episodes[(index, sample)]
                if kind == "step":
                    self.answers.append((index, sample, self.rollout.answer(ep, answer)))
                    continue
                try:
                    value = self.rollout._value(ep, self.rollout.env_cls if kind == "make" else ep.env.reset, answer)
                    if kind == "make":
                        ep.env = value
                        self.rollout.pool.submit(("reset", index, sample), value.reset)
                        chained = True
                        continue
                    first = self.rollout.first_observation(ep, value)
                except _Failed as failed:
                    self.rollout._failed(ep, str(failed))
                    first = []
                self._first(index, sample, first)
            answers = self.rollout.pool.ready(wait_s=0.0) if chained else []

    def _first(self, index: int, sample: int, first: list[int]) -> None:
        """A sample's first observation; with the group's G, the prompt opens with theirs (which must agree)."""
        firsts = self.firsts[index]
        firsts[sample] = first
        if len(firsts) < self.G:
            return
        del self.firsts[index]
        eps = [self.episodes[(index, j)] for j in range(self.G)]
        group = {tuple(firsts[j]) for j, ep in enumerate(eps) if ep.error is None} or {()}
        if len(group) > 1:
            raise ValueError(f"environment {self.rollout.spec!r}: reset() gave the samples of {self.wheres[index]} "
                             f"different first observations; it must depend on the data row only (it extends the "
                             f"shared prompt)")
        opening = list(group.pop())
        if self.prompt_len[index] + len(opening) > self.max_prompt_tokens:
            for ep in eps:  # vLLM's context and the native engine's slots hold a prompt of max_prompt_tokens
                self.rollout._failed(ep, f"reset()'s observation of {len(opening)} tokens makes the prompt "
                                         f"{self.prompt_len[index] + len(opening)} tokens, over "
                                         f"data.max_prompt_tokens={self.max_prompt_tokens}")
            opening = []
        self.openings[index] = opening


class ObservationRenderer:
    """Observation text -> token ids, once: wrapped as a tool message by the tokenizer's chat template
    where it has one (Qwen3/Hermes: `<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>
    \\n<|im_start|>assistant\\n`), else the text as it is. The wrap is read off the template once, as
    the difference between a conversation with and without a tool message after the model's turn."""

    _MARK = "\x00tidal-observation\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.before, self.after, self.close = "", "", ""
        if getattr(tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
            base = tokenizer.apply_chat_template(chat, tokenize=False)
            full = tokenizer.apply_chat_template(chat + [{"role": "tool", "content": self._MARK}], tokenize=False,
                                                 add_generation_prompt=True)
            eot = tokenizer.eos_token or ""
            closes = bool(eot) and eot in base  # the model's EOS ends a message of its template
            cut = base.rfind(eot) + len(eot) if closes else len(base)
            if full.startswith(base[:cut]) and self._MARK in full:
                self.before, _, self.after = full[cut:].partition(self._MARK)
                # a turn cut at its cap did not write its end-of-turn token: the wrap does
                self.close = eot if closes else ""

    def __call__(self, text: str, *, closed: bool = True) -> list[int]:
        wrapped = ("" if closed else self.close) + self.before + text + self.after
        return self.tokenizer.encode(wrapped, add_special_tokens=False)


ROLLOUTS: Registry[type] = Registry("rollout")
ROLLOUTS.register("single_turn", SingleTurn)
ROLLOUTS.register("multi_turn", MultiTurn)

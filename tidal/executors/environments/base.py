"""Environments of multi-turn rollouts: what answers the model between its turns.

An environment is a class, one instance per sample (so it may keep the episode's state):

    env = Env(sample, **multi_turn.env_args)  # the prompt's data row; `sample["prompt"]` is its text
    first = env.reset()      # None, or an observation appended to the prompt (the same for its G samples),
                             # or EnvStep(observation, max_tokens=k) to cap the model's first turn too
    result = env.step(turn)  # after every model turn: EnvStep(observation, done, reward_parts, max_tokens)

An observation is text (rendered once into tokens, as a tool message of the model's chat template
where it has one: tidal/executors/generator/rollouts.py ObservationRenderer) or a list of token ids
(appended as they are). Nothing the model wrote is ever re-tokenised: `turn.ids` are the ids it
sampled, `turn.text` their decoding. Tool calls in the chat templates' format: toolcall.py.

An environment is named in the config (`multi_turn.env`) by its registered name or as `module:Class`,
like reward functions. `deterministic = False` on a class says its observations are not a function
of the sample alone (a clock, the network): the sync == periodic equivalence cannot hold for it.
Its calls run off the engine's decode loop (tidal/executors/environments/pool.py; `step` may be `async
def`); `inline = True` on a class whose calls take microseconds makes them on the loop instead, where
they cost less than a thread's hand-off (the built-in lookup and calculator).

Under partial rollouts an episode cut at a step's token budget resumes in a later step, after a checkpoint too:
its environment is saved at the cut and restored there (`save_env`, `restore_env`): by `env.save() -> bytes` and
`Env.restore(state)` where a class defines them, else by pickling the instance. A class whose state cannot be
saved says `resumable = False`, and a run with partial rollouts refuses it before it starts.
"""
from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tidal.common.registry import Registry, load_attr


@dataclass(frozen=True)
class ModelTurn:
    index: int  # 0 for the model's first turn
    ids: torch.Tensor  # [n] int64, the tokens the model sampled in this turn, exactly
    text: str  # their decoding (special tokens skipped)
    ended: bool  # True: the turn ended with the model's end-of-turn token; False: cut at its token cap
    # True: multi_turn.max_turns is reached, no turn follows: the step may score it (reward_parts), its
    # observation is not read (a tool environment need not run a call in it)
    last: bool = False


@dataclass
class EnvStep:
    observation: str | list[int] | None = None  # None (or ""): nothing to append
    done: bool = False  # True: the episode is over; the observation, if any, is not appended
    reward_parts: dict[str, float] = field(default_factory=dict)  # summed over the episode, name by name
    # the token cap of the model's next turn (None: generator.max_new_tokens, which it can only lower):
    # a turn the environment reads one token of (a choice, a yes/no) ends there instead of running on
    max_tokens: int | None = None


class Env(Protocol):
    deterministic: bool
    inline: bool  # optional, False if absent

    def reset(self) -> str | list[int] | EnvStep | None: ...

    def step(self, turn: ModelTurn) -> EnvStep: ...

    # optional: save() -> bytes and a classmethod restore(state) -> Env (partial rollouts; default: pickle);
    # resumable = False where neither can work


def save_env(env, *, where: str) -> bytes:
    """An environment's state at a cut episode (partial rollouts): its save(), else the pickled instance. A state
    that cannot be saved stops the run, named: the episode could not go on in a later step."""
    try:
        return env.save() if callable(getattr(env, "save", None)) else pickle.dumps(env)
    except Exception as exc:
        how = "save()" if callable(getattr(env, "save", None)) else "pickling it"
        raise ValueError(f"environment {type(env).__name__} at {where} cannot be saved ({how} raised "
                         f"{type(exc).__name__}: {exc}); a cut episode resumes from its saved state in a later step: "
                         f"give the class save() and restore(state), or run without generator.partial_rollout_tokens"
                         ) from exc


def restore_env(cls: type, state: bytes):
    """An environment as `save_env` saved it: cls.restore(state), else unpickled."""
    restore = getattr(cls, "restore", None)
    return restore(state) if callable(restore) else pickle.loads(state)


ENVS: Registry[type] = Registry("environment")


def env_class(spec: str) -> type:
    """A registered environment's class, or `module:Class` imported (ValueError naming what failed)."""
    if ":" not in spec:
        _load_builtins()
        return ENVS.get(spec)
    cls = load_attr(spec, what=f"multi_turn.env={spec!r}")
    if not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"multi_turn.env={spec!r}: an environment needs reset() and step(turn) methods")
    return cls


def _load_builtins() -> None:
    # each module registers its classes on import; imported here so the registry is complete
    for name in ("lookup", "calculator", "python"):
        importlib.import_module(f"tidal.executors.environments.{name}")


def isolation_note(spec: str) -> str:
    """How an environment that runs the model's code is kept off the network ("" for one that runs none):
    printed by --dry-run and at the start of a run."""
    env = env_class(spec)
    if not hasattr(env, "isolation"):
        return ""
    if env.isolation() == "network namespace":
        return f"multi_turn.env={spec}: each call in a network namespace of its own (no network)"
    return (f"multi_turn.env={spec}: BEST EFFORT: no network namespace can be made here (not root, no unprivileged "
            f"user namespaces), only the socket module is blocked")

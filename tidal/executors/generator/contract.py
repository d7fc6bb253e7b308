"""What every generation engine speaks (native, vLLM): the request and response types, the `Engine`
protocol, and what an engine is built from (`EngineSpec`). The rollouts (rollouts.py), the partial-rollout
keeper (partial.py) and the engines themselves import these; none of them imports another's engine.

Token ids in, never text; each sample seeded from (run seed, step, prompt index, sample index)
(sampling.py), so what is sampled does not depend on the batch around it; groups streamed out as
their G samples finish, with the log-probs of the sampled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Protocol

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from tidal.channels.payloads import ParamSpec
    from tidal.executors.generator.config import GeneratorConfig
    from tidal.modeling.lora import LoraConfig


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int  # G samples per prompt
    temperature: float = 1.0  # 0 means greedy (log-probs are then those of the raw logits)
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    max_new_tokens: int
    seed: int  # run seed

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got {self.n}, {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: every token), got {self.top_k}")


@dataclass(frozen=True, kw_only=True)
class Resume:
    """A group cut at an earlier call's token budget (partial rollouts), to be continued: its samples
    keep their seeds (those of `step`, `index`) and their tokens so far, and go on from there."""
    step: int  # the step that seeded its samples
    index: int  # its prompt index in that step
    response_ids: list[torch.Tensor]  # G x [R_i]: an unfinished sample's every token so far
    logprobs: list[torch.Tensor]
    finished_G: torch.Tensor  # samples that already ended (EOS): they write nothing more
    # a multi-turn group's (the engine's GroupCompletion of its cut, as it came): each sample's sampled-token mask,
    # whether its episode is over (finished, or truncated at max_total_tokens) and where its current turn began
    loss_masks: list[torch.Tensor] | None = None
    over_G: torch.Tensor | None = None
    turn_starts: list[int] | None = None

    @property
    def t(self) -> int:
        """Tokens decoded so far: an unfinished sample's length (the group's samples decode together)."""
        return max(r.numel() for r in self.response_ids)


@dataclass(frozen=True, kw_only=True)
class PromptRequest:
    index: int  # prompt index within the call; part of every sample's seed (unless resumed)
    prompt_ids: list[int] | torch.Tensor
    resume: Resume | None = None  # continue a cut group instead of starting the prompt afresh
    # multi-turn: its environments are still being made and reset; it is admitted once Turns.opened() gives its
    # first observation, appended to prompt_ids (together at most Turns.max_prompt_tokens)
    opening: bool = False


@dataclass(kw_only=True)
class GroupCompletion:
    index: int
    prompt_ids_P: torch.Tensor
    response_ids: list[torch.Tensor]  # G ragged LongTensors, each ends with EOS if one was sampled
    logprobs: list[torch.Tensor]  # float32 log_softmax(logits / T) at the sampled tokens, before top-p
    finished_G: torch.Tensor  # bool, True where the sample hit EOS (with turns: its episode ended)
    loss_masks: list[torch.Tensor] | None = None  # with turns: G x [R_i] bool, True on sampled tokens
    # an MoE model's expert ids per token and routed layer, [prompt, response_1..G] (tidal/modeling/moe.py
    # pack); None for a dense model, and for multi-turn and partial rollouts (not recorded there)
    routing: list[torch.Tensor] | None = None
    # the call's token budget ran out before every sample ended: a partial group, continued by a
    # later call (PromptRequest.resume) rather than trained
    cut: bool = False
    # a cut multi-turn group: the samples whose episode is over (finished_G, or truncated at max_total_tokens) and
    # where each sample's current turn began in its response (the resumed turn's cap counts from there)
    over_G: torch.Tensor | None = None
    turn_starts: list[int] | None = None


def room_for_a_turn(*, used: int, observation: int, total: int) -> bool:
    """Whether a response that holds `used` tokens can take an `observation` and still write a turn (at least one
    token) within its `total`: the one rule of the rollout (which fails the episode otherwise) and of the engines
    (which cut it)."""
    return used + observation < total


class Turns(Protocol):
    """A multi-turn rollout's side of the engine (tidal/executors/generator/rollouts.py). With it, a sample's
    response is its turns and the observations between them; `max_tokens` caps each turn (at most
    `SamplingParams.max_new_tokens`), `max_total_tokens` the whole response. The environment answers
    off the engine's loop: a turn is submitted, and its answer comes back from `ready` later (the
    engine decodes its other samples meanwhile)."""

    max_total_tokens: int
    max_prompt_tokens: int  # a prompt with its first observation (a request that waits for `opened`)

    def opened(self, *, wait_s: float = 0.0) -> dict[int, list[int]]:
        """{index: first observation's token ids} of the prompts whose environments are ready since the last call
        (waiting up to `wait_s` for one): each such request (PromptRequest.opening) may be admitted now."""

    def max_tokens(self, *, index: int, sample: int) -> int:
        """The token cap of the current turn of sample `sample` of prompt `index` (asked again after
        every turn: the environment may change it)."""

    def submit(self, *, index: int, sample: int, turn_ids: torch.Tensor, ended: bool) -> None:
        """Sample `sample` of prompt `index` ended a turn (`ended`: with EOS, else at the turn's cap)."""

    def ready(self, *, wait_s: float = 0.0) -> list[tuple[int, int, list[int] | None]]:
        """(index, sample, answer) of the turns answered since the last call, waiting up to `wait_s` for
        one: the observation's token ids to append before the sample's next turn, or None: its episode
        is over."""

    def abandon(self) -> None:
        """A stop: forget the turns in flight."""


class AnsweredTurns:
    """Turns whose answers are a function of the turn, given at once (`answer`): engine tests and
    simple rollouts implement `answer` and `max_tokens` alone."""

    def answer(self, *, index: int, sample: int, turn_ids: torch.Tensor, ended: bool) -> list[int] | None:
        raise NotImplementedError

    def opened(self, *, wait_s: float = 0.0) -> dict[int, list[int]]:
        return {}  # its requests open at once

    def submit(self, *, index: int, sample: int, turn_ids: torch.Tensor, ended: bool) -> None:
        self.__dict__.setdefault("_answered", []).append(
            (index, sample, self.answer(index=index, sample=sample, turn_ids=turn_ids, ended=ended)))

    def ready(self, *, wait_s: float = 0.0) -> list[tuple[int, int, list[int] | None]]:
        out, self._answered = self.__dict__.get("_answered", []), []
        return out

    def abandon(self) -> None:
        self._answered = []


class Engine(Protocol):
    def generate(self, requests: list[PromptRequest], params: SamplingParams, *, step: int,
                 stop: Callable[[], bool] = ..., turns: Turns | None = None,
                 budget: int | None = None) -> Iterator[GroupCompletion]:
        """Each request's G-sample group as soon as it is done; `stop()` True abandons the rest;
        `budget`: tokens each sample may sample in this call, past which a group comes back cut (partial rollouts;
        with turns the observations do not count: they are fed, not sampled)."""

    def load_weights(self, shards: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> None:
        """The WEIGHTS channel's push has landed in `shards`: make the engine sample with it. An entry
        may have been replaced by the sender's own tensor (placement=colocated: tidal/channels/push.py); it
        holds the pushed weights until the next push."""

    def release(self) -> None:
        """Give the device's memory back between generations (placement=colocated: the trainer runs
        next on this device): at least the KV cache; the weights may stay."""

    def wake(self) -> None:
        """Take the memory `release` gave back, before the next generation or weight load."""

    def close(self) -> None:
        """Release what the engine holds, while the world is still up."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """What an engine is built from (tidal/executors/generator/engines.py): the model, the generator's ranks
    and the engine's own options; never the generator executor itself."""

    weights: str | None  # the first step's weights, an HF directory (None: the embedded model); with LoRA the base's
    adapter: str | None = None  # LoRA: a resumed run's adapters (its checkpoint directory); None: fresh ones
    lora: LoraConfig | None = None  # the trainer's adapters, which the engine holds too (None: no LoRA)
    dtype: torch.dtype
    tokenizer: object  # its eos and pad ids; vLLM writes it beside the weights
    max_tokens: int  # the longest prompt and response together (vLLM's context)
    config: GeneratorConfig  # tp, decode slots, admission, vLLM's section
    device: torch.device
    ranks: tuple[int, ...]  # the generator's global ranks
    unit: tuple[int, ...]  # this replica's (its tp ranks)
    rank: int  # this process's
    group: dist.ProcessGroup | None  # the generator's process group (a tp mesh is made under it)
    seed: int
    time_shared: bool = False  # placement=colocated: the engine gives its memory back between steps
    leader: bool = False  # the generator's first rank: it says when a slow engine is ready
    numerics: str = "default"  # model.numerics: "exact" makes the native engine batch-invariant (tidal/modeling/numerics.py)

    @property
    def tp_rank(self) -> int:
        return self.unit.index(self.rank)

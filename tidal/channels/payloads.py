"""Payload types carried by the GRPO-family and PPO graphs (ragged token data as lists of 1-D tensors), and
the parameter specs that describe a WEIGHTS push."""
from __future__ import annotations

import re

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutGroup:
    """One prompt and its G sampled responses, as generated (generator -> reward)."""

    step: int
    index: int  # prompt index within the step: fixes the trainer dp rank, never arrival order
    prompt: str
    extras: dict  # the data row's other columns (e.g. `answer`), passed to rewards
    prompt_ids: torch.Tensor  # [P] int64
    responses: list[torch.Tensor]  # G x [R_i] int64, EOS included when sampled
    logprobs: list[torch.Tensor]  # G x [R_i] float32, log_softmax(logits / T) of the sampled tokens
    finished: torch.Tensor  # [G] bool, hit EOS
    # the prompt's line in its data file (1-based; a Parquet file's row), named by reward errors;
    # None for the embedded task. Keyword-only: subclasses add fields without defaults
    data_row: int | None = field(default=None, kw_only=True)
    # multi-turn rollouts (tidal/executors/generator/rollouts.py): a response is the model's turns and the
    # environment's observations in order; G x [R_i] bool, True on the tokens the model sampled (the
    # only ones trained; `logprobs` is 0 elsewhere). None: every response token is the model's
    loss_masks: list[torch.Tensor] | None = field(default=None, kw_only=True)
    # one dict per sample from the rollout's environment: {"turns": n, "env_s": s, "reward_parts":
    # {name: value}, "error": message or None}; None for a single-turn rollout
    episodes: list[dict] | None = field(default=None, kw_only=True)
    # the version of the weights that sampled it: how many optimizer steps' barriers they had been
    # through (0: the initial weights); the trainer at step s holds version s, so s - version is the
    # group's staleness (0 in the on-policy schedules, checked every step)
    policy_version: int = field(default=0, kw_only=True)
    # partial rollouts (tidal/executors/generator/partial.py): G x [R_i] int32, the version that sampled each
    # token of a group resumed across steps; None: every token is `policy_version`'s
    versions: list[torch.Tensor] | None = field(default=None, kw_only=True)
    # an MoE model's routing as the generator ran it (tidal/modeling/moe.py): [prompt, response_1..G], each
    # its tokens x routed layers x top-k expert ids, flat, uint8 (int16 past 254 experts); None: not recorded
    routing: list[torch.Tensor] | None = field(default=None, kw_only=True)

    def staleness(self, step: int) -> tuple[int, int, int]:
        """(sum over the model's tokens, their number, the largest) of how many versions behind the
        weights of `step` (the trainer's) each was sampled."""
        tokens = sum(map(self.model_tokens, range(len(self.responses))))
        if self.versions is None:
            return (step - self.policy_version) * tokens, tokens, step - self.policy_version
        behind = torch.cat([step - v.long() for v in self.versions]) if self.versions else torch.zeros(0)
        return int(behind.sum()), tokens, int(behind.max()) if behind.numel() else 0

    def turns(self, i: int) -> list[tuple[str, torch.Tensor]]:
        """Response i as (role, token ids) runs: "assistant" where the model sampled, "tool" where the
        environment spoke; one assistant run for a single-turn rollout."""
        ids, mask = self.responses[i], self.loss_masks[i] if self.loss_masks is not None else None
        if mask is None or ids.numel() == 0:
            return [("assistant", ids)]
        starts = [0] + [t for t in range(1, len(mask)) if bool(mask[t]) != bool(mask[t - 1])] + [len(mask)]
        return [("assistant" if bool(mask[a]) else "tool", ids[a:b]) for a, b in zip(starts, starts[1:])]

    def model_tokens(self, i: int) -> int:
        """How many of response i's tokens the model sampled (all of them in a single-turn rollout)."""
        return self.responses[i].numel() if self.loss_masks is None else int(self.loss_masks[i].sum())


@dataclass
class ScoredGroup(RolloutGroup):
    """A rollout group with one scalar reward per response (reward -> trainer)."""

    rewards: torch.Tensor  # [G] float32
    reward_failures: int  # rewards that raised / were NaN and were scored 0 (on_error="zero")
    # each reward function's G scores before weighting, for samples.jsonl; keyword-only, so
    # subclasses may still add fields without defaults
    reward_parts: dict[str, list[float]] = field(default_factory=dict, kw_only=True)
    # the message of the group's first failed reward (lowest sample) under on_error="zero", for the
    # console's warning; None when none failed
    first_error: str | None = field(default=None, kw_only=True)


@dataclass
class AdvantagedGroup(ScoredGroup):
    """A scored group with a critic's advantage for every response token (critic -> trainer, PPO)."""

    advantages: list[torch.Tensor]  # G x [R_i] float32, GAE advantages (not yet whitened over the batch)


@dataclass
class WeightsUpdate:
    """Marker type of the WEIGHTS channel: the payload is the model's parameters themselves."""


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter travels on the WEIGHTS channel: both ends describe their model with these."""

    shape: tuple[int, ...]  # full (unsharded) shape
    dtype: torch.dtype
    tp_dim: int | None = None  # dim split over tp ranks (the same on both sides); None: replicated
    # an MoE model's experts dim (tidal/modeling/moe.py): split over the trainer's expert-parallel ranks
    # (trainer.ep); whole on the generator
    ep_dim: int | None = None


@dataclass
class GroupVerdict:
    """Whether a scored group was kept for training (dynamic sampling: reward -> generator)."""

    index: int
    kept: bool


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_layers(names) -> int:
    """The number of decoder layers among HF parameter names."""
    return 1 + max((int(m.group(1)) for m in map(_HF_LAYER.match, names) if m), default=-1)


def stage_of(*, layer: int | None, embedding: bool = False, layers: int, pp: int) -> int:
    """The rule of the trainer's pipeline stages (trainer.pp), by a parameter's place, for every side that
    asks (the stages' own cut, tidal/modeling/megatron/stages.py; the push plan, `hf_stage`): decoder layer
    `layer` on stage layer // (layers / pp), the embedding on the first, the final norm and LM head
    (layer None, not the embedding) on the last."""
    if layer is not None:
        return layer // (layers // pp)
    return 0 if embedding else pp - 1


def hf_stage(name: str, *, layers: int, pp: int) -> int:
    """The stage (`stage_of`) that holds and pushes HF parameter `name`: both ends of the WEIGHTS channel
    plan with it, so it is a function of the name."""
    m = _HF_LAYER.match(name)
    return stage_of(layer=int(m.group(1)) if m else None, embedding=name.startswith("model.embed_tokens."),
                    layers=layers, pp=pp)


def chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """[start, stop) of chunk i when torch.chunk splits n into `parts` (ceil-sized, last ones short)."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(start + size, n)


def local_shape(spec: ParamSpec, *, tp: int, rank: int) -> tuple[int, ...]:
    """Shape of tp rank `rank`'s shard of a parameter (no FSDP)."""
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        start, stop = chunk(shape[spec.tp_dim], tp, rank)
        shape[spec.tp_dim] = stop - start
    return tuple(shape)

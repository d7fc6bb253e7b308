"""The algorithm contract: pure tensor functions, no distributed code.

An algorithm is an advantage function, a loss function and a config class with defaults.
The trainer calls `advantages` once per prompt group and `loss` once per micro-batch; the
batch-level denominator is applied once at the barrier (docs/architecture.md "Determinism"), so `loss` returns a *sum* plus how much it adds to that denominator.

What the trainer does with the optional fields of `Algorithm`, per group as it arrives:
  1. rewards_G = algo.shape_rewards(rewards_G, lengths_G, cfg)      (DAPO's overlong penalty)
  2. KL in the reward (`kl.kl_in_reward(cfg)`): rewards_G = kl.kl_penalised_rewards(...)
  3. if not algo.keeps_group(rewards_G, cfg): drop the group (no loss, no denom) and have the
     generator top the batch up with further prompts                (DAPO's dynamic sampling)
  4. adv_G = algo.advantages(rewards_G, cfg); with advantage_scope "batch" this is only the
     score that is normalised over the batch at the barrier (see tidal/algorithms/batch_scope.py).
     An algorithm with `advantages=None` (PPO) takes per-token advantages a critic sent with the
     group instead of steps 1-4; batch scope then whitens them over the batch's tokens.
`normaliser` needs nothing new from the trainer: whatever it counts, `denom` is additive over
micro-batches, groups and data-parallel ranks, so summing and all-reducing it stays correct.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict

from tidal.algorithms.figures import Figure

# What the summed `denom` of a batch counts:
#   sequences: N per micro-batch -> 1/(B*G) over the batch (GRPO's mean over samples)
#   tokens:    real response tokens -> one token-level mean over the whole batch (DAPO)
#   constant:  N * max_response_tokens -> a fixed normaliser, independent of lengths (Dr. GRPO)
Normaliser = Literal["sequences", "tokens", "constant"]
# Where advantages are normalised: within one prompt group (known when the group arrives), or
# over the whole batch (known only at the barrier; REINFORCE++).
AdvantageScope = Literal["group", "batch"]


class AlgoConfig(BaseModel):
    """Base for per-algorithm hyper-parameters (the `algorithm:` section of a run config).

    What an algorithm needs from the rest of the run is declared here and overridden where it
    differs; the trainer and the recipes read these, they never probe a config for field names.
    """

    model_config = ConfigDict(extra="forbid")

    @property
    def needs_reference(self) -> bool:
        """The trainer keeps the frozen reference model and runs its forward (a KL term)."""
        return False

    @property
    def needs_behaviour(self) -> bool:
        """The loss reads the generator's log-probs of the sampled tokens (LossInputs.behaviour_logp_NT)."""
        return False

    @property
    def needs_entropy(self) -> bool:
        """The loss reads the policy's token entropy with its gradient (LossInputs.entropy_NT)."""
        return False

    @property
    def filters_groups(self) -> bool:
        """The reward executor may drop groups and the generator then tops the batch up (DAPO)."""
        return False

    @property
    def group_relative(self) -> bool:
        """Advantages compare each sample with the others of its prompt's group: one sample per
        prompt gives every advantage 0, so nothing trains."""
        return True

    def fit_generation(self, *, max_new_tokens: int) -> "AlgoConfig":
        """This config, told what the generator may produce (e.g. a length normaliser); default: as is."""
        return self


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of N response sequences, padded to T response tokens.

    `old_logp_NT` is the log-prob under the weights that generated the samples; with one optimizer
    step per batch it is `logp_NT.detach()`. `ref_logp_NT` is None when the KL coefficient is 0.
    Advantages: `adv_N`, one per sample (the critic-free algorithms), or `adv_NT`, one per token
    (GAE with a learned value function, tidal/algorithms/gae.py); exactly one of the two.
    """

    logp_NT: torch.Tensor
    old_logp_NT: torch.Tensor
    ref_logp_NT: torch.Tensor | None
    mask_NT: torch.Tensor  # bool, True on real response tokens
    adv_N: torch.Tensor | None = field(default=None, kw_only=True)
    adv_NT: torch.Tensor | None = field(default=None, kw_only=True)
    # the generator's log-probs of the sampled tokens (the behaviour policy mu), for a loss whose
    # config `needs_behaviour` (tidal/algorithms/corrections.py); None otherwise
    behaviour_logp_NT: torch.Tensor | None = field(default=None, kw_only=True)
    # the policy's token entropy with its gradient, for a loss with an entropy bonus (ClipConfig.needs_entropy)
    entropy_NT: torch.Tensor | None = field(default=None, kw_only=True)

    def token_advantages(self) -> torch.Tensor:
        """[N, T] (per-sample advantages as [N, 1], which broadcasts), at least float32."""
        return upcast(self.adv_NT) if self.adv_NT is not None else upcast(self.adv_N).unsqueeze(1)


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor  # scalar; summed over the micro-batch, NOT divided by the batch denominator
    denom: float  # this micro-batch's share of the batch denominator, in the units of Algorithm.normaliser
    # its statistics by metric name (tidal/algorithms/figures.py): one line in the loss is a new trainer/<name>
    stats: dict[str, Figure] = field(default_factory=dict)


AdvantageFn = Callable[[torch.Tensor, AlgoConfig], torch.Tensor]  # rewards_G -> adv_G
LossFn = Callable[[LossInputs, AlgoConfig], LossOutput]
RewardShapeFn = Callable[[torch.Tensor, torch.Tensor, AlgoConfig], torch.Tensor]  # rewards_G, lengths_G -> rewards_G
GroupFilterFn = Callable[[torch.Tensor, AlgoConfig], bool]  # rewards_G -> keep the group?


def unshaped(rewards_G: torch.Tensor, lengths_G: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    return rewards_G


def keep_every_group(rewards_G: torch.Tensor, cfg: AlgoConfig) -> bool:
    return True


@dataclass(frozen=True)
class Algorithm:
    name: str
    config_cls: type[AlgoConfig]
    # None: the advantages arrive with each group, one per token, from the registered source it names
    # (tidal/recipes/advantages.py: "critic", a learned value function); the trainer takes them as they come
    advantages: AdvantageFn | None
    loss: LossFn
    normaliser: Normaliser = "sequences"
    advantage_scope: AdvantageScope = "group"
    shape_rewards: RewardShapeFn = unshaped
    keeps_group: GroupFilterFn = keep_every_group
    recipe: str = "grpo"  # the graph and step phases it runs in (tidal/recipes/): a name, so algorithms stay pure
    advantage_source: str = "rewards"  # where its advantages come from (tidal/recipes/advantages.py), a name too

    def __post_init__(self) -> None:
        if self.normaliser not in get_args(Normaliser):
            raise ValueError(f"normaliser must be one of {get_args(Normaliser)}, got {self.normaliser!r}")
        if self.advantage_scope not in get_args(AdvantageScope):
            raise ValueError(f"advantage_scope must be one of {get_args(AdvantageScope)}, got {self.advantage_scope!r}")


def batch_denominator(normaliser: Normaliser, mask_NT: torch.Tensor, *,
                      max_response_tokens: int | None = None) -> float:
    """This micro-batch's share of the batch denominator; see `Normaliser`."""
    n = mask_NT.shape[0]
    if normaliser == "sequences":
        return float(n)
    if normaliser == "tokens":
        return float(mask_NT.sum().item())
    if normaliser == "constant":
        if max_response_tokens is None:
            raise ValueError("the constant normaliser needs max_response_tokens")
        longest = int(mask_NT.sum(dim=1).max().item()) if n else 0
        if longest > max_response_tokens:
            # A longer response would weigh more than the fixed budget allows: the config is wrong.
            raise ValueError(f"a response has {longest} tokens, more than max_response_tokens="
                             f"{max_response_tokens}; set it to the generator's max_new_tokens")
        return float(n * max_response_tokens)
    raise ValueError(f"unknown normaliser {normaliser!r}")


def upcast(t: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 log-probs lose the small differences the ratio is made of; float64 stays float64.
    return t.to(torch.promote_types(t.dtype, torch.float32))


def check_rewards(rewards_G: torch.Tensor) -> None:
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(f"rewards_G must be a non-empty 1-D tensor, got shape {tuple(rewards_G.shape)}")
    if not bool(torch.isfinite(rewards_G).all()):
        raise ValueError(f"rewards_G contains NaN/inf: {rewards_G.tolist()}")


def check_loss_inputs(inputs: LossInputs) -> None:
    shape = tuple(inputs.logp_NT.shape)
    if len(shape) != 2:
        raise ValueError(f"logp_NT must be 2-D (N, T), got shape {shape}")
    named = {"old_logp_NT": inputs.old_logp_NT, "mask_NT": inputs.mask_NT}
    if inputs.ref_logp_NT is not None:
        named["ref_logp_NT"] = inputs.ref_logp_NT
    for name, t in named.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} like logp_NT")
    if (inputs.adv_N is None) == (inputs.adv_NT is None):
        raise ValueError("give exactly one of adv_N (per sample) and adv_NT (per token)")
    if inputs.adv_N is not None and tuple(inputs.adv_N.shape) != shape[:1]:
        raise ValueError(f"adv_N has shape {tuple(inputs.adv_N.shape)}, expected ({shape[0]},)")
    if inputs.adv_NT is not None and tuple(inputs.adv_NT.shape) != shape:
        raise ValueError(f"adv_NT has shape {tuple(inputs.adv_NT.shape)}, expected {shape} like logp_NT")
    if inputs.behaviour_logp_NT is not None and tuple(inputs.behaviour_logp_NT.shape) != shape:
        raise ValueError(f"behaviour_logp_NT has shape {tuple(inputs.behaviour_logp_NT.shape)}, expected {shape}")
    if inputs.mask_NT.dtype != torch.bool:
        raise ValueError(f"mask_NT must be bool, got {inputs.mask_NT.dtype}")

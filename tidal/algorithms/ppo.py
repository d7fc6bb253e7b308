"""PPO with a learned value function (Schulman et al. 2017, arXiv:1707.06347; GAE: Schulman et al.
2016, arXiv:1506.02438), as RLHF runs it (Ouyang et al. 2022; verl, TRL, OpenRLHF).

The advantages are not a function of the rewards alone: a critic (tidal/executors/critic, on its own
ranks) computes each response token's value with the weights of the step's start, the token rewards
(the sequence reward on the last token, minus beta * kl_t on every token when the KL is in the
reward), and GAE advantages and returns (tidal/algorithms/gae.py). The trainer receives the advantages per
token with each group; `advantages=None` below says so.

Policy loss, per token t of sequence i (the clipped surrogate of tidal/algorithms/token_loss.py):
    pg_it = -min(ratio_it * A_it, clip(ratio_it, 1 - clip_low, 1 + clip_high) * A_it)
summed over tokens and divided by the batch's token count (verl's and TRL's token mean). A_it are
whitened over the whole batch, (A - mean) / (std + eps) over every response token of the step, as
PPO implementations do; the batch's statistics exist only at the barrier, and
tidal/algorithms/batch_scope.py makes streaming exact anyway (the first pass is linear in A).

The critic's loss is the clipped value loss of tidal/algorithms/gae.py, against its own values at the
step's start, with clip `vf_clip`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tidal.algorithms.base import Algorithm, LossInputs, LossOutput
from tidal.algorithms.token_loss import ClipConfig, token_level_loss


class PPOConfig(ClipConfig):
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount per token (1: an LLM response is one episode).")
    # 1 (verl's default): the critic's values only baseline the Monte-Carlo return, so an untrained critic
    # biases nothing; on the embedded task 1 beat 0.95 (reward 0.69 vs 0.67 at critic lr 3e-4, docs/algorithms.md)
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda: 1 = Monte-Carlo returns, 0 = one-step TD.")
    vf_clip: float = Field(0.2, gt=0.0, description="Value clip: a value moves at most this far from the step's "
                           "start per optimizer step of the critic.")
    eps: float = Field(1e-6, gt=0.0, description="Added to the batch std when whitening the advantages.")
    # the KL as a per-token reward (InstructGPT's), with the plain log-ratio estimator
    kl_in: Literal["loss", "reward"] = Field(
        "reward", description="reward: -beta * kl_t is each token's reward, computed by the critic; loss: beta * kl_t "
        "in the policy loss.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="Per-token estimator of KL(policy || reference).")

    @property
    def needs_reference(self) -> bool:
        """The *trainer's* reference: a KL in the reward is the critic's (it keeps its own reference)."""
        return self.beta > 0 and self.kl_in == "loss"

    @property
    def critic_reference(self) -> bool:
        """The critic keeps the initial policy to turn the KL into token rewards."""
        return self.beta > 0 and self.kl_in == "reward"

    @property
    def group_relative(self) -> bool:
        return False  # the critic's values are the baseline: one sample per prompt trains


def ppo_loss(inputs: LossInputs, cfg: PPOConfig) -> LossOutput:
    """The clipped surrogate on per-token advantages; a plain token sum, normalised by all tokens."""
    return token_level_loss(inputs, cfg, normaliser="tokens", per_sequence_mean=False)


PPO = Algorithm(name="ppo", config_cls=PPOConfig, advantages=None, loss=ppo_loss, normaliser="tokens",
                advantage_scope="batch", recipe="ppo", advantage_source="critic")

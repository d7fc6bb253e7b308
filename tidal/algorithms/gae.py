"""PPO with a learned value function: token rewards, GAE advantages and returns, the clipped value loss.

For one response of T tokens, values_T[t] is the critic's estimate of the return from token t on
(the state is the prompt and tokens < t), and r_t the token reward: the sequence reward on the last
token, minus beta * kl_t on every token when the KL is in the reward. The response ends the episode
(no bootstrap past its last token, finished or cut at max_new_tokens: the reward judged what it is):
    delta_t = r_t + gamma * V_{t+1} - V_t          (V_T = 0)
    A_t     = delta_t + gamma * lam * A_{t+1}      (A_T = 0)
    R_t     = A_t + V_t                            (the value target)
gamma = lam = 1 gives Monte-Carlo returns R_t = sum_{k >= t} r_k; lam = 0 gives one-step TD.
All [N, T] tensors are padded rows; mask_NT marks the tokens the model sampled. In a multi-turn
rollout it has holes, the environment's observations, which are not actions: as verl's multi-turn
GAE, the scan passes over them, so the model token before a hole bootstraps from the value of the
first model token after it (t+1 above is the next model token), and advantages and returns are 0
on a hole. Without holes (a single-turn rollout) this is the plain recursion above, bit for bit.
"""
from __future__ import annotations

import torch


def token_rewards(rewards_N: torch.Tensor, mask_NT: torch.Tensor, *, kl_NT: torch.Tensor | None = None,
                  beta: float = 0.0) -> torch.Tensor:
    """r_NT: each sequence's reward on its last model token (the last True of mask_NT), minus beta *
    kl_NT on every model token."""
    if bool((~mask_NT.any(dim=1)).any()):
        raise ValueError("a response has no tokens: it has no last token to carry its reward")
    T = mask_NT.shape[1]
    # the first True from the end (argmax returns the first maximum): lengths - 1 when there are no holes
    last_N = T - 1 - mask_NT.flip(1).to(torch.uint8).argmax(dim=1)
    r_NT = torch.zeros(mask_NT.shape, dtype=torch.float64)
    r_NT[torch.arange(mask_NT.shape[0]), last_N] = rewards_N.double()
    if kl_NT is not None and beta:
        r_NT -= beta * torch.where(mask_NT, kl_NT.double(), 0.0)
    return r_NT


def gae(r_NT: torch.Tensor, values_NT: torch.Tensor, mask_NT: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_NT, returns_NT) in float64, 0 on padding and holes; a backward scan over the columns."""
    if r_NT.shape != values_NT.shape or r_NT.shape != mask_NT.shape:
        raise ValueError(f"r_NT {tuple(r_NT.shape)}, values_NT {tuple(values_NT.shape)} and mask_NT "
                         f"{tuple(mask_NT.shape)} must have one shape")
    m_NT = mask_NT.double()
    r_NT, v_NT = r_NT.double() * m_NT, values_NT.double() * m_NT
    adv_NT = torch.zeros_like(r_NT)
    next_v_N = torch.zeros(r_NT.shape[0], dtype=torch.float64)
    next_adv_N = torch.zeros_like(next_v_N)
    for t in reversed(range(r_NT.shape[1])):
        # padding past a response's end keeps V_T = A_T = 0 for its last token; a hole keeps the next
        # model token's V and A for the model token before it (where: exact, no 0 * x rounding)
        delta_N = r_NT[:, t] + gamma * next_v_N - v_NT[:, t]
        adv_NT[:, t] = (delta_N + gamma * lam * next_adv_N) * m_NT[:, t]
        next_v_N = torch.where(mask_NT[:, t], v_NT[:, t], next_v_N)
        next_adv_N = torch.where(mask_NT[:, t], adv_NT[:, t], next_adv_N)
    return adv_NT, (adv_NT + v_NT) * m_NT


def clipped_value_loss(values_NT: torch.Tensor, old_values_NT: torch.Tensor, returns_NT: torch.Tensor,
                       mask_NT: torch.Tensor, *, clip: float) -> tuple[torch.Tensor, float]:
    """(sum over real tokens of 0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), how many tokens
    the clipped branch won): PPO's value loss, which keeps the critic near the values the advantages
    were computed with. Divide the sum by the batch's token count for a mean."""
    v_NT = values_NT.float()
    ret_NT = returns_NT.to(v_NT)
    old_NT = old_values_NT.to(v_NT)
    clipped_NT = old_NT + (v_NT - old_NT).clamp(-clip, clip)
    plain_NT, clip_NT = (v_NT - ret_NT) ** 2, (clipped_NT - ret_NT) ** 2
    loss_NT = 0.5 * torch.maximum(plain_NT, clip_NT)
    with torch.no_grad():
        # the clamp must have moved V: within the band `V_old + (V - V_old)` rounds away from V, and its
        # branch could win by that rounding alone (V=-0.07, V_old=0.02 counted a clip that did not act)
        active_NT = (v_NT - old_NT).abs() > clip
        clipped = int((active_NT & (clip_NT > plain_NT) & mask_NT).sum())
    return torch.where(mask_NT, loss_NT, 0.0).sum(), clipped


def explained_variance(values_NT: torch.Tensor, returns_NT: torch.Tensor, mask_NT: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the real tokens: 1 is a perfect critic, 0 one that predicts the mean."""
    v, r = values_NT.double()[mask_NT], returns_NT.double()[mask_NT]
    var_r = r.var(unbiased=False)
    return float("nan") if var_r == 0 else float(1 - (r - v).var(unbiased=False) / var_r)

"""Generalized Advantage Estimation (Schulman et al. 2016; the loop of seeds/000, derived in seeds/003)."""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape

__all__ = ["compute_gae"]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and lambda-returns over the real tokens of right-padded responses.

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lambda * A_{t+1},
    with V = 0 and A = 0 after each row's last real token (the episode has ended, seeds/000).
    returns_t = A_t + V_t is the critic's target (seeds/000 "改进一"). The advantages are not whitened:
    the caller whitens them (``masked_whiten``) once per rollout.

    The backward loop runs over T, vectorised over the batch. Padded positions are read through
    ``torch.where``, so NaN/inf stored there cannot reach the real tokens.

    Args:
        rewards: (B, T) per-token rewards (``kl_shaped_rewards``).
        values: (B, T) old critic values.
        response_mask: (B, T) 1/True for real tokens, right-padded (a row is 1...1 0...0; may be all 0).
        gamma: discount in [0, 1].
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        (advantages, returns): both (B, T) float32 (float64 kept), 0 at padded positions.

    Raises:
        ValueError: a mask row has a real token after padding (not right-padded).
    """
    fn = "compute_gae"
    check_2d(fn, rewards=rewards)
    check_same_shape(fn, rewards=rewards, values=values, response_mask=response_mask)
    check_number(fn, "gamma", gamma, low=0.0, low_inclusive=True, high=1.0)
    check_number(fn, "gae_lambda", gae_lambda, low=0.0, low_inclusive=True, high=1.0)
    mask = response_mask.bool()
    holes = (mask[:, 1:] & ~mask[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if holes:
        raise ValueError(
            f"{fn}: `response_mask` row(s) {holes} have a real token after padding; responses must be right-padded"
        )

    rewards = torch.where(mask, as_float(rewards), 0.0)
    values = torch.where(mask, as_float(values), 0.0)
    steps = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(steps)):
        # values is 0 past the last real token, which is the terminal V = 0 of seeds/000.
        next_value = values[:, t + 1] if t + 1 < steps else next_advantage.new_zeros(())
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(mask[:, t], delta + gamma * gae_lambda * next_advantage, 0.0)
        advantages[:, t] = next_advantage
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns

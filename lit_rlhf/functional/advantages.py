"""Advantage estimators of on-policy RLHF.

- ``compute_gae``: Generalized Advantage Estimation with a critic (Schulman et al. 2016), used by PPO.
- Critic-free, from sequence scores of K responses per prompt (rows g*K .. g*K+K-1 share prompt g):
  ``grpo_advantages`` (GRPO and Dr. GRPO) and ``rloo_advantages`` (RLOO) return per-sequence advantages
  (B,) that the caller broadcasts over the response tokens.
- ``discounted_returns``: per-token returns of KL-shaped rewards, the REINFORCE++ advantage before its
  batch whitening (Hu 2025).
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape
from lit_rlhf.functional.stats import as_groups

__all__ = ["compute_gae", "discounted_returns", "grpo_advantages", "rloo_advantages"]


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


def _check_group_size(fn: str, group_size: int) -> None:
    if group_size < 2:
        raise ValueError(
            f"{fn}: `group_size` must be >= 2 (a group baseline needs K >= 2 responses per prompt; "
            f"set generation.num_samples), got {group_size}"
        )


def grpo_advantages(
    scores: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages: (s_i - mean(group)) / (std(group) + eps).

    GRPO's outcome supervision (Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2: A_i = (r_i - mean(r)) /
    std(r), the same for every token of response i). With ``scale_by_std=False`` it is Dr. GRPO
    (Liu et al. 2025, arXiv 2503.20783, sec. 3.1 "Dr. GRPO"): the mean is subtracted but the std division,
    which over-weights nearly-solved or nearly-failed prompts, is dropped. The std is unbiased (torch's
    default, as TRL and torchtune). A group whose scores are all equal gets exactly 0.

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K responses contiguous.
        group_size: K >= 2.
        scale_by_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std (only with ``scale_by_std``).

    Returns:
        (B,) float32 (float64 kept) advantages.
    """
    fn = "grpo_advantages"
    _check_group_size(fn, group_size)
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (G, K)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # (G, K)
    # the mean of equal floats can differ from them in the last bit: force the exact 0
    return torch.where(all_equal, 0.0, centered).flatten()  # (B,)


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out: s_i minus the mean of the other K - 1 scores of its group.

    (Ahmadian et al. 2024, arXiv 2402.14740, the RLOO estimator; Kool et al. 2019.) The baseline of each
    sample is independent of it, so the estimator stays unbiased; it equals K / (K - 1) times the
    centred score. A group whose scores are all equal gets exactly 0.

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K responses contiguous.
        group_size: K >= 2.

    Returns:
        (B,) float32 (float64 kept) advantages.
    """
    fn = "rloo_advantages"
    _check_group_size(fn, group_size)
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (G, K)
    return torch.where(all_equal, 0.0, grouped - others_mean).flatten()  # (B,)


SEQUENCE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
# estimators whose baseline is the other responses to the same prompt: they need K >= 2
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def sequence_advantages(scores: torch.Tensor, estimator: str, group_size: int) -> torch.Tensor:
    """(B,) sequence scores -> (B,) per-sequence advantages of a critic-free estimator.

    ``grpo`` / ``dr_grpo``: :func:`grpo_advantages` with / without the std division; ``rloo``:
    :func:`rloo_advantages`; ``reinforce_pp_baseline``: the group mean subtracted (REINFORCE++-baseline,
    Hu 2025, arXiv 2501.03262, whitened over the batch afterwards like REINFORCE++); ``reinforce_pp``: the
    scores themselves (its baseline is the batch whitening of the returns).

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K responses contiguous.
        estimator: one of ``SEQUENCE_ESTIMATORS``.
        group_size: K (>= 2 for the ``GROUP_ESTIMATORS``).

    Returns:
        (B,) advantages.
    """
    if estimator in ("grpo", "dr_grpo"):
        return grpo_advantages(scores, group_size, scale_by_std=estimator == "grpo")  # (B,)
    if estimator == "rloo":
        return rloo_advantages(scores, group_size)  # (B,)
    if estimator == "reinforce_pp_baseline":
        return grpo_advantages(scores, group_size, scale_by_std=False)  # (B,)
    if estimator == "reinforce_pp":
        return scores  # (B,)
    raise ValueError(f"sequence_advantages: `estimator` must be one of {SEQUENCE_ESTIMATORS}, got {estimator!r}")


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{l >= 0} gamma^l r_{t+l} over each response's real tokens (0 on padding).

    REINFORCE++ (Hu 2025, arXiv 2501.03262, sec. 3: token-level KL penalty, then advantage normalisation) uses these returns of the KL-shaped token
    rewards (``kl_shaped_rewards``) as advantages, whitened over the whole batch by the caller (with the
    moments of every rank: ``masked_moments`` / ``whiten_from_moments``). They are GAE with V = 0 and
    lambda = 1 (delta_t = r_t), so this calls :func:`compute_gae` rather than re-deriving the recursion.

    Args:
        rewards: (B, T) per-token rewards.
        response_mask: (B, T) 1/True for real tokens, right-padded.
        gamma: discount in [0, 1].

    Returns:
        (B, T) float32 (float64 kept) returns.
    """
    values = torch.zeros_like(as_float(rewards))  # (B, T)
    returns, _ = compute_gae(rewards, values, response_mask, gamma, gae_lambda=1.0)  # (B, T)
    return returns


def fill_dropped_scores(scores: torch.Tensor, keep: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each dropped score (``keep`` False, e.g. a NaN) replaced by the mean of its group's kept scores.

    The group mean of the kept rows is unchanged and every group statistic (the baselines of
    ``grpo_advantages``, ``rloo_advantages``) stays finite; a group with no kept row takes the mean of all
    kept rows. The caller gives the dropped rows no gradient (their values only keep statistics finite).

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K = ``group_size`` responses contiguous
            (``group_size`` 1: no groups, the mean of all kept rows).
        keep: (B,) bool, False for the rows to drop.
        group_size: K >= 1.

    Returns:
        (B,) scores, equal to ``scores`` on kept rows.
    """
    kept = torch.where(keep, scores, 0.0)  # (B,)
    fallback = kept.sum() / keep.sum().clamp(min=1)  # ()
    group_sums = as_groups(kept, group_size, "fill_dropped_scores").sum(dim=1)  # (G,)
    group_counts = keep.view(-1, group_size).sum(dim=1)  # (G,)
    group_means = torch.where(group_counts > 0, group_sums / group_counts.clamp(min=1), fallback)  # (G,)
    return torch.where(keep, scores, group_means.repeat_interleave(group_size))  # (B,)

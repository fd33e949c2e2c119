"""Advantage estimators of on-policy RLHF.

- ``compute_gae``: Generalized Advantage Estimation with a critic (Schulman et al. 2016, arXiv 1506.02438),
  used by PPO.
- Critic-free, from sequence scores of K responses per prompt (rows g*K .. g*K+K-1 share prompt g):
  ``grpo_advantages`` (GRPO and Dr. GRPO) and ``rloo_advantages`` (RLOO) return per-sequence advantages
  (B,) that the caller broadcasts over the response tokens.
- ``discounted_returns``: per-token returns of KL-shaped rewards, the REINFORCE++ advantage before its
  batch whitening (Hu 2025, arXiv 2501.03262).

The (B, T) masks are loss masks: 1 on the tokens learned from. They may have holes (tool or environment
tokens between the model's tokens of a multi-turn rollout), which the recursions skip as if removed.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape
from lit_rlhf.functional.registry import SEQUENCE_ESTIMATORS
from lit_rlhf.functional.stats import as_groups, compact_left, scatter_back

__all__ = ["compute_gae", "discounted_returns", "grpo_advantages", "rloo_advantages"]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and lambda-returns over the loss-masked tokens of each response.

    Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv 1506.02438, eq. 16), as its backward recursion:
    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lambda * A_{t+1},
    where t + 1 is the next masked token (holes are skipped as if removed), and V = 0 and A = 0 after
    each row's last masked token (the episode has ended). returns_t = A_t + V_t is the lambda-return
    (Sutton & Barto 2018, "Reinforcement Learning: An Introduction", 2nd ed., sec. 12.1), the critic's
    target V_targ of PPO's value loss (Schulman et al. 2017, arXiv 1707.06347, eq. 9). The advantages are
    not whitened: the caller whitens them (``masked_whiten``) once per rollout.

    Rows with holes are packed left (:func:`compact_left`), the recursion runs on the packed rows and the
    results go back to their positions (:func:`scatter_back`); a right-padded row is unchanged by the
    packing. The backward loop runs over T, vectorised over the batch. Unmasked positions are read
    through ``torch.where``, so NaN/inf stored there cannot reach the masked tokens.

    Args:
        rewards: (B, T) per-token rewards (``kl_shaped_rewards``).
        values: (B, T) old critic values.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from (a row may be all 0); may have
            holes (tool/environment tokens), which are skipped as if removed.
        gamma: discount in [0, 1].
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        (advantages, returns): both (B, T) float32 (float64 kept), 0 at unmasked positions (holes and
        padding).
    """
    fn = "compute_gae"
    check_2d(fn, rewards=rewards)
    check_same_shape(fn, rewards=rewards, values=values, response_mask=response_mask)
    check_number(fn, "gamma", gamma, low=0.0, low_inclusive=True, high=1.0)
    check_number(fn, "gae_lambda", gae_lambda, low=0.0, low_inclusive=True, high=1.0)
    mask = response_mask.bool()

    rewards = torch.where(mask, as_float(rewards), 0.0)  # (B, T)
    values = torch.where(mask, as_float(values), 0.0)  # (B, T)
    # Packed: each row's masked tokens first, in order, then its holes and padding (all 0 now). The
    # permutation is the identity on a right-padded row, so its arithmetic is that of the unpacked row.
    rewards, packed_mask, order = compact_left(rewards, mask)  # (B, T) x 2, (B, T)
    values = values.gather(1, order)  # (B, T)
    steps = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(steps)):
        # values is 0 past the last masked token of the packed row: the terminal V = 0.
        next_value = values[:, t + 1] if t + 1 < steps else next_advantage.new_zeros(())
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(packed_mask[:, t], delta + gamma * gae_lambda * next_advantage, 0.0)
        advantages[:, t] = next_advantage
    returns = scatter_back(advantages + values, order, mask)  # (B, T)
    return scatter_back(advantages, order, mask), returns


def _check_group_size(fn: str, group_size: int) -> None:
    if group_size < 2:
        raise ValueError(
            f"{fn}: `group_size` must be >= 2 (a group baseline needs K >= 2 responses per prompt; "
            f"set generation.num_samples), got {group_size}"
        )


def grpo_advantages(
    scores: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    keep: torch.Tensor | None = None,
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
        keep: (B,) bool, the rows whose scores count (None = all): the group's mean and std are those of
            its kept rows, as if the others had not been sampled; dropped rows, and groups with fewer
            than 2 kept rows (no baseline), get 0.

    Returns:
        (B,) float32 (float64 kept) advantages.
    """
    fn = "grpo_advantages"
    _check_group_size(fn, group_size)
    if keep is not None:
        return _kept_group_advantages(scores, group_size, keep, "grpo" if scale_by_std else "mean", eps, fn)
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (G, K)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)  # (G, K)
    # the mean of equal floats can differ from them in the last bit: force the exact 0
    return torch.where(all_equal, 0.0, centered).flatten()  # (B,)


def rloo_advantages(scores: torch.Tensor, group_size: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE Leave-One-Out: s_i minus the mean of the other K - 1 scores of its group.

    (Ahmadian et al. 2024, arXiv 2402.14740, the RLOO estimator; Kool et al. 2019.) The baseline of each
    sample is independent of it, so the estimator stays unbiased; it equals K / (K - 1) times the
    centred score. A group whose scores are all equal gets exactly 0.

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K responses contiguous.
        group_size: K >= 2.
        keep: (B,) bool, the rows whose scores count (None = all): the baseline is the mean of the other
            kept rows of the group; dropped rows, and groups with fewer than 2 kept rows, get 0.

    Returns:
        (B,) float32 (float64 kept) advantages.
    """
    fn = "rloo_advantages"
    _check_group_size(fn, group_size)
    if keep is not None:
        return _kept_group_advantages(scores, group_size, keep, "rloo", 0.0, fn)
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # (G, 1)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # (G, K)
    return torch.where(all_equal, 0.0, grouped - others_mean).flatten()  # (B,)


# the names live in functional.registry (SEQUENCE_ESTIMATORS, GROUP_ESTIMATORS: baseline from the group, K >= 2)


def sequence_advantages(
    scores: torch.Tensor, estimator: str, group_size: int, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """(B,) sequence scores -> (B,) per-sequence advantages of a critic-free estimator.

    ``grpo`` / ``dr_grpo``: :func:`grpo_advantages` with / without the std division; ``rloo``:
    :func:`rloo_advantages`; ``reinforce_pp_baseline``: the group mean subtracted (REINFORCE++-baseline,
    Hu 2025, arXiv 2501.03262, whitened over the batch afterwards like REINFORCE++); ``reinforce_pp``: the
    scores themselves (its baseline is the batch whitening of the returns).

    Args:
        scores: (B,) sequence scores, B = G * K, each prompt's K responses contiguous.
        estimator: one of ``SEQUENCE_ESTIMATORS``.
        group_size: K (>= 2 for the ``GROUP_ESTIMATORS``).
        keep: (B,) bool, the rows whose scores count (None = all; see :func:`grpo_advantages`); a dropped
            row's advantage is 0.

    Returns:
        (B,) advantages.
    """
    if estimator in ("grpo", "dr_grpo"):
        return grpo_advantages(scores, group_size, scale_by_std=estimator == "grpo", keep=keep)  # (B,)
    if estimator == "rloo":
        return rloo_advantages(scores, group_size, keep=keep)  # (B,)
    if estimator == "reinforce_pp_baseline":
        return grpo_advantages(scores, group_size, scale_by_std=False, keep=keep)  # (B,)
    if estimator == "reinforce_pp":
        scores = as_float(scores)  # (B,)
        if keep is None:
            return scores
        check_same_shape("sequence_advantages", scores=scores, keep=keep)
        return torch.where(keep, scores, 0.0)  # (B,)
    raise ValueError(f"sequence_advantages: `estimator` must be one of {SEQUENCE_ESTIMATORS}, got {estimator!r}")


def _kept_group_advantages(
    scores: torch.Tensor, group_size: int, keep: torch.Tensor, baseline: str, eps: float, fn: str
) -> torch.Tensor:
    """Group baselines over the kept rows only (``baseline``: ``mean``, ``grpo`` mean and std, ``rloo``
    leave-one-out mean); 0 for dropped rows, groups of fewer than 2 kept rows and all-equal kept scores."""
    check_same_shape(fn, scores=scores, keep=keep)
    grouped = as_groups(scores, group_size, fn)  # (G, K)
    kept = as_groups(keep, group_size, fn).bool()  # (G, K)
    n = kept.sum(dim=1, keepdim=True)  # (G, 1) kept rows per group
    values = torch.where(kept, grouped, 0.0)  # (G, K) NaN of dropped rows gone
    total = values.sum(dim=1, keepdim=True)  # (G, 1)
    mean = total / n.clamp(min=1)  # (G, 1)
    if baseline == "rloo":
        advantages = values - (total - values) / (n - 1).clamp(min=1)  # (G, K) minus the other kept rows' mean
    else:
        advantages = values - mean  # (G, K)
        if baseline == "grpo":
            var = torch.where(kept, advantages, 0.0).pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
            advantages = advantages / (var.sqrt() + eps)  # (G, K)
    spread = torch.where(kept, grouped, -torch.inf).amax(1, keepdim=True) - torch.where(kept, grouped, torch.inf).amin(
        1, keepdim=True
    )  # (G, 1)
    signal = kept & (n >= 2) & (spread > 0)  # (G, K)
    return torch.where(signal, advantages, 0.0).flatten()  # (B,)


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{l >= 0} gamma^l r_{t+l} over each response's loss-masked tokens (0 elsewhere).

    t + l runs over the masked tokens only: holes are skipped as if removed. REINFORCE++ (Hu 2025,
    arXiv 2501.03262, sec. 3: token-level KL penalty, then advantage normalisation) uses these returns of
    the KL-shaped token rewards (``kl_shaped_rewards``) as advantages, whitened over the whole batch by
    the caller (with the moments of every rank: ``masked_moments`` / ``whiten_from_moments``). They are
    GAE with V = 0 and lambda = 1 (delta_t = r_t), so this calls :func:`compute_gae` rather than
    re-deriving the recursion.

    Args:
        rewards: (B, T) per-token rewards.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        gamma: discount in [0, 1].

    Returns:
        (B, T) float32 (float64 kept) returns, 0 at unmasked positions (holes and padding).
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
    check_same_shape("fill_dropped_scores", scores=scores, keep=keep)
    kept = torch.where(keep, scores, 0.0)  # (B,)
    fallback = kept.sum() / keep.sum().clamp(min=1)  # ()
    group_sums = as_groups(kept, group_size, "fill_dropped_scores").sum(dim=1)  # (G,)
    group_counts = keep.view(-1, group_size).sum(dim=1)  # (G,)
    group_means = torch.where(group_counts > 0, group_sums / group_counts.clamp(min=1), fallback)  # (G,)
    return torch.where(keep, scores, group_means.repeat_interleave(group_size))  # (B,)

"""PPO policy losses (clip and KL-penalty), the clipped value loss and the pairwise reward-model loss.

Every loss returns ``(loss, stats)``: ``loss`` a float32 scalar, ``stats`` a dict of detached float32
scalars keyed by metric name without prefix. Padded positions are replaced by neutral values with
``torch.where`` *before* any nonlinearity (exp, square), so NaN/inf stored there can change neither the
loss nor the gradient, and the gradient at padded positions is exactly 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_rlhf.functional._checks import as_float, check_number, check_same_shape
from lit_rlhf.functional.stats import masked_mean

__all__ = ["clipped_value_loss", "kl_penalty_policy_loss", "pairwise_reward_loss", "ppo_policy_loss"]


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Clip: -masked_mean(min(r * A, clip(r, 1 - eps, 1 + eps) * A)), r = exp(logprobs - old_logprobs).

    (Schulman et al. 2017, eq. 7; seeds/000 "PPO-Clip".) The ratio is against the rollout policy
    (``old_logprobs``), never the reference model.

    Args:
        logprobs: (B, T) log-probs of the current policy (with grad).
        old_logprobs: (B, T) log-probs of the rollout policy.
        advantages: (B, T) advantages (usually whitened).
        response_mask: (B, T) 1/True for real tokens.
        clip_coef: eps > 0.

    Returns:
        (loss, stats): stats has ``clipfrac`` (share of real tokens where the clipped term is taken),
        ``approx_kl`` = 0.5 * mean((lp - old)^2), ``policy_kl`` = mean(old - lp), ``ratio_mean`` and
        ``ratio_max`` (over real tokens).
    """
    fn = "ppo_policy_loss"
    check_same_shape(
        fn, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    check_number(fn, "clip_coef", clip_coef, low=0.0, low_inclusive=False)
    mask, log_ratio, ratio, advantages = _ratio_terms(logprobs, old_logprobs, advantages, response_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    stats = _ratio_stats(mask, log_ratio, ratio)
    stats["clipfrac"] = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss, stats


def kl_penalty_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Penalty: -masked_mean(r * A - beta * KL_t(old || new)), r = exp(logprobs - old_logprobs).

    (Schulman et al. 2017, eq. 8; seeds/000 "PPO-Penalty".) The per-token KL(pi_old || pi_theta) is the
    k1 estimate on tokens sampled from pi_old: old_logprobs - logprobs. ``beta`` comes from a
    ``PPOPenaltyKLController`` updated with the measured ``policy_kl``.

    Args:
        logprobs: (B, T) log-probs of the current policy (with grad).
        old_logprobs: (B, T) log-probs of the rollout policy.
        advantages: (B, T) advantages.
        response_mask: (B, T) 1/True for real tokens.
        beta: >= 0 (0 gives the plain importance-sampled surrogate -mean(r * A)).

    Returns:
        (loss, stats): stats has ``approx_kl``, ``policy_kl``, ``ratio_mean``, ``ratio_max`` as in
        ``ppo_policy_loss``. There is no ``clipfrac``: nothing is clipped in this objective.
    """
    fn = "kl_penalty_policy_loss"
    check_same_shape(
        fn, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    check_number(fn, "beta", beta, low=0.0, low_inclusive=True)
    mask, log_ratio, ratio, advantages = _ratio_terms(logprobs, old_logprobs, advantages, response_mask)
    kl_old_new = -log_ratio
    loss = -masked_mean(ratio * advantages - beta * kl_old_new, mask)
    return loss, _ratio_stats(mask, log_ratio, ratio)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_coef_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * masked_mean(max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2)) (seeds/000 "Critic").

    Taking the max stops the gradient when the new value has left the trust region *towards* the
    return (the clipped error is then the larger one and its gradient through the clip is 0), and keeps
    the full gradient otherwise (seeds/000 cases 1-3).

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) rollout critic values.
        returns: (B, T) GAE lambda-returns.
        response_mask: (B, T) 1/True for real tokens.
        clip_coef_value: eps > 0 (``float("inf")`` disables clipping).

    Returns:
        (loss, stats): stats has ``value_clipfrac`` (share of real tokens where the clipped error is larger).
    """
    fn = "clipped_value_loss"
    check_same_shape(fn, values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    check_number(fn, "clip_coef_value", clip_coef_value, low=0.0, low_inclusive=False)
    mask = response_mask.bool()
    values = torch.where(mask, as_float(values), 0.0)
    old_values = torch.where(mask, as_float(old_values), 0.0)
    returns = torch.where(mask, as_float(returns), 0.0)
    values_clipped = torch.clamp(values, old_values - clip_coef_value, old_values + clip_coef_value)
    unclipped = (values - returns).square()
    clipped = (values_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, {"value_clipfrac": masked_mean((clipped > unclipped).float(), mask).detach()}


def pairwise_reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss -log sigmoid(chosen - rejected - margin), averaged (seeds/000 "RM Training").

    The optional margin is the Llama-2 reward-model margin: a pair must be won by at least ``margin``.

    Args:
        chosen_scores: (B,) reward-model scores of the chosen responses.
        rejected_scores: (B,) scores of the rejected responses.
        margin: None, a float, or (B,) per-pair margins.

    Returns:
        (loss, stats): float32; stats has ``accuracy`` (share of pairs with chosen > rejected, margin
        ignored) and ``margin_mean`` (mean of chosen - rejected).
    """
    check_same_shape("pairwise_reward_loss", chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    diff = as_float(chosen_scores) - as_float(rejected_scores)
    logits = diff if margin is None else diff - (as_float(margin) if torch.is_tensor(margin) else margin)
    loss = -F.logsigmoid(logits).mean()
    stats = {"accuracy": (diff > 0).float().mean().detach(), "margin_mean": diff.mean().detach()}
    return loss, stats


def _ratio_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask, log-ratio, ratio and advantages with padding set to log-ratio 0 / advantage 0 before exp."""
    mask = response_mask.bool()
    log_ratio = torch.where(mask, as_float(logprobs) - as_float(old_logprobs), 0.0)
    return mask, log_ratio, torch.exp(log_ratio), torch.where(mask, as_float(advantages), 0.0)


def _ratio_stats(mask: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    log_ratio, ratio = log_ratio.detach(), ratio.detach()
    return {
        # Schulman's k2 and k1 estimates of KL(old || new) on the rollout tokens (seeds/000 approxkl/policykl).
        "approx_kl": 0.5 * masked_mean(log_ratio.square(), mask),
        "policy_kl": masked_mean(-log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        # ratio > 0, so 0 at padding never wins the max.
        "ratio_max": torch.where(mask, ratio, 0.0).amax(),
    }

"""PPO policy losses (clip and KL-penalty), the reference-KL loss term, the clipped value loss and the
pairwise reward-model loss (the offline preference losses are in :mod:`lit_rlhf.functional.preference`).

Every loss returns ``(loss, stats)``: ``loss`` a float32 scalar, ``stats`` a dict of detached float32
scalars keyed by metric name without prefix. The (B, T) masks are loss masks: 1 on the tokens learned
from; they may have holes (tool or environment tokens between the model's tokens of a multi-turn
rollout), and every loss and statistic equals that of the same inputs with the holes removed. Unmasked
positions (padding and holes) are replaced by neutral values with ``torch.where`` *before* any
nonlinearity (exp, square), so NaN/inf stored there can change neither the loss nor the gradient, and
the gradient at unmasked positions is exactly 0.

Policy losses reduce their per-token terms with one of ``LOSS_AGGREGATIONS`` (:func:`aggregate_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lit_rlhf.functional._checks import as_float, check_number, check_same_shape
from lit_rlhf.functional.kl import kl_penalty
from lit_rlhf.functional.registry import IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS
from lit_rlhf.functional.stats import masked_mean, masked_row_sum

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "aggregation_weight",
    "clipped_value_loss",
    "kl_penalty_policy_loss",
    "pairwise_reward_loss",
    "ppo_policy_loss",
    "reference_kl_loss",
]



def check_loss_aggregation(fn: str, loss_aggregation: str, max_response_length: int | None) -> None:
    """Raise ValueError for an unknown aggregation, or a missing/invalid constant of the Dr. GRPO one."""
    if loss_aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(
            f"{fn}: unknown `loss_aggregation` {loss_aggregation!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}"
        )
    if loss_aggregation == "seq_mean_token_sum_norm" and (
        max_response_length is None or max_response_length < 1
    ):
        raise ValueError(
            f"{fn}: `loss_aggregation`='seq_mean_token_sum_norm' needs `max_response_length` >= 1 "
            f"(the constant the token sums are divided by), got {max_response_length}"
        )


def aggregate_loss(
    token_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_aggregation: str = "token_mean",
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce per-token losses (B, T) to a scalar.

    - ``token_mean``: mean over all masked tokens of the batch (PPO; DAPO's token-level loss, arXiv
      2503.14476 sec. 3.3): every token weighs the same, so long responses weigh more.
    - ``seq_mean_token_mean``: mean over each response's masked tokens, then over responses (the
      original GRPO, Shao et al. 2024, arXiv 2402.03300 eq. 3: the 1/|o_i| inside the group mean).
    - ``seq_mean_token_sum_norm``: each response's token sum divided by the constant
      ``max_response_length``, then the mean over responses (Dr. GRPO, Liu et al. 2025, arXiv
      2503.20783 sec. 3.1: no length normalisation bias).

    Args:
        token_losses: (B, T) per-token losses.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        loss_aggregation: one of ``LOSS_AGGREGATIONS``.
        max_response_length: the constant of ``seq_mean_token_sum_norm`` (the generation's max_new_tokens).

    Returns:
        float32 (float64 kept) scalar. A row without masked tokens contributes 0 to the sequence means.
    """
    check_same_shape("aggregate_loss", token_losses=token_losses, response_mask=response_mask)
    check_loss_aggregation("aggregate_loss", loss_aggregation, max_response_length)
    if loss_aggregation == "token_mean":
        return masked_mean(token_losses, response_mask)
    row_sums = masked_row_sum(token_losses, response_mask)  # (B,)
    if loss_aggregation == "seq_mean_token_mean":
        lengths = response_mask.bool().sum(dim=1).clamp(min=1)  # (B,)
        return (row_sums / lengths).mean()
    return (row_sums / max_response_length).mean()


def aggregation_weight(
    part_mask: torch.Tensor, total_mask: torch.Tensor, loss_aggregation: str
) -> torch.Tensor:
    """Share of a micro-batch in its minibatch's aggregated loss, for gradient accumulation.

    ``aggregate_loss`` is a mean over tokens (``token_mean``) or over responses (the sequence means), so
    summing ``weight * aggregate_loss(part)`` over micro-batches gives ``aggregate_loss(minibatch)``.

    Args:
        part_mask: (b, T) loss mask of the micro-batch (may have holes, which are not counted).
        total_mask: (B, T) loss mask of the whole minibatch.
        loss_aggregation: one of ``LOSS_AGGREGATIONS``.

    Returns:
        scalar tensor: masked tokens of the part / of the minibatch, or rows of the part / of the minibatch.
    """
    # float32 whatever the default dtype (Lightning's bf16-true makes it bfloat16 inside training_step)
    if loss_aggregation == "token_mean":
        return part_mask.sum().float() / total_mask.sum().float()
    return torch.tensor(part_mask.shape[0] / total_mask.shape[0], dtype=torch.float32, device=part_mask.device)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_coef: float,
    clip_coef_high: float | None = None,
    loss_aggregation: str = "token_mean",
    max_response_length: int | None = None,
    importance_sampling_level: str = "token",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Clip: -aggregate(min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)), r = exp(logprobs - old_logprobs).

    (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347, eq. 7.) The ratio
    is against the rollout policy
    (``old_logprobs``), never the reference model. Options of the 2025 papers, off by default:

    - ``clip_coef_high`` > ``clip_coef``: DAPO's "clip-higher" (Yu et al. 2025, arXiv 2503.14476 sec. 3.1),
      a wider upper bound lets low-probability tokens rise (against entropy collapse).
    - ``importance_sampling_level="sequence"``: GSPO (Zheng et al. 2025, arXiv 2507.18071 sec. 4.1), the
      ratio of every token of response i is s_i = exp(mean_t(logprobs - old_logprobs)) with the mean over
      the masked tokens of the response, the length-normalised sequence likelihood ratio, clipped as a
      whole.
    - ``loss_aggregation``: see :func:`aggregate_loss`.
    - ``weights``: each token's term times w_t before the aggregation, e.g. the engine/trainer
      importance-sampling correction (:func:`~lit_rlhf.functional.is_correction_weights`; TIS, Yao et al.
      2025, https://fengyao.notion.site/off-policy-rl: min(pi_old/mu, C) times the clipped term).

    Args:
        logprobs: (B, T) log-probs of the current policy (with grad).
        old_logprobs: (B, T) log-probs of the rollout policy.
        advantages: (B, T) advantages (usually whitened).
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        clip_coef: eps_low > 0 (also eps_high when ``clip_coef_high`` is None).
        clip_coef_high: eps_high > 0, or None for the symmetric clip.
        loss_aggregation: one of ``LOSS_AGGREGATIONS``.
        max_response_length: the constant of ``seq_mean_token_sum_norm``.
        importance_sampling_level: ``token`` (PPO) or ``sequence`` (GSPO).
        weights: (B, T) per-token weights, constants (detached here), or None (all 1).

    Returns:
        (loss, stats): stats has ``clipfrac`` (share of masked tokens where the clipped term is taken),
        ``approx_kl`` = 0.5 * mean((lp - old)^2), ``policy_kl`` = mean(old - lp), ``ratio_mean`` and
        ``ratio_max`` (over masked tokens, of the token-level ratio whatever the importance-sampling level).
    """
    check_same_shape(
        "ppo_policy_loss",
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask,
    )  # fmt: skip
    clip_coef_high = _check_clip_options(clip_coef, clip_coef_high, importance_sampling_level)
    mask, log_ratio, ratio, advantages = _ratio_terms(logprobs, old_logprobs, advantages, response_mask)
    stats = _ratio_stats(mask, log_ratio, ratio)
    if importance_sampling_level == "sequence":
        ratio = _sequence_ratio(log_ratio, mask)  # (B, T): s_i on every masked token
    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_coef, 1.0 + clip_coef_high)  # (B, T)
    token_losses = _weighted("ppo_policy_loss", torch.maximum(unclipped, clipped), weights, mask)  # (B, T)
    loss = aggregate_loss(token_losses, mask, loss_aggregation, max_response_length)
    stats["clipfrac"] = masked_mean((clipped > unclipped).float(), mask).detach()
    return loss, stats


def _check_clip_options(
    clip_coef: float, clip_coef_high: float | None, importance_sampling_level: str
) -> float:
    """Raise ValueError for a clip coefficient <= 0 or an unknown importance-sampling level of
    :func:`ppo_policy_loss`; return eps_high (``clip_coef`` when ``clip_coef_high`` is None)."""
    fn = "ppo_policy_loss"
    check_number(fn, "clip_coef", clip_coef, low=0.0, low_inclusive=False)
    clip_coef_high = clip_coef if clip_coef_high is None else clip_coef_high
    check_number(fn, "clip_coef_high", clip_coef_high, low=0.0, low_inclusive=False)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"{fn}: unknown `importance_sampling_level` {importance_sampling_level!r}; expected token or sequence"
        )
    return clip_coef_high


def _sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio: (B, T) token log-ratios (0 off the mask) -> (B, T) s_i = exp(mean over response i's
    masked tokens of the log-ratio) on every masked token of row i, 0 off the mask."""
    lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    seq_log_ratio = masked_row_sum(log_ratio, mask).unsqueeze(1) / lengths  # (B, 1)
    return torch.where(mask, torch.exp(seq_log_ratio), 0.0)  # (B, T)


def _weighted(
    fn: str, token_terms: torch.Tensor, weights: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor:
    """(B, T) per-token terms times the detached (B, T) ``weights`` on the mask (unchanged when None)."""
    if weights is None:
        return token_terms
    check_same_shape(fn, response_mask=mask, weights=weights)
    return token_terms * torch.where(mask, as_float(weights.detach()), 0.0)  # (B, T)


def reference_kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_aggregation: str = "token_mean",
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL(pi_theta || pi_ref) as a loss term: aggregate(kl_t), by default GRPO's k3 estimate.

    GRPO puts the KL to the reference in the loss instead of the reward (Shao et al. 2024, arXiv
    2402.03300 eq. 3-4: D_KL = pi_ref/pi_theta - log(pi_ref/pi_theta) - 1 per token, unbiased and >= 0).
    The caller adds ``kl_loss_coef * loss`` to the policy loss.

    Args:
        logprobs: (B, T) log-probs of the current policy (with grad).
        ref_logprobs: (B, T) log-probs of the reference policy.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        estimator: a ``kl_penalty`` estimator (``k3`` in GRPO).
        loss_aggregation, max_response_length: see :func:`aggregate_loss`.

    Returns:
        (loss, stats): stats has ``kl_loss``.
    """
    check_same_shape(
        "reference_kl_loss", logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask
    )
    mask = response_mask.bool()
    logprobs = torch.where(mask, as_float(logprobs), 0.0)
    ref_logprobs = torch.where(mask, as_float(ref_logprobs), 0.0)
    kl = kl_penalty(logprobs, ref_logprobs, estimator)  # (B, T), 0 off the mask
    loss = aggregate_loss(kl, mask, loss_aggregation, max_response_length)
    return loss, {"kl_loss": loss.detach()}


def kl_penalty_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    beta: float,
    loss_aggregation: str = "token_mean",
    max_response_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-Penalty: -aggregate(r * A - beta * KL_t(old || new)), r = exp(logprobs - old_logprobs).

    (Schulman et al. 2017, arXiv 1707.06347, eq. 8.) The per-token KL(pi_old || pi_theta) is the
    k1 estimate on tokens sampled from pi_old: old_logprobs - logprobs. ``beta`` comes from a
    ``PPOPenaltyKLController`` updated with the measured ``policy_kl``.

    Args:
        logprobs: (B, T) log-probs of the current policy (with grad).
        old_logprobs: (B, T) log-probs of the rollout policy.
        advantages: (B, T) advantages.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        beta: >= 0 (0 gives the plain importance-sampled surrogate -mean(r * A)).
        loss_aggregation, max_response_length: see :func:`aggregate_loss`.
        weights: (B, T) per-token weights of the whole term (its KL estimate is a sample mean under
            pi_old too), as in :func:`ppo_policy_loss`; None = all 1.

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
    token_terms = _weighted(fn, ratio * advantages - beta * kl_old_new, weights, mask)  # (B, T)
    loss = -aggregate_loss(token_terms, mask, loss_aggregation, max_response_length)
    return loss, _ratio_stats(mask, log_ratio, ratio)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_coef_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * masked_mean(max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2)): the clipped value loss.

    Value-function clipping of OpenAI Baselines' PPO2, described by Engstrom et al. 2020 ("Implementation
    Matters in Deep Policy Gradients: A Case Study on PPO and TRPO", arXiv 2005.12729, sec. 3, the first
    code-level optimisation); R is the V_targ of Schulman et al. 2017 (arXiv 1707.06347, eq. 9). Taking the
    max stops the gradient when the new value has left the trust region towards the return, ending closer
    to it than the boundary is (the clipped error is then the larger one and its gradient through the
    clip is 0), and keeps the full gradient otherwise.

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) rollout critic values.
        returns: (B, T) GAE lambda-returns.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from; may have holes
            (tool/environment tokens), which are skipped as if removed.
        clip_coef_value: eps > 0 (``float("inf")`` disables clipping).

    Returns:
        (loss, stats): stats has ``value_clipfrac`` (share of masked tokens where the clipped error is larger).
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
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley-Terry loss -log sigmoid(chosen - rejected - margin), averaged over the pairs.

    The reward-model loss of InstructGPT (Ouyang et al. 2022, arXiv 2203.02155, eq. 1) on one pair per
    comparison. The optional margin is the Llama 2 reward-model margin (Touvron et al. 2023, arXiv
    2307.09288, sec. 3.2.2): a pair must be won by at least ``margin``. With ``weights`` w (e.g. the
    bootstrap counts of ``poisson_bootstrap_weights``) the average is weighted: sum(w * l) / sum(w), 0 when
    every weight is 0 (a pair of weight 2 counts as two copies of it).

    Args:
        chosen_scores: (B,) reward-model scores of the chosen responses.
        rejected_scores: (B,) scores of the rejected responses.
        margin: None, a float, or (B,) per-pair margins.
        weights: None, or (B,) non-negative weights of the pairs.

    Returns:
        (loss, stats): float32; stats has ``accuracy`` (share of pairs with chosen > rejected, margin
        ignored) and ``margin_mean`` (mean of chosen - rejected), unweighted.
    """
    check_same_shape("pairwise_reward_loss", chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    if torch.is_tensor(margin) and margin.dim() > 0:  # a (B, 1) margin would broadcast to (B, B)
        check_same_shape("pairwise_reward_loss", chosen_scores=chosen_scores, margin=margin)
    diff = as_float(chosen_scores) - as_float(rejected_scores)  # (B,)
    logits = diff if margin is None else diff - (as_float(margin) if torch.is_tensor(margin) else margin)  # (B,)
    losses = -F.logsigmoid(logits)  # (B,)
    if weights is None:
        loss = losses.mean()
    else:
        check_same_shape("pairwise_reward_loss", chosen_scores=chosen_scores, weights=weights)
        if bool((weights < 0).any()):
            raise ValueError("pairwise_reward_loss: `weights` must be >= 0")
        weights = as_float(weights)  # (B,)
        loss = (weights * losses).sum() / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)
    stats = {"accuracy": (diff > 0).float().mean().detach(), "margin_mean": diff.mean().detach()}
    return loss, stats


def _ratio_terms(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask, log-ratio, ratio and advantages with unmasked positions set to log-ratio 0 / advantage 0 before exp."""
    mask = response_mask.bool()
    log_ratio = torch.where(mask, as_float(logprobs) - as_float(old_logprobs), 0.0)
    return mask, log_ratio, torch.exp(log_ratio), torch.where(mask, as_float(advantages), 0.0)


def _ratio_stats(mask: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    log_ratio, ratio = log_ratio.detach(), ratio.detach()
    return {
        # k2 and k1 estimates of KL(old || new) on the rollout tokens (Schulman 2020, "Approximating KL
        # Divergence", http://joschu.net/blog/kl-approx.html).
        "approx_kl": 0.5 * masked_mean(log_ratio.square(), mask),
        "policy_kl": masked_mean(-log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        # ratio > 0, so 0 off the mask never wins the max.
        "ratio_max": torch.where(mask, ratio, 0.0).amax(),
    }

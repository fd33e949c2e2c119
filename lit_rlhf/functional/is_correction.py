"""Importance-sampling correction of the engine/trainer mismatch: token or sequence weights pi_old / mu.

The rollout engine samples from mu (another kernel, bf16, weights a step out of sync); the PPO ratio's
denominator is pi_old, the trainer's own scoring of the same tokens. The policy-gradient estimate is an
expectation under pi_old, so each token's loss is weighted by w = pi_old / mu, made safe in one of four
ways (the names are TRL's ``vllm_importance_sampling_mode`` choices):

- ``token_truncate``: w_t = min(rho_t, C), truncated importance sampling (TIS; Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training",
  https://fengyao.notion.site/off-policy-rl, the TIS-PPO objective: min(pi_old/mu, C) times PPO's clipped
  term, C = 2);
- ``token_mask``: w_t = rho_t inside the band [low, C], 0 outside (masked importance sampling, MIS; Liu,
  Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
  Mismatch", https://richardli.xyz/rl-collapse, part 3: rejecting outliers rather than clipping them);
- ``sequence_truncate`` / ``sequence_mask``: one weight per response, min(rho_i, C) or rho_i inside the
  band, on each of its learned tokens (the same post, part 2: sequence-level correction is unbiased for
  the sequence's likelihood, at the price of variance).

The sequence ratio rho_i is ``product`` = exp(sum_t d_t), the likelihood ratio of the whole response (TRL's
sequence modes), or ``geometric_mean`` = exp(mean_t d_t), its per-token geometric mean (verl's ``geometric``
rollout rejection, https://verl.readthedocs.io/en/latest/algo/rollout_corr.html), which does not compound
with the length, so one band fits short and long responses (its useful bands are narrow, e.g. [0.999, 1.001]).

**The support of mu.** Under top-k/top-p the engine samples from q = pi / Z_t on the kept tokens, where Z_t
is the probability mass the truncation kept at step t; the trainer scores the untruncated pi_old. So
log pi_old - log q = log Z_t + (engine-vs-trainer difference) at every token. Here mu is the engine's
log-prob on the trainer's support, ``behavior_logprobs + log_kept_mass`` (= log pi_engine): the factor Z_t
is left out, because

1. it is not a difference between two policies but a rule applied to the same one (the truncation), and the
   trainer's convention, with every engine, is already to learn the untruncated policy from truncated
   samples; with the Hugging Face engine, which is the trainer's own policy, the weights must then be 1;
2. it is biased downwards (Z_t <= 1), so it would shrink every token's gradient by its step's kept mass
   (TRL issue #6789 measured a mean ratio equal to the kept mass, 0.896 at top_p = 0.8), and a sequence
   ratio, the product of the Z_t, would mask every long response;
3. it corrects nothing: tokens outside the kept set are never sampled, so no weight on the sampled ones
   recovers an expectation under the untruncated pi_old.

What remains, rho_t = exp(d_t) with d_t = log pi_old - (behavior_logprobs + log_kept_mass), is the
numerical mismatch this correction is for; its raw statistics are ``behavior_mismatch_stats``'
``is_ratio_*`` (:mod:`lit_rlhf.functional.behavior`, the same d_t). An engine that truncates must report
``log_kept_mass`` (``lit_rlhf.engines.Responses``); None means it had no truncation.

Shapes: B rows, T response length. The mask is the loss mask (1 on the tokens learned from); its holes
and padding get weight 0 and never change a result.
"""

from __future__ import annotations

import math

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape
from lit_rlhf.functional.registry import IS_CORRECTION_MODES, IS_SEQUENCE_RATIOS
from lit_rlhf.functional.stats import masked_row_sum

__all__ = [
    "IS_CORRECTION_STATS",
    "band_weights",
    "behavior_log_ratio",
    "is_correction_weights",
    "normalized_ess",
    "sequence_log_ratio",
    "truncated_weights",
]

# per-rollout statistics, keyed without prefix (logged as rollout/...); which appear depends on the mode
IS_CORRECTION_STATS = (
    "is_weight_mean", "is_weight_max", "is_clipped_frac", "is_masked_frac", "is_ess",
    "is_seq_ratio_mean", "is_seq_ratio_max",
)  # fmt: skip
# the sequence ratio's statistics are of exp(clamp(log rho, -20, 20)): a product over a long response can
# overflow float32 (weights never do: they are bounded in log space first)
_STATS_LOG_BOUND = 20.0


def behavior_log_ratio(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    log_kept_mass: torch.Tensor | None,
    mask: torch.Tensor,
) -> torch.Tensor:
    """d_t = log pi_old - log mu on the trainer's support (see the module docstring).

    Args:
        old_logprobs: (B, T) the trainer's log-probs of the sampled tokens (``Rollout.old_logprobs``).
        behavior_logprobs: (B, T) the engine's log-probs of the same tokens (``Responses.logprobs``).
        log_kept_mass: (B, T) log Z_t of the engine's top-k/top-p truncation (None: none).
        mask: (B, T) the loss mask.

    Returns:
        (B, T) float32 (float64 kept) d_t, 0 off the mask.
    """
    fn = "behavior_log_ratio"
    check_same_shape(fn, old_logprobs=old_logprobs, behavior_logprobs=behavior_logprobs, mask=mask)
    check_2d(fn, old_logprobs=old_logprobs)
    mask = mask.bool()
    mu = as_float(behavior_logprobs)  # (B, T)
    if log_kept_mass is not None:
        check_same_shape(fn, old_logprobs=old_logprobs, log_kept_mass=log_kept_mass)
        mu = mu + as_float(log_kept_mass)  # (B, T) log pi_engine, the untruncated support
    return torch.where(mask, as_float(old_logprobs) - mu, 0.0)  # (B, T)


def sequence_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, sequence_ratio: str = "product"
) -> torch.Tensor:
    """log rho_i of each response: sum_t d_t (``product``) or mean_t d_t (``geometric_mean``) over its
    learned tokens.

    Args:
        log_ratio: (B, T) token log-ratios d_t.
        mask: (B, T) the loss mask.
        sequence_ratio: one of ``IS_SEQUENCE_RATIOS``.

    Returns:
        (B,) float32; 0 for a row without learned tokens.
    """
    fn = "sequence_log_ratio"
    check_same_shape(fn, log_ratio=log_ratio, mask=mask)
    if sequence_ratio not in IS_SEQUENCE_RATIOS:
        raise ValueError(
            f"{fn}: unknown `sequence_ratio` {sequence_ratio!r}; expected one of {list(IS_SEQUENCE_RATIOS)}"
        )
    total = masked_row_sum(as_float(log_ratio), mask)  # (B,)
    if sequence_ratio == "product":
        return total
    return total / mask.bool().sum(dim=1).clamp(min=1)  # (B,)


def truncated_weights(log_ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(d), C) of log-ratios of any shape, computed as exp(min(d, log C)) (never overflows)."""
    check_number("truncated_weights", "cap", cap, low=1.0, low_inclusive=True)
    return torch.exp(torch.clamp(as_float(log_ratio), max=math.log(cap)))


def band_weights(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """exp(d) where low <= exp(d) <= high, else 0, of log-ratios of any shape (``low`` 0: no lower bound)."""
    fn = "band_weights"
    check_number(fn, "low", low, low=0.0, low_inclusive=True, high=1.0)
    check_number(fn, "high", high, low=1.0, low_inclusive=True)
    d = as_float(log_ratio)
    log_low = math.log(low) if low > 0 else -math.inf
    inside = (d >= log_low) & (d <= math.log(high))
    return torch.where(inside, torch.exp(torch.clamp(d, max=math.log(high))), 0.0)


def normalized_ess(weights: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (N sum w^2) of N weights: Kish's effective sample size over N (Owen 2013, "Monte Carlo
    theory, methods and examples", ch. 9), in (0, 1], 1 when all weights are equal; 0 when all are 0 or
    N = 0."""
    w = as_float(weights).flatten()  # (N,)
    squares = w.square().sum()
    if w.numel() == 0 or squares == 0:
        return w.new_zeros(())
    return w.sum().square() / (w.numel() * squares)


def is_correction_weights(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    log_kept_mass: torch.Tensor | None,
    mask: torch.Tensor,
    mode: str,
    cap: float = 2.0,
    low: float = 0.0,
    sequence_ratio: str = "product",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token weights of the engine/trainer correction and their per-rollout statistics.

    With d_t from :func:`behavior_log_ratio`, the unit is the token (``token_*``) or the response
    (``sequence_*``, rho_i from :func:`sequence_log_ratio`); the unit's weight is min(rho, C)
    (``*_truncate``) or rho inside [low, C] and 0 outside (``*_mask``). The caller multiplies each learned
    token's policy-gradient loss by its weight (a constant: no gradient flows through it); a weight of 0
    removes the token's term but it still counts in the loss aggregation's denominator (TRL's convention).

    Args:
        old_logprobs: (B, T) the trainer's log-probs pi_old of the sampled tokens.
        behavior_logprobs: (B, T) the engine's log-probs of the same tokens.
        log_kept_mass: (B, T) log Z_t of the engine's truncation (None: none).
        mask: (B, T) the loss mask.
        mode: one of ``IS_CORRECTION_MODES``.
        cap: C >= 1, the truncation bound and the band's upper end.
        low: the band's lower end in [0, 1] (``*_mask`` only; 0 = no lower bound).
        sequence_ratio: ``product`` or ``geometric_mean`` (``sequence_*`` only).

    Returns:
        (weights, stats): (B, T) float32 weights in [0, C], 0 off the mask, and 0-d float32 stats over the
        units (learned tokens, or responses with at least one learned token): ``is_weight_mean``,
        ``is_weight_max``, ``is_clipped_frac`` (truncate: share of units with rho > C) or
        ``is_masked_frac`` (mask: share of units outside the band), ``is_ess`` (:func:`normalized_ess`
        of the units' weights), and for the sequence modes ``is_seq_ratio_mean`` / ``is_seq_ratio_max`` of
        the raw rho_i (the token ratios' are ``behavior_mismatch_stats``').
    """
    fn = "is_correction_weights"
    if mode not in IS_CORRECTION_MODES:
        raise ValueError(f"{fn}: unknown `mode` {mode!r}; expected one of {list(IS_CORRECTION_MODES)}")
    check_number(fn, "cap", cap, low=1.0, low_inclusive=True)
    check_number(fn, "low", low, low=0.0, low_inclusive=True, high=1.0)
    mask = mask.bool()
    log_ratio = behavior_log_ratio(old_logprobs, behavior_logprobs, log_kept_mass, mask)  # (B, T)
    level, bound = mode.split("_")
    if level == "token":
        units = mask  # (B, T) the learned tokens
        unit_log_ratio = log_ratio[mask]  # (N,)
    else:
        units = mask.any(dim=1)  # (B,) the responses with learned tokens
        unit_log_ratio = sequence_log_ratio(log_ratio, mask, sequence_ratio)[units]  # (N,)
    if bound == "truncate":
        unit_weights = truncated_weights(unit_log_ratio, cap)  # (N,)
    else:
        unit_weights = band_weights(unit_log_ratio, low, cap)  # (N,)
    placed = torch.zeros(units.shape, dtype=log_ratio.dtype, device=log_ratio.device)  # (B, T) or (B,)
    placed[units] = unit_weights
    weights = placed if level == "token" else torch.where(mask, placed[:, None], 0.0)  # (B, T)
    return weights, _unit_stats(unit_log_ratio, unit_weights, mode, cap, low)


def _unit_stats(
    unit_log_ratio: torch.Tensor, unit_weights: torch.Tensor, mode: str, cap: float, low: float
) -> dict[str, torch.Tensor]:
    """:func:`is_correction_weights`' stats from the (N,) units' log-ratios and weights (all 0 if N = 0)."""
    level, bound = mode.split("_")
    sequence = level == "sequence"
    frac = "is_clipped_frac" if bound == "truncate" else "is_masked_frac"
    names = ["is_weight_mean", "is_weight_max", frac, "is_ess"]
    names += ["is_seq_ratio_mean", "is_seq_ratio_max"] if sequence else []
    if unit_weights.numel() == 0:
        return dict.fromkeys(names, unit_weights.new_zeros(()))
    above = unit_log_ratio > math.log(cap)  # (N,)
    outside = above | (unit_log_ratio < math.log(low)) if low > 0 else above  # (N,)
    stats = {
        "is_weight_mean": unit_weights.mean(),
        "is_weight_max": unit_weights.max(),
        frac: (above if bound == "truncate" else outside).to(unit_weights.dtype).mean(),
        "is_ess": normalized_ess(unit_weights),
    }
    if sequence:
        ratio = torch.exp(unit_log_ratio.clamp(-_STATS_LOG_BOUND, _STATS_LOG_BOUND))  # (N,)
        stats.update(is_seq_ratio_mean=ratio.mean(), is_seq_ratio_max=ratio.max())
    return stats

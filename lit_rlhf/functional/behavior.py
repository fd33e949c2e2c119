"""How far the engine's sampling distribution is from the trainer's: the behaviour-policy mismatch.

Three log-probs of a sampled token a_t are never confused:

- ``behavior_logprobs``: log q(a_t), the distribution the engine sampled from (temperature, then top-k and
  top-p truncation, renormalised over the kept tokens), with ``log_kept_mass`` = log Z_t, the mass the
  truncation kept of the tempered distribution;
- ``old_logprobs``: log pi_old(a_t), the trainer's actor before this rollout's update, at the rollout's
  temperature over the whole vocabulary: the PPO ratio's denominator;
- ``ref_logprobs``: the reference policy at the same temperature, for the KL only.

Under truncation q = pi_old / Z on the kept tokens, so log pi_old - log q = log Z at every token: a factor
that is not a policy change (TRL issue #6789 measured a mean ratio equal to the kept mass, 0.896 at
top_p=0.8). The mismatch is therefore measured on the trainer's support: against ``behavior_logprobs +
log_kept_mass``, the engine's log-prob of the token under the untruncated tempered distribution, so that
what remains is the engine-vs-trainer numerical difference (kernels, precision, weights out of sync).

Shapes: B rows, T response length.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import check_same_shape
from lit_rlhf.functional.stats import masked_mean

__all__ = ["BEHAVIOR_MISMATCH_STATS", "behavior_mismatch_stats"]

BEHAVIOR_MISMATCH_STATS = (
    "logprob_diff_mean", "logprob_diff_max", "is_ratio_mean", "is_ratio_min", "is_ratio_max",
    "is_ratio_outside_band", "kept_mass_mean",
)  # fmt: skip


def behavior_mismatch_stats(
    old_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    log_kept_mass: torch.Tensor | None,
    mask: torch.Tensor,
    band: float = 0.1,
) -> dict[str, torch.Tensor]:
    """Token statistics of the trainer-vs-engine mismatch, on the trainer's (untruncated) support.

    With d_t = old_logprobs - (behavior_logprobs + log_kept_mass) and rho_t = exp(d_t), over the learned
    tokens: ``logprob_diff_mean`` = mean |d|, ``logprob_diff_max`` = max |d|, ``is_ratio_mean/min/max``
    of rho, ``is_ratio_outside_band`` = share of tokens with rho outside [1 - band, 1 + band], and
    ``kept_mass_mean`` = mean Z (1 without truncation).

    Args:
        old_logprobs: (B, T) the trainer's log-probs of the sampled tokens.
        behavior_logprobs: (B, T) the engine's log-probs of the same tokens (``Responses.logprobs``).
        log_kept_mass: (B, T) log Z of each step's truncation (None: no truncation).
        mask: (B, T) 1 on the tokens learned from (may have holes).
        band: half-width of the band around 1 of ``is_ratio_outside_band``.

    Returns:
        dict of 0-d float32 tensors keyed by ``BEHAVIOR_MISMATCH_STATS``.
    """
    check_same_shape("behavior_mismatch_stats", old_logprobs=old_logprobs, behavior_logprobs=behavior_logprobs, mask=mask)
    mask = mask.bool()
    kept = torch.zeros_like(behavior_logprobs) if log_kept_mass is None else log_kept_mass.float()  # (B, T)
    diff = torch.where(mask, old_logprobs.float() - (behavior_logprobs.float() + kept), 0.0)  # (B, T)
    ratio = diff.exp()  # (B, T)
    real = ratio[mask]  # (N,)
    if real.numel() == 0:
        zero = diff.new_zeros(())
        return dict.fromkeys(BEHAVIOR_MISMATCH_STATS, zero)
    return {
        "logprob_diff_mean": masked_mean(diff.abs(), mask),
        "logprob_diff_max": diff.abs()[mask].max(),
        "is_ratio_mean": real.mean(),
        "is_ratio_min": real.min(),
        "is_ratio_max": real.max(),
        "is_ratio_outside_band": ((real < 1 - band) | (real > 1 + band)).float().mean(),
        "kept_mass_mean": masked_mean(kept.exp(), mask),
    }

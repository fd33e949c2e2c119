"""Per-token KL(pi || pi_ref) estimates and the KL-shaped per-token reward (seeds/000, seeds/003)."""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape

__all__ = ["KL_ESTIMATORS", "kl_penalty", "kl_shaped_rewards", "masked_kl"]

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    With d = logprobs - ref_logprobs (tokens sampled from pi), the estimators of J. Schulman,
    "Approximating KL divergence" (2020):

    - "k1": d (unbiased, can be negative per token);
    - "abs": |d|;
    - "k2": d^2 / 2 (biased, low variance);
    - "k3": exp(-d) - 1 + d (unbiased and >= 0); computed as expm1(-d) + d, accurate for small d.

    Args:
        logprobs: (B, T) log pi(token).
        ref_logprobs: (B, T) log pi_ref(token).
        estimator: one of ``KL_ESTIMATORS``.

    Returns:
        (B, T) float32 (float64 kept); elementwise, so padded positions carry whatever their inputs give.
    """
    check_same_shape("kl_penalty", logprobs=logprobs, ref_logprobs=ref_logprobs)
    d = as_float(logprobs) - as_float(ref_logprobs)
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(
        f"kl_penalty: unknown `estimator` {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}"
    )


def masked_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """(B, T) per-token ``kl_penalty`` on real tokens, exactly 0 on padding whatever it holds."""
    return torch.where(response_mask.bool(), kl_penalty(logprobs, ref_logprobs, estimator), 0.0)  # (B, T)


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards r_t = -kl_coef * KL_t, plus the sequence score at the last real token (seeds/000).

    Args:
        scores: (B,) sequence-level rewards (reward model or reward function).
        logprobs: (B, T) rollout-policy log-probs of the response tokens.
        ref_logprobs: (B, T) reference-policy log-probs of the same tokens.
        response_mask: (B, T) 1/True for real response tokens. Every row needs at least one.
        kl_coef: >= 0, the KL penalty coefficient (the KL controller's value).
        estimator: see ``kl_penalty``.

    Returns:
        (rewards, kl): both (B, T) float32 (float64 kept), 0 at padded positions whatever the padded
        log-probs hold.

    Raises:
        ValueError: a row of ``response_mask`` has no real token (its score would have nowhere to go).
    """
    fn = "kl_shaped_rewards"
    check_2d(fn, logprobs=logprobs)
    check_same_shape(fn, logprobs=logprobs, ref_logprobs=ref_logprobs, response_mask=response_mask)
    if scores.shape != logprobs.shape[:1]:
        raise ValueError(f"{fn}: `scores` must be (B,) = ({logprobs.shape[0]},), got {tuple(scores.shape)}")
    check_number(fn, "kl_coef", kl_coef, low=0.0, low_inclusive=True)
    mask = response_mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"{fn}: `response_mask` row(s) {empty} have no real token; each response needs at least one"
        )

    kl = masked_kl(logprobs, ref_logprobs, mask, estimator)  # (B, T)
    rewards = -kl_coef * kl
    # The last real token, wherever the padding is: the largest position index with mask = 1.
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)
    rewards = rewards.scatter_add(1, last, as_float(scores).to(rewards.dtype).unsqueeze(1))
    return rewards, kl

"""Per-token KL(pi || pi_ref) estimates and the KL-shaped per-token reward.

The estimators are the k1/k2/k3 of J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html); the reward is InstructGPT's r(x, y) - beta * log(pi / pi_ref)
(Ouyang et al. 2022, arXiv 2203.02155, eq. 2) with the log-ratio spread over the tokens.

The (B, T) masks are loss masks: 1 on the tokens learned from; they may have holes (tool or environment
tokens), which are skipped as if removed.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_2d, check_number, check_same_shape
from lit_rlhf.functional.registry import KL_ESTIMATORS

__all__ = ["KL_ESTIMATORS", "kl_penalty", "kl_shaped_rewards", "masked_kl"]



def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    With d = logprobs - ref_logprobs (tokens sampled from pi), the estimators of J. Schulman,
    "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html):

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
    """(B, T) per-token ``kl_penalty`` on the loss-masked tokens, exactly 0 elsewhere whatever it holds.

    ``response_mask`` is the loss mask: 1/True on tokens learned from; it may have holes
    (tool/environment tokens), which get 0 like padding.
    """
    return torch.where(response_mask.bool(), kl_penalty(logprobs, ref_logprobs, estimator), 0.0)  # (B, T)


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards r_t = -kl_coef * KL_t, plus the sequence score at the last masked token.

    InstructGPT's KL-shaped reward (Ouyang et al. 2022, arXiv 2203.02155, eq. 2) per token: the KL
    penalty on every masked token and the score on the last one. Holes are skipped as if removed: they
    get no KL and the score goes to the last masked token even when tool/environment tokens follow it.

    Args:
        scores: (B,) sequence-level rewards (reward model or reward function).
        logprobs: (B, T) rollout-policy log-probs of the response tokens.
        ref_logprobs: (B, T) reference-policy log-probs of the same tokens.
        response_mask: (B, T) the loss mask: 1/True on tokens learned from (every row needs at least
            one); may have holes (tool/environment tokens), which are skipped as if removed.
        kl_coef: >= 0, the KL penalty coefficient (the KL controller's value).
        estimator: see ``kl_penalty``.

    Returns:
        (rewards, kl): both (B, T) float32 (float64 kept), 0 at unmasked positions (holes and padding)
        whatever the log-probs there hold.

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
    # The last masked token, wherever the padding and holes are: the largest position index with mask = 1.
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True)
    rewards = rewards.scatter_add(1, last, as_float(scores).to(rewards.dtype).unsqueeze(1))
    return rewards, kl

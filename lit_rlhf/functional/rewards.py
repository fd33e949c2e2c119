"""Sequence-reward math: the weighted sum of several reward functions and DAPO's soft overlong punishment.

Shapes: N reward functions, B responses.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import check_number


def weighted_reward_sum(
    scores: torch.Tensor, weights: torch.Tensor, scored: torch.Tensor | None = None
) -> torch.Tensor:
    """The total reward of each response: sum_i w_i * s_i over the N reward functions.

    A function of weight 0 is left out of the sum (it is only logged), so its NaN/inf does not reach the
    total; a non-finite score of any other function makes the row's total non-finite, for the caller's
    non-finite policy (``scoring.on_nonfinite``) to raise on or drop. Where ``scored`` is False the
    function gave no score (TRL's None: the row is another task's): that term is left out of the sum, as
    TRL's ``nansum`` leaves it, and a row that no function of nonzero weight scored is NaN.

    Args:
        scores: (N, B) raw scores of each function for each response (any value where not ``scored``).
        weights: (N,) finite weights (any sign).
        scored: (N, B) bool, False where function i gave response j no score; None: every one did.

    Returns:
        (B,) float32 totals.
    """
    if scores.dim() != 2 or weights.shape != (scores.shape[0],):
        raise ValueError(
            f"weighted_reward_sum: `scores` must be (N, B) and `weights` (N,), got {tuple(scores.shape)} "
            f"and {tuple(weights.shape)}"
        )
    if scored is not None and scored.shape != scores.shape:
        raise ValueError(
            f"weighted_reward_sum: `scored` must be (N, B) like `scores`, got {tuple(scored.shape)} and "
            f"{tuple(scores.shape)}"
        )
    if not bool(torch.isfinite(weights).all()):
        raise ValueError(f"weighted_reward_sum: `weights` must be finite, got {weights.tolist()}")
    scores, weights = scores.float(), weights.float()
    used = (weights != 0)[:, None].expand_as(scores)  # (N, B)
    counted = used if scored is None else used & scored.bool()  # (N, B)
    total = torch.where(counted, weights[:, None] * scores, 0.0).sum(dim=0)  # (B,)
    if scored is None or not bool(used.any()):  # every term scored, or only logged ones
        return total
    return torch.where(counted.any(dim=0), total, torch.nan)  # (B,) NaN: no term scored the row


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476 eq. 13) of responses' lengths.

        R(|y|) = 0                                   if |y| <= L_max - L_cache
               = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
               = -1                                  if L_max < |y|

    It is 0 up to the start of the cache window, falls linearly to -1 at ``max_length`` and stays -1 beyond;
    ``cache_length`` 0 is a hard limit (0 up to ``max_length``, -1 beyond).

    Args:
        lengths: (B,) response lengths in tokens (integers or floats).
        max_length: L_max >= 1.
        cache_length: L_cache, 0 <= L_cache <= L_max.

    Returns:
        (B,) float32 penalties in [-1, 0].
    """
    fn = "soft_overlong_penalty"
    check_number(fn, "max_length", max_length, low=1, low_inclusive=True)
    check_number(fn, "cache_length", cache_length, low=0, low_inclusive=True, high=max_length)
    if lengths.dim() != 1:
        raise ValueError(f"{fn}: `lengths` must be 1-D (B,), got shape {tuple(lengths.shape)}")
    lengths = lengths.float()  # (B,)
    start = float(max_length - cache_length)
    ramp = (start - lengths) / max(cache_length, 1)  # (B,); only read inside the window (cache_length >= 1)
    penalty = torch.where(lengths <= start, 0.0, ramp)  # (B,)
    return torch.where(lengths > max_length, -1.0, penalty)  # (B,)

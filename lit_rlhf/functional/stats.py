"""Masked statistics over (B, T) token tensors.

The mask of a (B, T) token tensor is the loss mask: 1 on the tokens learned from. It may have holes
(tool or environment tokens between the model's tokens of a multi-turn rollout), which are skipped as if
removed: every result equals that of the same inputs with the hole positions deleted, and (B, T) outputs
are 0 there. :func:`compact_left` / :func:`scatter_back` do that deletion for recurrences over time.

Padding rule for every function here: results on masked tokens never depend on the values stored at
unmasked positions (padding or holes), even when those are NaN or inf (a logit row past the EOS can
overflow). Values are therefore selected with ``torch.where`` and never multiplied by the mask, because
``nan * 0 = nan`` and ``inf * 0 = nan``; ``where`` also gives an exact zero gradient to those positions.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_same_shape

__all__ = [
    "as_groups",
    "compact_left",
    "explained_variance",
    "group_score_stats",
    "masked_mean",
    "masked_moments",
    "masked_row_sum",
    "masked_sum",
    "masked_std",
    "masked_var",
    "masked_whiten",
    "scatter_back",
    "whiten_from_moments",
]

# Added to the variance before the square root so a constant input whitens to 0 instead of nan
# (the constant used by TRL and OpenAI's lm-human-preferences).
WHITEN_EPS = 1e-8


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of the masked elements of ``x``: sum(x * mask) / sum(mask) over ``dim``.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.
        dim: dimension to reduce; None reduces over all elements.

    Returns:
        float32 (float64 kept) tensor: a scalar when ``dim`` is None, else ``x`` with ``dim`` removed.
        A reduction with no masked element is 0/0 = nan (no error, so no host sync in the loss path).
    """
    check_same_shape("masked_mean", x=x, mask=mask)
    mask = mask.bool()
    x = as_float(x)
    total = torch.where(mask, x, 0.0).sum() if dim is None else torch.where(mask, x, 0.0).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of the masked elements of ``x`` over ``dim`` (e.g. a sequence log-prob from token log-probs).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.
        dim: dimension to reduce; None reduces over all elements.

    Returns:
        float32 (float64 kept) tensor: a scalar when ``dim`` is None, else ``x`` with ``dim`` removed;
        0 where there is no masked element.
    """
    check_same_shape("masked_sum", x=x, mask=mask)
    kept = torch.where(mask.bool(), as_float(x), 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_row_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of each row's masked elements: (B, T) -> (B,) (e.g. a sequence's KL from per-token KL).

    Args:
        x: (B, T).
        mask: (B, T) the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.

    Returns:
        (B,) tensor in the dtype of ``x`` (float32 at least); 0 for a row without masked elements.
    """
    check_same_shape("masked_row_sum", x=x, mask=mask)
    return masked_sum(x, mask, dim=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements of ``x`` (all of them together).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.
        unbiased: apply Bessel's correction n / (n - 1).

    Returns:
        float32 (float64 kept) scalar.

    Raises:
        ValueError: no masked element, or only one with ``unbiased=True`` (the variance is undefined).
    """
    check_same_shape("masked_var", x=x, mask=mask)
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0 or (unbiased and n == 1):
        raise ValueError(
            f"masked_var: `mask` has {n} real element(s); the {'unbiased ' if unbiased else ''}variance needs "
            f"at least {2 if unbiased else 1}"
        )
    x = as_float(x)
    mean = masked_mean(x, mask)
    centered = torch.where(mask, x - mean, 0.0)
    var = centered.square().sum() / n
    if unbiased:
        var = var * (n / (n - 1))
    return var


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation of the masked elements of ``x``, for logging: 0 for a single element.

    A metric must not stop a run whose rollout happened to hold one learned token (one prompt, K = 1, a
    one-token response), where :func:`masked_var` (unbiased) is undefined; no spread was seen, so 0.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape; the loss mask (at least one element).

    Returns:
        float32 (float64 kept) scalar.
    """
    check_same_shape("masked_std", x=x, mask=mask)
    return masked_var(x, mask, unbiased=int(mask.bool().sum()) > 1).sqrt()


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the masked elements of ``x``: moments that add up across shards.

    Summing the moments of several shards (e.g. ``all_reduce`` over data-parallel ranks) and whitening
    each shard with :func:`whiten_from_moments` whitens with the statistics of all of them together.

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape as ``x``; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.

    Returns:
        (3,) float64 tensor (float64 so that the one-pass variance keeps its precision).
    """
    check_same_shape("masked_moments", x=x, mask=mask)
    mask = mask.bool()
    x = torch.where(mask, x.double(), 0.0)
    return torch.stack([mask.sum().double(), x.sum(), x.square().sum()])


def whiten_from_moments(
    x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var from ``moments`` (see :func:`masked_moments`).

    Args:
        x: any shape, e.g. (B, T).
        mask: same shape; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed.
        moments: (3,) [count, sum, sum of squares], of ``x`` alone or summed over shards; count >= 2.
        shift_mean: subtract the mean (True) or keep it (False).

    Returns:
        float32 (float64 kept) tensor shaped like ``x``, 0 at unmasked positions (holes and padding).

    Raises:
        ValueError: fewer than two masked elements in ``moments`` (the variance is undefined).
    """
    check_same_shape("whiten_from_moments", x=x, mask=mask)
    count, total, total_sq = moments.double().unbind()
    n = int(count)
    if n < 2:
        raise ValueError(f"whitening needs at least 2 real elements, the moments count {n}")
    mean = total / count
    var = ((total_sq - count * mean.square()) / (count - 1)).clamp(min=0.0)
    x = as_float(x)
    mean, var = mean.to(x.dtype), var.to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten the masked elements of ``x``: (x - mean) / sqrt(var + 1e-8), statistics over masked elements.

    ``var`` is the unbiased masked variance. With ``shift_mean=False`` the mean is added back, so only the
    scale changes (the TRL / OpenAI lm-human-preferences convention for whitening rewards).

    Args:
        x: any shape, e.g. (B, T) advantages.
        mask: same shape; the loss mask: 1/True on the elements learned from; may have holes (tool/environment tokens),
            which are skipped as if removed (at least two).
        shift_mean: subtract the mean (True) or keep it (False).

    Returns:
        float32 (float64 kept) tensor shaped like ``x``, 0 at unmasked positions (holes and padding).
    """
    return whiten_from_moments(x, mask, masked_moments(x, mask), shift_mean)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over masked tokens (how much of the return the critic explains).

    1 is a perfect critic, 0 is no better than predicting the mean, negative is worse. Both variances are
    biased (the Bessel factor cancels in the ratio), so a single masked token is allowed.

    Args:
        values: (B, T) critic predictions.
        returns: (B, T) targets.
        mask: (B, T) the loss mask: 1/True on the tokens learned from (at least one); may have holes
            (tool/environment tokens), which are skipped as if removed.

    Returns:
        float32 (float64 kept) scalar; nan when Var(returns) is 0 (undefined, as in CleanRL).
    """
    check_same_shape("explained_variance", values=values, returns=returns, mask=mask)
    mask = mask.bool()
    returns = torch.where(mask, as_float(returns), 0.0)
    residual = torch.where(mask, returns - as_float(values), 0.0)
    var_returns = masked_var(returns, mask, unbiased=False)
    var_residual = masked_var(residual, mask, unbiased=False)
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns, torch.nan)


def as_groups(scores: torch.Tensor, group_size: int, fn: str = "as_groups") -> torch.Tensor:
    """(B,) per-response scores -> (G, K) with G = B / K: row g holds the responses to prompt g.

    Rows g*K .. g*K+K-1 of a rollout share a prompt (each prompt's K responses are contiguous), so a
    view suffices.

    Raises:
        ValueError: ``scores`` is not 1-D, ``group_size`` < 1, or B is not a multiple of ``group_size``.
    """
    if scores.dim() != 1:
        raise ValueError(f"{fn}: `scores` must be 1-D (B,), got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(
            f"{fn}: {scores.shape[0]} scores cannot be split into groups of `group_size`={group_size}"
        )
    return as_float(scores).view(-1, group_size)


def compact_left(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack each row's masked elements to the left, in order: the row with its holes removed.

    A loss-mask row ``1 1 0 0 1 1 0 0`` (holes at 2, 3) becomes ``1 1 1 1 0 0 0 0``, the values moving
    with it; the unmasked values follow in their order (the caller masks them out). A right-padded row
    (no holes) is left exactly as it is. :func:`scatter_back` undoes it.

    Args:
        x: (B, T).
        mask: (B, T) the loss mask, 1/True on the elements to keep.

    Returns:
        (packed, packed_mask, order): ``packed[b, j] = x[b, order[b, j]]`` (B, T); ``packed_mask`` (B, T)
        bool, right-padded, ``mask.sum(1)`` ones per row; ``order`` (B, T) int64 permutation of each row.
    """
    check_same_shape("compact_left", x=x, mask=mask)
    if x.dim() != 2:
        raise ValueError(f"compact_left: `x` must be 2-D (B, T), got shape {tuple(x.shape)}")
    mask = mask.bool()
    # a stable sort on "is unmasked" keeps the masked elements, and the unmasked ones, in their order
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # (B, T)
    return x.gather(1, order), mask.gather(1, order), order


def scatter_back(packed: torch.Tensor, order: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`compact_left`: ``packed`` (B, T) back to the original positions, 0 off ``mask``.

    Args:
        packed: (B, T) values in the packed layout.
        order: (B, T) the permutation returned by :func:`compact_left`.
        mask: (B, T) the original (unpacked) loss mask.

    Returns:
        (B, T) in the dtype of ``packed``: ``out[b, order[b, j]] = packed[b, j]`` on masked positions,
        exactly 0 on the others (holes and padding).
    """
    check_same_shape("scatter_back", packed=packed, order=order, mask=mask)
    out = torch.empty_like(packed).scatter_(1, order, packed)  # (B, T)
    return torch.where(mask.bool(), out, 0.0)


def group_score_stats(scores: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean within-group standard deviation (unbiased) and the fraction of groups whose scores are all equal.

    A group whose K scores are all equal carries no signal for a group-baseline estimator (its
    advantages are 0), so the fraction tells how much of a rollout such an estimator learns from.

    Args:
        scores: (B,) sequence scores, each prompt's ``group_size`` >= 2 responses contiguous.
        group_size: K.

    Returns:
        (group_score_std, group_all_equal_frac): float32 scalars.
    """
    if group_size < 2:
        raise ValueError(f"group_score_stats: `group_size` must be >= 2, got {group_size}")
    grouped = as_groups(scores, group_size, "group_score_stats")  # (G, K)
    all_equal = (grouped == grouped[:, :1]).all(dim=1)  # (G,)
    return grouped.std(dim=1).mean(), all_equal.float().mean()

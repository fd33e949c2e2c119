"""Reward-model ensembles: the aggregated score of K members, their spread, and bootstrap weights of pairs.

Coste et al. 2024, "Reward Model Ensembles Help Mitigate Overoptimization" (ICLR 2024, arXiv:2310.02743),
sec. 3: a policy optimised against the mean of K reward models still over-optimises; a conservative
aggregate, the worst member (WCO) or the mean minus a multiple of the members' disagreement (UWO), mitigates
it under best-of-n and PPO.

Shapes: K ensemble members, B responses (or pairs).
"""

from __future__ import annotations

import math

import torch

from lit_rlhf.functional._checks import as_float, check_number

__all__ = [
    "ENSEMBLE_AGGREGATIONS",
    "aggregate_ensemble",
    "disagreement_loss",
    "ensemble_std",
    "poisson_bootstrap_weights",
    "standardize_members",
]

# the aggregations of an ensemble's scores (``aggregate_ensemble``)
ENSEMBLE_AGGREGATIONS = ("mean", "mean_minus_std", "mean_minus_var", "min")

_MASK64 = (1 << 64) - 1


def ensemble_std(scores: torch.Tensor) -> torch.Tensor:
    """The spread of the K members' scores of each response: their population standard deviation.

        std_b = sqrt((1 / K) * sum_k (s_kb - mean_b)^2)

    Divided by K, not K - 1: the K members are the whole ensemble, not a sample of it (the intra-ensemble
    variance of Coste et al. 2024, sec. 3, is the same average of squared deviations). One member has
    spread 0.

    Args:
        scores: (K, B) scores of each member for each response.

    Returns:
        (B,) float32 standard deviations (NaN where a member's score is).
    """
    _check_scores("ensemble_std", scores)
    scores = as_float(scores)  # (K, B)
    return scores.var(dim=0, correction=0).sqrt()  # (B,)


def standardize_members(scores: torch.Tensor, means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """The K members' scores on one common scale: each member standardised by its own reference statistics,
    then mapped to the members' average mean and spread.

        z_kb = (s_kb - mu_k) / sigma_k                        (member k's score in its own standard units)
        s'_kb = mean_j(mu_j) + mean_j(sigma_j) * z_kb

    A Bradley-Terry reward model is identified only up to an additive constant (its loss sees score
    differences), and members trained apart also land on different scales. Raw, the members' spread across
    one response then measures their offsets and scales as well as their disagreement, and the mean is led
    by the widest member. Standardised, every member counts alike, and the spread is zero for a response all
    members place at the same point of their own reference distribution. Mapping back to the average mean and
    spread keeps the aggregate in the units of the raw scores (a KL coefficient tuned for them keeps its
    weight); members with equal statistics are left as they are.

    Args:
        scores: (K, B) scores of each member for each response.
        means: (K,) each member's mean score on a reference set (e.g. held-out preference pairs).
        stds: (K,) each member's standard deviation there, > 0.

    Returns:
        (K, B) float32 scores.
    """
    fn = "standardize_members"
    _check_scores(fn, scores)
    K = scores.shape[0]
    means, stds = as_float(means).to(scores.device), as_float(stds).to(scores.device)  # (K,), (K,)
    if means.shape != (K,) or stds.shape != (K,):
        raise ValueError(
            f"{fn}: `means` and `stds` must have shape ({K},) for {K} members, got {tuple(means.shape)} and "
            f"{tuple(stds.shape)}"
        )
    if not bool(torch.isfinite(means).all() & torch.isfinite(stds).all() & (stds > 0).all()):
        raise ValueError(f"{fn}: `means` must be finite and `stds` finite and > 0, got {means.tolist()} and {stds.tolist()}")
    z = (as_float(scores) - means[:, None]) / stds[:, None]  # (K, B)
    return means.mean() + stds.mean() * z  # (K, B)


def aggregate_ensemble(scores: torch.Tensor, aggregation: str, coef: float = 1.0) -> torch.Tensor:
    """One score per response from the scores of the K members of a reward-model ensemble.

    With m_b the members' mean, v_b their population variance and s_b = sqrt(v_b) their spread
    (:func:`ensemble_std`), all over the K members of response b:

    - ``mean``: m_b (the paper's mean optimisation).
    - ``min``: min_k s_kb, worst-case optimisation (WCO, Coste et al. 2024, sec. 3); no coefficient.
    - ``mean_minus_var``: m_b - coef * v_b, uncertainty-weighted optimisation (UWO) exactly as the paper
      writes it: the mean penalised by lambda (``coef``) times the intra-ensemble variance.
    - ``mean_minus_std``: m_b - coef * s_b, UWO with the standard deviation in place of the variance: the
      penalty then has the scores' own units, so ``coef`` (a number of standard deviations, a lower
      confidence bound) keeps its meaning when the reward models' scale changes, which the variance's
      lambda does not (it scales with 1 / scale).

    Args:
        scores: (K, B) scores of each member for each response.
        aggregation: one of ``ENSEMBLE_AGGREGATIONS``.
        coef: lambda >= 0 of ``mean_minus_var`` / ``mean_minus_std`` (ignored by ``mean`` and ``min``).

    Returns:
        (B,) float32 aggregated scores; a non-finite member score makes its response's aggregate
        non-finite (for the caller's non-finite policy).
    """
    fn = "aggregate_ensemble"
    if aggregation not in ENSEMBLE_AGGREGATIONS:
        raise ValueError(f"{fn}: `aggregation` must be one of {ENSEMBLE_AGGREGATIONS}, got {aggregation!r}")
    check_number(fn, "coef", coef, low=0.0, low_inclusive=True)
    if not math.isfinite(coef):
        raise ValueError(f"{fn}: `coef` must be finite, got {coef}")
    _check_scores(fn, scores)
    scores = as_float(scores)  # (K, B)
    if aggregation == "min":
        return torch.amin(scores, dim=0)  # (B,), NaN propagates
    mean = scores.mean(dim=0)  # (B,)
    if aggregation == "mean":
        return mean
    variance = scores.var(dim=0, correction=0)  # (B,)
    penalty = variance if aggregation == "mean_minus_var" else variance.sqrt()  # (B,)
    return mean - coef * penalty  # (B,)


def poisson_bootstrap_weights(row_index: torch.Tensor, seeds: torch.Tensor | list[int]) -> torch.Tensor:
    """Each member's bootstrap count of each pair: K independent Poisson(1) draws per row, a function of
    (seed, row) alone.

    Bagging (Breiman 1996) trains each member on N pairs resampled with replacement, where a pair appears
    Multinomial(N, 1/N) ~ Poisson(1) times; the Poisson bootstrap (Oza & Russell 2001, "Online Bagging and
    Boosting"; Hanley & MacGibbon 2006) draws those counts independently per pair, so no member needs the
    dataset's size or its own data order: weighting each pair's loss by its count trains every member on
    its own resample from one shared stream of batches. The draw is a hash of (seed, row) (splitmix64,
    Steele et al. 2014) through the Poisson(1) inverse CDF: the same pair gets the same count in every
    epoch, on every rank and after a resume.

    Args:
        row_index: (B,) non-negative integer position of each pair in its dataset.
        seeds: (K,) integer seed of each member.

    Returns:
        (K, B) float32 counts in {0, 1, 2, ...} (mean 1, variance 1 over many rows).
    """
    if row_index.dim() != 1 or row_index.dtype.is_floating_point:
        raise ValueError(
            f"poisson_bootstrap_weights: `row_index` must be a 1-D integer tensor (B,), got {row_index.dtype} "
            f"of shape {tuple(row_index.shape)}"
        )
    rows = row_index.tolist()
    if any(r < 0 for r in rows):
        raise ValueError("poisson_bootstrap_weights: `row_index` must be >= 0")
    seeds = seeds.tolist() if torch.is_tensor(seeds) else list(seeds)
    counts = [[_poisson1(_splitmix64(_splitmix64(seed & _MASK64) ^ row)) for row in rows] for seed in seeds]
    return torch.tensor(counts, dtype=torch.float32, device=row_index.device).reshape(len(seeds), len(rows))


def _splitmix64(x: int) -> int:
    """The splitmix64 finaliser of a 64-bit integer (Steele, Lea & Flood 2014, "Fast splittable
    pseudorandom number generators")."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _poisson1(bits: int) -> int:
    """A Poisson(1) draw from 64 random bits: the inverse CDF at u = top 53 bits / 2^53."""
    u = (bits >> 11) / float(1 << 53)
    k, p = 0, math.exp(-1.0)
    cdf = p
    while u >= cdf and k < 30:  # P(k >= 30) < 1e-32
        k += 1
        p /= k
        cdf += p
    return k


def _check_scores(fn: str, scores: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(
            f"{fn}: `scores` must be (K, B) with K >= 1 members, got shape {tuple(scores.shape)}"
        )


def disagreement_loss(
    labelled: torch.Tensor, unlabelled: torch.Tensor, target: float, eps: float = 1e-6
) -> torch.Tensor:
    """Agree where the pairs speak, disagree where they do not: diversity by disagreement (D-BAT, Pagliardini
    et al. 2023, "Agree to Disagree", ICLR 2023, arXiv:2202.04414, sec. 3), for scalar reward models.

        agree    = mean_n sqrt(var_k(s_kn) + eps)                  over the labelled texts n
        disagree = mean_u relu(target - sqrt(var_k(s_ku) + eps))   over the unlabelled texts u
        loss     = agree + disagree

    Added to the members' Bradley-Terry losses it keeps their spread (``ensemble_std``) small on the texts of
    the preference pairs, which also pins their offsets together (Bradley-Terry alone leaves each member's
    offset free), and asks for a spread of at least ``target`` on texts no pair covers; so that spread has
    to come from what sets those texts apart, and mean - k std (``aggregate_ensemble``) falls there. The hinge
    bounds the disagreement (without it the members would drift apart without end). ``eps`` keeps the
    gradient of the square root finite where the members agree exactly.

    Args:
        labelled: (K, N) the members' scores of the pairs' texts (chosen and rejected).
        unlabelled: (K, U) their scores of unlabelled texts.
        target: the spread asked for on the unlabelled texts (> 0), in the scores' units.
        eps: added to the variances before the square root (> 0).

    Returns:
        () float32 loss.
    """
    fn = "disagreement_loss"
    _check_scores(fn, labelled)
    _check_scores(fn, unlabelled)
    if labelled.shape[0] != unlabelled.shape[0] or labelled.shape[0] < 2:
        raise ValueError(
            f"{fn}: labelled {tuple(labelled.shape)} and unlabelled {tuple(unlabelled.shape)} need the same "
            "number of members K >= 2 on dim 0"
        )
    check_number(fn, "target", target, low=0.0, low_inclusive=False)
    check_number(fn, "eps", eps, low=0.0, low_inclusive=False)
    labelled, unlabelled = as_float(labelled), as_float(unlabelled)  # (K, N), (K, U)
    agree = (labelled.var(dim=0, correction=0) + eps).sqrt().mean()  # ()
    spread = (unlabelled.var(dim=0, correction=0) + eps).sqrt()  # (U,)
    disagree = torch.relu(target - spread).mean()  # ()
    return agree + disagree

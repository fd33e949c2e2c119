"""Last-layer uncertainty of a reward model: how far a response's features lie from the ones it was fit on.

A reward model is linear in its last hidden state at the scored token, r(x) = w^T phi(x) + b. A linear head with
a Gaussian prior fit to features Phi (N, H) has a Gaussian posterior whose covariance is proportional to
(Phi^T Phi + lambda I)^-1, so the predictive spread of r(x) is proportional to the elliptical norm

    u(x) = sqrt(phi(x)^T (Phi^T Phi + lambda I)^-1 phi(x))

(Bayesian linear regression: Bishop 2006, "Pattern Recognition and Machine Learning", eq. 3.59; the confidence
width of linear bandits: Abbasi-Yadkori et al. 2011, "Improved Algorithms for Linear Stochastic Bandits",
Theorem 2). It is large where phi(x) points along directions the training features rarely took, whatever the
score there. Zhang et al. 2024 ("Overcoming Reward Overoptimization via Adversarial Policy Optimization with
Lightweight Uncertainty Estimation", arXiv:2403.05171, sec. 3) measure a reward model's uncertainty from its
last-layer embeddings so, in place of an ensemble: u(x) is the spread of infinitely many heads on one backbone,
drawn from that posterior.

Shapes: N training texts, B responses, H hidden size.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import check_number

__all__ = ["elliptical_width", "feature_precision"]


def feature_precision(features: torch.Tensor, ridge: float) -> torch.Tensor:
    """The ridge-regularised second-moment matrix of the training features, in float64.

        M = Phi^T Phi + ridge * I

    Args:
        features: (N, H) the last hidden states of the N training texts at their scored tokens.
        ridge: lambda > 0, the prior precision: it keeps M invertible where the features span fewer than H
            directions (the width there grows as 1 / sqrt(ridge)).

    Returns:
        (H, H) float64 symmetric positive definite matrix.
    """
    if features.dim() != 2 or features.shape[0] < 1:
        raise ValueError(f"feature_precision: `features` must be (N, H) with N >= 1, got shape {tuple(features.shape)}")
    check_number("feature_precision", "ridge", ridge, low=0.0, low_inclusive=False)
    phi = features.double()  # (N, H)
    return phi.T @ phi + ridge * torch.eye(phi.shape[1], dtype=torch.float64, device=phi.device)  # (H, H)


def elliptical_width(features: torch.Tensor, covariance: torch.Tensor) -> torch.Tensor:
    """Each response's elliptical norm under ``covariance`` (the inverse of :func:`feature_precision`).

        u_b = sqrt(phi_b^T C phi_b)

    Args:
        features: (B, H) the responses' last hidden states at their scored tokens.
        covariance: (H, H) C = M^-1, symmetric positive semi-definite.

    Returns:
        (B,) float32 widths (>= 0; round-off below 0 is clamped).
    """
    if features.dim() != 2 or covariance.shape != (features.shape[1], features.shape[1]):
        raise ValueError(
            f"elliptical_width: `features` (B, H) and `covariance` (H, H) must agree, got {tuple(features.shape)}"
            f" and {tuple(covariance.shape)}"
        )
    phi = features.double()  # (B, H)
    quadratic = ((phi @ covariance.to(phi)) * phi).sum(dim=-1)  # (B,)
    return quadratic.clamp(min=0.0).sqrt().float()  # (B,)

"""The best-of-n frontier: the gold reward of best-of-n sampling from the SFT policy against its KL.

Best-of-n (BoN) samples n responses and keeps the one the proxy reward model scores highest. Its KL to the
sampling policy is analytic, ``log n - (n - 1) / n`` nats (Stiennon et al. 2020, arXiv 2009.01325,
appendix G.3; the bound Gao et al. 2022, arXiv 2210.10760, sec. 2 plot every method against), so it is the
reference curve of the gold-vs-KL plot: a trained policy above it buys more gold per nat than reranking.

Its expected gold comes from N >= n samples per prompt without drawing subsets: with the N samples sorted
by proxy score, the i-th smallest (1-based) is the best of a uniformly drawn n-subset with probability
``C(i - 1, n - 1) / C(N, n)`` (Nakano et al. 2021, arXiv 2112.09332, appendix; the unbiased estimator Gao
et al. 2022 use, sec. 3.1). Ties in the proxy score are broken by sample order.

Shapes: G prompts, N samples per prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["best_of_n_gold", "best_of_n_kl", "distance_to_frontier", "frontier", "plot_frontier", "sample_frontier"]


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || policy) in nats: ``log n - (n - 1) / n`` (0 for n = 1)."""
    if n < 1:
        raise ValueError(f"best_of_n_kl: n must be >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def best_of_n_gold(proxy: torch.Tensor, gold: torch.Tensor, n: int) -> torch.Tensor:
    """Expected gold of best-of-n by ``proxy``, per prompt, from N >= n samples each: (G, N) -> (G,).

    Args:
        proxy: (G, N) proxy scores (what best-of-n ranks by).
        gold: (G, N) gold rewards of the same samples.
        n: samples per best-of-n draw, 1 <= n <= N.
    """
    if proxy.shape != gold.shape or proxy.dim() != 2:
        raise ValueError(f"best_of_n_gold: proxy {tuple(proxy.shape)} and gold {tuple(gold.shape)} must be (G, N)")
    N = proxy.shape[1]
    if not 1 <= n <= N:
        raise ValueError(f"best_of_n_gold: n must be in [1, {N}], got {n}")
    order = torch.sort(proxy.double(), dim=1, stable=True).indices  # (G, N) ascending
    sorted_gold = torch.gather(gold.double(), 1, order)  # (G, N)
    i = torch.arange(1, N + 1, dtype=torch.float64)  # (N,) 1-based ranks
    # log C(i-1, n-1) - log C(N, n), 0 weight where i - 1 < n - 1
    log_weights = _log_comb(i - 1, n - 1) - _log_comb(torch.tensor(float(N)), n)  # (N,)
    weights = torch.where(i >= n, log_weights.exp(), 0.0)  # (N,), sums to 1
    return (sorted_gold * weights).sum(dim=1).float()  # (G,)


def _log_comb(a: torch.Tensor, b: int) -> torch.Tensor:
    """log C(a, b) for a >= b (elementwise; -inf-free garbage where a < b, masked by the caller)."""
    a = a.double().clamp(min=b)
    return torch.lgamma(a + 1) - math.lgamma(b + 1) - torch.lgamma(a - b + 1)


def frontier(proxy: torch.Tensor, gold: torch.Tensor, ns: Sequence[int] | None = None) -> list[dict]:
    """``{n, kl, gold_mean}`` of best-of-n for each n in ``ns`` (default 1, 2, 4, ..., N), over (G, N) samples."""
    N = proxy.shape[1]
    ns = list(ns) if ns is not None else [2**k for k in range(int(math.log2(N)) + 1)]
    return [{"n": n, "kl": best_of_n_kl(n), "gold_mean": best_of_n_gold(proxy, gold, n).mean().item()} for n in ns]


def distance_to_frontier(points: Sequence[dict], kl: float, gold: float) -> float | None:
    """``gold`` minus the frontier's gold at ``kl`` (linear in sqrt(KL) between its points, Gao et al.'s
    axis); None beyond the frontier's last KL (no extrapolation)."""
    xs = [math.sqrt(p["kl"]) for p in points]
    ys = [p["gold_mean"] for p in points]
    x = math.sqrt(max(kl, 0.0))
    if x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return gold - (y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1)
    return gold - ys[0]


def sample_frontier(
    sft_dir: str | Path, reward_model_dir: str | Path, prompts: Sequence[str], generation: Any, n_max: int = 64,
    batch_size: int = 256,
) -> list[dict]:  # fmt: skip
    """The best-of-n frontier of the SFT policy: ``n_max`` samples per prompt scored by the proxy reward
    model and the gold reward, then :func:`frontier` for n = 1, 2, 4, ..., ``n_max``."""
    from lit_rlhf.demo import evaluate

    repeated = [p for p in prompts for _ in range(n_max)]
    rows = evaluate.sample_policy(
        sft_dir, repeated, generation, reference_dir=sft_dir, reward_model_dir=reward_model_dir,
        batch_size=batch_size, seed=1,
    )  # fmt: skip
    proxy = torch.tensor([r["proxy"] for r in rows]).view(len(prompts), n_max)  # (G, N)
    gold = torch.tensor([r["gold"] for r in rows]).view(len(prompts), n_max)  # (G, N)
    return frontier(proxy, gold)


def plot_frontier(points: Sequence[dict], policies: dict[str, Sequence[tuple[float, float]]], path: Path) -> None:
    """Gold against sqrt(KL to the SFT policy): the best-of-n frontier and each policy's (KL, gold) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.plot([math.sqrt(p["kl"]) for p in points], [p["gold_mean"] for p in points], "k--o", ms=3,
            label=f"best-of-n of SFT by the proxy RM (n = 1..{points[-1]['n']})")  # fmt: skip
    for name, xy in policies.items():
        ax.plot([math.sqrt(max(k, 0.0)) for k, _ in xy], [g for _, g in xy], "o", ms=6, label=name)
    ax.set_xlabel("sqrt(KL to the SFT policy), sqrt(nats)")
    ax.set_ylabel("gold reward mean")
    ax.set_title("Gold reward against KL: trained policies and the best-of-n frontier")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

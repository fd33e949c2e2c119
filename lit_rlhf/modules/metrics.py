"""Metric bookkeeping of the online-RL modules: named running means and maxima reduced across ranks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchmetrics import MaxMetric, MeanMetric, MinMetric

__all__ = ["MetricGroup", "accumulate_stats", "row_weight"]


def row_weight(count: int | torch.Tensor) -> float:
    """``count`` as the float ``batch_size`` of ``self.log(..., sync_dist=True)``: a row-weighted mean over ranks.

    Lightning accumulates an epoch mean's weights in an integer tensor and averages it over the ranks in place,
    which floors it: with unequal rows per rank (a held-out split that does not divide, rows dropped) every such
    mean came out inflated by (sum / world) / floor(sum / world). A float weight keeps the accumulator float
    (Lightning-AI/pytorch-lightning#21859, `_ResultMetric.compute` in
    ``lightning/pytorch/trainer/connectors/logger_connector/result.py``).
    """
    return float(count)


class MetricGroup(torch.nn.Module):
    """Named running means (maxima for ``*_max``, minima for ``*_min``) as torchmetrics, so values reduce
    across ranks."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        kinds = {"_max": MaxMetric, "_min": MinMetric}
        self.metrics = torch.nn.ModuleDict(
            {n.replace("/", "__"): kinds.get(n[-4:], MeanMetric)() for n in names}
        )

    def update(self, values: dict[str, torch.Tensor | float], weight: float = 1.0) -> None:
        for name, value in values.items():
            key = name.replace("/", "__")
            if key not in self.metrics:
                declared = sorted(k.replace("__", "/") for k in self.metrics)
                raise KeyError(f"metric {name!r} is not declared (declared: {declared}); declare it with the others")
            metric = self.metrics[key]
            value = torch.as_tensor(value, dtype=torch.float32).detach()
            if isinstance(metric, MeanMetric):
                metric.update(value, weight)
            else:
                metric.update(value)

    def compute_and_reset(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, metric in self.metrics.items():
            if metric.update_called:
                out[key.replace("__", "/")] = metric.compute()
            metric.reset()
        return out


def accumulate_stats(
    total: dict[str, torch.Tensor], part: dict[str, torch.Tensor], weight: torch.Tensor
) -> None:
    """Fold a micro-batch's loss stats into the minibatch's: weighted means, the max of maxima and the min
    of minima."""
    for key, value in part.items():
        if key.endswith("_max"):
            total[key] = torch.maximum(total[key], value) if key in total else value
        elif key.endswith("_min"):
            total[key] = torch.minimum(total[key], value) if key in total else value
        else:
            total[key] = total.get(key, 0.0) + value * weight

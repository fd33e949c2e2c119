"""Metric bookkeeping of the online-RL modules: named running means and maxima reduced across ranks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchmetrics import MaxMetric, MeanMetric

__all__ = ["MetricGroup", "accumulate_stats"]


class MetricGroup(torch.nn.Module):
    """Named running means (and maxima for ``*_max``) as torchmetrics, so values reduce across ranks."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.metrics = torch.nn.ModuleDict(
            {n.replace("/", "__"): MaxMetric() if n.endswith("_max") else MeanMetric() for n in names}
        )

    def update(self, values: dict[str, torch.Tensor | float], weight: float = 1.0) -> None:
        for name, value in values.items():
            metric = self.metrics[name.replace("/", "__")]
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
    """Fold a micro-batch's loss stats into the minibatch's: weighted means, and the max of maxima."""
    for key, value in part.items():
        if key.endswith("_max"):
            total[key] = torch.maximum(total[key], value) if key in total else value
        else:
            total[key] = total.get(key, 0.0) + value * weight

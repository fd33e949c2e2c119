"""Metric bookkeeping of the online-RL modules: named running means and maxima reduced across ranks."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torchmetrics import MaxMetric, MeanMetric, MinMetric

__all__ = ["MetricGroup", "accumulate_stats"]


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

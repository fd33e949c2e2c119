"""Modules that fail on purpose, for subprocess tests of the CLI (imported by ``class_path``)."""

from __future__ import annotations

import torch

from lit_rlhf.modules import RewardModelModule


class NaNAtEndRewardModel(RewardModelModule):
    """A reward model whose first weight turns NaN when training ends (before the export)."""

    def on_train_end(self) -> None:
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")

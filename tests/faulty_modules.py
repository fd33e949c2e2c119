"""Modules that fail on purpose, for subprocess tests of the CLI (imported by ``class_path``)."""

from __future__ import annotations

import os
import signal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lit_rlhf.modules import RewardModelModule


class NaNAtEndRewardModel(RewardModelModule):
    """A reward model whose first weight turns NaN when training ends (before the export)."""

    def on_train_end(self) -> None:
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] = float("nan")


class SigtermAt(Callback):
    """Sends this process SIGTERM as training batch ``batch`` (1-based, counted in this fit) begins, as a
    scheduler would at any moment; Lightning finishes that step, then stops."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)

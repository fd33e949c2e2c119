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
    """Sends this process SIGTERM in the middle of training step ``step`` (before its backward), as a
    scheduler would; Lightning finishes that step, then stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

"""Modules that fail on purpose, for subprocess tests of the CLI (imported by ``class_path``)."""

from __future__ import annotations

import builtins
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


class RaiseAt(Callback):
    """Raises ``exception`` (a builtin's name) at the ``call``-th time (1-based) that ``hook`` runs inside
    training batch ``batch`` (1-based, counted in this fit): a reward service failing in a rollout, memory
    running out in an update, Ctrl-C (``KeyboardInterrupt``). ``hook``: a Lightning callback hook
    (``on_before_backward`` runs after the rollout and before each optimiser step's backward;
    ``on_validation_batch_start`` in a validation inside the fit)."""

    def __init__(self, batch: int, hook: str = "on_before_backward", call: int = 1, exception: str = "RuntimeError") -> None:
        self.batch, self.hook, self.call, self.exception = batch, hook, call, exception
        self.batches = self.calls = 0
        setattr(self, hook, self._maybe_raise)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.batches += 1
        self.calls = 0

    def _maybe_raise(self, *args, **kwargs) -> None:
        if self.batches != self.batch:
            return
        self.calls += 1
        if self.calls == self.call:
            raise getattr(builtins, self.exception)(f"RaiseAt: {self.hook} call {self.call} of training batch {self.batch}")

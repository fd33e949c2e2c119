"""Progress reporting that works in a terminal and in a log file, and a quiet model summary.

- :class:`LitProgressBar`: Lightning's TQDM bar without the ``v_num`` entry; when stdout is not a
  terminal (a job log, ``> file``) it draws no bars but prints a plain progress line every
  ``log_every_s`` seconds and at the end of each epoch and validation.
- :class:`RolloutProgressBar`: for online modules (one training batch = one rollout) it counts
  ``rollouts_done`` of ``max_rollouts`` with score, KL and s/rollout, and says why fitting stopped.
- :class:`QuietModelSummary`: the model summary without the FLOPs column and ``Total FLOPs: 0`` when
  Lightning could not count FLOPs (no ``example_input_array``).

The CLI adds them (see :func:`default_callbacks`); a plain ``Trainer`` user passes them in ``callbacks``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from typing_extensions import override


def _fmt(value: Any) -> str:
    value = float(value)
    return f"{value:.4g}"


class LitProgressBar(TQDMProgressBar):
    """TQDM progress bar without ``v_num`` that prints progress lines in non-TTY output.

    Args:
        refresh_rate: batches between bar updates in a terminal.
        log_every_s: seconds between progress lines when stdout is not a terminal (0 = every batch).
        tty: force terminal (True) or log-file (False) behaviour; None detects ``sys.stdout.isatty()``.
    """

    def __init__(self, refresh_rate: int = 1, log_every_s: float = 30.0, tty: bool | None = None) -> None:
        super().__init__(refresh_rate=refresh_rate)
        if log_every_s < 0:
            raise ValueError(f"log_every_s must be >= 0, got {log_every_s}")
        self.log_every_s = log_every_s
        self.tty = tty
        self._last_line = -math.inf
        self._start = time.monotonic()
        self._epoch_total: int | float | None = None

    @property
    def is_tty(self) -> bool:
        return sys.stdout.isatty() if self.tty is None else self.tty

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: in the run folder's name already
        return items

    # In a log file tqdm's carriage-return redraws are noise: the bars are dummies, lines are printed.
    @override
    def init_sanity_tqdm(self) -> Tqdm:
        return super().init_sanity_tqdm() if self.is_tty else Tqdm(disable=True)

    @override
    def init_train_tqdm(self) -> Tqdm:
        return super().init_train_tqdm() if self.is_tty else Tqdm(disable=True)

    @override
    def init_validation_tqdm(self) -> Tqdm:
        return super().init_validation_tqdm() if self.is_tty else Tqdm(disable=True)

    @override
    def init_test_tqdm(self) -> Tqdm:
        return super().init_test_tqdm() if self.is_tty else Tqdm(disable=True)

    def print_line(self, text: str, force: bool = False) -> None:
        """Print a progress line (non-TTY only), at most every ``log_every_s`` seconds unless ``force``."""
        now = time.monotonic()
        if self.is_tty or self.is_disabled or (not force and now - self._last_line < self.log_every_s):
            return
        self._last_line = now
        print(text, flush=True)

    def metrics_text(self, trainer: Trainer, pl_module: LightningModule, prefix: str = "") -> str:
        items = self.get_metrics(trainer, pl_module)
        return " ".join(
            f"{k}={_fmt(v) if isinstance(v, (int, float)) else v}" for k, v in items.items() if k.startswith(prefix)
        )

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = time.monotonic()

    @override
    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        # read once per epoch (a resumable sampler's length shrinks as it is consumed), capped by max_steps
        total = self.total_train_batches
        if trainer.max_steps and trainer.max_steps > 0 and total not in (None, math.inf):
            total = min(total, trainer.max_steps - trainer.global_step)
        self._epoch_total = total

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        n, total = batch_idx + 1, self._epoch_total
        total_text = "?" if total in (None, math.inf) else int(total)
        epochs = "" if trainer.max_epochs in (None, -1) else f"/{trainer.max_epochs}"
        self.print_line(
            f"epoch {trainer.current_epoch + 1}{epochs} batch {n}/{total_text} step {trainer.global_step}"
            f" ({time.monotonic() - self._start:.0f}s) {self.metrics_text(trainer, pl_module)}",
            force=n == total,
        )

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not trainer.sanity_checking:
            # the step the loggers file the scalars under; for an online module, the rollouts it follows
            rollouts = getattr(pl_module, "rollouts_done", None)
            step = trainer.fit_loop.epoch_loop._batches_that_stepped  # as samples.logger_step reads it
            when = f"after rollout {rollouts}" if rollouts is not None else f"at step {step}"
            self.print_line(f"validation {when}: {self.metrics_text(trainer, pl_module, 'val/')}", force=True)


class RolloutProgressBar(LitProgressBar):
    """Progress of an online module: ``rollouts_done`` / ``hparams.max_rollouts``, score, KL, s/rollout.

    Reads from the module: ``rollouts_done`` (int, rollouts finished), ``hparams.max_rollouts`` (None =
    the trainer's ``max_steps`` decides) and the progress-bar values it logs as ``score`` and ``kl``.
    """

    def total_rollouts(self, trainer: Trainer, pl_module: LightningModule) -> int | None:
        limit = getattr(pl_module.hparams, "max_rollouts", None)
        if limit is not None:
            return int(limit)
        return trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None

    def rollout_postfix(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, str]:
        metrics = self.get_metrics(trainer, pl_module)
        post = {k: _fmt(metrics[k]) for k in ("score", "kl") if k in metrics}
        done = pl_module.rollouts_done
        if done:
            post["s/rollout"] = f"{(time.monotonic() - self._start) / done:.2f}"
        return post

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=self.total_rollouts(trainer, pl_module))
        bar.n = pl_module.rollouts_done
        bar.unit = "rollout"
        bar.set_description("Rollouts")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        done, total = pl_module.rollouts_done, self.total_rollouts(trainer, pl_module)
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = done
            bar.set_postfix(self.rollout_postfix(trainer, pl_module))  # refreshes the bar
        post = " ".join(f"{k}={v}" for k, v in self.rollout_postfix(trainer, pl_module).items())
        self.print_line(f"rollout {done}/{total if total is not None else '?'} {post}", force=done == total)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        total = getattr(pl_module.hparams, "max_rollouts", None)
        if total is not None and pl_module.rollouts_done >= total:
            rank_zero_info(f"`Trainer.fit` stopped: max_rollouts={total} reached.")


class QuietModelSummary(ModelSummary):
    """``ModelSummary`` that leaves out FLOPs when Lightning counted none (``Total FLOPs: 0``)."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            return ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
        columns = [col for col in summary_data if col[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns)
        rank_zero_info("\n" + "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops")))


def default_callbacks(module: LightningModule, trainer_config: dict[str, Any]) -> list[Callback]:
    """The progress bar and model summary the CLI adds unless the config brings its own or turns them off.

    Online modules (they have ``rollouts_done``) get :class:`RolloutProgressBar`, others
    :class:`LitProgressBar`; both get :class:`QuietModelSummary`.
    """
    given = trainer_config.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    extra: list[Callback] = []
    if trainer_config.get("barebones"):  # Lightning refuses a progress bar or a model summary there
        return extra
    if trainer_config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
        extra.append(RolloutProgressBar() if hasattr(module, "rollouts_done") else LitProgressBar())
    if trainer_config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in given):
        extra.append(QuietModelSummary())
    return extra

"""The ``lit-rlhf`` command: LightningCLI over every module and DataModule of the project.

    lit-rlhf fit --config configs/rm_tiny.yaml
    lit-rlhf fit --config configs/ppo_tiny.yaml --trainer.max_steps 8
    lit-rlhf fit --config configs/rm_tiny.yaml --print_config

Subclass mode: ``model`` and ``data`` are ``class_path`` + ``init_args``, so one entry point runs
:class:`SFTModule`, :class:`RewardModelModule`, :class:`PPOModule` (or a user's own subclasses).
TensorBoard is the default logger, under ``runs/``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "runs", "name": "lit_rlhf", "default_hp_metric": False},
}


# Messages a user cannot act on (they advertise services or restate what the run obviously does).
QUIET_INFO_PREFIXES = (
    "💡 Tip:",
    "Loading `train_dataloader` to estimate number of stepping batches",
    "Trainer already configured with model summary callbacks",  # the CLI's own QuietModelSummary
)
QUIET_WARNINGS = (
    # lightning's own use of a torch API deprecated in torch 2.10+
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
)
# PPO-style modules keep their frozen reference/reward models in eval mode on purpose.
EVAL_MODE_WARNING = r"Found \d+ module\(s\) in eval mode at the start of training"


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(QUIET_INFO_PREFIXES)


def quiet_lightning(module: LightningModule | None = None) -> None:
    """Silence Lightning's advertising tips and notices the user cannot act on; real warnings stay.

    With ``module`` an online module (it has ``rollouts_done``; its frozen models are in eval mode by
    design), also the "Found N module(s) in eval mode" warning.
    """
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in log.filters):
            log.addFilter(_DropMessages())
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    if not sys.stderr.isatty():  # in a log file, carriage-return bars of datasets/transformers are noise
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    if module is not None and getattr(module, "frozen_models_in_eval_mode", hasattr(module, "rollouts_done")):
        warnings.filterwarnings("ignore", message=EVAL_MODE_WARNING)


class LitRLHFCLI(LightningCLI):
    """LightningCLI with lit_rlhf's defaults (TensorBoard logger, progress bar, overwritable config).

    It adds :class:`~lit_rlhf.progress.RolloutProgressBar` (online modules) or
    :class:`~lit_rlhf.progress.LitProgressBar` and :class:`~lit_rlhf.progress.QuietModelSummary`
    unless the config brings its own or disables them, and silences Lightning's tips (:func:`quiet_lightning`).
    """

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        from lit_rlhf.progress import default_callbacks

        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        quiet_lightning(self.model)
        if self.subcommand in ("validate", "test", "predict"):  # no checkpoints are written: moot
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        kwargs["callbacks"] = given + default_callbacks(self.model, config)
        return super().instantiate_trainer(**kwargs)


def run_cli(args: list[str] | None = None) -> LitRLHFCLI:
    """Run the CLI on ``args`` (default: ``sys.argv``) and return it (its ``trainer``, ``model``, ``datamodule``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_lightning()  # before the Trainer's connectors log their tips
    import lit_rlhf.data  # noqa: F401  (registers the DataModules for class_path short names)
    import lit_rlhf.modules  # noqa: F401

    return LitRLHFCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"logger": DEFAULT_LOGGER},
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,
    )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point of ``lit-rlhf``."""
    run_cli(args)


if __name__ == "__main__":
    main()

"""The ``lit-rlhf`` command: LightningCLI over every module and DataModule of the project.

    lit-rlhf fit --config configs/rm_tiny.yaml
    lit-rlhf fit --config configs/ppo_tiny.yaml --trainer.max_steps 8
    lit-rlhf fit --config configs/rm_tiny.yaml --print_config

Subclass mode: ``model`` and ``data`` are ``class_path`` + ``init_args``, so one entry point runs
:class:`SFTModule`, :class:`RewardModelModule`, :class:`PPOModule` (or a user's own subclasses).
TensorBoard is the default logger, under ``runs/``.
"""

from __future__ import annotations

import os

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "runs", "name": "lit_rlhf", "default_hp_metric": False},
}


class LitRLHFCLI(LightningCLI):
    """LightningCLI with lit_rlhf's defaults (TensorBoard logger, progress bar, overwritable config)."""


def run_cli(args: list[str] | None = None) -> LitRLHFCLI:
    """Run the CLI on ``args`` (default: ``sys.argv``) and return it (its ``trainer``, ``model``, ``datamodule``)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
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

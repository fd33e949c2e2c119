"""The ``lit-rlhf`` command: LightningCLI over every module and DataModule of the project.

    lit-rlhf fit --config configs/rm_tiny.yaml
    lit-rlhf fit --config configs/ppo_tiny.yaml --trainer.max_steps 8
    lit-rlhf fit --config configs/rm_tiny.yaml --print_config

Subclass mode: ``model`` and ``data`` are ``class_path`` + ``init_args``, so one entry point runs
:class:`SFTModule`, :class:`RewardModelModule`, :class:`PPOModule` (or a user's own subclasses).
TensorBoard is the default logger, under ``runs/``.

Reliability (README, "Reliability"): every fit gets a :class:`~lit_rlhf.callbacks.SigtermCheckpoint`
(SIGTERM saves a resumable checkpoint and exits 143); ``--ckpt_path`` is checked first (a damaged file is
named with what is wrong with it, ``last`` with nothing to resume from is an error); on resume the
checkpoint's model hyper-parameters replace the config file's (LightningCLI's rule) but ``--model...``
options given on the command line are applied again on top of them, so they win.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import sys
import warnings
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lit_rlhf.callbacks import SigtermCheckpoint
from lit_rlhf.checkpoints import CheckpointFileError, load_checkpoint_file
from lit_rlhf.modules.online_migration import migrate_checkpoint_hparams, moved_hint

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


# ``ckpt_path`` values that the Trainer resolves itself (not file names)
SPECIAL_CKPT_PATHS = ("last", "best", "hpc")


def model_flags(args: list[str]) -> list[str]:
    """The ``--model...`` options of a command line, each with its value, in their order."""
    flags, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--model" or arg.startswith(("--model.", "--model=")):
            step = 1 if "=" in arg else 2
            flags += args[i : i + step]
            i += step
        else:
            i += 1
    return flags


MOVED_MARKER = "the online modules' flat arguments moved into settings groups:"
# where jsonargparse's messages name a key it does not accept (config file, command line)
_UNKNOWN_KEY_PATTERNS = (
    r"Option '([\w.]+)' is not accepted", r"NestedArg\(key='([\w.]+)'", r"Key '([\w.]+)' is not expected",
    r"unrecognized arguments: --([\w.]+)",
)  # fmt: skip


def moved_keys_message(message: str) -> str | None:
    """For a parse error about keys of the earlier flat layout of the online modules, one message that
    names each key's new place (None when the error is about something else)."""
    patterns = (*_UNKNOWN_KEY_PATTERNS, r"'(\w+)' is now")  # (the latter: a nested parser's rewritten error)
    keys = list(dict.fromkeys(k for pattern in patterns for k in re.findall(pattern, message)))
    keys = [k.removeprefix("model.init_args.").removeprefix("model.") for k in keys]
    module = re.search(r"class_path '[\w.]*\.(\w+)'", message)
    module = module.group(1) if module else None
    if not any(moved_hint(k, module) for k in keys):
        return None
    given = re.search(r"Given value: (\{.*\})\s*$", message, flags=re.M)
    try:  # every flat key of the config's init_args, not only the first one jsonargparse names
        init_args = ast.literal_eval(given.group(1)).get("init_args", {}) if given else {}
        keys = list(dict.fromkeys([*keys, *init_args]))
    except (ValueError, SyntaxError, AttributeError):
        pass
    hints = [h for h in (moved_hint(k, module) for k in keys) if h]
    return (
        f"{MOVED_MARKER} " + "; ".join(hints)
        + " (in YAML e.g. `update: {epochs: 2}`, on the command line `--model.init_args.update.epochs 2`)"
    )


class LitRLHFArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors about moved arguments say where they went."""

    def error(self, message: str, ex: Exception | None = None):
        return super().error(moved_keys_message(message) or message, ex)


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
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand == "fit" and not any(isinstance(c, SigtermCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(SigtermCheckpoint())
        return trainer

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        self._command_line = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path``, load the checkpoint's model hyper-parameters, re-apply ``--model`` options.

        Replaces LightningCLI's version (which loads the file unchecked and lets the checkpoint's values
        override the command line) at the same point of parsing.
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not ckpt_path or str(ckpt_path) in SPECIAL_CKPT_PATHS:
            return
        try:
            checkpoint = load_checkpoint_file(ckpt_path)
        except CheckpointFileError as err:
            self.parser.error(f"--ckpt_path: {err}")
        hparams = dict((checkpoint or {}).get("hyper_parameters", {}))
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        class_path = hparams.pop("_class_path", None)
        if class_path is not None:
            hparams = migrate_checkpoint_hparams(class_path, hparams, str(ckpt_path))
            hparams = {"class_path": class_path, "dict_kwargs": hparams}
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        flags = model_flags(self._command_line)
        if flags:
            self.config = self.parser.parse_args([subcommand, *flags], namespace=self.config)

    def before_fit(self) -> None:
        """``--ckpt_path last`` with no last checkpoint is an error (Lightning would warn and start afresh)."""
        if str(self.config.fit.get("ckpt_path")) != "last":
            return
        folders = {c.dirpath for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)}
        found = [
            f for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
            for f in c._find_last_checkpoints(self.trainer)
        ]  # fmt: skip
        if not found:
            where = ", ".join(str(f) for f in folders if f) or "no ModelCheckpoint folder with a fixed dirpath"
            raise FileNotFoundError(
                f"--ckpt_path last: no last*.ckpt to resume from ({where}). Give ModelCheckpoint a fixed"
                " dirpath and save_last: true (as the shipped configs do), or pass a checkpoint file"
            )


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
        parser_class=LitRLHFArgumentParser,
        args=args,
    )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point of ``lit-rlhf``."""
    run_cli(args)


if __name__ == "__main__":
    main()

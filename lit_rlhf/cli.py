"""The ``lit-rlhf`` command: LightningCLI over every module and DataModule of the project.

    lit-rlhf fit --config configs/rm_tiny.yaml
    lit-rlhf fit --config configs/ppo_tiny.yaml --trainer.max_steps 8
    lit-rlhf fit --config configs/rm_tiny.yaml --print_config

Subclass mode: ``model`` and ``data`` are ``class_path`` + ``init_args``, so one entry point runs
:class:`SFTModule`, :class:`RewardModelModule`, :class:`PPOModule` (or a user's own subclasses).
TensorBoard is the default logger, under ``runs/``.

Reliability (README, "Reliability"): every fit gets a :class:`~lit_rlhf.callbacks.SigtermCheckpoint`
(SIGTERM saves a resumable checkpoint and exits 143), a :class:`~lit_rlhf.fault_checkpoint.FaultCheckpoint`
(an exception in the fit saves the state of the last finished step) and a
:class:`~lit_rlhf.callbacks.CheckpointFolderCheck` (checkpoint folders that cannot be written are refused before the first step). ``--ckpt_path`` is checked
before anything runs: a damaged file is named with what is wrong with it (``last`` is resolved the way
Lightning does, newest ``last*.ckpt``, and that file checked the same way; ``last`` with nothing to resume
from is an error), and so is a checkpoint of another module class than the config's. On resume from a file
the checkpoint's model hyper-parameters replace the config file's (LightningCLI's rule) but ``--model...``
options given on the command line are applied on top of them, so they win; hyper-parameters that cannot
change on resume (:data:`FIXED_ON_RESUME`, e.g. ``generation.num_samples``) are compared with the
checkpoint's and a change is refused.

Errors with the project's own messages (``ValueError``/``TypeError``/``OSError`` raised by lit_rlhf code
while the config's classes are built, or while a subcommand sets up: data, dataloaders, fit-start checks)
end the command with one ``error: <message>`` line and exit status 2; ``LIT_RLHF_DEBUG=1`` shows the full
traceback instead. A missing local folder that a shipped config writes (an ``HFExport`` ``dirpath``) is
named with that config.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
import warnings
from typing import Any, NoReturn

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lit_rlhf.callbacks import CheckpointFolderCheck, SigtermCheckpoint, check_output_folder
from lit_rlhf.checkpoints import CheckpointFileError, load_checkpoint_file
from lit_rlhf.cli_errors import (
    DEBUG_ENV,
    fail,
    fail_on_project_error,
    in_setup_hook,
    lightning_misconfiguration_message,
    moved_keys_message,
    nested_field_message,
)
from lit_rlhf.cli_resume import FIXED_ON_RESUME, CheckpointInfo, _import_class, find_last_checkpoint
from lit_rlhf.fault_checkpoint import FaultCheckpoint
from lit_rlhf.process_groups import release_process_groups

__all__ = ["DEBUG_ENV", "FIXED_ON_RESUME", "LitRLHFCLI", "main", "moved_keys_message", "run_cli"]

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


def split_model_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, the ``--model...`` options each with its value), both in their order."""
    others, flags, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--model" or arg.startswith(("--model.", "--model=")):
            step = 1 if "=" in arg else 2
            flags += args[i : i + step]
            i += step
        else:
            others.append(arg)
            i += 1
    return others, flags


def null_fields_as_json(args: list[str]) -> list[str]:
    """``--model.init_args.<group>.<field> null`` as ``--model.init_args.<group> '{"<field>": null}'``.

    jsonargparse hands a nested field of a subclass's argument its value as the text ``'None'`` (a float field
    such as ``kl.target`` then refuses it); the JSON form of the group sets that field to None and keeps the
    group's others.
    """
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if "=" in arg:
            (flag, value), step = arg.split("=", 1), 1
        else:
            flag, value, step = arg, args[i + 1] if i + 1 < len(args) else None, 2
        prefix = next((p for p in ("--model.init_args.", "--model.") if flag.startswith(p)), None)
        path = flag[len(prefix) :].split(".") if prefix else []
        if len(path) >= 2 and value == "null" and path[0] != "init_args":
            out += [prefix + ".".join(path[:-1]), json.dumps({path[-1]: None})]
            i += step
        else:
            out.append(arg)
            i += 1
    return out


def model_flags(args: list[str]) -> list[str]:
    """The ``--model...`` options of a command line, each with its value, in their order."""
    return split_model_flags(args)[1]


class LitRLHFArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose errors about moved arguments say where they went."""

    def error(self, message: str, ex: Exception | None = None):
        return super().error(moved_keys_message(message) or nested_field_message(message) or message, ex)


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
        if self.subcommand == "fit":
            for cls in (SigtermCheckpoint, FaultCheckpoint, CheckpointFolderCheck):
                if not any(isinstance(c, cls) for c in trainer.callbacks):
                    trainer.callbacks.append(cls())
        return trainer

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        self._command_line = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        self._checkpoint: CheckpointInfo | None = None
        rewritten = null_fields_as_json(self._command_line)
        if isinstance(args, dict) or rewritten == self._command_line:
            return super().parse_arguments(parser, args)
        with warnings.catch_warnings():  # the rewritten sys.argv is given as args: not the mistake it warns of
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            super().parse_arguments(parser, rewritten)

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` and its module class, load its model hyper-parameters, ``--model`` options on top.

        Replaces LightningCLI's version (which loads the file unchecked, takes the checkpoint's class whatever
        the config says, and lets the checkpoint's values override the command line) at the same point of
        parsing. ``last`` (resolved only once the Trainer exists) is checked in :meth:`after_instantiate_classes`.
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
        if checkpoint is None:  # a sharded folder: the strategy reads it
            return
        self._checkpoint = info = CheckpointInfo.read(str(ckpt_path), checkpoint)
        del checkpoint
        model_class = self._config_model_class(subcommand)
        # an online module's checkpoint of the earlier flat layout: its arguments mapped into the groups
        self._checkpoint = info = info.migrated(info.class_path or model_class)
        if model_class is not None:
            problem = info.class_problem(model_class)
            if problem:
                fail(f"--ckpt_path: checkpoint {info.path}: {problem}; resume it with the config of the run that wrote it")
        if not info.hparams:
            return
        arguments = info.arguments
        model = {"class_path": info.class_path, "init_args": arguments} if info.class_path else {"init_args": arguments}
        others, flags = split_model_flags(self._command_line)
        if self._command_line and subcommand in others:
            # the whole command line again, the checkpoint's model between the config files and the --model
            # options (so those win); re-parsing only the options over the parsed namespace fails on Optional
            # dataclass arguments (jsonargparse: "Not a valid subclass of ModelSpec")
            try:  # YAML, as jsonargparse reads option values (JSON has no inf/nan)
                encoded = yaml.safe_dump(model, default_flow_style=True, width=2**31).strip()
            except yaml.YAMLError:
                encoded = None
            if encoded is not None:
                self.config = self.parser.parse_args([*others, f"--model={encoded}", *flags])
                return
        if info.class_path:
            model = {"class_path": info.class_path, "dict_kwargs": arguments}
        self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
        if flags:
            self.config = self.parser.parse_args([subcommand, *flags], namespace=self.config)

    def _config_model_class(self, subcommand: str) -> type | None:
        model = self.config[subcommand].get("model")
        class_path = model.get("class_path") if model is not None and hasattr(model, "get") else None
        return _import_class(class_path) if class_path else None

    def instantiate_classes(self) -> None:
        """Build the config's classes; an error with the project's message ends in one ``error:`` line."""
        try:
            super().instantiate_classes()
        except Exception as err:
            fail_on_project_error(err)
            raise

    def after_instantiate_classes(self) -> None:
        """Resolve and check ``--ckpt_path last``; refuse a checkpoint of another class or with changed
        :data:`FIXED_ON_RESUME` hyper-parameters."""
        subcommand = self.subcommand
        if subcommand is None:
            return
        self._check_logger_folders()
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if str(ckpt_path) == "last":
            path = find_last_checkpoint(self.trainer)
            if path is None:
                self._no_last_checkpoint()
            try:
                checkpoint = load_checkpoint_file(path)
            except CheckpointFileError as err:
                fail(f"--ckpt_path last: {err}")
            if checkpoint is not None:
                self._checkpoint = CheckpointInfo.read(path, checkpoint)
                del checkpoint
            self.config_init[subcommand]["ckpt_path"] = path  # the file checked here is the file loaded
        info, where = self._checkpoint, "--ckpt_path last" if str(ckpt_path) == "last" else "--ckpt_path"
        if info is None:
            return
        problem = info.class_problem(type(self.model), self.model)
        if problem:
            fail(f"{where}: checkpoint {info.path}: {problem}; resume it with the config of the run that wrote it")
        if subcommand == "fit":
            changed = info.changed_fixed_hparams(self.model)
            if changed:
                fail(f"{where}: checkpoint {info.path}: " + "; ".join(changed) + "; start a new run to change it")

    def _check_logger_folders(self) -> None:
        """A logger's ``save_dir`` that cannot be a writable folder (a file, no permission) is refused here, in
        one line, not by a traceback when the run writes its config there."""
        for logger in self.trainer.loggers:
            save_dir = getattr(logger, "save_dir", None)
            if save_dir is not None:
                try:
                    check_output_folder(save_dir, f"trainer.logger ({type(logger).__name__}) save_dir")
                except OSError as err:
                    fail(str(err))

    def _no_last_checkpoint(self) -> NoReturn:
        folders = {c.dirpath for c in self.trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)}
        where = ", ".join(str(f) for f in folders if f) or "no ModelCheckpoint folder with a fixed dirpath"
        fail(
            f"--ckpt_path last: no last*.ckpt to resume from ({where}). Give ModelCheckpoint a fixed"
            " dirpath and save_last: true (as the shipped configs do), or pass a checkpoint file"
        )

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; an error with the project's message from a setup hook (data, dataloaders, fit-start checks)
        ends in one ``error:`` line, errors from the steps themselves keep their traceback."""
        try:
            super()._run_subcommand(subcommand)
        except Exception as err:
            if in_setup_hook(err):
                fail_on_project_error(err)
            started = self.trainer.fit_loop.epoch_loop.batch_progress.total.started
            debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
            if isinstance(err, MisconfigurationException) and not started and not debug:  # a Trainer setting
                fail(lightning_misconfiguration_message(str(err)), debug_hint=True)
            in_ckpt_path = any(f.name == "_parse_ckpt_path" for f in traceback.extract_tb(err.__traceback__))
            if isinstance(err, ValueError) and in_ckpt_path and not debug:  # --ckpt_path best / hpc unresolved
                fail(f"--ckpt_path: {' '.join(str(err).split())}", debug_hint=True)
            raise

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        """LightningCLI's subcommands but ``predict``: no module here has a prediction step."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}


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
    """Console-script entry point of ``lit-rlhf``; after a subcommand that ran to its end, the process groups of
    a multi-process run are destroyed while the interpreter is whole (see :mod:`lit_rlhf.process_groups`).

    The working directory is put first on ``sys.path``, as ``python -m`` does, so that the modules a config
    names beside it (``reward_fn: my_rewards:style``, ``env: my_envs:Guess``) are found."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    run_cli(args)
    release_process_groups()


if __name__ == "__main__":
    main()

"""The ``lit-rlhf`` command: LightningCLI over every module and DataModule of the project.

    lit-rlhf fit --config configs/rm_tiny.yaml
    lit-rlhf fit --config configs/ppo_tiny.yaml --trainer.max_steps 8
    lit-rlhf fit --config configs/rm_tiny.yaml --print_config

Subclass mode: ``model`` and ``data`` are ``class_path`` + ``init_args``, so one entry point runs
:class:`SFTModule`, :class:`RewardModelModule`, :class:`PPOModule` (or a user's own subclasses).
TensorBoard is the default logger, under ``runs/``.

Reliability (README, "Reliability"): every fit gets a :class:`~lit_rlhf.callbacks.SigtermCheckpoint`
(SIGTERM saves a resumable checkpoint and exits 143) and a :class:`~lit_rlhf.callbacks.CheckpointFolderCheck`
(checkpoint folders that cannot be written are refused before the first step). ``--ckpt_path`` is checked
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

import ast
import dataclasses
import importlib
import inspect
import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import yaml
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

from lit_rlhf.callbacks import CheckpointFolderCheck, SigtermCheckpoint
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


def model_flags(args: list[str]) -> list[str]:
    """The ``--model...`` options of a command line, each with its value, in their order."""
    return split_model_flags(args)[1]


# Model hyper-parameters (dotted paths into ``hparams``) that a resumed fit may not change, with why. An
# online module may add its own in a ``fixed_on_resume`` class attribute (a mapping or a sequence of paths).
FIXED_ON_RESUME: dict[str, str] = {
    "generation.num_samples": (
        "K, the responses sampled per prompt: the saved run's rollouts, prompt batches and group statistics"
        " are laid out for its K"
    ),
}

# Set to 1 for the full traceback instead of one ``error:`` line.
DEBUG_ENV = "LIT_RLHF_DEBUG"
USER_ERROR_TYPES = (ValueError, TypeError, OSError)
PROJECT_DIR = Path(__file__).resolve().parent
# Hooks that run before the first step of a subcommand: project errors from them are setup errors.
SETUP_HOOKS = frozenset(
    {
        "setup", "prepare_data", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
        "configure_model", "configure_optimizers", "on_fit_start", "on_train_start", "on_validation_start",
        "on_test_start", "on_predict_start", "on_load_checkpoint", "load_state_dict",
    }
)  # fmt: skip


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from (``__cause__``, else unsuppressed ``__context__``)."""
    found: list[BaseException] = []
    while err is not None and all(err is not e for e in found):
        found.append(err)
        err = err.__cause__ if err.__cause__ is not None else (None if err.__suppress_context__ else err.__context__)
    return found


def _raised_in_project(err: BaseException) -> bool:
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return PROJECT_DIR in Path(tb.tb_frame.f_code.co_filename).resolve().parents


def project_error(err: BaseException) -> BaseException | None:
    """The outermost exception of ``err``'s chain that lit_rlhf code raised with its own message
    (``ValueError``, ``TypeError`` or ``OSError``), or None: the error is not the project's."""
    return next((e for e in _chain(err) if isinstance(e, USER_ERROR_TYPES) and _raised_in_project(e)), None)


def in_setup_hook(err: BaseException) -> bool:
    """Whether ``err`` (or one it was raised from) passed through a hook of :data:`SETUP_HOOKS`."""
    return any(frame.name in SETUP_HOOKS for e in _chain(err) for frame in traceback.extract_tb(e.__traceback__))


def config_folders() -> list[Path]:
    """Where shipped configs are looked for: ``configs/`` of the working directory and of the checkout."""
    folders = [Path.cwd() / "configs", PROJECT_DIR.parent / "configs"]
    return list(dict.fromkeys(f.resolve() for f in folders if f.is_dir()))


def config_writing(folder: str) -> Path | None:
    """The shipped config whose ``HFExport`` writes ``folder`` or a folder holding it (top-level configs
    first), or None."""
    target = os.path.normpath(folder)
    for root in config_folders():
        for path in sorted(root.rglob("*.yaml"), key=lambda p: (len(p.relative_to(root).parts), str(p))):
            try:
                config = yaml.safe_load(path.read_text()) or {}
                callbacks = (config.get("trainer") or {}).get("callbacks") or []
            except (OSError, yaml.YAMLError, AttributeError):
                continue
            for entry in callbacks if isinstance(callbacks, list) else [callbacks]:
                if not isinstance(entry, Mapping) or not str(entry.get("class_path", "")).endswith("HFExport"):
                    continue
                dirpath = (entry.get("init_args") or {}).get("dirpath")
                written = os.path.normpath(str(dirpath)) if dirpath is not None else None
                if written is not None and (target == written or target.startswith(written + os.sep)):
                    return path  # the folder itself or one inside it (PPO's export/actor)
    return None


def missing_folder_hints(message: str) -> str:
    """Hints for quoted relative paths in ``message`` that do not exist but a shipped config writes."""
    hints = []
    for quoted in dict.fromkeys(re.findall(r"'([^'\s]+)'", message)):
        if os.path.isabs(quoted) or os.path.exists(quoted) or "/" not in quoted:
            continue
        writer = config_writing(quoted)
        if writer is not None:
            shown = os.path.relpath(writer) if not os.path.relpath(writer).startswith("..") else str(writer)
            hints.append(f"{quoted} is written by the HFExport of {shown}: run `lit-rlhf fit --config {shown}` first")
    return "".join(f" ({hint})" for hint in hints)


def fail(message: str, debug_hint: bool = False) -> NoReturn:
    """End the command with one ``error:`` line (exit status 2, as for a bad option)."""
    sys.stderr.write(f"error: {message}\n" + (f"(set {DEBUG_ENV}=1 for the traceback)\n" if debug_hint else ""))
    sys.stderr.flush()
    raise SystemExit(2)


def fail_on_project_error(err: BaseException) -> None:
    """``fail`` with the message of the project's error in ``err``'s chain; returns when there is none
    (or ``LIT_RLHF_DEBUG`` is set), so the caller re-raises ``err``."""
    found = project_error(err)
    if found is None or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        return
    message = str(found) or type(found).__name__
    if isinstance(found, OSError) and not isinstance(found, FileNotFoundError) and found.filename is not None:
        message = f"{found.strerror or message}: {found.filename}"
    fail(message + missing_folder_hints(message), debug_hint=True)


def _import_class(class_path: str) -> type | None:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_parameters(cls: type) -> set[str] | None:
    """Names ``cls(...)`` accepts, or None when it takes ``**kwargs`` it does not resolve. A ``**kwargs``
    passed on to the parent's ``__init__`` (the online modules: see ``OnlineRLModule``) adds the parent's
    names, and the online base's own ``**groups`` are its ``settings_groups``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - {"self"}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return names
        if klass.__name__ == "OnlineRLModule":
            return names | set(getattr(cls, "settings_groups", {}))
        if klass is LightningModule:
            break
    return None


def _unaccepted(cls: type, arguments: Mapping[str, Any]) -> list[str]:
    """The names among ``arguments`` that ``cls(...)`` does not accept, down to the fields of its settings
    groups (``update.old_logprobs_from_update`` is a critic-free field, not a PPO one)."""
    accepted = _init_parameters(cls)
    if accepted is None:
        return []
    unknown = sorted(set(arguments) - accepted)
    for key, group in getattr(cls, "settings_groups", {}).items():
        value = arguments.get(key)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(group):
            fields = {f.name for f in dataclasses.fields(group)}
            unknown += [f"{key}.{name}" for name in sorted(set(value) - fields)]
    return unknown


def _concrete_modules(base: type = LightningModule) -> list[type]:
    found, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if not inspect.isabstract(cls) and cls not in found:
            found.append(cls)
    return found


def _hparam(hparams: Mapping, dotted: str) -> Any:
    """``hparams["a"]["b"]`` for ``"a.b"`` (dicts or objects with attributes); a ``KeyError`` if absent."""
    value: Any = hparams
    for part in dotted.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif not isinstance(value, Mapping) and hasattr(value, part):
            value = getattr(value, part)
        else:
            raise KeyError(dotted)
    return value


@dataclass
class CheckpointInfo:
    """What the resume checks read from a checkpoint file (the file itself is not kept in memory)."""

    path: str
    hparams: dict[str, Any]
    state_prefixes: set[str]

    @classmethod
    def read(cls, path: str, checkpoint: Mapping[str, Any]) -> CheckpointInfo:
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        prefixes = {key.split(".", 1)[0] for key in checkpoint.get("state_dict") or {}}
        return cls(str(path), hparams, prefixes)

    @property
    def class_path(self) -> str | None:
        return self.hparams.get("_class_path")

    @property
    def arguments(self) -> dict[str, Any]:
        return {k: v for k, v in self.hparams.items() if not k.startswith("_")}

    def migrated(self, cls: type | str | None) -> CheckpointInfo:
        """The checkpoint with the flat hyper-parameters of an online module's earlier layout mapped into
        their settings groups (``modules.online_migration``; unchanged for other modules and layouts)."""
        if cls is None:
            return self
        arguments = migrate_checkpoint_hparams(cls, self.arguments)
        if arguments is self.arguments or arguments == self.arguments:
            return self
        private = {k: v for k, v in self.hparams.items() if k.startswith("_")}
        return replace(self, hparams={**arguments, **private})

    def class_problem(self, cls: type, model: LightningModule | None = None) -> str | None:
        """Why this checkpoint cannot be resumed as a ``cls`` (None when it can, as far as can be told).

        With ``_class_path`` (checkpoints written through the CLI) the classes are compared; otherwise the
        hyper-parameter names must be arguments of ``cls`` and, given the built ``model``, the checkpoint's
        weights must sit under the model's own top-level names.
        """
        name = f"{cls.__name__} ({cls.__module__}.{cls.__qualname__})"
        if self.class_path is not None:
            saved = _import_class(self.class_path)
            if saved is not cls:
                return f"it holds a {self.class_path}, but the config's model is {name}"
        unknown = _unaccepted(cls, self.arguments)
        if unknown:
            if self.class_path is not None:
                return (
                    f"its hyper-parameters {unknown} are not arguments of {name} (renamed since the checkpoint"
                    " was written?)"
                )
            return f"its hyper-parameters {unknown} are not arguments of the config's model {name}{self._guess()}"
        if model is not None and self.class_path is None:
            extra = sorted(self.state_prefixes - {k.split(".", 1)[0] for k in model.state_dict()})
            if extra:
                return f"it holds weights under {extra}, which the config's model {name} has not{self._guess()}"
        return None

    def _guess(self) -> str:
        fits = [c for c in _concrete_modules() if _init_parameters(c) is not None and not _unaccepted(c, self.arguments)]
        if not fits:
            return "; it was written by another module class"
        best = min(fits, key=lambda c: len(_init_parameters(c) or ()))
        return f"; it was written by another module class (its hyper-parameters fit {best.__name__})"

    def changed_fixed_hparams(self, model: LightningModule) -> list[str]:
        """Messages for hyper-parameters of :data:`FIXED_ON_RESUME` (and ``model.fixed_on_resume``) whose
        value in ``model.hparams`` differs from the checkpoint's."""
        fixed = dict(FIXED_ON_RESUME)
        extra = getattr(type(model), "fixed_on_resume", ())
        fixed.update(extra if isinstance(extra, Mapping) else {key: "" for key in extra})
        problems = []
        for key, why in fixed.items():
            try:
                saved, now = _hparam(self.hparams, key), _hparam(model.hparams, key)
            except KeyError:
                continue
            if saved != now:
                because = f" ({why})" if why else ""
                problems.append(f"{key} cannot change on resume: the checkpoint has {saved!r}, this run {now!r}{because}")
        return problems


def find_last_checkpoint(trainer: Trainer) -> str | None:
    """The file ``ckpt_path="last"`` loads, found as Lightning does: the newest of the ``last*.ckpt`` files of
    every ``ModelCheckpoint`` and the files of ``OnExceptionCheckpoint`` callbacks; None when there is none."""
    candidates = {getattr(cb, "ckpt_path", None) for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    existing = {str(p): os.path.getmtime(p) for p in candidates if p and os.path.exists(p)}
    return max(existing, key=existing.get) if existing else None


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
        if self.subcommand == "fit":
            for cls in (SigtermCheckpoint, CheckpointFolderCheck):
                if not any(isinstance(c, cls) for c in trainer.callbacks):
                    trainer.callbacks.append(cls())
        return trainer

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        self._command_line = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        self._checkpoint: CheckpointInfo | None = None
        super().parse_arguments(parser, args)

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
            raise


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

"""What the ``lit-rlhf`` command checks of a checkpoint before resuming from it: its module class, its
hyper-parameters (the old flat layout mapped into the settings groups), the settings a resume may not
change, and which file ``--ckpt_path last`` stands for."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lit_rlhf.modules.online_migration import migrate_checkpoint_hparams

# Model hyper-parameters (dotted paths into ``hparams``) that a resumed fit may not change, with why. An
# online module may add its own in a ``fixed_on_resume`` class attribute (a mapping or a sequence of paths).
FIXED_ON_RESUME: dict[str, str] = {
    "generation.num_samples": (
        "K, the responses sampled per prompt: the saved run's rollouts, prompt batches and group statistics"
        " are laid out for its K"
    ),
}

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

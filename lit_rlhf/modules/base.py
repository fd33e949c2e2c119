"""Shared plumbing of the SFT and reward-model modules: optimiser wiring, export, lean checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lit_rlhf.models import tokenizer_difference
from lit_rlhf.modules.optim import resolve_total_steps


def configure_optimizer_and_scheduler(
    module: LightningModule,
    params: list[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
    total_steps: int | float,
) -> dict[str, Any]:
    """Build an optimiser (and an optional per-step scheduler) in Lightning's dict form."""
    if not params:
        raise ValueError(f"{type(module).__name__} has no trainable parameters")
    opt = optimizer(params)
    if scheduler is None:
        return {"optimizer": opt}
    sched = scheduler(opt)
    resolve_total_steps(sched, total_steps)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def check_data_tokenizer(module: LightningModule, source: str | None) -> None:
    """Refuse a data module whose tokenizer is not the model's (``module.tokenizer``, loaded from ``source``):
    the model would read its token ids under another vocabulary (an index error at best, silent training at
    worst). Called from the modules' ``setup``; data given as plain DataLoaders is not seen."""
    data = getattr(module.trainer, "datamodule", None)
    theirs, mine = getattr(data, "tokenizer", None), getattr(module, "tokenizer", None)
    if theirs is None or mine is None:
        return
    difference = tokenizer_difference(theirs, mine)
    if difference is not None:
        where = getattr(getattr(data, "hparams", None), "tokenizer", None) or type(data).__name__
        raise ValueError(
            f"{type(module).__name__}: the data module's tokenizer ({where!r}) is not the model's ({source!r}): "
            f"{difference}; give the data module the model's tokenizer"
        )


def trainable_state_dict_keys(model: torch.nn.Module, prefix: str) -> set[str]:
    """Checkpoint keys of ``model`` worth saving: trainable parameters and buffers.

    Frozen base weights of a LoRA model are reloaded from the model spec on resume, so saving them in
    every checkpoint only costs disk and time.
    """
    keys = {f"{prefix}{name}" for name, p in model.named_parameters() if p.requires_grad}
    keys |= {f"{prefix}{name}" for name, _ in model.named_buffers()}
    # FSDP1 wrappers appear in parameter names but not in (their own, cleaned) state-dict keys
    return {key.replace("_fsdp_wrapped_module.", "") for key in keys}


def drop_frozen_weights(checkpoint: dict[str, Any], model: torch.nn.Module, prefix: str) -> None:
    """Remove frozen parameters of ``model`` (state-dict keys under ``prefix``) from a checkpoint."""
    keep = trainable_state_dict_keys(model, prefix)
    state = checkpoint["state_dict"]
    for key in [k for k in state if k.startswith(prefix) and k not in keep]:
        del state[key]


def plain_hparams(module: LightningModule, **values: Any) -> None:
    """Store hyperparameters as plain Python values, so ``hparams.yaml`` and checkpoints hold no
    ``!!python/object`` tags (Lightning's ``load_hparams_from_yaml`` reads them back).

    ``values`` (e.g. ``model=spec``) replace entries of ``module.hparams``; every dataclass value is then
    stored as its ``dataclasses.asdict`` dict, also inside dicts, lists and tuples (:func:`plain_value`). Both
    the live and the initial (logged) hparams are updated. Constructors take such dicts back
    (``ModelSpec.coerce``), so ``load_from_checkpoint`` works.
    """
    for store in (module.hparams, getattr(module, "_hparams_initial", None)):
        if store is None:
            continue
        store.update(values)
        for key, value in list(store.items()):
            store[key] = plain_value(value)


def plain_value(value: Any) -> Any:
    """``value`` with every dataclass instance in it, at any depth of dicts, lists and tuples (e.g. an
    ensemble's ``[ModelSpec, ...]`` members), replaced by its ``dataclasses.asdict`` dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_value(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # a NamedTuple's fields
    return value


def internal_base(cls: type) -> type:
    """Class decorator: mark an internal base class (a module without its own algorithm) as abstract.

    LightningCLI offers every imported, non-abstract ``LightningModule`` subclass as a ``--model``
    choice (jsonargparse's ``get_all_subclass_paths`` skips abstract ones); this hides the base from
    that list and from direct instantiation, while its subclasses stay concrete.
    """
    cls.__abstractmethods__ = frozenset({"(internal base class: use a subclass)"})
    return cls

"""Callbacks: Hugging Face export at the end of fit."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class HFExport(Callback):
    """At the end of ``fit``, write the module's trained model(s) with ``save_pretrained`` to ``dirpath``.

    The module decides what that means through its ``export_pretrained(folder)`` method: SFT writes a
    causal LM, the reward model a sequence classifier, PPO the actor (``dirpath``/actor) and critic
    (``dirpath``/critic). Every rank calls it (sharded models gather collectively); only rank 0 writes.

    Args:
        dirpath: output folder; relative paths are taken from the working directory.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        export = getattr(pl_module, "export_pretrained", None)
        if export is None:
            raise TypeError(f"{type(pl_module).__name__} has no export_pretrained(folder) method")
        export(self.dirpath)
        rank_zero_info(f"HFExport: wrote {Path(self.dirpath).resolve()}")

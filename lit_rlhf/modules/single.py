"""``SingleModelModule``: what the SFT and reward-model modules share as modules that train one
Hugging Face model, ``self.model``: building it, sharding it, its optimiser, lean checkpoints, export."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf.models import ModelSpec, export_pretrained, load_tokenizer
from lit_rlhf.modules.base import (
    configure_optimizer_and_scheduler,
    drop_frozen_weights,
    internal_base,
    plain_hparams,
)
from lit_rlhf.modules.distributed import gather_for_export, is_sharded_checkpoint, shard_models


@internal_base
class SingleModelModule(LightningModule):
    """Base of :class:`SFTModule` and :class:`RewardModelModule` (subclasses document their arguments).

    Not a choice of the CLI's ``--model`` (see :mod:`lit_rlhf.cli`): it has no training step of its own.
    """

    def _init_model(
        self,
        spec: ModelSpec | dict[str, Any] | str,
        build: Callable[[ModelSpec, Any], torch.nn.Module],
        optimizer: OptimizerCallable,
        scheduler: LRSchedulerCallable | None,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        # A ModelSpec, a dict of its fields or a path string; checked here, before any loading.
        spec = ModelSpec.coerce(spec, "model")
        self.spec = spec
        plain_hparams(self, model=dataclasses.asdict(spec))  # hparams.yaml readable by Lightning
        self.tokenizer = load_tokenizer(spec.tokenizer or spec.name_or_path)
        self.model = build(spec, self.tokenizer)
        # Frozen LoRA base weights are reloaded from the spec on resume instead of checkpointed.
        self.strict_loading = spec.lora is None

    @override
    def configure_model(self) -> None:
        shard_models(self, ("model",))

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        return configure_optimizer_and_scheduler(
            self, params, self.optimizer, self.scheduler, self.trainer.estimated_stepping_batches
        )

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.spec.lora is not None and not is_sharded_checkpoint(self):
            drop_frozen_weights(checkpoint, self.model, "model.")

    def export_pretrained(self, folder: str) -> None:
        """Write the model (LoRA merged) and tokenizer with ``save_pretrained`` to ``folder``."""
        full = gather_for_export(self, self.model)  # collective under FSDP; None off rank 0
        if full is not None:
            export_pretrained(full, self.tokenizer, folder)

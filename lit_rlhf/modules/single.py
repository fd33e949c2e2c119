"""``SingleModelModule``: what the SFT, reward-model and DPO modules share as modules that train one
Hugging Face model, ``self.model``: building it, sharding it, its optimiser, lean checkpoints, export,
greedy sample completions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf.models import ModelSpec, export_pretrained, load_tokenizer
from lit_rlhf.modules.base import configure_optimizer_and_scheduler, drop_frozen_weights
from lit_rlhf.modules.distributed import (
    gather_for_export,
    generation_context,
    is_sharded_checkpoint,
    shard_models,
)


class SingleModelModule(LightningModule):
    """Base of :class:`SFTModule`, :class:`RewardModelModule` and :class:`DPOModule` (subclasses document
    their arguments)."""

    def _init_model(
        self,
        spec: ModelSpec,
        build: Callable[[ModelSpec, Any], torch.nn.Module],
        optimizer: OptimizerCallable,
        scheduler: LRSchedulerCallable | None,
    ) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.spec = spec  # (under LightningCLI, self.hparams holds the raw config dicts)
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

    @torch.no_grad()
    def generate_text(self, prompts: list[torch.Tensor], max_new_tokens: int) -> list[tuple[str, str]]:
        """Greedy completions of token-id prompts by the causal LM ``self.model``, as (prompt, completion)
        strings. Collective under FSDP and multi-rank runs: every rank calls it (``synced_gpus``)."""
        rows = []
        was_training = self.model.training
        self.model.eval()
        for prompt in prompts:
            ids = prompt.unsqueeze(0).to(self.device)
            with generation_context(self, self.model):
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.tokenizer.eos_token_id,
                    synced_gpus=self.trainer.world_size > 1,
                )
            rows.append(
                (
                    self.tokenizer.decode(prompt, skip_special_tokens=True),
                    self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True),
                )
            )
        self.model.train(was_training)
        return rows

"""``SingleModelModule``: what the SFT, reward-model and DPO modules share as modules that train one
Hugging Face model, ``self.model``: building it, sharding it, its optimiser, skipping non-finite steps,
lean checkpoints, export, greedy sample completions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric
from typing_extensions import override

from lit_rlhf.batching import Bucketing, scatter_rows, sequence_micro_batches
from lit_rlhf.guards import StepGuard
from lit_rlhf.models import ModelSpec, check_positions, export_pretrained, load_tokenizer
from lit_rlhf.modules.base import (
    check_data_tokenizer,
    configure_optimizer_and_scheduler,
    drop_frozen_weights,
    internal_base,
    plain_hparams,
)
from lit_rlhf.modules.distributed import (
    clip_without_scaler,
    gather_for_export,
    generation_context,
    is_sharded_checkpoint,
    shard_models,
)


@internal_base
class SingleModelModule(LightningModule):
    """Base of :class:`SFTModule`, :class:`RewardModelModule` and :class:`DPOModule` (subclasses document their arguments).

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
        self.tokenizer_source = spec.tokenizer or spec.name_or_path
        self.tokenizer = load_tokenizer(self.tokenizer_source, trust_remote_code=spec.trust_remote_code)
        self.model = build(spec, self.tokenizer)
        # Frozen LoRA base weights are reloaded from the spec on resume instead of checkpointed.
        self.strict_loading = spec.lora is None
        self.step_guard = StepGuard()

    @override
    def setup(self, stage: str) -> None:
        check_data_tokenizer(self, self.tokenizer_source)

    def set_bucketing(self, bucketing: Bucketing | dict | None) -> dict[str, Any]:
        """Keep the checked ``bucketing`` settings; returns them as a plain dict (for ``hparams.yaml``)."""
        self.bucketing = Bucketing.coerce(bucketing, f"{type(self).__name__}: bucketing")
        return self.bucketing.as_dict()

    def micro_batches(self, attention_mask: torch.Tensor) -> list[tuple[torch.Tensor | slice, slice]]:
        """(rows, columns) of the forwards over an (N, L) batch: length-bucketed and trimmed under
        ``bucketing`` where that saves compute, else the whole batch (see :mod:`lit_rlhf.batching`)."""
        if attention_mask.numel():
            longest = attention_mask.sum(dim=1).max()
            check_positions(self.model, longest, type(self).__name__, "the batch's longest row (the data's max_length)")
        return sequence_micro_batches(attention_mask, self.bucketing.resolved(self.model))

    def per_row(
        self, fn: Callable[..., Any], attention_mask: torch.Tensor, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``fn(*(t[rows][:, columns] for t in tensors))`` on each micro-batch of :meth:`micro_batches`,
        its (n_i,) outputs (a tensor or a tuple) put back in batch order: (N,) each, differentiable.

        Exact for per-row results (sequence scores and log-probs): a row's numbers do not depend on
        the other rows of its forward or on padding columns."""
        batches = self.micro_batches(attention_mask)
        outputs = []
        for rows, columns in batches:
            out = fn(*(t[rows][:, columns] for t in tensors))
            outputs.append(out if isinstance(out, tuple) else (out,))
        n, rows = attention_mask.shape[0], [b[0] for b in batches]
        return tuple(scatter_rows(parts, rows, n) for parts in zip(*outputs))

    def persist_train_metrics(self, *metrics: torch.nn.Module) -> None:
        """Keep the running state of epoch-level training metrics in checkpoints, so that an epoch resumed
        mid-way reports the same value as an uninterrupted one (single process; under DDP each rank resumes
        with rank 0's partial state)."""
        for metric in metrics:
            for m in metric.modules():
                if isinstance(m, Metric):
                    m.persistent(True)

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
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """``Trainer(gradient_clip_val=...)`` under ``bf16-mixed`` with the default fused AdamW, which
        Lightning refuses (see :func:`~lit_rlhf.modules.distributed.clip_without_scaler`); other precisions
        clip as Lightning does."""
        if not clip_without_scaler(self, optimizer, gradient_clip_val, gradient_clip_algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.step_guard.observe_loss(loss)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step whose loss or gradient is not finite (on any rank) is skipped: its gradients are
        dropped, so the weights and the optimiser's moments stay as they were; ``train/skipped_steps``
        counts such steps."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        reduce = partial(self.trainer.strategy.reduce_boolean_decision, all=True)
        if not self.step_guard.allow_step(params, reduce):
            rank_zero_warn(
                f"step {self.global_step}: non-finite loss or gradient; optimiser step skipped"
                f" ({self.step_guard.skipped} so far)"
            )
        # only on the steps the loggers write (each self.log walks Lightning's result collection: ~1 ms
        # under cProfile, a fraction of that without it); Lightning's LearningRateMonitor asks the same
        # connector
        if self.trainer._logger_connector.should_update_logs:
            self.log("train/skipped_steps", float(self.step_guard.skipped), on_step=True, on_epoch=False)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["step_guard"] = self.step_guard.state_dict()
        if self.spec.lora is not None and not is_sharded_checkpoint(self):
            drop_frozen_weights(checkpoint, self.model, "model.")

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.step_guard.load_state_dict(checkpoint.get("step_guard", {}))
        # checkpoints written before the metric states were kept: start those metrics empty
        state = checkpoint["state_dict"]
        for name, m in self.named_modules():
            if isinstance(m, Metric):
                for key, value in m.state_dict(prefix=f"{name}.").items():
                    state.setdefault(key, value)

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

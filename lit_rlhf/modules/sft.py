"""Supervised fine-tuning of a causal LM with the loss on response tokens only."""

from __future__ import annotations

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from lit_rlhf.batching import Bucketing
from lit_rlhf.data.contract import check_batch
from lit_rlhf.functional import masked_sum
from lit_rlhf.models import ModelSpec, build_causal_lm, next_token_logprobs
from lit_rlhf.modules.metrics import row_weight
from lit_rlhf.modules.optim import AdamW, WarmupCosineLR
from lit_rlhf.modules.samples import log_text_table, logger_step, prompts_from_batch
from lit_rlhf.modules.single import SingleModelModule


class SFTModule(SingleModelModule):
    """Causal-LM fine-tuning on (prompt, response) batches from :class:`~lit_rlhf.data.SFTDataModule`.

    Args:
        model: the policy to fine-tune: a ModelSpec, a dict of its fields, or a hub id / folder string.
        optimizer: optimiser factory, e.g. ``torch.optim.AdamW`` with ``lr`` in YAML.
        scheduler: learning-rate schedule factory (stepped every optimiser step); None for constant.
        num_samples: validation/test prompts whose greedy completions are logged as a text table
            (``val/samples``, ``test/samples``) at the step of that validation's scalars (0 disables).
        sample_max_new_tokens: length limit of those sample completions.
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, the batch is
            forwarded as length-sorted micro-batches of at most ``token_budget`` padded tokens with their
            all-padding columns dropped, their token sums combined into the batch's means; loss and
            metrics are unchanged (up to float rounding). ``{enabled: false}`` runs one padded forward.
    """

    def __init__(
        self,
        model: ModelSpec,
        optimizer: OptimizerCallable = AdamW,
        scheduler: LRSchedulerCallable | None = WarmupCosineLR,
        num_samples: int = 4,
        sample_max_new_tokens: int = 48,
        bucketing: Bucketing | None = None,
    ) -> None:
        super().__init__()
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        bucketing = self.set_bucketing(bucketing)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self._init_model(model, build_causal_lm, optimizer, scheduler)
        # Token-weighted means so perplexity is exp(mean NLL per response token), reduced across ranks.
        self.train_nll, self.val_nll = MeanMetric(), MeanMetric()
        self.train_acc, self.val_acc = MeanMetric(), MeanMetric()
        self.test_nll, self.test_acc = MeanMetric(), MeanMetric()
        self.persist_train_metrics(self.train_nll, self.train_acc)
        self._sample_prompts: list[torch.Tensor] = []

    def _step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean response-token NLL, token accuracy and the response-token count of a batch."""
        check_batch(batch, "sft", type(self).__name__)  # a clear message instead of a KeyError
        n_tokens = batch["response_mask"][:, 1:].bool().sum()
        nll, acc = 0.0, 0.0
        # Means over the batch's response tokens as sums over its micro-batches (one: the whole batch).
        for rows, columns in self.micro_batches(batch["attention_mask"]):
            ids, attention = batch["input_ids"][rows][:, columns], batch["attention_mask"][rows][:, columns]
            # Token t is predicted from position t-1 (shift by one); only response tokens are scored.
            labels = ids[:, 1:]  # (b, l-1)
            mask = batch["response_mask"][rows][:, columns][:, 1:].bool()  # (b, l-1)
            logprobs, predicted = next_token_logprobs(self.model, ids, attention, mask, argmax=True)  # (b, l-1) x2
            correct = (predicted == labels).float()  # (b, l-1)
            nll = nll - masked_sum(logprobs, mask) / n_tokens
            acc = acc + masked_sum(correct, mask) / n_tokens
        return nll, acc, n_tokens

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, acc, n_tokens = self._step(batch)
        self.train_nll.update(loss.detach(), n_tokens)
        self.train_acc.update(acc, n_tokens)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        self.log("train/token_accuracy", self.train_acc, on_step=False, on_epoch=True)
        return loss

    @override
    def on_train_epoch_end(self) -> None:
        self.log("train/perplexity", torch.exp(self.train_nll.compute()))
        self.train_nll.reset()

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step("val", batch, batch_idx)

    @override
    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step("test", batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def _eval_step(self, stage: str, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, acc, n_tokens = self._step(batch)
        nll, token_acc = getattr(self, f"{stage}_nll"), getattr(self, f"{stage}_acc")
        nll.update(loss, n_tokens)
        token_acc.update(acc, n_tokens)
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True, batch_size=row_weight(batch["input_ids"].shape[0]))
        self.log(f"{stage}/token_accuracy", token_acc, on_step=False, on_epoch=True)
        if batch_idx == 0 and self.hparams.num_samples:
            self._sample_prompts = prompts_from_batch(batch, self.hparams.num_samples)

    def _eval_epoch_end(self, stage: str) -> None:
        nll = getattr(self, f"{stage}_nll")
        self.log(f"{stage}/perplexity", torch.exp(nll.compute()))
        nll.reset()
        if self._sample_prompts and not self.trainer.sanity_checking:
            texts = self.generate_text(self._sample_prompts, self.hparams.sample_max_new_tokens)
            # the step of this validation's scalars (global_step is one ahead of it mid-epoch)
            step = logger_step(self.trainer)
            log_text_table(self, f"{stage}/samples", ["prompt", "completion"], texts, step=step)
        self._sample_prompts = []

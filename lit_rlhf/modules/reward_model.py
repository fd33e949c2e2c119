"""Reward-model training on preference pairs with the pairwise Bradley-Terry loss."""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from lit_rlhf.batching import Bucketing
from lit_rlhf.data.contract import check_batch
from lit_rlhf.functional import pairwise_reward_loss
from lit_rlhf.models import (
    ModelSpec,
    build_score_model,
    check_shared_prefix_mode,
    packed_sequence_scores,
    pair_layout,
    refuse_unsupported_shared_prefix,
    sequence_scores,
)
from lit_rlhf.modules.metrics import row_weight
from lit_rlhf.modules.optim import AdamW, WarmupCosineLR
from lit_rlhf.modules.single import SingleModelModule


class PairMetrics(torch.nn.Module):
    """Accuracy, margin and score statistics of (chosen, rejected) pairs, as torchmetrics (rank-synced)."""

    NAMES = ("accuracy", "margin", "chosen_mean", "chosen_sq", "rejected_mean", "rejected_sq")

    def __init__(self) -> None:
        super().__init__()
        self.metrics = torch.nn.ModuleDict({name: MeanMetric() for name in self.NAMES})

    def update(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        values = {
            "accuracy": (chosen > rejected).float(),
            "margin": chosen - rejected,
            "chosen_mean": chosen,
            "chosen_sq": chosen**2,
            "rejected_mean": rejected,
            "rejected_sq": rejected**2,
        }
        for name, value in values.items():
            self.metrics[name].update(value.detach().float())

    def compute(self) -> dict[str, torch.Tensor]:
        m = {name: metric.compute() for name, metric in self.metrics.items()}
        return {
            "accuracy": m["accuracy"],
            "margin": m["margin"],
            "chosen_score_mean": m["chosen_mean"],
            "chosen_score_std": (m["chosen_sq"] - m["chosen_mean"] ** 2).clamp(min=0).sqrt(),
            "rejected_score_mean": m["rejected_mean"],
            "rejected_score_std": (m["rejected_sq"] - m["rejected_mean"] ** 2).clamp(min=0).sqrt(),
        }

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()


class RewardModelModule(SingleModelModule):
    """Bradley-Terry reward model (InstructGPT, Ouyang et al. 2022, eq. 1) scored at the last real token.

    Batches come from :class:`~lit_rlhf.data.PreferenceDataModule`: ``input_ids``/``attention_mask`` of
    shape (2B, L) with the B chosen rows first, then the B rejected rows, so a pair is scored in one
    forward; an optional ``margin`` (B,) is subtracted inside the sigmoid (Llama 2, Touvron et al. 2023).

    Args:
        model: the reward model (a ModelSpec, a dict of its fields, or a hub id / folder string): a causal-LM backbone (e.g. the SFT export) gets a fresh scalar head,
            a sequence-classification checkpoint keeps its head.
        optimizer: optimiser factory, e.g. ``torch.optim.AdamW`` with ``lr`` in YAML.
        scheduler: learning-rate schedule factory (stepped every optimiser step); None for constant.
        center_rewards_coef: weight of the centring regulariser coef * mean((r_chosen + r_rejected)^2)
            that keeps scores near zero mean (Eisenstein et al. 2023); 0 disables it.
        use_margin: subtract the batch's ``margin`` column when the data has one.
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, the rows are
            scored in length-sorted forwards of at most ``token_budget`` padded tokens with their
            all-padding columns dropped; scores, loss and metrics are unchanged (up to float rounding).
            ``{enabled: false}`` scores the whole batch in one padded forward.
        shared_prefix: ``auto`` (default), ``on`` or ``off``: score a pair (of a batch with a
            ``response_mask``, as PreferenceDataModule's) as one row
            ``[prompt | chosen | rejected]`` with a block attention mask, the prompt computed once
            (``models.shared_prefix``; equal scores to float rounding). ``auto`` packs a batch when its
            estimated forward cost falls below 0.75 of the padded one (long prompts) and the attention is
            sdpa or eager; ``on`` always packs.
    """

    def __init__(
        self,
        model: ModelSpec,
        optimizer: OptimizerCallable = AdamW,
        scheduler: LRSchedulerCallable | None = WarmupCosineLR,
        center_rewards_coef: float = 0.0,
        use_margin: bool = True,
        bucketing: Bucketing | None = None,
        shared_prefix: Literal["auto", "on", "off"] = "auto",
    ) -> None:
        super().__init__()
        if center_rewards_coef < 0:
            raise ValueError(f"center_rewards_coef must be >= 0, got {center_rewards_coef}")
        bucketing = self.set_bucketing(bucketing)
        check_shared_prefix_mode(shared_prefix, "RewardModelModule: shared_prefix")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self._init_model(model, build_score_model, optimizer, scheduler)
        refuse_unsupported_shared_prefix("RewardModelModule: shared_prefix", shared_prefix, model=self.model)
        self.train_metrics, self.val_metrics, self.test_metrics = PairMetrics(), PairMetrics(), PairMetrics()
        self.persist_train_metrics(self.train_metrics)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, L) token ids and mask -> (N,) float32 scores read at each row's last real token."""
        return sequence_scores(self.model, input_ids, attention_mask)

    def _step(
        self, batch: dict[str, torch.Tensor], metrics: PairMetrics
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairwise loss of a (2B, L) batch and the (B,) chosen and (B,) rejected scores, in batch order
        (however the rows were scored: padded, length-bucketed or in the shared-prompt layout)."""
        check_batch(batch, "preference", type(self).__name__)
        # the shared-prompt layout needs to know the prompt: batches without a response_mask stay padded
        mode = self.hparams.shared_prefix if "response_mask" in batch else "off"
        layout = pair_layout(
            self.model, mode, batch["input_ids"], batch["attention_mask"], batch.get("response_mask"),
            self.tokenizer.pad_token_id, lm_head=False,
        )  # fmt: skip
        if layout is None:
            columns = (batch["input_ids"], batch["attention_mask"])
            (scores,) = self.per_row(self, batch["attention_mask"], *columns)  # (2B,), length-bucketed
        else:  # the pair's prompt computed once: [prompt | chosen | rejected]
            scores = packed_sequence_scores(self.model, layout)  # (2B,)
        chosen, rejected = scores.chunk(2)
        margin = batch.get("margin") if self.hparams.use_margin else None
        loss, _ = pairwise_reward_loss(chosen, rejected, margin)
        if self.hparams.center_rewards_coef > 0:
            loss = loss + self.hparams.center_rewards_coef * ((chosen + rejected) ** 2).mean()
        metrics.update(chosen, rejected)
        return loss, chosen, rejected

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _, _ = self._step(batch, self.train_metrics)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def on_train_epoch_end(self) -> None:
        self._log_pair_metrics("train", self.train_metrics)

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Logs ``val/loss``; returns the pair scores (``on_validation_batch_end``'s ``outputs``)."""
        loss, chosen, rejected = self._step(batch, self.val_metrics)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=row_weight(batch["input_ids"].shape[0] // 2))
        return {"loss": loss, "chosen": chosen.detach(), "rejected": rejected.detach()}

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_pair_metrics("val", self.val_metrics)

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Logs ``test/loss``; returns the pair scores (``on_test_batch_end``'s ``outputs``)."""
        loss, chosen, rejected = self._step(batch, self.test_metrics)
        self.log("test/loss", loss, sync_dist=True, batch_size=row_weight(batch["input_ids"].shape[0] // 2))
        return {"loss": loss, "chosen": chosen.detach(), "rejected": rejected.detach()}

    @override
    def on_test_epoch_end(self) -> None:
        self._log_pair_metrics("test", self.test_metrics)

    def _log_pair_metrics(self, stage: str, metrics: PairMetrics) -> None:
        values = metrics.compute()
        self.log(f"{stage}/accuracy", values.pop("accuracy"), prog_bar=True)
        self.log_dict({f"{stage}/{k}": v for k, v in values.items()})
        metrics.reset()

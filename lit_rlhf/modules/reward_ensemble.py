"""K reward models trained side by side in one fit and exported as one ensemble folder (Coste et al. 2024,
"Reward Model Ensembles Help Mitigate Overoptimization", ICLR 2024, arXiv:2310.02743).

    lit-rlhf fit --config configs/rm_ensemble_tiny.yaml     # writes runs/rm_ensemble_tiny/export
    # then in a PPO / GRPO / online DPO config:  reward_model: runs/rm_ensemble_tiny/export

Metric names: ``{stage}/loss`` (the mean of the members' losses), ``{stage}/accuracy``, ``{stage}/margin``
and the score statistics of :class:`~lit_rlhf.modules.reward_model.RewardModelModule`, of the ensemble's
aggregated score; ``{stage}/member_<k>/accuracy`` of each member; ``{stage}/ensemble_std``, the members'
mean spread on the pairs' responses; with ``disagreement``, ``train/disagreement`` (the term) and
``train/unlabelled_std`` (the members' mean spread on the step's unlabelled texts).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing, sequence_micro_batches
from lit_rlhf.data.contract import check_batch
from lit_rlhf.ensembles import write_ensemble_manifest
from lit_rlhf.models import ModelSpec, build_score_model, check_positions, export_pretrained, sequence_scores
from lit_rlhf.modules.base import plain_hparams
from lit_rlhf.modules.disagreement import Disagreement, UnlabelledTexts
from lit_rlhf.modules.distributed import clip_each_model, gather_for_export, shard_models
from lit_rlhf.modules.metrics import row_weight
from lit_rlhf.modules.optim import AdamW, WarmupCosineLR
from lit_rlhf.modules.reward_model import PairMetrics
from lit_rlhf.modules.single import SingleModelModule

Aggregation = Literal["mean", "mean_minus_std", "mean_minus_var", "min"]


class RewardEnsembleModule(SingleModelModule):
    """An ensemble of K Bradley-Terry reward models (InstructGPT, Ouyang et al. 2022, eq. 1), trained on the
    same preference batches in one fit (:class:`~lit_rlhf.data.PreferenceDataModule`).

    Member k is ``model`` built with ``seeds[k]`` (its new scalar head; with an inline ``config`` its whole
    random initialisation), so the members start apart; with ``bootstrap`` each also trains on its own
    resample of the pairs (each pair's loss weighted by a Poisson(1) count of (seed, pair),
    ``functional.poisson_bootstrap_weights``: bagging without K data loaders). The loss is the sum of the
    members' losses: each member's gradient is its own loss's, and per-parameter optimisers (AdamW) step each
    member as if it trained alone, and the Trainer's ``gradient_clip_val`` clips each member's gradient on its
    own (under FSDP1 their joint norm). The export (``HFExport``) writes ``member_<k>`` folders, each a reward model
    ``AutoModelForSequenceClassification`` loads, and an ``ensemble.json`` naming them with ``aggregation``
    and ``coef`` (:mod:`lit_rlhf.ensembles`); an online module's ``reward_model`` takes that folder.

    Rows are scored padded, in length-bucketed micro-batches (``bucketing``); the shared-prompt layout of
    ``RewardModelModule`` is not used. All K models are held in memory and run every batch: for large
    reward models, train members in separate fits (``RewardModelModule`` with different seeds) and give
    their folders as ``reward_model: {ensemble: [...]}``.

    Args:
        model: the members' reward model (a ModelSpec, a dict of its fields or a path): a causal-LM backbone
            (e.g. the SFT export) gets fresh scalar heads, a sequence-classification checkpoint keeps its head.
        num_members: K >= 2 (Coste et al. found 4-5 members enough).
        seeds: the K members' seeds (distinct integers); None = ``model.seed`` + k (0 + k when unset).
        bootstrap: train each member on its own Poisson bootstrap resample of the pairs (needs the
            batches' ``row_index``, as PreferenceDataModule gives).
        aggregation: the ensemble's default aggregation written to ``ensemble.json`` and used for the
            logged ``accuracy`` (``functional.aggregate_ensemble``): mean, mean_minus_std, mean_minus_var, min.
        coef: lambda >= 0 of the ``mean_minus_*`` aggregations.
        optimizer: optimiser factory, e.g. ``torch.optim.AdamW`` with ``lr`` in YAML.
        scheduler: learning-rate schedule factory (stepped every optimiser step); None for constant.
        center_rewards_coef: weight of each member's centring regulariser coef * mean((r_c + r_r)^2)
            (Eisenstein et al. 2023); 0 disables it.
        use_margin: subtract the batch's ``margin`` column when the data has one.
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields),
            as in ``RewardModelModule``.
        disagreement: members that agree on the pairs and disagree on unlabelled texts
            (:class:`~lit_rlhf.modules.disagreement.Disagreement` or a dict of its fields: ``texts``, a .jsonl
            file, ``coef``, ``target``, ...; D-BAT, Pagliardini et al. 2023): the members' spread grows where no
            pair constrains them, which mean - k std then penalises. None (default) = off.
    """

    def __init__(
        self,
        model: ModelSpec,
        num_members: int = 3,
        seeds: list[int] | None = None,
        bootstrap: bool = False,
        aggregation: Aggregation = "mean_minus_std",
        coef: float = 1.0,
        optimizer: OptimizerCallable = AdamW,
        scheduler: LRSchedulerCallable | None = WarmupCosineLR,
        center_rewards_coef: float = 0.0,
        use_margin: bool = True,
        bucketing: Bucketing | None = None,
        disagreement: Disagreement | None = None,
    ) -> None:
        super().__init__()
        spec = ModelSpec.coerce(model, "model")
        self.seeds = _check_arguments(spec, num_members, seeds, aggregation, coef, center_rewards_coef)
        bucketing = self.set_bucketing(bucketing)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self._init_model(spec, self.build_members, optimizer, scheduler)
        self.disagreement = None
        self._unlabelled = None
        if disagreement is not None:
            self.disagreement = Disagreement.coerce(disagreement, f"{type(self).__name__}: disagreement")
        plain_hparams(self, seeds=self.seeds)  # as resolved
        self.metrics = torch.nn.ModuleDict(
            {f"{s}_metrics": self.stage_metrics() for s in ("train", "val", "test")}
        )
        self.persist_train_metrics(self.metrics["train_metrics"])

    def unlabelled(self) -> UnlabelledTexts | None:
        """The tokenised texts of ``disagreement`` (None without it), read once, when first needed: a fit reads
        them in ``setup``, while loading a checkpoint to test or export it does not need the file."""
        if self.disagreement is not None and self._unlabelled is None:
            texts = UnlabelledTexts(self.disagreement, self.tokenizer)
            longest = max(map(len, texts.ids))
            check_positions(self.model[0], longest, type(self).__name__, f"the unlabelled texts of "
                            f"{self.disagreement.texts} (cut them with disagreement.max_length)")  # fmt: skip
            self._unlabelled = texts
        return self._unlabelled

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":
            self.unlabelled()  # read, tokenise and check the texts before training

    def build_members(self, spec: ModelSpec, tokenizer) -> torch.nn.ModuleList:
        """The K reward models, member k built with ``seeds[k]``; refused when they would all stay one model."""
        members = torch.nn.ModuleList(
            build_score_model(dataclasses.replace(spec, seed=seed), tokenizer) for seed in self.seeds
        )
        if not self.hparams.bootstrap and _all_equal(members):
            raise ValueError(
                f"{type(self).__name__}: the {len(members)} members start from the same weights (a reward-model "
                "checkpoint keeps its trained head, so the seeds change nothing) and would train on the same "
                "pairs: they would stay one model (ensemble spread 0). Set bootstrap: true (each member its own "
                "resample of the pairs), or start from the backbone (e.g. the SFT export) for a new head each"
            )
        return members

    def stage_metrics(self) -> torch.nn.ModuleDict:
        """The aggregated score's pair metrics, each member's accuracy and the mean spread, of one stage."""
        return torch.nn.ModuleDict({
            "pairs": PairMetrics(),
            "members": torch.nn.ModuleList(MeanMetric() for _ in self.seeds),
            "spread": MeanMetric(),
        })  # fmt: skip

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, L) token ids and mask -> (K, N) float32 scores of every member at each row's last real token."""
        return torch.stack([sequence_scores(member, input_ids, attention_mask) for member in self.model])

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        """The summed pairwise losses of the K members on a (2B, L) batch (chosen rows first); updates the
        stage's metrics and logs the members' mean loss."""
        check_batch(batch, "preference", type(self).__name__)
        hp = self.hparams
        # 1. Every member's scores of the 2B rows, in length-bucketed micro-batches.
        scores = torch.stack(self.per_row(self.member_scores, batch["attention_mask"], batch["input_ids"],
                                          batch["attention_mask"]))  # (K, 2B)  # fmt: skip
        chosen, rejected = scores.chunk(2, dim=1)  # (K, B), (K, B)
        # 2. Each member's Bradley-Terry loss, on its bootstrap resample of the pairs in training.
        weights = None
        if hp.bootstrap and stage == "train":
            weights = F.poisson_bootstrap_weights(self.row_index(batch), self.seeds)  # (K, B)
        margin = batch.get("margin") if hp.use_margin else None
        losses = []
        for k in range(len(self.seeds)):
            w = None if weights is None else weights[k]  # (B,)
            loss, _ = F.pairwise_reward_loss(chosen[k], rejected[k], margin, weights=w)
            if hp.center_rewards_coef > 0:
                center = (chosen[k] + rejected[k]) ** 2  # (B,)
                center = center.mean() if w is None else (w * center).sum() / w.sum().clamp(min=1.0)
                loss = loss + hp.center_rewards_coef * center
            losses.append(loss)
        losses = torch.stack(losses)  # (K,)
        total = losses.sum()
        if self.disagreement is not None and stage == "train":  # 3. agree on the pairs, disagree off them
            step = self.trainer.fit_loop.epoch_loop.total_batch_idx  # restored on resume
            term, free = self.disagreement_term(scores, step, self.global_rank, self.trainer.world_size)
            weight = row_weight(free.shape[1])
            self.log("train/disagreement", term, sync_dist=True, batch_size=weight)
            self.log("train/unlabelled_std", F.ensemble_std(free.detach()).mean(), sync_dist=True, batch_size=weight)
            total = total + self.disagreement.coef * term
        # 4. Metrics of the ensemble's aggregated score, of each member, and of the members' spread.
        metrics = self.metrics[f"{stage}_metrics"]
        aggregate = F.aggregate_ensemble(scores.detach(), hp.aggregation, hp.coef)  # (2B,)
        metrics["pairs"].update(*aggregate.chunk(2))
        for k, member in enumerate(metrics["members"]):
            member.update((chosen[k] > rejected[k]).float().detach())
        metrics["spread"].update(F.ensemble_std(scores.detach()))
        self.log(f"{stage}/loss", losses.mean(), prog_bar=stage != "test", sync_dist=True,
                 batch_size=row_weight(chosen.shape[1]))  # fmt: skip
        return total

    def disagreement_term(
        self, scores: torch.Tensor, step: int, rank: int = 0, world_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``functional.disagreement_loss`` of the members' (K, 2B) ``scores`` of a step's pair texts and of the
        unlabelled texts of training step ``step`` on ``rank`` (a function of both: a resumed fit draws as an
        uninterrupted one); returns the () term and the (K, U) scores of the unlabelled texts."""
        input_ids, attention_mask = (t.to(scores.device) for t in self.unlabelled().batch(step, rank, world_size))
        free = torch.stack(self.per_row(self.member_scores, attention_mask, input_ids, attention_mask))  # (K, U)
        return F.disagreement_loss(scores, free, self.disagreement.target), free

    def member_scores(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(n, L) rows of one micro-batch -> each member's (n,) scores."""
        return tuple(sequence_scores(member, input_ids, attention_mask) for member in self.model)

    @staticmethod
    def row_index(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "row_index" not in batch:
            raise KeyError(
                "RewardEnsembleModule(bootstrap=True): batches need a `row_index` (B,) column (each pair's position"
                " in its dataset), as PreferenceDataModule's collator gives"
            )
        return batch["row_index"]

    @override
    def micro_batches(self, attention_mask: torch.Tensor) -> list[tuple[torch.Tensor | slice, slice]]:
        """As :meth:`SingleModelModule.micro_batches`, planned for one member (each runs the same rows)."""
        return sequence_micro_batches(attention_mask, self.bucketing.resolved(self.model[0]))

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    @override
    def on_train_epoch_end(self) -> None:
        self.log_stage_metrics("train")

    @override
    def on_validation_epoch_end(self) -> None:
        self.log_stage_metrics("val")

    @override
    def on_test_epoch_end(self) -> None:
        self.log_stage_metrics("test")

    def log_stage_metrics(self, stage: str) -> None:
        metrics = self.metrics[f"{stage}_metrics"]
        values = metrics["pairs"].compute()
        self.log(f"{stage}/accuracy", values.pop("accuracy"), prog_bar=True)
        self.log_dict({f"{stage}/{k}": v for k, v in values.items()})
        self.log_dict({f"{stage}/member_{k}/accuracy": m.compute() for k, m in enumerate(metrics["members"])})
        self.log(f"{stage}/ensemble_std", metrics["spread"].compute())
        metrics["pairs"].reset()
        for metric in (*metrics["members"], metrics["spread"]):
            metric.reset()

    @override
    def configure_model(self) -> None:
        shard_models(self, [f"model.{k}" for k in range(len(self.seeds))])

    @override
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:  # fmt: skip
        """``Trainer(gradient_clip_val=...)`` clips each member's gradient on its own, as the member would be
        clipped trained alone (``distributed.clip_each_model``; under FSDP1 their joint norm)."""
        if not clip_each_model(self, optimizer, self.model, gradient_clip_val, gradient_clip_algorithm):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def export_pretrained(self, folder: str) -> None:
        """Write each member to ``folder/member_<k>`` (LoRA merged, with the tokenizer) and ``ensemble.json``."""
        names = [f"member_{k}" for k in range(len(self.seeds))]
        written = False
        for name, member in zip(names, self.model):
            full = gather_for_export(self, member)  # collective under FSDP; None off rank 0
            if full is not None:
                export_pretrained(full, self.tokenizer, Path(folder) / name)
                written = True
        if written:
            hp = self.hparams
            extra = {} if self.disagreement is None else {"disagreement": self.disagreement.as_dict()}
            write_ensemble_manifest(
                folder, names, hp.aggregation, hp.coef, seeds=self.seeds, bootstrap=hp.bootstrap, **extra
            )


def _check_arguments(
    spec: ModelSpec, num_members: int, seeds: list[int] | None, aggregation: str, coef: float, center: float
) -> list[int]:
    """Raise for arguments outside ``RewardEnsembleModule``'s Args; returns the members' seeds."""
    name = "RewardEnsembleModule"
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 2:
        raise ValueError(f"{name}: num_members must be an integer >= 2, got {num_members!r}")
    if seeds is None:
        base = 0 if spec.seed is None else spec.seed
        seeds = [base + k for k in range(num_members)]
    seeds = list(seeds)
    if (
        len(seeds) != num_members
        or len(set(seeds)) != len(seeds)
        or not all(isinstance(s, int) for s in seeds)
    ):
        raise ValueError(
            f"{name}: seeds must be {num_members} distinct integers (one per member), got {seeds!r}"
        )
    if aggregation not in F.ENSEMBLE_AGGREGATIONS:
        raise ValueError(
            f"{name}: aggregation must be one of {list(F.ENSEMBLE_AGGREGATIONS)}, got {aggregation!r}"
        )
    if not (isinstance(coef, (int, float)) and math.isfinite(coef) and coef >= 0):
        raise ValueError(f"{name}: coef must be a finite number >= 0, got {coef!r}")
    if center < 0:
        raise ValueError(f"{name}: center_rewards_coef must be >= 0, got {center}")
    return seeds


def _all_equal(members: torch.nn.ModuleList) -> bool:
    """Whether every member's parameters equal the first member's (same names, values)."""
    first = dict(members[0].named_parameters())
    return all(
        all(torch.equal(first[name], p) for name, p in other.named_parameters()) for other in members[1:]
    )

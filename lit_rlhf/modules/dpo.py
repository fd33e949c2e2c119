"""Offline preference optimisation of a causal LM: DPO, conservative DPO, IPO and SimPO.

Metric names (TRL's, under the project's ``train/`` / ``val/`` / ``test/`` prefixes): ``{stage}/loss``,
``{stage}/rewards/chosen``, ``{stage}/rewards/rejected``, ``{stage}/rewards/margins``,
``{stage}/rewards/accuracies``, ``{stage}/logps/chosen``, ``{stage}/logps/rejected``; ``val/samples``
(``test/samples``) is a table of greedy completions of validation (test) prompts.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric
from typing_extensions import override

from lit_rlhf.batching import Bucketing
from lit_rlhf.functional import DPO_LOSS_TYPES, chosen_nll, dpo_loss
from lit_rlhf.models import (
    ModelSpec,
    SharedPrefixLayout,
    build_causal_lm,
    check_shared_prefix_mode,
    frozen_copy,
    layout_fits,
    packed_response_logprobs,
    pair_layout,
    reference_logits_context,
    refuse_unsupported_shared_prefix,
    response_logprobs,
)
from lit_rlhf.models import disable_dropout as zero_dropout
from lit_rlhf.modules.distributed import is_sharded_checkpoint, shard_models, unwrap
from lit_rlhf.modules.dpo_reference import PrecomputedReference
from lit_rlhf.modules.metrics import row_weight
from lit_rlhf.modules.optim import AdamW, WarmupCosineLR
from lit_rlhf.modules.samples import log_text_table, logger_step, prompts_from_batch
from lit_rlhf.modules.single import SingleModelModule

DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
# with nll_coef > 0 (RPO): the chosen responses' per-token NLL, under TRL's name
NLL_METRIC = "nll_loss"


class DPOModule(PrecomputedReference, SingleModelModule):
    """Direct preference optimisation on (prompt, chosen, rejected) batches from
    :class:`~lit_rlhf.data.PreferenceDataModule` (``input_ids``/``attention_mask``/``response_mask`` of
    shape (2B, L), the B chosen rows first): chosen and rejected are scored in one forward, a sequence's
    log-prob summed over its response tokens (EOS included, prompt excluded).

    Args:
        model: the policy to optimise (usually the SFT export): a ``ModelSpec``, a dict of its fields
            or a path string; with ``lora`` only the adapters train.
        reference: the reference policy pi_ref; None = the initial policy: a frozen copy, or for a LoRA
            policy the policy itself with its adapters disabled (no second copy). Must be None for
            ``loss_type="simpo"`` (reference-free).
        beta: > 0, strength of the implicit KL constraint to the reference (DPO's beta, IPO's tau).
        loss_type: "sigmoid" (DPO; with ``label_smoothing`` > 0 conservative DPO), "ipo" or "simpo";
            IPO and SimPO use length-averaged log-probs (see :func:`~lit_rlhf.functional.dpo_loss`).
        label_smoothing: in [0, 0.5): assumed probability that a preference label is flipped (cDPO).
        simpo_gamma: >= 0, SimPO's target reward margin (``loss_type="simpo"`` only).
        nll_coef: >= 0, alpha of RPO (Pang et al. 2024, arXiv 2404.19733): the loss adds alpha times the
            chosen responses' per-token negative log-likelihood (``functional.chosen_nll``, logged as
            ``{stage}/nll_loss``; ``{stage}/loss`` includes it), which keeps their likelihood from falling
            with the rejected ones' (TRL's ``rpo_alpha``). 0 (default) is plain DPO / IPO / SimPO.
        precompute_ref_logprobs: score the whole training and validation sets (and the test set, when the data
            module has a ``test_path``) with the reference once, when fitting starts, keep the log-probs per
            pair (by ``row_index``) and free the reference;
            needs a data module with ``train_dataset``/``val_dataset``/``collator`` (PreferenceDataModule).
        disable_dropout: set the policy's dropout to 0, so that before the first update the policy and
            the reference give the same log-probs (implicit rewards start at exactly 0), as TRL does.
        optimizer: optimiser factory, e.g. ``torch.optim.AdamW`` with ``lr`` in YAML.
        scheduler: learning-rate schedule factory (stepped every optimiser step); None for constant.
        num_samples: validation prompts whose greedy completions are logged as text (0 disables).
        sample_max_new_tokens: length limit of those sample completions.
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, the policy
            and reference forwards run on length-sorted rows in micro-batches of at most ``token_budget``
            padded tokens with their all-padding columns dropped; log-probs, loss and metrics are
            unchanged (up to float rounding). ``{enabled: false}`` runs one padded forward per batch.
    """

    def __init__(
        self,
        model: ModelSpec,
        reference: ModelSpec | None = None,
        beta: float = 0.1,
        loss_type: Literal["sigmoid", "ipo", "simpo"] = "sigmoid",
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.0,
        nll_coef: float = 0.0,
        precompute_ref_logprobs: bool = False,
        disable_dropout: bool = True,
        shared_prefix: Literal["auto", "on", "off"] = "auto",
        optimizer: OptimizerCallable = AdamW,
        scheduler: LRSchedulerCallable | None = WarmupCosineLR,
        num_samples: int = 4,
        sample_max_new_tokens: int = 48,
        bucketing: Bucketing | None = None,
    ) -> None:
        super().__init__()
        bucketing = self.set_bucketing(bucketing)
        model = ModelSpec.coerce(model, "model")
        reference = None if reference is None else ModelSpec.coerce(reference, "reference")
        _validate(reference, beta, loss_type, label_smoothing, simpo_gamma, precompute_ref_logprobs, num_samples)
        if not (math.isfinite(nll_coef) and nll_coef >= 0):
            raise ValueError(f"DPOModule: nll_coef must be a finite number >= 0, got {nll_coef}")
        check_shared_prefix_mode(shared_prefix, "DPOModule: shared_prefix")
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self._init_model(model, build_causal_lm, optimizer, scheduler)
        if disable_dropout:
            zero_dropout(self.model)
        # the reference: None when reference-free (SimPO) or when a LoRA policy disables its adapters
        self.reference: torch.nn.Module | None = None
        if reference is not None:
            self.reference = frozen_copy(build_causal_lm(reference, self.tokenizer))
        elif loss_type != "simpo" and model.lora is None:
            self.reference = frozen_copy(self.model)
        self.strict_loading = False  # the reference is rebuilt in __init__, not checkpointed
        refuse_unsupported_shared_prefix("DPOModule: shared_prefix", shared_prefix, model=self.model, reference=self.reference)
        self._init_reference_tables()
        metrics = (*DPO_METRICS, NLL_METRIC)
        self.val_metrics = torch.nn.ModuleDict({n.replace("/", "__"): MeanMetric() for n in metrics})
        self.test_metrics = torch.nn.ModuleDict({n.replace("/", "__"): MeanMetric() for n in metrics})
        self._sample_prompts: list[torch.Tensor] = []

    # -- the algorithm -----------------------------------------------------------------------------
    def _step(self, batch: dict[str, torch.Tensor], split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One DPO loss on a (2B, L) batch of B pairs."""
        hp = self.hparams
        # 1. Policy log-probs of chosen and rejected responses, one forward over the 2B rows (or the B
        #    rows [prompt | chosen | rejected] of the shared-prompt layout).
        layout = self._pair_layout(self.model, batch)
        logps, n_tokens = self._logprobs(self.model, batch, layout)  # (2B,), (2B,)
        # 2. Reference log-probs: looked up (precomputed) or one frozen forward; none for SimPO.
        ref_logps = None if hp.loss_type == "simpo" else self._reference_logps(batch, split, layout)  # (2B,)
        chosen_sums, chosen_tokens = logps.chunk(2)[0], n_tokens.chunk(2)[0]  # (B,), (B,)
        # 3. IPO and SimPO compare per-token (length-averaged) log-probs.
        if hp.loss_type in ("ipo", "simpo"):
            logps = logps / n_tokens.clamp(min=1)  # (2B,)
            ref_logps = None if ref_logps is None else ref_logps / n_tokens.clamp(min=1)  # (2B,)
        # 4. The preference loss on the B pairs (chosen rows first).
        policy_chosen, policy_rejected = logps.chunk(2)  # (B,), (B,)
        ref_chosen, ref_rejected = (None, None) if ref_logps is None else ref_logps.chunk(2)  # (B,), (B,)
        loss, stats = dpo_loss(
            policy_chosen,
            policy_rejected,
            ref_chosen,
            ref_rejected,
            beta=hp.beta,
            loss_type=hp.loss_type,
            label_smoothing=hp.label_smoothing,
            simpo_gamma=hp.simpo_gamma,
        )
        # 5. RPO: the chosen responses' per-token NLL (nll_coef > 0).
        if hp.nll_coef:
            nll = chosen_nll(chosen_sums, chosen_tokens)  # ()
            loss, stats[NLL_METRIC] = loss + hp.nll_coef * nll, nll.detach()
        return loss, stats

    def _pair_layout(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> SharedPrefixLayout | None:
        """The shared-prompt layout of the batch's pairs when ``shared_prefix`` packs them, else None."""
        return pair_layout(
            model, self.hparams.shared_prefix, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
            self.tokenizer.pad_token_id,
        )  # fmt: skip

    def _logprobs(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], layout: SharedPrefixLayout | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(2B,) summed response log-probs and (2B,) response lengths: packed when ``layout`` fits ``model``,
        else in length-bucketed micro-batches of the padded rows."""
        if layout is not None and layout_fits(model, layout):
            return packed_response_logprobs(model, layout)
        columns = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        return self.per_row(partial(response_logprobs, model), batch["attention_mask"], *columns)

    @torch.no_grad()
    def _reference_logps(
        self, batch: dict[str, torch.Tensor], split: str, layout: SharedPrefixLayout | None
    ) -> torch.Tensor:
        """(2B,) float32 reference log-probs of the batch's rows, summed over their response tokens."""
        if self.hparams.precompute_ref_logprobs:
            return self._lookup(batch, split)
        return self._score_reference(batch, layout)

    def _score_reference(
        self, batch: dict[str, torch.Tensor], layout: SharedPrefixLayout | None = None
    ) -> torch.Tensor:
        model = self.reference if self.reference is not None else self.model
        # a LoRA policy with its adapters disabled is the initial policy
        context = reference_logits_context(unwrap(self.model)) if self.reference is None else nullcontext()
        with torch.no_grad(), context:
            logps, _ = self._logprobs(model, batch, layout)
        return logps

    # -- Lightning hooks ---------------------------------------------------------------------------
    @override
    def on_fit_start(self) -> None:
        if self.hparams.precompute_ref_logprobs:
            self._precompute_for_fit()

    @override
    def on_validation_start(self) -> None:
        if self.hparams.precompute_ref_logprobs:
            self._precompute(("val",))  # validate() without fit(), or with another data module

    @override
    def on_test_start(self) -> None:
        if self.hparams.precompute_ref_logprobs:
            self._precompute(("test",))

    @override
    def configure_model(self) -> None:
        shard_models(self, ("model", "reference"))

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, stats = self._step(batch, "train")
        pairs = batch["input_ids"].shape[0] // 2
        self.log("train/loss", loss, prog_bar=True, sync_dist=True, batch_size=row_weight(pairs))
        self.log_dict({f"train/{k}": v for k, v in stats.items()}, sync_dist=True, batch_size=row_weight(pairs))
        return loss

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
        loss, stats = self._step(batch, stage)
        pairs = batch["input_ids"].shape[0] // 2
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True, batch_size=row_weight(pairs))
        metrics = getattr(self, f"{stage}_metrics")
        for name, value in stats.items():
            metrics[name.replace("/", "__")].update(value, pairs)
        if batch_idx == 0 and self.hparams.num_samples:
            self._sample_prompts = prompts_from_batch(batch, self.hparams.num_samples)

    def _eval_epoch_end(self, stage: str) -> None:
        """Split means of the metrics (all pairs of all ranks) and the ``{stage}/samples`` table."""
        for key, metric in getattr(self, f"{stage}_metrics").items():
            if metric.update_called:
                self.log(f"{stage}/{key.replace('__', '/')}", metric.compute(), prog_bar=key.endswith("accuracies"))
            metric.reset()
        if self._sample_prompts and not self.trainer.sanity_checking:
            texts = self.generate_text(self._sample_prompts, self.hparams.sample_max_new_tokens)
            log_text_table(self, f"{stage}/samples", ["prompt", "completion"], texts, step=logger_step(self.trainer))
        self._sample_prompts = []

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if not is_sharded_checkpoint(self):
            for key in [k for k in checkpoint["state_dict"] if k.startswith("reference.")]:
                del checkpoint["state_dict"][key]


def _validate(
    reference: ModelSpec | None,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    simpo_gamma: float,
    precompute: bool,
    num_samples: int,
) -> None:
    """Check DPOModule's arguments at construction, with messages naming the argument."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"DPOModule: loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not beta > 0:
        raise ValueError(f"DPOModule: beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"DPOModule: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("DPOModule: label_smoothing is not defined for loss_type='ipo'")
    if simpo_gamma < 0 or (simpo_gamma and loss_type != "simpo"):
        raise ValueError(f"DPOModule: simpo_gamma must be >= 0 and needs loss_type='simpo', got {simpo_gamma}")
    if loss_type == "simpo" and (reference is not None or precompute):
        raise ValueError(
            "DPOModule: loss_type='simpo' is reference-free; leave reference=None and precompute_ref_logprobs=False"
        )
    if num_samples < 0:
        raise ValueError(f"DPOModule: num_samples must be >= 0, got {num_samples}")

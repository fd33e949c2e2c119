"""The update phase of :class:`~lit_rlhf.modules.online.OnlineRLModule`: epochs of minibatch steps over the
buffered rollout, in micro-batches, with the non-finite guard, the loss contract and the engine's weight
sync after the update.

Shapes: B rollout rows, T response length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import torch
from lightning.pytorch import LightningModule
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.guards import check_finite_weights
from lit_rlhf.models.embedding_grads import EmbeddingGradAccumulator
from lit_rlhf.models.fused_head import head_grads_in_place
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.distributed import clip_grad_norm
from lit_rlhf.modules.metrics import accumulate_stats
from lit_rlhf.rollout import Rollout

# part -> (loss, stats); the loss is one tensor in the unit of ``micro_batch_weight`` or, where it adds terms that
# are means over learned tokens to a loss of another unit (a sequence-mean policy loss), the pair (loss in that
# unit, token-mean terms)
LossFn = Callable[[Rollout], tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]]


@internal_base
class OnlineUpdate(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's ``buffer``, ``update``, ``step_guard``, ``engine``,
    ``update_metrics``, ``loss_stats``, ``micro_batches``, ``rollouts_done``, ``actor``)."""

    # the update's minibatches hold whole prompts (all K responses of each), not rows (online DPO's pairs)
    minibatches_of_prompts: ClassVar[bool] = False
    # stats in the unit of ``micro_batch_weight`` (the loss's own: rows under a sequence-mean aggregation,
    # online DPO's pairs); the others are means over learned tokens, weighted by the micro-batch's tokens
    loss_unit_stats: ClassVar[frozenset[str]] = frozenset({"policy_loss", "kl_loss"})

    def check_precision_fit(self) -> None:
        """Refuse fp16 mixed precision with a gradient scaler (``16-mixed`` on a GPU): in manual optimisation the
        gradients are clipped and screened while still scaled (the scaler unscales inside ``step``), so every
        update would shrink by the scale. ``bf16-mixed`` needs no scaler."""
        if getattr(self.trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"{type(self).__name__}: precision 16-mixed (fp16 with a gradient scaler) is not supported by the "
                "online modules' manual optimisation, which clips the gradients before the scaler would unscale them; "
                "use bf16-mixed (or 32-true)"
            )

    def rollout_prompts(self) -> int | None:
        """The prompts of one rollout on this rank: the data module's ``batch_size``, else that of the training
        DataLoader once the fit has loaded it (from ``on_train_start`` on); None where neither tells."""
        batch = getattr(getattr(getattr(self.trainer, "datamodule", None), "hparams", None), "batch_size", None)
        if isinstance(batch, int):
            return batch
        batch = getattr(self.trainer.train_dataloader, "batch_size", None)
        return batch if isinstance(batch, int) else None

    def check_minibatches_fit(self) -> None:
        """Refuse, when the fit sets up, ``update.num_minibatches`` above what a rollout of the data module's
        ``batch_size`` prompts can be split into (the replay buffer would refuse it after the first rollout),
        and a ``kl.horizon`` too small for such a rollout (:meth:`check_kl_horizon_fit`)."""
        batch = self.rollout_prompts()
        if batch is None:
            return
        K = self.num_samples
        units, what = (batch, "prompts") if self.minibatches_of_prompts else (batch * K, "rows")
        if units < self.update.num_minibatches:
            raise ValueError(
                f"{type(self).__name__}: update.num_minibatches={self.update.num_minibatches} is more than a "
                f"rollout's {units} {what} (the data's batch_size {batch}, generation.num_samples {K}): each "
                "minibatch needs at least one"
            )
        self.check_kl_horizon_fit()

    def check_kl_horizon_fit(self) -> None:
        """Refuse an adaptive KL controller (``kl.target``) whose ``kl.horizon`` a rollout would overrun.

        Each rollout moves the coefficient by the factor 1 + error x n / horizon (error in [-0.2, 0.2],
        n the rollout's rows over all ranks: ``functional.AdaptiveKLController``), which is 0 or negative
        from n >= 5 x horizon on: the controller would stop the fit after the first rollout's update. Checked
        when the fit sets up (a data module's ``batch_size``) and again when training starts (a plain
        DataLoader's); nothing is checked where neither tells the batch size.
        """
        prompts = self.rollout_prompts()
        if self.kl.target is None or prompts is None:
            return
        K, world = self.num_samples, self.trainer.world_size
        rows = prompts * K * world
        if rows >= 5 * self.kl.horizon:
            raise ValueError(
                f"{type(self).__name__}: kl.horizon={self.kl.horizon} is too small for a rollout of {rows} rows (the"
                f" data's batch_size {prompts} x generation.num_samples {K} x {world} process(es)): the adaptive"
                f" KL controller of kl.target moves its coefficient by up to 20% x rows / horizon per rollout,"
                f" which must stay below 100%; use kl.horizon >= {rows // 5 + 1}"
            )

    @override
    def on_train_start(self) -> None:
        """The checks of :meth:`check_kl_horizon_fit` with the training DataLoader's batch size (a fit given
        a plain DataLoader, whose batch size the setup did not know), then the other bases' hooks."""
        self.check_kl_horizon_fit()
        super().on_train_start()

    def run_update_epochs(
        self, loss_fn: LossFn, optimized: Sequence[tuple[torch.optim.Optimizer, torch.nn.Module]]
    ) -> float:
        """``update.epochs`` passes over shuffled minibatches of the buffered rollout, one optimiser step each.

        Each minibatch is processed in micro-batches of at most ``scoring.forward_batch_size`` rows
        (length-bucketed and trimmed under ``scoring.bucketing``, see :meth:`micro_batches`) whose losses are
        weighted by their share of the minibatch (learned tokens, or rows for the sequence-mean
        aggregations), so the accumulated gradient equals the minibatch's loss. A minibatch whose mean ratio
        exceeds ``update.ratio_threshold`` is skipped (``skipped_minibatches``); one whose loss or gradient
        is not finite on any rank is never stepped, on any optimiser (``nonfinite_steps``). Afterwards every
        trained model is checked for non-finite weights, and the engine (asleep during the update) wakes up
        and, when an optimiser step was taken, syncs the actor's new weights. Returns the mean
        KL(old || new) of the last epoch.
        """
        params = [p for opt, _ in optimized for group in opt.param_groups for p in group["params"]]
        stepped = False
        self.engine.sleep()
        # one process: the input embeddings' gradients accumulate row by row in place (models.embedding_grads),
        # the fused LM head's micro-batch by micro-batch (models.fused_head)
        rowwise = self.update.embedding_grads == "auto" and self.trainer.world_size == 1
        embeddings = EmbeddingGradAccumulator([m for _, m in optimized], enabled=rowwise)
        with embeddings, head_grads_in_place(rowwise):
            for _ in range(self.update.epochs):
                epoch_kl = []
                for mb in self.buffer.minibatches():
                    stats, took_step = self.minibatch_step(loss_fn, mb, optimized, params)
                    stepped |= took_step
                    epoch_kl.append(stats["policy_kl"])
        for _, model in optimized:
            check_finite_weights(model, f"rollout {self.rollouts_done + 1}: {type(model).__name__} after the update")
        self.engine.wake_up()
        if stepped:
            self.engine.sync_weights(self.actor)
        return torch.stack(epoch_kl).mean().item()

    def minibatch_step(
        self, loss_fn: LossFn, mb: Rollout, optimized: Sequence[tuple[torch.optim.Optimizer, torch.nn.Module]],
        params: list[torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], bool]:
        """Accumulate minibatch ``mb``'s gradient, then step every optimiser unless the step is skipped or not
        finite; the gradients are removed either way. Returns the minibatch's stats and whether it stepped."""
        update = self.update
        stats = self.accumulate_minibatch(loss_fn, mb)
        skip = False
        if update.ratio_threshold is not None:  # one decision for every rank (the mean of their ratios), or the
            # data-parallel copies of the model part ways: a rank that skips while another steps
            ratio = torch.as_tensor(stats["ratio_mean"], dtype=torch.float32, device=self.device).detach().clone()
            skip = bool(self.trainer.strategy.reduce(ratio, reduce_op="mean") > update.ratio_threshold)
        reduce = partial(self.trainer.strategy.reduce_boolean_decision, all=True)
        finite = self.step_guard.allow_step(params, reduce)  # removes the gradients if not
        if finite and not skip:
            for opt, model in optimized:
                if update.max_grad_norm is not None:
                    clip_grad_norm(self, opt, model, update.max_grad_norm)
                opt.step()
        for opt, _ in optimized:
            opt.zero_grad(set_to_none=True)
        self.update_metrics.update({**stats, "skipped_minibatches": float(skip), "nonfinite_steps": float(not finite)})
        return stats, finite and not skip

    def accumulate_minibatch(self, loss_fn: LossFn, mb: Rollout) -> dict[str, torch.Tensor]:
        """Backward of one minibatch's loss, micro-batch by micro-batch; returns its weighted stats."""
        stats: dict[str, torch.Tensor] = {}
        # a prompt's K rows stay in one micro-batch when the buffer keeps groups (shared-prompt layout)
        T, K = mb.response_mask.shape[1], self.buffer.group_size
        for rows, columns, t in self.micro_batches(mb.attention_mask, T, K):
            part = mb.select(rows).crop(columns, t)
            weight = self.micro_batch_weight(part, mb)
            tokens = F.aggregation_weight(part.loss_mask, mb.loss_mask, "token_mean")  # the token-mean terms' share
            loss, part_stats = loss_fn(part)
            self.check_stats(part_stats)
            if isinstance(loss, tuple):  # (loss in the weight's unit, token-mean terms)
                loss, token_terms = loss
                self.step_guard.observe_loss(loss + token_terms)
                self.manual_backward(loss * weight + token_terms * tokens)
            else:
                self.step_guard.observe_loss(loss)
                self.manual_backward(loss * weight)
            in_unit = {k: v for k, v in part_stats.items() if k in self.loss_unit_stats}
            accumulate_stats(stats, in_unit, weight)
            accumulate_stats(stats, {k: v for k, v in part_stats.items() if k not in in_unit}, tokens)
        return stats

    def micro_batch_weight(self, part: Rollout, mb: Rollout) -> torch.Tensor:
        """The share of micro-batch ``part`` in minibatch ``mb``'s loss (``functional.aggregation_weight`` under
        ``update.loss_aggregation``); a loss that is a mean over other units (online DPO's pairs) overrides it."""
        return F.aggregation_weight(part.loss_mask, mb.loss_mask, self.update.loss_aggregation)

    def check_stats(self, stats: dict[str, torch.Tensor]) -> None:
        """The loss returned the stats the update loop reads and only declared ones (``loss_stats``)."""
        name = type(self).__name__
        missing = [s for s in self.required_stats(self.update) if s not in stats]
        if missing:
            raise KeyError(f"{name}: its loss returned no {missing} (returned {sorted(stats)}); the update loop reads them")
        undeclared = sorted(set(stats) - set(self.loss_stats))
        if undeclared:
            raise KeyError(f"{name}: its loss returned undeclared stat(s) {undeclared}; add them to `loss_stats`")

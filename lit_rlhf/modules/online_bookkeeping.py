"""Bookkeeping of :class:`~lit_rlhf.modules.online.OnlineRLModule` that is not the algorithm: rollout metrics
and sample tables, checkpoint state for an exact resume, and the Hugging Face export."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import export_pretrained
from lit_rlhf.modules.base import drop_frozen_weights, internal_base
from lit_rlhf.modules.distributed import gather_for_export, is_sharded_checkpoint, unwrap
from lit_rlhf.modules.online_eval import set_rng_state
from lit_rlhf.modules.optim import resolve_total_steps
from lit_rlhf.modules.samples import log_text_table
from lit_rlhf.rollout import Rollout


@internal_base
class OnlineBookkeeping(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's attributes: ``rollout_metrics``, ``update_metrics``,
    ``metric_prefix``, ``num_samples``, ``kl_ctl``, ``buffer``, ``rollouts_done``, ``step_guard``, ``actor``,
    ``tokenizer``, ``rewards``, ``samples``, ``max_rollouts``)."""

    # -- metrics and samples --------------------------------------------------------------------------
    def log_rollout_stats(
        self,
        sample: Any,
        scores: torch.Tensor,
        sequence_rewards: torch.Tensor,
        kl: torch.Tensor,
        entropy: torch.Tensor,
        old_logprobs: torch.Tensor,
    ) -> None:
        """Rollout-level metrics of a ``Sample`` (``online.Sample``), reduced across ranks by torchmetrics:
        KL and entropy over the learned tokens, lengths over the response tokens, group statistics when
        K >= 2, the engine-vs-trainer mismatch when the engine gave behaviour log-probs and a trainer forward
        computed ``old_logprobs`` (not when they are the sampler's record, ``old_logprobs_sampled``: only
        ``kept_mass_mean`` then), and the engine's own timings (``RolloutEngine.stats``: ``engine_generate_s``, ``engine_sync_s``) when it reports them."""
        responses, mask = sample.responses, sample.loss_mask
        stats = {
            "score": scores.mean(),
            "reward": sequence_rewards.mean(),
            "kl_ref": F.masked_row_sum(kl, mask).mean(),
            "response_length": responses.mask.sum(1).float().mean(),
            "eos_rate": 1.0 - responses.truncated.float().mean(),
            "entropy": F.masked_mean(entropy, mask),
        }
        if self.num_samples >= 2:
            stats["group_score_std"], stats["group_all_equal_frac"] = F.group_score_stats(
                scores, self.num_samples
            )
        if responses.logprobs is not None:
            mismatch = F.behavior_mismatch_stats(old_logprobs, responses.logprobs, responses.log_kept_mass, mask)
            if self.old_logprobs_sampled:  # old_logprobs is the sampler's own record: 0 / 1 by construction
                mismatch = {"kept_mass_mean": mismatch["kept_mass_mean"]}
            stats.update(mismatch)
        stats.update({f"engine_{name}": value for name, value in self.engine.stats().items()})
        if sample.episodes is not None:  # turns, tool calls and errors, observation tokens, how episodes ended
            stats.update(sample.episodes.metrics())
        self.rollout_metrics.update(stats)

    def build_rollout(self, sample: Any, old_logprobs, ref_logprobs, advantages, scores, **fields: Any) -> Rollout:
        """The Rollout of a ``Sample`` and its scoring (``old_values``, ``rewards``, ``returns`` as given),
        with the weights of the engine/trainer correction when ``update.is_correction`` applies to it."""
        return Rollout(
            sample.input_ids, sample.attention_mask, sample.responses.mask, old_logprobs, ref_logprobs,
            fields.get("old_values"), fields.get("rewards"), advantages, fields.get("returns"), scores,
            loss_mask=sample.loss_mask, behavior_logprobs=sample.responses.logprobs,
            is_weights=self.is_correction_weights(sample, old_logprobs),
        )  # fmt: skip

    def correction_mode(self, responses: Any) -> str | None:
        """The ``update.is_correction`` mode of a rollout of these ``Responses`` (None: uncorrected)."""
        truncates = self.generation.top_k > 0 or self.generation.top_p < 1.0
        return self.update.is_correction.resolve(self.engine, responses, type(self).__name__, truncates)

    def is_correction_weights(self, sample: Any, old_logprobs: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) weights pi_old / mu of a ``Sample``'s learned tokens (``functional.is_correction_weights``),
        their statistics logged as ``rollout/is_*``; None when the rollout is uncorrected."""
        mode = self.correction_mode(sample.responses)
        if mode is None:
            return None
        if old_logprobs is None:
            raise RuntimeError(
                f"{type(self).__name__}: a corrected rollout needs the old log-probs of the scoring forward"
            )
        settings, responses = self.update.is_correction, sample.responses
        weights, stats = F.is_correction_weights(
            old_logprobs, responses.logprobs, responses.log_kept_mass, sample.loss_mask, mode,
            settings.cap, settings.low, settings.sequence_ratio,
        )  # fmt: skip
        self.rollout_metrics.update(stats)
        return weights

    def optimizers_and_schedulers(self, models: list[torch.nn.Module], factories) -> Any:
        """``configure_optimizers``'s return for ``models`` and their (optimiser, scheduler) factories: one
        optimiser each over its trainable parameters, and the schedules stretched to the run's length."""
        optimizers, schedulers = [], []
        for model, (optimizer_fn, scheduler_fn) in zip(models, factories):
            optimizers.append(optimizer_fn([p for p in model.parameters() if p.requires_grad]))
            if scheduler_fn is not None:
                schedulers.append(scheduler_fn(optimizers[-1]))
                resolve_total_steps(schedulers[-1], self.planned_rollouts(len(models)))
        if len(optimizers) == 1 and not schedulers:
            return optimizers[0]
        return optimizers, schedulers

    def planned_rollouts(self, n_optimizers: int) -> int | float:
        """The rollouts this fit runs, the length of the run-length schedules (which step once a rollout).

        ``max_rollouts``, else the trainer's limits in rollouts: a rollout is one training batch, so
        ``max_epochs`` counts passes over the prompts, but ``max_steps`` counts optimiser steps,
        ``update.epochs x update.num_minibatches`` per optimiser per rollout (a skipped minibatch makes the
        run one step longer than planned; the schedule then stays at its end value).
        """
        if self.max_rollouts is not None:
            return self.max_rollouts
        trainer = self.trainer
        by_epochs = trainer.estimated_stepping_batches  # training batches, capped at max_steps
        if trainer.max_steps is None or trainer.max_steps < 0:
            return by_epochs
        per_rollout = self.update.epochs * self.update.num_minibatches * n_optimizers
        return min(by_epochs, math.ceil(trainer.max_steps / per_rollout))

    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        """Per-rollout values of the controllers and learning rates (without prefix)."""
        return {"kl_coef": torch.tensor(self.kl_ctl.value, dtype=torch.float32)}

    def finish_rollout(self, prompts, responses, response_mask, scores, schedule=None) -> None:
        """Log the rollout's metrics and (every ``log_samples_every`` rollouts) a sample table; count it.
        ``schedule``: the ``schedule_metrics`` this rollout used, taken before its controllers and schedulers
        advanced (None: read now)."""
        metrics = {f"rollout/{k}": v for k, v in self.rollout_metrics.compute_and_reset().items()}
        updates = {**self.update_metrics.compute_and_reset(), **(schedule or self.schedule_metrics())}
        metrics.update({f"{self.metric_prefix}/{k}": v for k, v in updates.items()})
        self.log_dict(metrics, prog_bar=False, batch_size=responses.shape[0])
        self.log("score", metrics["rollout/score"], prog_bar=True, logger=False)
        self.log("kl", metrics["rollout/kl_ref"], prog_bar=True, logger=False)
        self.rollouts_done += 1
        every, n = self.samples.every, self.samples.rows
        if every and n and (self.rollouts_done - 1) % every == 0:
            texts = self.tokenizer.batch_decode(prompts[:n], skip_special_tokens=True)
            answers = self.rewards.decode_responses(responses[:n], response_mask[:n])
            rows = [(p, r, f"{s:.3f}") for p, r, s in zip(texts, answers, scores[:n].tolist())]
            log_text_table(self, "rollout/samples", ["prompt", "response", "score"], rows)
        if self.max_rollouts is not None and self.rollouts_done >= self.max_rollouts:
            self.trainer.should_stop = True

    # -- Lightning hooks: limits, checkpoints, export -------------------------------------------------
    @override
    def on_train_start(self) -> None:
        """After a resume, stretch run-length schedules to the (possibly larger) ``max_rollouts`` of this run."""
        total = self.planned_rollouts(len(self.trainer.optimizers))
        for scheduler in self.lr_schedulers_list():
            resolve_total_steps(scheduler, total)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Stop before a rollout past ``max_rollouts`` (e.g. when resuming an end-of-run checkpoint)."""
        limit = self.max_rollouts
        if limit is not None and self.rollouts_done >= limit:
            self.trainer.should_stop = True
            return -1  # Lightning skips the rest of the epoch; should_stop ends the fit
        # log at the rollout index (one batch, one rollout): after resuming a run whose max_rollouts ended it
        # inside a validation, Lightning's logging step trails it by one (that step's increment is not replayed)
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.rollouts_done
        return None

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not is_sharded_checkpoint(self):  # a sharded checkpoint must hold every key (see there)
            for prefix in ("reference.", "rewards.", "monitor."):
                for key in [k for k in checkpoint["state_dict"] if k.startswith(prefix)]:
                    del checkpoint["state_dict"][key]
            for name, model in self.lora_models().items():  # rebuilt from their specs on resume
                drop_frozen_weights(checkpoint, model, f"{name}.")
        checkpoint["online_state"] = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "buffer": self.buffer.state_dict(),
            "rollouts_done": self.rollouts_done,
            "step_guard": self.step_guard.state_dict(),
            "rng_seed": self.rng_seed,  # as resolved (rng_seed=None follows seed_everything)
            # generate() samples from the global RNG; restoring it makes a resumed run sample identically
            # (during an evaluation, the training stream held aside: see OnlineEvaluation)
            **self.training_rng_state(),
            "rng_at_epoch_end": self.at_epoch_end(),
        }

    def at_epoch_end(self) -> bool:
        """Whether this epoch's last batch is done: the next rollout comes from a new epoch, whose DataLoader
        iterator first draws its base seed from the global RNG (``torch.utils.data``'s ``_BaseDataLoaderIter``)."""
        trainer = self._trainer
        if trainer is None or trainer.sanity_checking or not trainer.training and not trainer.validating:
            return False
        # processed: counted once the step ran (the step-start snapshot of a fault checkpoint has not yet)
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed >= trainer.num_training_batches

    def lora_models(self) -> dict[str, torch.nn.Module]:
        """Attribute name -> trained LoRA (peft) model of the module (the actor, a PPO critic): their frozen
        base weights are left out of checkpoints (README: rebuilt from the model spec on resume)."""
        from peft import PeftModel

        return {name: child for name, child in self.named_children() if isinstance(unwrap(child), PeftModel)}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # checkpoints of earlier versions hold the actor a second time, as the engine's model: not a weight
        for key in [k for k in checkpoint.get("state_dict", {}) if k.startswith("_engine_model.")]:
            del checkpoint["state_dict"][key]
        self.check_fixed_on_resume(checkpoint)
        state = self.online_state(checkpoint)
        self.step_guard.load_state_dict(state.get("step_guard", {}))
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.buffer.load_state_dict(state["buffer"])
        self.rollouts_done = state["rollouts_done"]
        saved_seed = state.get("rng_seed", self.rng_seed)
        if saved_seed != self.rng_seed:
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint was written with rng_seed={saved_seed}, this module has"
                f" rng_seed={self.rng_seed}: weights rebuilt rather than loaded (frozen reference or reward"
                f" models of random init) may differ. Pass rng_seed={saved_seed} (or the run's seed_everything)."
            )
        # applied at the next training_step, after Lightning has finished restoring and set up the data
        self._rng_to_restore = {k: state.get(k) for k in ("torch_rng", "cuda_rng", "python_rng", "numpy_rng")}
        self._rng_to_restore["at_epoch_end"] = state.get("rng_at_epoch_end", False)

    def check_fixed_on_resume(self, checkpoint: dict[str, Any]) -> None:
        """K (``generation.num_samples``) cannot change on resume: the replay buffer's shuffling, the group
        baselines and the prompt position all assume the checkpoint's (the CLI checks this earlier too)."""
        generation = (checkpoint.get("hyper_parameters") or {}).get("generation")
        saved = generation.get("num_samples") if isinstance(generation, dict) else None
        if saved is not None and saved != self.num_samples:
            raise ValueError(
                f"{type(self).__name__}: generation.num_samples (K) cannot change on resume: the checkpoint has "
                f"{saved}, this module {self.num_samples}; start a new run to change it"
            )

    @staticmethod
    def online_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The online modules' part of a checkpoint (``ppo_state`` in checkpoints of earlier versions)."""
        return checkpoint["online_state"] if "online_state" in checkpoint else checkpoint["ppo_state"]

    def restore_rng(self) -> None:
        """Apply the RNG state of a resumed checkpoint (once, at the first rollout after loading); after a
        checkpoint of an epoch's last rollout, with the draw the uninterrupted run's next DataLoader iterator made
        (:meth:`at_epoch_end`; not with persistent workers, whose iterator is reset without one)."""
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            loader = self.trainer.train_dataloader
            if self._rng_to_restore.get("at_epoch_end") and not getattr(loader, "persistent_workers", False):
                # the uninterrupted run's new epoch iterator drew this (a resumed one drew it before the restore)
                torch.empty((), dtype=torch.int64).random_()
            self._rng_to_restore = None

    def exported_models(self) -> dict[str, torch.nn.Module | None]:
        """Sub-folder name -> model written by :meth:`export_pretrained`."""
        return {"actor": self.actor}

    def export_pretrained(self, folder: str) -> None:
        """Write ``folder/actor`` (AutoModelForCausalLM) and the subclass's other trained models."""
        for name, model in self.exported_models().items():
            full = None if model is None else gather_for_export(self, model)  # collective under FSDP
            if full is not None:
                export_pretrained(full, self.tokenizer, f"{folder}/{name}")

"""Bookkeeping of :class:`~lit_rlhf.modules.online.OnlineRLModule` that is not the algorithm: rollout metrics
and sample tables, checkpoint state for an exact resume, and the Hugging Face export."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import export_pretrained
from lit_rlhf.modules.base import drop_frozen_weights, internal_base
from lit_rlhf.modules.distributed import gather_for_export, is_sharded_checkpoint
from lit_rlhf.modules.optim import resolve_total_steps
from lit_rlhf.modules.samples import log_text_table


@internal_base
class OnlineBookkeeping(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's attributes: ``rollout_metrics``, ``update_metrics``,
    ``metric_prefix``, ``num_samples``, ``kl_ctl``, ``buffer``, ``rollouts_done``, ``step_guard``, ``actor``, ``tokenizer``, ``rewards``)."""

    # -- metrics and samples --------------------------------------------------------------------------
    def log_rollout_stats(
        self,
        scores: torch.Tensor,
        sequence_rewards: torch.Tensor,
        kl: torch.Tensor,
        response_mask: torch.Tensor,
        truncated: torch.Tensor,
        entropy: torch.Tensor,
    ) -> None:
        """Rollout-level metrics, reduced across ranks by torchmetrics; group statistics when K >= 2."""
        stats = {
            "score": scores.mean(),
            "reward": sequence_rewards.mean(),
            "kl_ref": F.masked_row_sum(kl, response_mask).mean(),
            "response_length": response_mask.sum(1).float().mean(),
            "eos_rate": 1.0 - truncated.float().mean(),
            "entropy": F.masked_mean(entropy, response_mask),
        }
        if self.num_samples >= 2:
            stats["group_score_std"], stats["group_all_equal_frac"] = F.group_score_stats(
                scores, self.num_samples
            )
        self.rollout_metrics.update(stats)

    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        """Per-rollout values of the controllers and learning rates (without prefix)."""
        return {"kl_coef": torch.tensor(self.kl_ctl.value)}

    def finish_rollout(self, prompts, responses, response_mask, scores) -> None:
        """Log the rollout's metrics and (every ``log_samples_every`` rollouts) a sample table; count it."""
        metrics = {f"rollout/{k}": v for k, v in self.rollout_metrics.compute_and_reset().items()}
        updates = {**self.update_metrics.compute_and_reset(), **self.schedule_metrics()}
        metrics.update({f"{self.metric_prefix}/{k}": v for k, v in updates.items()})
        self.log_dict(metrics, prog_bar=False, batch_size=responses.shape[0])
        self.log("score", metrics["rollout/score"], prog_bar=True, logger=False)
        self.log("kl", metrics["rollout/kl_ref"], prog_bar=True, logger=False)
        self.rollouts_done += 1
        every, n = self.hparams.log_samples_every, self.hparams.num_log_samples
        if every and n and (self.rollouts_done - 1) % every == 0:
            texts = self.tokenizer.batch_decode(prompts[:n], skip_special_tokens=True)
            answers = self.rewards.decode_responses(responses[:n], response_mask[:n])
            rows = [(p, r, f"{s:.3f}") for p, r, s in zip(texts, answers, scores[:n].tolist())]
            log_text_table(self, "rollout/samples", ["prompt", "response", "score"], rows)
        if self.hparams.max_rollouts is not None and self.rollouts_done >= self.hparams.max_rollouts:
            self.trainer.should_stop = True

    # -- Lightning hooks: limits, checkpoints, export -------------------------------------------------
    @override
    def on_train_start(self) -> None:
        """After a resume, stretch run-length schedules to the (possibly larger) ``max_rollouts`` of this run."""
        total = self.hparams.max_rollouts or self.trainer.estimated_stepping_batches
        for scheduler in self.lr_schedulers_list():
            resolve_total_steps(scheduler, total)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Stop before a rollout past ``max_rollouts`` (e.g. when resuming an end-of-run checkpoint)."""
        limit = self.hparams.max_rollouts
        if limit is not None and self.rollouts_done >= limit:
            self.trainer.should_stop = True
            return -1  # Lightning skips the rest of the epoch; should_stop ends the fit
        return None

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not is_sharded_checkpoint(self):  # a sharded checkpoint must hold every key (see there)
            for prefix in ("reference.", "rewards.", "monitor."):
                for key in [k for k in checkpoint["state_dict"] if k.startswith(prefix)]:
                    del checkpoint["state_dict"][key]
            if self.actor_lora:
                drop_frozen_weights(checkpoint, self.actor, "actor.")
        checkpoint["online_state"] = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "buffer": self.buffer.state_dict(),
            "rollouts_done": self.rollouts_done,
            "step_guard": self.step_guard.state_dict(),
            "rng_seed": self.rng_seed,  # as resolved (rng_seed=None follows seed_everything)
            # generate() samples from the global RNG; restoring it makes a resumed run sample identically
            # (during an evaluation, the training stream held aside: see OnlineEvaluation)
            **self.training_rng_state(),
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["online_state"] if "online_state" in checkpoint else checkpoint["ppo_state"]
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
        self._rng_to_restore = (state["torch_rng"], state["cuda_rng"])

    def restore_rng(self) -> None:
        """Apply the RNG state of a resumed checkpoint (once, at the first rollout after loading)."""
        if self._rng_to_restore is not None:
            cpu, cuda = self._rng_to_restore
            torch.set_rng_state(cpu)
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
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

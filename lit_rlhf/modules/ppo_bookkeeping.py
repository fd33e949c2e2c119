"""Bookkeeping of :class:`~lit_rlhf.modules.ppo.PPOModule` that is not the algorithm: rollout metrics and
sample tables, checkpoint state for an exact resume, and the Hugging Face export."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule

from lit_rlhf import functional as F
from lit_rlhf.models import export_pretrained
from lit_rlhf.modules.base import drop_frozen_weights
from lit_rlhf.modules.distributed import gather_for_export, is_sharded_checkpoint
from lit_rlhf.modules.ppo_parts import masked_row_sum
from lit_rlhf.modules.samples import log_text_table


class PPOBookkeeping(LightningModule):
    """Mixin of PPOModule: metrics, checkpoint state and export (it relies on PPOModule's attributes)."""

    def log_rollout_stats(
        self, scores, rewards, kl, response_mask, truncated, entropy, values, advantages, returns
    ):
        """Rollout-level metrics (before advantage whitening), reduced across ranks by torchmetrics."""
        self.rollout_metrics.update(
            {
                "score": scores.mean(),
                "reward": masked_row_sum(rewards, response_mask).mean(),
                "kl_ref": masked_row_sum(kl, response_mask).mean(),
                "response_length": response_mask.sum(1).float().mean(),
                "eos_rate": 1.0 - truncated.float().mean(),
                "entropy": F.masked_mean(entropy, response_mask),
                "explained_variance": F.explained_variance(values, returns, response_mask),
                "advantages_mean": F.masked_mean(advantages, response_mask),
                "advantages_std": F.masked_var(advantages, response_mask).sqrt(),
                "returns_mean": F.masked_mean(returns, response_mask),
                "values_mean": F.masked_mean(values, response_mask),
            }
        )

    def finish_rollout(self, batch, responses, response_mask, scores) -> None:
        metrics = {f"rollout/{k}": v for k, v in self.rollout_metrics.compute_and_reset().items()}
        for key in ("explained_variance", "advantages_mean", "advantages_std", "returns_mean", "values_mean"):
            metrics[f"ppo/{key}"] = metrics.pop(f"rollout/{key}")
        metrics.update({f"ppo/{k}": v for k, v in self.ppo_metrics.compute_and_reset().items()})
        metrics["ppo/kl_coef"] = torch.tensor(self.kl_ctl.value)
        if self.hparams.policy_loss == "kl_penalty":
            metrics["ppo/beta"] = torch.tensor(self.beta_ctl.value)
        actor_opt, critic_opt = self.optimizers()
        metrics["ppo/lr_actor"] = torch.tensor(actor_opt.param_groups[0]["lr"])
        metrics["ppo/lr_critic"] = torch.tensor(critic_opt.param_groups[0]["lr"])
        self.log_dict(metrics, prog_bar=False, batch_size=responses.shape[0])
        self.log("score", metrics["rollout/score"], prog_bar=True, logger=False)
        self.log("kl", metrics["rollout/kl_ref"], prog_bar=True, logger=False)
        self.rollouts_done += 1
        every, n = self.hparams.log_samples_every, self.hparams.num_log_samples
        if every and n and (self.rollouts_done - 1) % every == 0:
            prompts = self.tokenizer.batch_decode(batch["input_ids"][:n], skip_special_tokens=True)
            texts = self.rewards.decode_responses(responses[:n], response_mask[:n])
            rows = [(p, r, f"{s:.3f}") for p, r, s in zip(prompts, texts, scores[:n].tolist())]
            log_text_table(self, "rollout/samples", ["prompt", "response", "score"], rows)
        if self.hparams.max_rollouts is not None and self.rollouts_done >= self.hparams.max_rollouts:
            self.trainer.should_stop = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if not is_sharded_checkpoint(self):  # a sharded checkpoint must hold every key (see there)
            for prefix in ("reference.", "rewards."):
                for key in [k for k in checkpoint["state_dict"] if k.startswith(prefix)]:
                    del checkpoint["state_dict"][key]
            if self.actor_lora:
                drop_frozen_weights(checkpoint, self.actor, "actor.")
        checkpoint["ppo_state"] = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "beta_ctl": self.beta_ctl.state_dict(),
            "buffer": self.buffer.state_dict(),
            "rollouts_done": self.rollouts_done,
            # generate() samples from the global RNG; restoring it makes a resumed run sample identically
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["ppo_state"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.beta_ctl.load_state_dict(state["beta_ctl"])
        self.buffer.load_state_dict(state["buffer"])
        self.rollouts_done = state["rollouts_done"]
        # applied at the next training_step, after Lightning has finished restoring and set up the data
        self._rng_to_restore = (state["torch_rng"], state["cuda_rng"])

    def _restore_rng(self) -> None:
        if self._rng_to_restore is not None:
            cpu, cuda = self._rng_to_restore
            torch.set_rng_state(cpu)
            if cuda:
                torch.cuda.set_rng_state_all(cuda)
            self._rng_to_restore = None

    def export_pretrained(self, folder: str) -> None:
        """Write ``folder/actor`` (AutoModelForCausalLM) and ``folder/critic`` (when separate)."""
        for name, model in (("actor", self.actor), ("critic", self.critic)):
            full = None if model is None else gather_for_export(self, model)  # collective under FSDP
            if full is not None:
                export_pretrained(full, self.tokenizer, f"{folder}/{name}")

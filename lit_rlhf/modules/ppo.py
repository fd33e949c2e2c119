"""PPO for RLHF as a LightningModule with manual optimisation (Schulman et al. 2017, arXiv:1707.06347;
Ouyang et al. 2022, arXiv:2203.02155).

One ``training_step`` = one rollout: generate responses to a batch of prompts, score them, shape the
rewards with a KL penalty, compute GAE, then run ``update.epochs`` passes over shuffled minibatches.
The parts every online algorithm shares live in :class:`~lit_rlhf.modules.online.OnlineRLModule`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import (
    ModelSpec,
    ValueHead,
    build_score_model,
    critic_values,
    disable_dropout,
    policy_forward,
)
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_settings import GAESettings, PPOUpdate
from lit_rlhf.modules.optim import CriticAdamW, PolicyAdamW
from lit_rlhf.rollout import Rollout

PPO_LOSS_STATS = (
    "policy_loss", "value_loss", "kl_loss", "entropy", "approx_kl", "policy_kl", "clipfrac", "value_clipfrac",
    "ratio_mean", "ratio_max",
)  # fmt: skip
PPO_CRITIC_STATS = ("explained_variance", "advantages_mean", "advantages_std", "returns_mean", "values_mean")


class PPOModule(OnlineRLModule):
    """PPO with an actor, a critic, a frozen reference and a reward model or reward function.

    Besides its own arguments below it takes every argument of
    :class:`~lit_rlhf.modules.online.OnlineRLModule` (``reference``, ``reward_model`` / ``reward_fn``,
    ``monitor_reward_fn``, ``engine``, ``generation``, ``kl``, ``scoring``, ``samples``, ``evaluation``,
    ``max_rollouts``, ``rng_seed``).

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        critic: critic spec; None starts it from the reward model (its value head on the reward model's
            backbone, as InstructGPT does; an ensemble's first member), or from the actor's backbone with a
            fresh head when rewards come from a function.
        share_critic_backbone: a value head on the actor's backbone instead of a separate critic.
        update: the update phase (``PPOUpdate``: epochs, minibatches, clip ranges, loss aggregation, entropy
            bonus, gradient clip, ratio threshold, ``policy_loss`` clip or kl_penalty, value loss, and
            ``is_correction``, the engine/trainer importance-sampling weights of the policy loss).
        advantage: GAE (``GAESettings``: gamma, gae_lambda, whitening of advantages and rewards).
        actor_optimizer: optimiser factory of the actor; default AdamW at lr 1e-6 (``PolicyAdamW``).
        critic_optimizer: optimiser factory of the critic (or the shared value head); default AdamW at
            lr 9e-6 (``CriticAdamW``).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
        critic_scheduler: LR schedule of the critic, stepped once per rollout (None = constant).
    """

    metric_prefix = "ppo"
    loss_stats = PPO_LOSS_STATS
    extra_metrics = PPO_CRITIC_STATS
    settings_groups: ClassVar[dict] = {**OnlineRLModule.settings_groups, "update": PPOUpdate, "advantage": GAESettings}
    packed_forwards = False  # the critic's forward has no shared-prompt form
    sharded_models = ("actor", "critic", "value_head", "reference", "rewards.model", "monitor.model")

    def __init__(
        self,
        actor: ModelSpec | dict | str,
        critic: ModelSpec | dict | str | None = None,
        share_critic_backbone: bool = False,
        update: PPOUpdate | None = None,
        advantage: GAESettings | None = None,
        actor_optimizer: OptimizerCallable = PolicyAdamW,
        critic_optimizer: OptimizerCallable = CriticAdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(actor=actor, update=update, advantage=advantage, **kwargs)
        if share_critic_backbone and critic is not None:
            raise ValueError("PPOModule: share_critic_backbone=True uses a value head on the actor; do not also set critic")
        self.factories = ((actor_optimizer, actor_scheduler), (critic_optimizer, critic_scheduler))
        with self.seeded_init():  # the stream the actor, reference and reward model were built from
            if share_critic_backbone:
                # it reads the LM head's input: OPT projects hidden_size to word_embed_proj_dim before the head
                width = self.actor.get_output_embeddings().weight.shape[1]
                self.critic, self.value_head = None, ValueHead(width)
            else:
                critic_spec = self.shares_tokenizer(critic or self.rewards.model_spec or actor, "critic")
                self.critic, self.value_head = build_score_model(critic_spec, self.tokenizer), None
                disable_dropout(self.critic)
        self.beta_ctl = F.PPOPenaltyKLController(self.update.init_beta, self.update.beta_target)

    # ----------------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.restore_rng()
        advantage = self.advantage
        # 1. Generate responses with the current policy (K per prompt, each prompt's K rows contiguous).
        sample = self.sample(batch)
        ids, attention, mask, T = sample.input_ids, sample.attention_mask, sample.loss_mask, sample.responses.ids.shape[1]
        # 2. Score without gradients: old/ref log-probs, old values, sequence scores.
        old_logprobs, ref_logprobs, old_values, entropy = self.score_rollout(ids, attention, T, responses=sample.responses)
        scores, keep = self.score_responses(ids, attention, T, sample.responses.truncated, sample.columns, sample.env_scores)
        # 3. KL-shaped per-token rewards (InstructGPT, arXiv:2203.02155 eq. 2), then GAE advantages and returns.
        rewards, kl = F.kl_shaped_rewards(scores, old_logprobs, ref_logprobs, mask, self.kl_ctl.value, self.kl.estimator)
        sequence_rewards = F.masked_row_sum(rewards, mask)  # (B,) score - KL penalty, logged unwhitened
        if advantage.whiten_rewards:
            rewards = self.whiten(rewards, mask, shift_mean=False)
        advantages, returns = F.compute_gae(rewards, old_values, mask, advantage.gamma, advantage.gae_lambda)
        self.log_rollout_stats(sample, scores, sequence_rewards, kl, entropy, old_logprobs)
        self.log_critic_stats(old_values, advantages, returns, mask)
        if advantage.whiten:  # over the kept rows (scoring.on_nonfinite: drop)
            advantages = self.whiten(advantages, mask if bool(keep.all()) else mask & keep[:, None])
        rollout = self.build_rollout(
            sample, old_logprobs, ref_logprobs, advantages, scores, old_values=old_values, rewards=rewards, returns=returns
        )
        # 4. PPO epochs over shuffled minibatches of the replay buffer.
        kept = self.drop_rows(rollout, keep)
        self.buffer.put(kept)
        self.run_update_epochs(self.ppo_loss, self.optimized_models())
        self.buffer.clear()
        # 5. Controllers and schedules advance once per rollout (the values this rollout used are logged);
        #    PPO-Penalty's beta from the KL of the updated policy to the rollout's (arXiv:1707.06347 sec. 4).
        schedule = self.schedule_metrics()
        self.update_kl_controller(kl, mask)
        if self.update.policy_loss == "kl_penalty":
            self.beta_ctl.update(self.kl_after_update(kept), n_steps=1)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(sample.prompts, sample.responses.ids, sample.responses.mask, scores, schedule)

    @torch.no_grad()
    def kl_after_update(self, rollout: Rollout) -> float:
        """Mean KL(old || new) over the rollout's learned tokens, the updated actor against the rollout
        policy, over every rank: PPO-Penalty's d, measured after the epochs (the last minibatch's
        ``policy_kl`` is measured before its step: 0 with one step per rollout). The k3 estimate (Schulman
        2020, "Approximating KL divergence"), never negative: the update raised the very tokens it is read on,
        which pulls k1's mean below 0."""
        T = rollout.response_mask.shape[1]
        total = torch.zeros(2, dtype=torch.float64, device=rollout.input_ids.device)  # (2,) KL sum, tokens
        for rows, columns, t in self.micro_batches(rollout.attention_mask, T):
            part = rollout.select(rows).crop(columns, t)
            logprobs, _, _ = policy_forward(self.actor, part.input_ids, part.attention_mask, t, self.generation.temperature)
            kl = F.masked_kl(part.old_logprobs, logprobs, part.loss_mask, "k3")  # (b, t)
            total += torch.stack([kl.sum(), part.loss_mask.sum()]).double()
        total = self.trainer.strategy.reduce(total, reduce_op="sum")
        return float(total[0] / total[1].clamp(min=1))

    # ----------------------------------------------------------------------------------------------
    @override
    def policy_and_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int):
        """Actor log-probs and entropy, and the critic's values V(s_t) (or the shared value head's)."""
        logprobs, entropy, shared_values = policy_forward(
            self.actor, input_ids, attention_mask, T, self.generation.temperature, self.value_head
        )
        values = (
            shared_values if self.critic is None else critic_values(self.critic, input_ids, attention_mask, T)
        )
        return logprobs, entropy, values

    @override
    def rollout_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> torch.Tensor:
        """The critic's values V(s_t) alone (the old log-probs came from the sampler)."""
        return critic_values(self.critic, input_ids, attention_mask, T)

    @override
    def policy_forward_needed(self) -> str | None:
        if self.critic is None:
            return "share_critic_backbone: the value head reads the actor's hidden states"
        return super().policy_forward_needed()

    def log_critic_stats(self, values, advantages, returns, mask) -> None:
        """The critic's and GAE's per-rollout statistics (before advantage whitening), as ``ppo/...``."""
        self.update_metrics.update(
            {
                "explained_variance": F.explained_variance(values, returns, mask),
                "advantages_mean": F.masked_mean(advantages, mask),
                "advantages_std": F.masked_std(advantages, mask),
                "returns_mean": F.masked_mean(returns, mask),
                "values_mean": F.masked_mean(values, mask),
            }
        )

    def optimized_models(self) -> list[tuple[torch.optim.Optimizer, torch.nn.Module]]:
        """(optimiser, model) of the actor and of the critic (or the shared value head)."""
        actor_opt, critic_opt = self.optimizers()
        return [(actor_opt, self.actor), (critic_opt, self.value_head if self.critic is None else self.critic)]

    def ppo_loss(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """loss = L_policy - c_e * H + c_v * L_V (+ kl.loss_coef * KL to the reference) on one micro-batch
        (arXiv:1707.06347 eq. 9)."""
        update, mask, T = self.update, part.loss_mask, part.response_mask.shape[1]
        logprobs, entropy, values = policy_forward(
            self.actor, part.input_ids, part.attention_mask, T, self.generation.temperature, self.value_head,
            entropy_grad=update.ent_coef > 0,
        )  # fmt: skip
        if self.critic is not None:
            values = critic_values(self.critic, part.input_ids, part.attention_mask, T)
        aggregation = dict(loss_aggregation=update.loss_aggregation, max_response_length=self.max_response_length)
        if update.policy_loss == "clip":
            pg_loss, pg_stats = F.ppo_policy_loss(
                logprobs, part.old_logprobs, part.advantages, mask, update.clip_coef, update.clip_coef_high,
                importance_sampling_level=update.importance_sampling_level, weights=part.is_weights,
                **aggregation,
            )  # fmt: skip
        else:
            pg_loss, pg_stats = F.kl_penalty_policy_loss(
                logprobs, part.old_logprobs, part.advantages, mask, self.beta_ctl.value,
                weights=part.is_weights, **aggregation,
            )  # fmt: skip
        vf_loss, vf_stats = F.clipped_value_loss(values, part.old_values, part.returns, mask, update.clip_coef_value)
        mean_entropy = F.masked_mean(entropy, mask)
        stats = {**pg_stats, **vf_stats, "policy_loss": pg_loss.detach(), "value_loss": vf_loss.detach()}
        stats["entropy"] = mean_entropy.detach()
        kl_loss = None
        if self.kl.loss_coef > 0:
            kl_loss, kl_stats = F.reference_kl_loss(logprobs, part.ref_logprobs, mask, self.kl.loss_estimator, **aggregation)
            stats.update(kl_stats)
        if update.loss_aggregation != "token_mean":  # the value loss and entropy are token means: weighted apart
            policy = pg_loss if kl_loss is None else pg_loss + self.kl.loss_coef * kl_loss
            return (policy, update.vf_coef * vf_loss - update.ent_coef * mean_entropy), stats
        loss = pg_loss - update.ent_coef * mean_entropy + update.vf_coef * vf_loss
        return loss if kl_loss is None else loss + self.kl.loss_coef * kl_loss, stats

    @override
    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        metrics = super().schedule_metrics()
        if self.update.policy_loss == "kl_penalty":
            metrics["beta"] = torch.tensor(self.beta_ctl.value, dtype=torch.float32)
        actor_opt, critic_opt = self.optimizers()
        metrics["lr_actor"] = torch.tensor(actor_opt.param_groups[0]["lr"], dtype=torch.float32)
        metrics["lr_critic"] = torch.tensor(critic_opt.param_groups[0]["lr"], dtype=torch.float32)
        return metrics

    # ----------------------------------------------------------------------------------------------
    @override
    def configure_optimizers(self):
        critic_module = self.value_head if self.critic is None else self.critic
        return self.optimizers_and_schedulers([self.actor, critic_module], self.factories)

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["online_state"]["beta_ctl"] = self.beta_ctl.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.beta_ctl.load_state_dict(self.online_state(checkpoint)["beta_ctl"])

    @override
    def exported_models(self) -> dict:
        """``actor`` and, when separate, ``critic``."""
        return {"actor": self.actor, "critic": self.critic}

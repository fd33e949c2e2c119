"""PPO for RLHF as a LightningModule with manual optimisation (seeds/002; Ouyang et al. 2022).

One ``training_step`` = one rollout: generate responses to a batch of prompts, score them, shape the
rewards with a KL penalty, compute GAE, then run ``ppo_epochs`` passes over shuffled minibatches.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import (
    ModelSpec,
    ValueHead,
    build_causal_lm,
    build_score_model,
    frozen_copy,
    load_tokenizer,
    reference_logits_context,
)
from lit_rlhf.modules.distributed import (
    clip_grad_norm,
    generation_context,
    shard_models,
    unwrap,
)
from lit_rlhf.modules.optim import AdamW, resolve_total_steps
from lit_rlhf.modules.ppo_bookkeeping import PPOBookkeeping
from lit_rlhf.modules.ppo_parts import (
    PPO_METRICS,
    ROLLOUT_METRICS,
    MetricGroup,
    RewardSource,
    accumulate_stats,
    chunked,
    critic_values,
    disable_dropout,
    masked_row_sum,
    policy_forward,
    validate_ppo_args,
    whiten_across_ranks,
)
from lit_rlhf.rollout import GenerationSettings, ReplayBuffer, Rollout, generate_responses


class PPOModule(PPOBookkeeping):
    """PPO with an actor, a critic, a frozen reference and a reward model or reward function.

    Args:
        actor: the policy to train (usually the SFT export).
        reward_model: reward model spec or exported folder (``name_or_path``); exclusive with reward_fn.
        reward_fn: ``package.module:function`` mapping (prompts, responses) strings to float scores.
        monitor_reward_fn: a second ``module:function`` scorer that is only logged
            (``rollout/monitor_score``), never optimised: e.g. a gold reward beside a proxy reward model.
        critic: critic spec; None starts it from the reward model (seeds/001), or from the actor's
            backbone with a fresh head when rewards come from a function.
        reference: reference policy spec; None = the initial actor (its LoRA-disabled self for a LoRA actor).
        share_critic_backbone: a value head on the actor's backbone instead of a separate critic.
        generation: sampling settings of the rollout.
        ppo_epochs: passes over each rollout.
        num_minibatches: optimiser steps per pass (the rollout's rows are split evenly).
        forward_batch_size: rows per forward pass (rollout scoring and gradient-accumulation micro-batches).
        policy_loss: ``clip`` (PPO-Clip) or ``kl_penalty`` (PPO-Penalty with adaptive beta, seeds/000).
        clip_coef: epsilon of the clipped ratio.
        clip_coef_value: clip range of new values around the old ones.
        vf_coef: weight of the value loss.
        ent_coef: weight of the entropy bonus.
        gamma: discount factor of GAE.
        gae_lambda: lambda of GAE (Schulman et al. 2016).
        kl_coef: initial coefficient of the KL penalty in the reward.
        kl_target: target sequence KL for the adaptive controller (Ziegler et al. 2019); None = fixed kl_coef.
        kl_horizon: horizon (in rollout rows) of the adaptive controller.
        kl_estimator: per-token KL estimator in the reward: k1, k2, k3 or abs.
        init_beta: initial beta of the ``kl_penalty`` policy loss.
        beta_target: target KL(old || new) per token of the ``kl_penalty`` policy loss.
        ratio_threshold: skip a minibatch whose mean ratio exceeds this (None = never skip).
        max_grad_norm: gradient-norm clip per optimiser (None = off).
        whiten_advantages: whiten advantages per rollout (mean 0, std 1 over the real tokens of all ranks).
        whiten_rewards: whiten the shaped rewards (keeping their mean) before GAE.
        score_clip: clip scores to [-score_clip, score_clip] (None = off).
        missing_eos_penalty: subtracted from the score of a response truncated without a stop token.
        max_rollouts: stop fitting after this many rollouts (None = the trainer's limits decide).
        log_samples_every: log a prompt/response/score table every this many rollouts (0 = never).
        num_log_samples: rows of that table.
        rng_seed: seed of the model initialisations and the minibatch shuffling (named apart from the
            DataModule's `seed`, since Lightning refuses equal hparam names with different values).
        actor_optimizer: optimiser factory of the actor.
        critic_optimizer: optimiser factory of the critic (or the shared value head).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
        critic_scheduler: LR schedule of the critic, stepped once per rollout (None = constant).
    """

    def __init__(
        self,
        actor: ModelSpec,
        reward_model: ModelSpec | None = None,
        reward_fn: str | None = None,
        monitor_reward_fn: str | None = None,
        critic: ModelSpec | None = None,
        reference: ModelSpec | None = None,
        share_critic_backbone: bool = False,
        generation: GenerationSettings | None = None,
        ppo_epochs: int = 4,
        num_minibatches: int = 2,
        forward_batch_size: int = 16,
        policy_loss: Literal["clip", "kl_penalty"] = "clip",
        clip_coef: float = 0.2,
        clip_coef_value: float = 0.2,
        vf_coef: float = 0.5,
        ent_coef: float = 0.0,
        gamma: float = 1.0,
        gae_lambda: float = 0.95,
        kl_coef: float = 0.05,
        kl_target: float | None = None,
        kl_horizon: int = 10000,
        kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k1",
        init_beta: float = 0.1,
        beta_target: float = 0.01,
        ratio_threshold: float | None = 10.0,
        max_grad_norm: float | None = 1.0,
        whiten_advantages: bool = True,
        whiten_rewards: bool = False,
        score_clip: float | None = None,
        missing_eos_penalty: float | None = None,
        max_rollouts: int | None = None,
        log_samples_every: int = 10,
        num_log_samples: int = 4,
        rng_seed: int = 0,
        actor_optimizer: OptimizerCallable = AdamW,
        critic_optimizer: OptimizerCallable = AdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.save_hyperparameters(
            ignore=["actor_optimizer", "critic_optimizer", "actor_scheduler", "critic_scheduler"]
        )
        validate_ppo_args(self.hparams)
        self.factories = (actor_optimizer, critic_optimizer, actor_scheduler, critic_scheduler)
        self.generation = generation or GenerationSettings()
        # (under LightningCLI, self.hparams holds the raw config dicts, not the dataclasses)
        self.actor_lora = actor.lora is not None
        self.tokenizer = load_tokenizer(actor.tokenizer or actor.name_or_path, padding_side="left")
        with torch.random.fork_rng():  # seeded, so a resumed run rebuilds identical frozen models
            torch.manual_seed(rng_seed)
            self.actor = build_causal_lm(actor, self.tokenizer)
            disable_dropout(self.actor)
            if reference is not None:
                self.reference = frozen_copy(build_causal_lm(reference, self.tokenizer))
            else:  # a LoRA actor with disabled adapters is its own reference (no second copy)
                self.reference = None if actor.lora else frozen_copy(self.actor)
            self.rewards = RewardSource(reward_model, reward_fn, self.tokenizer)
            self.monitor = (
                None if monitor_reward_fn is None else RewardSource(None, monitor_reward_fn, self.tokenizer)
            )
            if share_critic_backbone:
                self.critic, self.value_head = None, ValueHead(self.actor.config.hidden_size)
            else:
                critic_spec = critic or reward_model or actor
                self.critic, self.value_head = build_score_model(critic_spec, self.tokenizer), None
                disable_dropout(self.critic)
        self.kl_ctl = (
            F.FixedKLController(kl_coef)
            if kl_target is None
            else F.AdaptiveKLController(kl_coef, kl_target, kl_horizon)
        )
        self.beta_ctl = F.PPOPenaltyKLController(init_beta, beta_target)
        self.buffer = ReplayBuffer(num_minibatches, rng_seed)
        self.rollout_metrics, self.ppo_metrics = MetricGroup(ROLLOUT_METRICS), MetricGroup(PPO_METRICS)
        self.rollouts_done = 0
        self._rng_to_restore: torch.Tensor | None = None
        self.strict_loading = False  # frozen weights are rebuilt in __init__, not checkpointed

    # ----------------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._restore_rng()
        # 1. Generate responses with the current policy.
        responses, response_mask, truncated = self.generate(batch["input_ids"], batch["attention_mask"])
        input_ids = torch.cat([batch["input_ids"], responses], dim=1)
        attention_mask = torch.cat([batch["attention_mask"], response_mask.long()], dim=1)
        # 2. Score without gradients: old/ref log-probs, old values, sequence scores.
        T = responses.shape[1]
        old_logprobs, ref_logprobs, old_values, entropy = self.score_rollout(input_ids, attention_mask, T)
        scores = self.rewards.score(input_ids, attention_mask, T, self.hparams.forward_batch_size)
        scores = self.adjust_scores(scores, truncated)
        if self.monitor is not None:
            monitor = self.monitor.score(input_ids, attention_mask, T, self.hparams.forward_batch_size)
            self.rollout_metrics.update({"monitor_score": monitor.mean()})
        # 3. KL-shaped per-token rewards (seeds/000), then GAE advantages and returns.
        rewards, kl = F.kl_shaped_rewards(
            scores, old_logprobs, ref_logprobs, response_mask, self.kl_ctl.value, self.hparams.kl_estimator
        )
        if self.hparams.whiten_rewards:
            rewards = whiten_across_ranks(self.trainer.strategy, rewards, response_mask, shift_mean=False)
        advantages, returns = F.compute_gae(
            rewards, old_values, response_mask, self.hparams.gamma, self.hparams.gae_lambda
        )
        self.log_rollout_stats(
            scores, rewards, kl, response_mask, truncated, entropy, old_values, advantages, returns
        )
        if self.hparams.whiten_advantages:
            advantages = whiten_across_ranks(self.trainer.strategy, advantages, response_mask)
        rollout = Rollout(
            input_ids, attention_mask, response_mask, old_logprobs, ref_logprobs,
            old_values, rewards, advantages, returns, scores,
        )  # fmt: skip
        # 4. PPO epochs over shuffled minibatches of the replay buffer.
        self.buffer.put(rollout)
        last_policy_kl = self.ppo_epochs()
        self.buffer.clear()
        # 5. Controllers and schedules advance once per rollout; metrics and samples are logged.
        global_kl = self.all_gather(masked_row_sum(kl, response_mask).mean()).mean().item()
        self.kl_ctl.update(global_kl, n_steps=rollout.batch_size * self.trainer.world_size)
        if self.hparams.policy_loss == "kl_penalty":
            self.beta_ctl.update(last_policy_kl, n_steps=1)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(batch, responses, response_mask, scores)

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor):
        was_training = self.actor.training
        self.actor.eval()
        with generation_context(self, self.actor):
            out = generate_responses(
                self.actor, prompts, prompt_mask, self.generation,
                eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                tokenizer=self.tokenizer, synced_gpus=self.trainer.world_size > 1,
            )  # fmt: skip
        self.actor.train(was_training)
        return out

    @torch.no_grad()
    def score_rollout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int):
        """(B, P+T) sequences -> old log-probs, reference log-probs, old values, entropy, each (B, T).

        Runs in chunks of ``forward_batch_size`` rows so memory does not grow with the rollout, and
        keeps no (B, T, V) logits.
        """
        parts: dict[str, list[torch.Tensor]] = {"old": [], "ref": [], "values": [], "entropy": []}
        for rows in chunked(input_ids.shape[0], self.hparams.forward_batch_size):
            ids, mask = input_ids[rows], attention_mask[rows]
            logprobs, entropy, shared_values = policy_forward(
                self.actor, ids, mask, T, self.generation.temperature, self.value_head
            )
            with reference_logits_context(unwrap(self.actor)):
                ref_model = self.reference if self.reference is not None else self.actor
                ref_logprobs, _, _ = policy_forward(ref_model, ids, mask, T, self.generation.temperature)
            values = shared_values if self.critic is None else critic_values(self.critic, ids, mask, T)
            for key, value in zip(parts, (logprobs, ref_logprobs, values, entropy)):
                parts[key].append(value)
        return tuple(torch.cat(v) for v in parts.values())

    def adjust_scores(self, scores: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """Missing-EOS penalty, then optional clipping of the sequence scores (seeds/000)."""
        if self.hparams.missing_eos_penalty is not None:
            scores = scores - self.hparams.missing_eos_penalty * truncated.float()
        if self.hparams.score_clip is not None:
            scores = scores.clamp(-self.hparams.score_clip, self.hparams.score_clip)
        return scores

    def ppo_epochs(self) -> float:
        """The update phase: ``ppo_epochs`` passes of clipped policy/value/entropy losses.

        Each minibatch is processed in micro-batches of ``forward_batch_size`` rows whose losses are
        weighted by their share of the minibatch's real tokens, so the accumulated gradient equals the
        minibatch's token-mean loss. Returns the mean KL(old || new) of the last epoch.
        """
        hp = self.hparams
        actor_opt, critic_opt = self.optimizers()
        for _ in range(hp.ppo_epochs):
            epoch_kl = []
            for mb in self.buffer.minibatches():
                n_tokens = mb.response_mask.sum()
                stats: dict[str, torch.Tensor] = {}
                for rows in chunked(mb.batch_size, hp.forward_batch_size):
                    part = mb.select(rows)
                    weight = part.response_mask.sum() / n_tokens
                    loss, part_stats = self.ppo_loss(part)
                    self.manual_backward(loss * weight)
                    accumulate_stats(stats, part_stats, weight)
                skip = hp.ratio_threshold is not None and stats["ratio_mean"] > hp.ratio_threshold
                if not skip:
                    critic_module = self.value_head if self.critic is None else self.critic
                    for opt, model in ((actor_opt, self.actor), (critic_opt, critic_module)):
                        if hp.max_grad_norm is not None:
                            clip_grad_norm(self, opt, model, hp.max_grad_norm)
                        opt.step()
                actor_opt.zero_grad(set_to_none=True)
                critic_opt.zero_grad(set_to_none=True)
                self.ppo_metrics.update({**stats, "skipped_minibatches": float(skip)})
                epoch_kl.append(stats["policy_kl"])
        return torch.stack(epoch_kl).mean().item()

    def ppo_loss(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """loss = L_policy - c_e * H + c_v * L_V (seeds/002) on one micro-batch."""
        hp, mask, T = self.hparams, part.response_mask, part.response_mask.shape[1]
        logprobs, entropy, values = policy_forward(
            self.actor,
            part.input_ids,
            part.attention_mask,
            T,
            self.generation.temperature,
            self.value_head,
            entropy_grad=hp.ent_coef > 0,
        )
        if self.critic is not None:
            values = critic_values(self.critic, part.input_ids, part.attention_mask, T)
        if hp.policy_loss == "clip":
            pg_loss, pg_stats = F.ppo_policy_loss(
                logprobs, part.old_logprobs, part.advantages, mask, hp.clip_coef
            )
        else:
            pg_loss, pg_stats = F.kl_penalty_policy_loss(
                logprobs, part.old_logprobs, part.advantages, mask, self.beta_ctl.value
            )
        vf_loss, vf_stats = F.clipped_value_loss(
            values, part.old_values, part.returns, mask, hp.clip_coef_value
        )
        mean_entropy = F.masked_mean(entropy, mask)
        loss = pg_loss - hp.ent_coef * mean_entropy + hp.vf_coef * vf_loss
        stats = {**pg_stats, **vf_stats, "policy_loss": pg_loss.detach(), "value_loss": vf_loss.detach()}
        stats["entropy"] = mean_entropy.detach()
        return loss, stats

    # ----------------------------------------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        shard_models(self, ("actor", "critic", "value_head", "reference", "rewards.model", "monitor.model"))

    @override
    def configure_optimizers(self):
        actor_opt_fn, critic_opt_fn, actor_sched_fn, critic_sched_fn = self.factories
        actor_params = [p for p in self.actor.parameters() if p.requires_grad]
        critic_module = self.value_head if self.critic is None else self.critic
        critic_params = [p for p in critic_module.parameters() if p.requires_grad]
        optimizers = [actor_opt_fn(actor_params), critic_opt_fn(critic_params)]
        schedulers = []
        for opt, fn in zip(optimizers, (actor_sched_fn, critic_sched_fn)):
            if fn is not None:
                scheduler = fn(opt)
                resolve_total_steps(
                    scheduler, self.hparams.max_rollouts or self.trainer.estimated_stepping_batches
                )
                schedulers.append(scheduler)
        return optimizers, schedulers

    def lr_schedulers_list(self) -> list:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return schedulers if isinstance(schedulers, list) else [schedulers]

"""PPO for RLHF as a LightningModule with manual optimisation (seeds/002; Ouyang et al. 2022).

One ``training_step`` = one rollout: generate responses to a batch of prompts, score them, shape the
rewards with a KL penalty, compute GAE, then run ``ppo_epochs`` passes over shuffled minibatches.
The parts every online algorithm shares live in :class:`~lit_rlhf.modules.online.OnlineRLModule`.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing
from lit_rlhf.models import (
    ModelSpec,
    ValueHead,
    build_score_model,
    critic_values,
    disable_dropout,
    policy_forward,
)
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_checks import check_ppo_args
from lit_rlhf.modules.optim import CriticAdamW, PolicyAdamW, resolve_total_steps
from lit_rlhf.rollout import GenerationSettings, Rollout

PPO_METRICS = (
    "policy_loss", "value_loss", "entropy", "approx_kl", "policy_kl", "clipfrac", "value_clipfrac",
    "ratio_mean", "ratio_max", "skipped_minibatches", "nonfinite_steps",
    "explained_variance", "advantages_mean", "advantages_std", "returns_mean", "values_mean",
)  # fmt: skip


class PPOModule(OnlineRLModule):
    """PPO with an actor, a critic, a frozen reference and a reward model or reward function.

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        reward_model: reward model spec or exported folder (``name_or_path``); exclusive with reward_fn.
        reward_fn: ``package.module:function`` mapping (prompts, responses) strings to float scores.
        monitor_reward_fn: a second ``module:function`` scorer that is only logged
            (``rollout/monitor_score``), never optimised: e.g. a gold reward beside a proxy reward model.
        critic: critic spec; None starts it from the reward model (seeds/001), or from the actor's
            backbone with a fresh head when rewards come from a function.
        reference: reference policy spec; None = the initial actor (its LoRA-disabled self for a LoRA actor).
        share_critic_backbone: a value head on the actor's backbone instead of a separate critic.
        generation: sampling settings of the rollout (``GenerationSettings`` or a dict of its fields).
        ppo_epochs: passes over each rollout.
        num_minibatches: optimiser steps per pass (the rollout's rows are split evenly).
        forward_batch_size: the most rows per forward pass (rollout scoring and gradient-accumulation
            micro-batches).
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, rows are
            sorted by length into micro-batches of at most ``token_budget`` padded tokens (and
            ``forward_batch_size`` rows) whose all-padding columns are dropped; results are unchanged
            (exact up to float rounding). ``{enabled: false}`` keeps every forward at the full width.
        policy_loss: ``clip`` (PPO-Clip) or ``kl_penalty`` (PPO-Penalty with adaptive beta, seeds/000).
        clip_coef: epsilon of the clipped ratio (its lower bound 1 - clip_coef).
        clip_coef_high: upper epsilon of the ratio (DAPO "clip-higher", arXiv 2503.14476); None = clip_coef.
        loss_aggregation: how the policy loss reduces its token terms: ``token_mean`` (PPO),
            ``seq_mean_token_mean`` or ``seq_mean_token_sum_norm`` (see ``functional.aggregate_loss``).
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
        num_log_samples: rows of that table (and of the ``val/samples``/``test/samples`` tables).
        eval_generation: settings of the evaluation rollouts of ``validate``/``test`` (and of validation
            during fit): ``GenerationSettings``, or a dict of fields overriding ``generation`` with one
            sample per prompt (None = exactly that).
        eval_greedy: decode evaluation rollouts greedily (argmax) instead of sampling them.
        rng_seed: seed of the model initialisations, the minibatch shuffling and the evaluation sampling
            (named apart from the DataModule's `seed`, since Lightning refuses equal hparam names with
            different values); None follows ``seed_everything`` (the value used is stored in the
            hyper-parameters and checkpoints).
        on_nonfinite: what a NaN/inf score of the reward model or function does: ``raise`` (default:
            the fit stops, naming the rollout, the scorer and the prompt/response, before anything is
            learnt from it) or ``drop`` (those rows get no gradient and are counted in
            ``rollout/nonfinite_scores``). Non-finite losses or gradients are always skipped.
        actor_optimizer: optimiser factory of the actor; default AdamW at lr 1e-6 (``PolicyAdamW``).
        critic_optimizer: optimiser factory of the critic (or the shared value head); default AdamW at
            lr 9e-6 (``CriticAdamW``).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
        critic_scheduler: LR schedule of the critic, stepped once per rollout (None = constant).
    """

    sharded_models = ("actor", "critic", "value_head", "reference", "rewards.model", "monitor.model")

    def __init__(
        self,
        actor: ModelSpec,
        reward_model: ModelSpec | None = None,
        reward_fn: str | None = None,
        monitor_reward_fn: str | None = None,
        critic: ModelSpec | None = None,
        reference: ModelSpec | None = None,
        share_critic_backbone: bool = False,
        generation: GenerationSettings | dict | None = None,
        ppo_epochs: int = 4,
        num_minibatches: int = 2,
        forward_batch_size: int = 16,
        bucketing: Bucketing | dict | None = None,
        policy_loss: Literal["clip", "kl_penalty"] = "clip",
        clip_coef: float = 0.2,
        clip_coef_high: float | None = None,
        loss_aggregation: Literal[
            "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"
        ] = "token_mean",
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
        eval_generation: GenerationSettings | dict | None = None,
        eval_greedy: bool = False,
        rng_seed: int | None = None,
        on_nonfinite: Literal["raise", "drop"] = "raise",
        actor_optimizer: OptimizerCallable = PolicyAdamW,
        critic_optimizer: OptimizerCallable = CriticAdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
        critic_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        check_ppo_args(locals())
        super().__init__(
            actor=actor, reward_model=reward_model, reward_fn=reward_fn, monitor_reward_fn=monitor_reward_fn,
            reference=reference, generation=generation, forward_batch_size=forward_batch_size,
            bucketing=bucketing, num_minibatches=num_minibatches, kl_coef=kl_coef, kl_target=kl_target,
            kl_horizon=kl_horizon,
            score_clip=score_clip, missing_eos_penalty=missing_eos_penalty, max_rollouts=max_rollouts,
            log_samples_every=log_samples_every, num_log_samples=num_log_samples,
            eval_generation=eval_generation, eval_greedy=eval_greedy, rng_seed=rng_seed,
            on_nonfinite=on_nonfinite,
            metric_prefix="ppo", update_metrics=PPO_METRICS,
        )  # fmt: skip
        self.save_plain_hyperparameters(
            ignore=["actor_optimizer", "critic_optimizer", "actor_scheduler", "critic_scheduler"]
        )
        self.factories = (actor_optimizer, critic_optimizer, actor_scheduler, critic_scheduler)
        with self.seeded_init():  # the stream the actor, reference and reward model were built from
            if share_critic_backbone:
                self.critic, self.value_head = None, ValueHead(self.actor.config.hidden_size)
            else:
                critic_spec = ModelSpec.coerce(critic or reward_model or actor, "critic")
                self.critic, self.value_head = build_score_model(critic_spec, self.tokenizer), None
                disable_dropout(self.critic)
        self.beta_ctl = F.PPOPenaltyKLController(init_beta, beta_target)

    # ----------------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.restore_rng()
        hp = self.hparams
        # 1. Generate responses with the current policy (K per prompt, each prompt's K rows contiguous).
        prompts, prompt_mask = self.expand_prompts(batch)
        responses, response_mask, truncated = self.generate(prompts, prompt_mask)
        input_ids = torch.cat([prompts, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        # 2. Score without gradients: old/ref log-probs, old values, sequence scores.
        T = responses.shape[1]
        old_logprobs, ref_logprobs, old_values, entropy = self.score_rollout(input_ids, attention_mask, T)
        scores, keep = self.score_responses(input_ids, attention_mask, T, truncated)
        # 3. KL-shaped per-token rewards (seeds/000), then GAE advantages and returns.
        rewards, kl = F.kl_shaped_rewards(
            scores, old_logprobs, ref_logprobs, response_mask, self.kl_ctl.value, hp.kl_estimator
        )
        if hp.whiten_rewards:
            rewards = self.whiten(rewards, response_mask, shift_mean=False)
        advantages, returns = F.compute_gae(rewards, old_values, response_mask, hp.gamma, hp.gae_lambda)
        self.log_rollout_stats(
            scores, F.masked_row_sum(rewards, response_mask), kl, response_mask, truncated, entropy
        )
        self.log_critic_stats(old_values, advantages, returns, response_mask)
        if hp.whiten_advantages:
            advantages = self.whiten(advantages, response_mask)
        rollout = Rollout(
            input_ids, attention_mask, response_mask, old_logprobs, ref_logprobs,
            old_values, rewards, advantages, returns, scores,
        )  # fmt: skip
        # 4. PPO epochs over shuffled minibatches of the replay buffer.
        self.buffer.put(self.drop_rows(rollout, keep))
        last_policy_kl = self.ppo_epochs()
        self.buffer.clear()
        # 5. Controllers and schedules advance once per rollout; metrics and samples are logged.
        self.update_kl_controller(kl, response_mask)
        if hp.policy_loss == "kl_penalty":
            self.beta_ctl.update(last_policy_kl, n_steps=1)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(prompts, responses, response_mask, scores)

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

    def log_critic_stats(self, values, advantages, returns, response_mask) -> None:
        """The critic's and GAE's per-rollout statistics (before advantage whitening), as ``ppo/...``."""
        self.update_metrics.update(
            {
                "explained_variance": F.explained_variance(values, returns, response_mask),
                "advantages_mean": F.masked_mean(advantages, response_mask),
                "advantages_std": F.masked_var(advantages, response_mask).sqrt(),
                "returns_mean": F.masked_mean(returns, response_mask),
                "values_mean": F.masked_mean(values, response_mask),
            }
        )

    def ppo_epochs(self) -> float:
        """The update phase: ``ppo_epochs`` passes of clipped policy/value/entropy losses over the buffer.

        Returns the mean KL(old || new) of the last epoch (the PPO-Penalty controller's input).
        """
        actor_opt, critic_opt = self.optimizers()
        critic_module = self.value_head if self.critic is None else self.critic
        optimized = [(actor_opt, self.actor), (critic_opt, critic_module)]
        return self.run_update_epochs(
            self.ppo_loss, optimized, self.hparams.ppo_epochs, self.hparams.loss_aggregation
        )

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
        aggregation = dict(
            loss_aggregation=hp.loss_aggregation, max_response_length=self.generation.max_new_tokens
        )
        if hp.policy_loss == "clip":
            pg_loss, pg_stats = F.ppo_policy_loss(
                logprobs,
                part.old_logprobs,
                part.advantages,
                mask,
                hp.clip_coef,
                hp.clip_coef_high,
                **aggregation,
            )
        else:
            pg_loss, pg_stats = F.kl_penalty_policy_loss(
                logprobs, part.old_logprobs, part.advantages, mask, self.beta_ctl.value, **aggregation
            )
        vf_loss, vf_stats = F.clipped_value_loss(
            values, part.old_values, part.returns, mask, hp.clip_coef_value
        )
        mean_entropy = F.masked_mean(entropy, mask)
        loss = pg_loss - hp.ent_coef * mean_entropy + hp.vf_coef * vf_loss
        stats = {**pg_stats, **vf_stats, "policy_loss": pg_loss.detach(), "value_loss": vf_loss.detach()}
        stats["entropy"] = mean_entropy.detach()
        return loss, stats

    @override
    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        metrics = super().schedule_metrics()
        if self.hparams.policy_loss == "kl_penalty":
            metrics["beta"] = torch.tensor(self.beta_ctl.value)
        actor_opt, critic_opt = self.optimizers()
        metrics["lr_actor"] = torch.tensor(actor_opt.param_groups[0]["lr"])
        metrics["lr_critic"] = torch.tensor(critic_opt.param_groups[0]["lr"])
        return metrics

    # ----------------------------------------------------------------------------------------------
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

    @override
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["online_state"]["beta_ctl"] = self.beta_ctl.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint["online_state"] if "online_state" in checkpoint else checkpoint["ppo_state"]
        self.beta_ctl.load_state_dict(state["beta_ctl"])

    @override
    def exported_models(self) -> dict:
        """``actor`` and, when separate, ``critic``."""
        return {"actor": self.actor, "critic": self.critic}

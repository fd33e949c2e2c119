"""Critic-free on-policy RLHF: GRPO, Dr. GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline behind one switch.

One ``training_step`` = one rollout: sample K responses per prompt, score them, turn the scores into
advantages with the chosen estimator (``functional/advantages.py``), then run ``ppo_epochs`` passes of
the clipped surrogate over shuffled minibatches. There is no critic, no critic optimiser and no value
loss; PPO with GAE and a critic is :class:`~lit_rlhf.modules.PPOModule`.

The KL to the reference can be a per-token penalty in the reward (``kl_coef``, the RLOO and REINFORCE++
way) and/or a loss term (``kl_loss_coef``, the GRPO way). Advantages follow OpenRLHF's construction:
the (baselined) sequence score is placed at the last real token, the per-token KL penalty is added, and
the advantage of token t is the discounted sum of what follows (with ``kl_coef`` = 0 and gamma = 1 this
is the baselined score on every token).
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_checks import check_critic_free_args
from lit_rlhf.modules.optim import PolicyAdamW, resolve_total_steps
from lit_rlhf.replay import UpdateRecord
from lit_rlhf.rollout import GenerationSettings, Rollout

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
POLICY_METRICS = (
    "policy_loss", "kl_loss", "entropy", "approx_kl", "policy_kl", "clipfrac", "ratio_mean", "ratio_max",
    "skipped_minibatches", "nonfinite_steps", "advantages_mean", "advantages_std",
)  # fmt: skip


class CriticFreeModule(OnlineRLModule):
    """On-policy RLHF without a critic: the baseline comes from the other responses or the batch.

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        reward_model: reward model spec or exported folder (``name_or_path``); exclusive with reward_fn.
        reward_fn: ``package.module:function`` mapping (prompts, responses) strings to float scores.
        monitor_reward_fn: a second ``module:function`` scorer that is only logged
            (``rollout/monitor_score``), never optimised.
        reference: reference policy spec; None = the initial actor (its LoRA-disabled self for a LoRA actor).
        advantage_estimator: ``grpo`` (group mean and std; Shao et al. 2024), ``dr_grpo`` (group mean
            only; Liu et al. 2025), ``rloo`` (leave-one-out mean; Ahmadian et al. 2024), ``reinforce_pp``
            (batch-whitened returns; Hu 2025) or ``reinforce_pp_baseline`` (group mean subtracted first).
            All but ``reinforce_pp`` need ``generation.num_samples`` >= 2. ``gae`` needs a critic: PPOModule.
        generation: sampling settings (``GenerationSettings`` or a dict of its fields); None =
            ``GenerationSettings(num_samples=4)``. ``num_samples`` is K, the responses per prompt.
        ppo_epochs: passes over each rollout.
        num_minibatches: optimiser steps per pass (the rollout's rows are split evenly).
        forward_batch_size: the most rows per forward pass (rollout scoring and gradient-accumulation
            micro-batches).
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, rows are
            sorted by length into micro-batches of at most ``token_budget`` padded tokens (and
            ``forward_batch_size`` rows) whose all-padding columns are dropped; results are unchanged
            (exact up to float rounding). ``{enabled: false}`` keeps every forward at the full width.
        loss_aggregation: ``token_mean`` (every real token of the minibatch weighs the same),
            ``seq_mean_token_mean`` (the original GRPO) or ``seq_mean_token_sum_norm`` (Dr. GRPO: token sums
            divided by ``generation.max_new_tokens``).
        clip_coef: lower epsilon of the clipped ratio (1 - clip_coef), and the upper one unless set below.
        clip_coef_high: upper epsilon (1 + clip_coef_high), DAPO's "clip-higher" (e.g. 0.28); None = clip_coef.
        importance_sampling_level: ``token`` ratios (PPO, GRPO) or one ``sequence`` ratio per response, the
            geometric mean of its token ratios (GSPO, Zheng et al. 2025).
        ent_coef: weight of the entropy bonus.
        gamma: discount of the per-token returns (1.0 = every token gets the sequence's advantage).
        kl_coef: coefficient of the per-token KL penalty in the reward (0 = no KL in the reward).
        kl_target: target sequence KL for the adaptive controller of ``kl_coef``; None = fixed.
        kl_horizon: horizon (in rollout rows) of the adaptive controller.
        kl_estimator: per-token KL estimator in the reward: k1, k2, k3 or abs.
        kl_loss_coef: weight of the KL-to-reference loss term (GRPO's; 0 = off).
        kl_loss_estimator: per-token KL estimator of that term (GRPO uses k3).
        ratio_threshold: skip a minibatch whose mean ratio exceeds this (None = never skip).
        max_grad_norm: gradient-norm clip (None = off).
        score_clip: clip scores to [-score_clip, score_clip] (None = off).
        missing_eos_penalty: subtracted from the score of a response truncated without a stop token.
        max_rollouts: stop fitting after this many rollouts (None = the trainer's limits decide).
        log_samples_every: log a prompt/response/score table every this many rollouts (0 = never).
        num_log_samples: rows of that table (and of the ``val/samples``/``test/samples`` tables).
        eval_generation: settings of the evaluation rollouts of ``validate``/``test`` (and of validation
            during fit): ``GenerationSettings``, or a dict of fields overriding ``generation`` with one
            sample per prompt (None = exactly that).
        eval_greedy: decode evaluation rollouts greedily (argmax) instead of sampling them.
        rng_seed: seed of the model initialisations, the minibatch shuffling and the evaluation sampling;
            None follows ``seed_everything`` (the value used is stored in the hyper-parameters and checkpoints).
        on_nonfinite: what a NaN/inf score of the reward model or function does: ``raise`` (default:
            the fit stops, naming the rollout, the scorer and the prompt/response, before anything is
            learnt from it) or ``drop`` (those rows get no gradient and are counted in
            ``rollout/nonfinite_scores``). Non-finite losses or gradients are always skipped.
        shared_prefix: ``auto`` (default), ``on`` or ``off``: compute each prompt once for its K responses
            (one row ``[prompt | r1 | ... | rK]`` with a block attention mask, ``models.shared_prefix``;
            equal log-probs to float rounding) in the rollout's actor/reference scoring and the update's
            forwards. ``auto`` packs a batch when its estimated forward cost falls below 0.75 of the
            padded one (prompts about as long as the responses or longer; short prompts stay padded) and
            the attention is sdpa or eager; ``on`` always packs. When the rollout packs, the update
            shuffles whole groups (a prompt's K rows stay in one minibatch) instead of rows.
        old_logprobs_from_update: when each rollout gets exactly one optimiser step (``ppo_epochs`` =
            ``num_minibatches`` = 1) and no KL penalty in the reward (``kl_coef`` = 0),
            take the old log-probs and the rollout entropy from that step's own forward instead of a
            separate scoring forward of the actor: its policy is the rollout policy, so the ratio is
            exactly 1 (TRL's GRPOTrainer does the same). False always runs the scoring forward.
        actor_optimizer: optimiser factory of the actor; default AdamW at lr 1e-6 (``PolicyAdamW``).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
    """

    def __init__(
        self,
        actor: ModelSpec,
        reward_model: ModelSpec | None = None,
        reward_fn: str | None = None,
        monitor_reward_fn: str | None = None,
        reference: ModelSpec | None = None,
        advantage_estimator: AdvantageEstimator = "grpo",
        generation: GenerationSettings | dict | None = None,
        ppo_epochs: int = 4,
        num_minibatches: int = 2,
        forward_batch_size: int = 16,
        bucketing: Bucketing | dict | None = None,
        loss_aggregation: Literal[
            "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"
        ] = "token_mean",
        clip_coef: float = 0.2,
        clip_coef_high: float | None = None,
        importance_sampling_level: Literal["token", "sequence"] = "token",
        ent_coef: float = 0.0,
        gamma: float = 1.0,
        kl_coef: float = 0.05,
        kl_target: float | None = None,
        kl_horizon: int = 10000,
        kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k1",
        kl_loss_coef: float = 0.0,
        kl_loss_estimator: Literal["k1", "k2", "k3", "abs"] = "k3",
        ratio_threshold: float | None = 10.0,
        max_grad_norm: float | None = 1.0,
        score_clip: float | None = None,
        missing_eos_penalty: float | None = None,
        max_rollouts: int | None = None,
        log_samples_every: int = 10,
        num_log_samples: int = 4,
        eval_generation: GenerationSettings | dict | None = None,
        eval_greedy: bool = False,
        rng_seed: int | None = None,
        on_nonfinite: Literal["raise", "drop"] = "raise",
        shared_prefix: Literal["auto", "on", "off"] = "auto",
        old_logprobs_from_update: bool = True,
        actor_optimizer: OptimizerCallable = PolicyAdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        if generation is None:
            generation = GenerationSettings(num_samples=4)
        check_critic_free_args(locals())
        super().__init__(
            actor=actor, reward_model=reward_model, reward_fn=reward_fn, monitor_reward_fn=monitor_reward_fn,
            reference=reference, generation=generation, forward_batch_size=forward_batch_size,
            bucketing=bucketing, num_minibatches=num_minibatches, kl_coef=kl_coef, kl_target=kl_target,
            kl_horizon=kl_horizon,
            score_clip=score_clip, missing_eos_penalty=missing_eos_penalty, max_rollouts=max_rollouts,
            log_samples_every=log_samples_every, num_log_samples=num_log_samples,
            eval_generation=eval_generation, eval_greedy=eval_greedy, rng_seed=rng_seed,
            on_nonfinite=on_nonfinite, shared_prefix=shared_prefix,
            metric_prefix="policy", update_metrics=POLICY_METRICS,
        )  # fmt: skip
        self.save_plain_hyperparameters(ignore=["actor_optimizer", "actor_scheduler"])
        self.factories = (actor_optimizer, actor_scheduler)
        self.update_record: UpdateRecord | None = None  # set while an on-policy update fills it

    @property
    def on_policy_update(self) -> bool:
        """Whether the update's one optimiser step computes the old log-probs (``old_logprobs_from_update``)."""
        hp = self.hparams
        one_step = hp.ppo_epochs == 1 and hp.num_minibatches == 1
        return hp.old_logprobs_from_update and one_step and hp.kl_coef == 0  # (kl_target needs kl_coef > 0)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.restore_rng()
        # 1. Generate K responses per prompt with the current policy (each prompt's K rows contiguous).
        prompts, prompt_mask = self.expand_prompts(batch)
        responses, response_mask, truncated = self.generate(prompts, prompt_mask)
        input_ids = torch.cat([prompts, responses], dim=1)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=1)
        # 2. Score without gradients: reference log-probs and sequence scores, and the old log-probs and
        #    entropy unless the update's one on-policy step computes them (None then).
        T, on_policy = responses.shape[1], self.on_policy_update
        old_logprobs, ref_logprobs, _, entropy = self.score_rollout(
            input_ids, attention_mask, T, policy=not on_policy
        )
        scores, keep = self.score_responses(input_ids, attention_mask, T, truncated)
        # 3. Advantages of the chosen estimator, per token.
        advantages = self.estimate_advantages(scores, old_logprobs, ref_logprobs, response_mask)
        rollout = Rollout(
            input_ids, attention_mask, response_mask, old_logprobs, ref_logprobs,
            old_values=None, rewards=None, advantages=advantages, returns=None, scores=scores,
        )  # fmt: skip
        # 4. ppo_epochs passes of the clipped surrogate over shuffled minibatches (of whole groups when
        #    the shared-prompt layout packs them); an on-policy step records the old log-probs.
        group_size = self.num_samples if self.packs_groups(input_ids, attention_mask, T) else 1
        self.buffer.put(self.drop_rows(rollout, keep), group_size=group_size)
        self.update_record = UpdateRecord(response_mask) if on_policy else None
        self.update_policy()
        if on_policy:
            old_logprobs, entropy = self.update_record.logprobs, self.update_record.entropy
        self.buffer.clear()
        self.update_record = None
        # 5. Rollout statistics (the rollout policy's KL to the reference), controllers and schedules
        #    advance once per rollout; metrics and samples are logged.
        kl = F.masked_kl(old_logprobs, ref_logprobs, response_mask, self.hparams.kl_estimator)  # (B, T)
        sequence_kl = F.masked_row_sum(kl, response_mask)
        self.log_rollout_stats(
            scores, scores - self.kl_ctl.value * sequence_kl, kl, response_mask, truncated, entropy
        )
        self.update_kl_controller(kl, response_mask)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(prompts, responses, response_mask, scores)

    def estimate_advantages(
        self,
        scores: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        """(B,) scores -> (B, T) advantages.

        The estimator's per-sequence value goes to the last real token, the KL penalty (``kl_coef``) to
        every token; the discounted returns of these rewards are the advantages, whitened over the
        batch of every rank for the REINFORCE++ estimators. ``old_logprobs`` None (an on-policy update
        computes them): the reward holds no KL term (``kl_coef`` is 0 then).
        """
        hp = self.hparams
        sequence_advantages = F.sequence_advantages(scores, hp.advantage_estimator, self.num_samples)  # (B,)
        logprobs = ref_logprobs if old_logprobs is None else old_logprobs  # None: a zero KL term
        rewards, _ = F.kl_shaped_rewards(
            sequence_advantages, logprobs, ref_logprobs, response_mask, self.kl_ctl.value, hp.kl_estimator
        )  # (B, T)
        advantages = F.discounted_returns(rewards, response_mask, hp.gamma)  # (B, T)
        self.update_metrics.update(
            {
                "advantages_mean": F.masked_mean(advantages, response_mask),
                "advantages_std": F.masked_var(advantages, response_mask).sqrt(),
            }
        )
        if hp.advantage_estimator in ("reinforce_pp", "reinforce_pp_baseline"):
            advantages = self.whiten(advantages, response_mask)  # (B, T)
        return advantages

    def update_policy(self) -> float:
        """The update phase: ``ppo_epochs`` passes of :meth:`policy_loss` over the buffered rollout.

        Returns the mean KL(old || new) of the last epoch.
        """
        hp = self.hparams
        optimized = [(self.optimizers(), self.actor)]
        return self.run_update_epochs(self.policy_loss, optimized, hp.ppo_epochs, hp.loss_aggregation)

    def policy_loss(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate (+ kl_loss_coef * KL to the reference - ent_coef * entropy) on one micro-batch."""
        hp, mask, T = self.hparams, part.response_mask, part.response_mask.shape[1]
        layout = self.shared_prefix_layout(part.input_ids, part.attention_mask, T)
        logprobs, entropy = self.actor_forward(
            self.actor, part.input_ids, part.attention_mask, T, self.generation.temperature, layout,
            entropy_grad=hp.ent_coef > 0,
        )  # fmt: skip
        old_logprobs = part.old_logprobs
        if self.update_record is not None:  # the one on-policy step: its policy is the rollout policy
            old_logprobs = self.update_record.put(part.rows, logprobs, entropy)
        aggregation = dict(
            loss_aggregation=hp.loss_aggregation, max_response_length=self.generation.max_new_tokens
        )
        pg_loss, stats = F.ppo_policy_loss(
            logprobs, old_logprobs, part.advantages, mask, hp.clip_coef, hp.clip_coef_high,
            importance_sampling_level=hp.importance_sampling_level, **aggregation,
        )  # fmt: skip
        mean_entropy = F.masked_mean(entropy, mask)
        loss = pg_loss - hp.ent_coef * mean_entropy
        if hp.kl_loss_coef > 0:
            kl_loss, kl_stats = F.reference_kl_loss(
                logprobs, part.ref_logprobs, mask, hp.kl_loss_estimator, **aggregation
            )
            loss = loss + hp.kl_loss_coef * kl_loss
            stats.update(kl_stats)
        stats.update(policy_loss=pg_loss.detach(), entropy=mean_entropy.detach())
        return loss, stats

    @override
    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        metrics = super().schedule_metrics()
        metrics["lr_actor"] = torch.tensor(self.optimizers().param_groups[0]["lr"])
        return metrics

    @override
    def configure_optimizers(self):
        optimizer_fn, scheduler_fn = self.factories
        optimizer = optimizer_fn([p for p in self.actor.parameters() if p.requires_grad])
        if scheduler_fn is None:
            return optimizer
        scheduler = scheduler_fn(optimizer)
        resolve_total_steps(scheduler, self.hparams.max_rollouts or self.trainer.estimated_stepping_batches)
        return [optimizer], [scheduler]

"""Critic-free on-policy RLHF: GRPO, Dr. GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline behind one switch.

One ``training_step`` = one rollout: sample K responses per prompt, score them, turn the scores into
advantages with the chosen estimator (``functional/advantages.py``, names in ``functional.registry``), then
run ``update.epochs`` passes of the clipped surrogate over shuffled minibatches. There is no critic, no
critic optimiser and no value loss; PPO with GAE and a critic is :class:`~lit_rlhf.modules.PPOModule`.

The KL to the reference can be a per-token penalty in the reward (``kl.coef``, the RLOO and REINFORCE++
way) and/or a loss term (``kl.loss_coef``, the GRPO way). Advantages follow OpenRLHF's construction:
the (baselined) sequence score is placed at the last learned token, the per-token KL penalty is added, and
the advantage of token t is the discounted sum of what follows (with ``kl.coef`` = 0 and gamma = 1 this
is the baselined score on every token).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_settings import AdvantageSettings, CriticFreeUpdate
from lit_rlhf.modules.optim import PolicyAdamW
from lit_rlhf.replay import UpdateRecord
from lit_rlhf.rollout import GenerationSettings, Rollout

POLICY_LOSS_STATS = (
    "policy_loss", "kl_loss", "entropy", "approx_kl", "policy_kl", "clipfrac", "ratio_mean", "ratio_max",
)  # fmt: skip


class CriticFreeModule(OnlineRLModule):
    """On-policy RLHF without a critic: the baseline comes from the other responses or the batch.

    Besides its own arguments below it takes every argument of
    :class:`~lit_rlhf.modules.online.OnlineRLModule` (``reference``, ``reward_model`` / ``reward_fn``,
    ``monitor_reward_fn``, ``engine``, ``kl``, ``scoring``, ``samples``, ``evaluation``, ``max_rollouts``,
    ``rng_seed``).

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        advantage: the estimator (``AdvantageSettings``: ``estimator`` grpo, dr_grpo, rloo, reinforce_pp
            or reinforce_pp_baseline, and ``gamma``).
        generation: sampling settings (``GenerationSettings`` or a dict of its fields); None = the defaults.
            ``num_samples`` is K, the responses per prompt: 4 unless given (here, unlike PPO's 1).
        update: the update phase (``CriticFreeUpdate``: epochs, minibatches, clip ranges, loss aggregation,
            importance-sampling level, entropy bonus, gradient clip, ratio threshold,
            ``old_logprobs_from_update``, and ``is_correction``, the engine/trainer importance-sampling
            weights of the policy loss).
        actor_optimizer: optimiser factory of the actor; default AdamW at lr 1e-6 (``PolicyAdamW``).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
    """

    metric_prefix = "policy"
    loss_stats = POLICY_LOSS_STATS
    extra_metrics = ("advantages_mean", "advantages_std")
    settings_groups: ClassVar[dict] = {
        **OnlineRLModule.settings_groups, "update": CriticFreeUpdate, "advantage": AdvantageSettings,
    }  # fmt: skip
    default_num_samples: ClassVar[int] = 4  # K where generation.num_samples is not given

    def __init__(
        self,
        actor: ModelSpec | dict | str,
        advantage: AdvantageSettings | None = None,
        generation: GenerationSettings | None = None,
        update: CriticFreeUpdate | None = None,
        actor_optimizer: OptimizerCallable = PolicyAdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
        **kwargs: Any,
    ) -> None:
        generation = GenerationSettings.default_samples(generation, self.default_num_samples)
        super().__init__(actor=actor, advantage=advantage, generation=generation, update=update, **kwargs)
        estimator = self.advantage.estimator
        if F.ADVANTAGE_ESTIMATORS[estimator].needs_group and self.num_samples < 2:
            raise ValueError(
                f"CriticFreeModule: advantage.estimator={estimator!r} needs generation.num_samples >= 2 (its "
                f"baseline is the other responses to the same prompt), got num_samples={self.num_samples}"
            )
        self.factories = ((actor_optimizer, actor_scheduler),)
        self.update_record: UpdateRecord | None = None  # set while an on-policy update fills it

    @property
    def on_policy_update(self) -> bool:
        """Whether the update's one optimiser step computes the old log-probs (``old_logprobs_from_update``)."""
        update = self.update
        one_step = update.epochs == 1 and update.num_minibatches == 1
        return update.old_logprobs_from_update and one_step and self.kl.coef == 0  # (kl.target needs coef > 0)

    @override
    def wants_rollout_policy_terms(self) -> bool:
        return not self.on_policy_update

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.restore_rng()
        # 1. Generate K responses per prompt with the current policy (each prompt's K rows contiguous).
        sample = self.sample(batch)
        ids, attention, mask, T = sample.input_ids, sample.attention_mask, sample.loss_mask, sample.responses.ids.shape[1]
        # 2. Score without gradients: reference log-probs and sequence scores, and the old log-probs and
        #    entropy unless the update's one on-policy step computes them (None then; never for a rollout
        #    the engine/trainer correction weights, whose weights need them now).
        on_policy = self.on_policy_update and self.correction_mode(sample.responses) is None
        old_logprobs, ref_logprobs, _, entropy = self.score_rollout(
            ids, attention, T, policy=not on_policy, responses=sample.responses
        )
        scores, keep = self.score_responses(ids, attention, T, sample.responses.truncated, sample.columns, sample.env_scores)
        # 3. Advantages of the chosen estimator, per token.
        advantages = self.estimate_advantages(scores, old_logprobs, ref_logprobs, mask, keep)
        rollout = self.build_rollout(sample, old_logprobs, ref_logprobs, advantages, scores)
        # 4. update.epochs passes of the clipped surrogate over shuffled minibatches (of whole groups when
        #    the shared-prompt layout packs them); an on-policy step records the old log-probs.
        group_size = self.num_samples if self.packs_groups(ids, attention, T) else 1
        self.buffer.put(self.drop_rows(rollout, keep), group_size=group_size)
        self.update_record = UpdateRecord(mask) if on_policy else None
        self.run_update_epochs(self.policy_loss, [(self.optimizers(), self.actor)])
        if on_policy:
            old_logprobs, entropy = self.update_record.logprobs, self.update_record.entropy
        self.buffer.clear()
        self.update_record = None
        # 5. Rollout statistics (the rollout policy's KL to the reference), controllers and schedules
        #    advance once per rollout; metrics and samples are logged.
        kl = F.masked_kl(old_logprobs, ref_logprobs, mask, self.kl.estimator)  # (B, T)
        sequence_kl = F.masked_row_sum(kl, mask)  # (B,)
        self.log_rollout_stats(sample, scores, scores - self.kl_ctl.value * sequence_kl, kl, entropy, old_logprobs)
        schedule = self.schedule_metrics()  # the coefficient and learning rate this rollout used
        self.update_kl_controller(kl, mask)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(sample.prompts, sample.responses.ids, sample.responses.mask, scores, schedule)

    def estimate_advantages(
        self,
        scores: torch.Tensor,
        old_logprobs: torch.Tensor | None,
        ref_logprobs: torch.Tensor,
        mask: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B,) scores -> (B, T) advantages over the learned tokens (``mask``).

        ``keep`` (B,) marks the rows whose scores count (``scoring.on_nonfinite: drop``): the group
        baselines and the REINFORCE++ whitening see only those rows, as if the others had not been sampled.

        The estimator's per-sequence value goes to the last learned token, the KL penalty (``kl.coef``) to
        every learned token; the discounted returns of these rewards are the advantages, whitened over the
        batch of every rank for the REINFORCE++ estimators. ``old_logprobs`` None (an on-policy update
        computes them): the reward holds no KL term (``kl.coef`` is 0 then).
        """
        estimator = self.advantage.estimator
        keep = None if keep is None or bool(keep.all()) else keep  # (B,) or None: every row counts
        sequence_advantages = F.sequence_advantages(scores, estimator, self.num_samples, keep)  # (B,)
        logprobs = ref_logprobs if old_logprobs is None else old_logprobs  # None: a zero KL term
        rewards, _ = F.kl_shaped_rewards(
            sequence_advantages, logprobs, ref_logprobs, mask, self.kl_ctl.value, self.kl.estimator
        )  # (B, T)
        advantages = F.discounted_returns(rewards, mask, self.advantage.gamma)  # (B, T)
        self.update_metrics.update(
            {"advantages_mean": F.masked_mean(advantages, mask), "advantages_std": F.masked_std(advantages, mask)}
        )
        if F.ADVANTAGE_ESTIMATORS[estimator].whiten_returns:
            kept = mask if keep is None else mask & keep[:, None]  # (B, T)
            advantages = self.whiten(advantages, kept)  # (B, T)
        return advantages

    def policy_loss(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped surrogate (+ kl.loss_coef * KL to the reference - ent_coef * entropy) on one micro-batch."""
        update, kl, mask, T = self.update, self.kl, part.loss_mask, part.response_mask.shape[1]
        layout = self.shared_prefix_layout(part.input_ids, part.attention_mask, T)
        logprobs, entropy = self.actor_forward(
            self.actor, part.input_ids, part.attention_mask, T, self.generation.temperature, layout,
            entropy_grad=update.ent_coef > 0,
        )  # fmt: skip
        old_logprobs = part.old_logprobs
        if self.update_record is not None:  # the one on-policy step: its policy is the rollout policy
            old_logprobs = self.update_record.put(part.rows, logprobs, entropy)
        aggregation = dict(loss_aggregation=update.loss_aggregation, max_response_length=self.max_response_length)
        pg_loss, stats = F.ppo_policy_loss(
            logprobs, old_logprobs, part.advantages, mask, update.clip_coef, update.clip_coef_high,
            importance_sampling_level=update.importance_sampling_level, weights=part.is_weights,
            **aggregation,
        )  # fmt: skip
        mean_entropy = F.masked_mean(entropy, mask)
        stats.update(policy_loss=pg_loss.detach(), entropy=mean_entropy.detach())
        kl_loss = None
        if kl.loss_coef > 0:
            kl_loss, kl_stats = F.reference_kl_loss(logprobs, part.ref_logprobs, mask, kl.loss_estimator, **aggregation)
            stats.update(kl_stats)
        if update.loss_aggregation != "token_mean" and update.ent_coef > 0:  # the entropy is a token mean
            policy = pg_loss if kl_loss is None else pg_loss + kl.loss_coef * kl_loss
            return (policy, -update.ent_coef * mean_entropy), stats
        loss = pg_loss - update.ent_coef * mean_entropy
        return loss if kl_loss is None else loss + kl.loss_coef * kl_loss, stats

    @override
    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        metrics = super().schedule_metrics()
        metrics["lr_actor"] = torch.tensor(self.optimizers().param_groups[0]["lr"], dtype=torch.float32)
        return metrics

    @override
    def configure_optimizers(self):
        return self.optimizers_and_schedulers([self.actor], self.factories)

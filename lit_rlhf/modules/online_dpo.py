"""Online DPO on the online base: the DPO loss on pairs the current policy samples and the reward source ranks
(Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792, Algorithm 1;
TRL's ``OnlineDPOTrainer``).

One ``training_step`` = one rollout: sample K >= 2 responses per prompt from the current policy, score them
with the reward model, the ensemble or the reward function, take each prompt's best as chosen and its worst
as rejected (``functional.best_worst_pairs``; a tie gives no pair and no gradient, and is counted; with
``kl.coef`` > 0 ranked by the KL-regularised score, ``functional.kl_regularized_scores``), then run
``update.epochs`` passes of the DPO (or IPO) loss of ``functional.dpo_loss`` over minibatches of whole
prompts. The reference is a frozen copy of the initial policy, or the actor with its LoRA adapters disabled,
as in :class:`~lit_rlhf.modules.DPOModule`; its log-probs come from the rollout's scoring forward. Policy
and reference log-probs are taken at ``generation.temperature`` (1.0 by default), as in every online module.

Metrics, TRL's names under ``dpo/``: ``loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies`` (the implicit rewards beta * log pi/pi_ref), ``logps/chosen``, ``logps/rejected``,
``scores_margin`` (TRL's ``objective/scores_margin``: the reward source's chosen - rejected, before any KL
term of the ranking), ``beta`` (the
rollout's, adapted when ``kl.target`` is set);
``pairs`` and ``ties`` (prompts with and without a pair, over all ranks); ``policy_kl`` and ``ratio_mean``
(the update's drift from the rollout policy), ``lr_actor``. The rollout metrics are the base's:
``rollout/score`` (TRL's ``objective/scores``), ``rollout/kl_ref`` (``objective/kl``), ``rollout/entropy``,
``rollout/reward`` = score - beta * KL (``objective/rlhf_reward``), ``rollout/eos_rate``.

Shapes: G prompts, K samples per prompt, B = G*K rollout rows, T response length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules.dpo import DPO_METRICS, NLL_METRIC
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_settings import KLSettings, UpdateSettings
from lit_rlhf.modules.optim import PolicyAdamW
from lit_rlhf.rollout import GenerationSettings, Rollout
from lit_rlhf.settings import Settings

ONLINE_DPO_LOSS_STATS = ("loss", *DPO_METRICS, NLL_METRIC, "scores_margin", "policy_kl", "ratio_mean")


@dataclass
class PreferenceSettings(Settings):
    """The preference loss of online DPO (``functional.dpo_loss``).

    Attributes:
        beta: > 0, the strength of the implicit KL constraint to the reference (DPO's beta, IPO's tau).
        loss_type: ``sigmoid`` (DPO, Rafailov et al. 2023, arXiv 2305.18290 eq. 7) or ``ipo`` (Azar et al.
            2023, arXiv 2310.12036 eq. 17, on length-averaged log-probs).
        label_smoothing: in [0, 0.5), the assumed probability that the ranking is wrong (conservative DPO;
            ``sigmoid`` only).
        nll_coef: >= 0, RPO's alpha (Pang et al. 2024, arXiv 2404.19733): the loss adds alpha times the chosen
            responses' per-token NLL (``functional.chosen_nll``; ``nll_loss`` is logged either way).
    """

    group: ClassVar[str] = "preference"

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = 0.0
    nll_coef: float = 0.0

    def __post_init__(self) -> None:
        self.check_types()
        self.require_finite("beta", "label_smoothing", "nll_coef")
        self.require("nll_coef", self.nll_coef >= 0, ">= 0")
        self.require("beta", self.beta > 0, "> 0")
        self.require_choice("loss_type", ("sigmoid", "ipo"))
        self.require("label_smoothing", 0 <= self.label_smoothing < 0.5, "in [0, 0.5)")
        if self.loss_type == "ipo":
            self.require("label_smoothing", self.label_smoothing == 0, "0 with loss_type='ipo'")


@dataclass
class OnlineDPOUpdate(UpdateSettings):
    """:class:`UpdateSettings` of online DPO: by default one optimiser step per rollout (Guo et al. 2024).

    DPO's loss has no ratio to clip and no advantages: ``clip_coef`` is not used, ``clip_coef_high``,
    ``ent_coef``, ``importance_sampling_level`` and ``loss_aggregation`` (the loss is a mean over the
    rollout's pairs) must keep their defaults, and the engine/trainer correction (``is_correction``) is off
    (``auto`` and ``none`` mean none). ``ratio_threshold`` (None here) still skips a minibatch whose
    policy drifted that far from the rollout policy over several epochs.
    """

    epochs: int = 1
    num_minibatches: int = 1
    ratio_threshold: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, default in (("clip_coef_high", None), ("ent_coef", 0.0), ("importance_sampling_level", "token"),
                              ("loss_aggregation", "token_mean")):  # fmt: skip
            self.require(
                name, getattr(self, name) == default, f"{default!r} (it does not apply to online DPO)"
            )
        mode = self.is_correction.mode
        if mode not in ("auto", "none"):
            raise ValueError(
                f"update.is_correction.mode must be 'auto' or 'none' for online DPO (no ratio to weight), got {mode!r}"
            )
        self.is_correction = dataclasses.replace(self.is_correction, mode="none")


@dataclass
class OnlineDPOKL(KLSettings):
    """:class:`KLSettings` of online DPO. The KL to the reference is DPO's own (``preference.beta``); there is
    no KL loss term (``loss_coef`` 0).

    ``coef`` (>= 0, default 0) ranks each prompt's samples by the KL-regularised reward, the score less
    ``coef`` times the response's summed KL to the reference under ``estimator``
    (``functional.kl_regularized_scores``): a response that drifted far loses its pair to one that stayed
    close, which gives the loss the pull back towards the reference that DPO's beta alone lacks (beta only
    slows the drift). This ranking is this project's option, not in Guo et al. 2024; 0 ranks by the score.
    ``estimator`` is also that of the logged ``rollout/kl_ref``. ``target`` (None = a fixed beta) and ``horizon``
    adapt beta itself: DPO's beta is the coefficient of the KL-regularised reward objective whose optimum its
    loss fits (Rafailov et al. 2023, arXiv 2305.18290 eq. 3-4), so Ziegler et al.'s proportional controller
    (arXiv 1909.08593 sec. 2.2), which steers PPO's KL coefficient, steers it here too, one-sided: beta
    grows while the rollout's mean sequence KL to the reference is above ``target`` nats and shrinks while it
    is below, each rollout by at most 20% x rows / ``horizon``, but never below ``preference.beta``. Unlike
    PPO's KL penalty, DPO's loss has no pull back towards the reference, so a KL past its target does not come
    back down: a two-sided controller lowered beta while the KL was still rising towards the target, and the
    KL then overshot for good (the demo's measurement, ``configs/demo/online_dpo.yaml``).
    """

    coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require("loss_coef", self.loss_coef == 0, "0: online DPO's KL to the reference is preference.beta")

    @override
    def check_adaptive_target(self) -> None:
        """A target adapts ``preference.beta``, not ``coef`` (which stays 0)."""


class OnlineDPOModule(OnlineRLModule):
    """Online DPO: the DPO loss on the current policy's own samples, ranked by the reward source.

    Besides its own arguments below it takes every argument of
    :class:`~lit_rlhf.modules.online.OnlineRLModule` (``reference``, ``reward_model`` (one model or an
    ensemble) / ``reward_fn``, ``monitor_reward_fn``, ``engine``, ``scoring``, ``samples``, ``evaluation``,
    ``max_rollouts``, ``rng_seed``).

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        preference: the loss (``PreferenceSettings``: beta, loss_type sigmoid or ipo, label_smoothing).
        generation: sampling settings; None = the defaults. ``num_samples`` is K >= 2 (2 unless given), the
            responses ranked per prompt (best vs worst); ``scoring.forward_batch_size`` must be a multiple of
            K (a prompt's pair is scored in one micro-batch).
        update: the update phase (``OnlineDPOUpdate``: epochs, minibatches of whole prompts, gradient clip).
        kl: ``OnlineDPOKL``: the KL to the reference is DPO's ``preference.beta`` (``loss_coef`` 0);
            ``coef`` > 0 ranks the samples by score - coef x their KL to the reference (0: by score);
            ``estimator`` is that KL's and the logged ``rollout/kl_ref``'s; ``target`` and ``horizon`` adapt
            beta to hold that KL near ``target`` nats per response (None: a fixed beta).
        actor_optimizer: optimiser factory of the actor; default AdamW at lr 1e-6 (``PolicyAdamW``).
        actor_scheduler: LR schedule of the actor, stepped once per rollout (None = constant).
    """

    metric_prefix = "dpo"
    loss_stats = ONLINE_DPO_LOSS_STATS
    loss_unit_stats = frozenset(ONLINE_DPO_LOSS_STATS) - {"policy_kl", "ratio_mean"}  # per pair; the drift per token
    extra_metrics = ("pairs", "ties", "beta")
    minibatches_of_prompts: ClassVar[bool] = True  # a pair's two rows in one minibatch
    settings_groups: ClassVar[dict] = {
        **OnlineRLModule.settings_groups, "update": OnlineDPOUpdate, "kl": OnlineDPOKL,
        "preference": PreferenceSettings,
    }  # fmt: skip
    default_num_samples: ClassVar[int] = 2  # K where generation.num_samples is not given

    def __init__(
        self,
        actor: ModelSpec | dict | str,
        preference: PreferenceSettings | None = None,
        generation: GenerationSettings | None = None,
        update: OnlineDPOUpdate | None = None,
        kl: OnlineDPOKL | None = None,
        actor_optimizer: OptimizerCallable = PolicyAdamW,
        actor_scheduler: LRSchedulerCallable | None = None,
        **kwargs: Any,
    ) -> None:
        generation = GenerationSettings.default_samples(generation, self.default_num_samples)
        super().__init__(
            actor=actor, preference=preference, generation=generation, update=update, kl=kl, **kwargs
        )
        self.factories = ((actor_optimizer, actor_scheduler),)
        # (B,) +1 chosen, -1 rejected, 0 in no pair: each row's role while the update runs
        self.pair_roles: torch.Tensor | None = None

    @override
    def build_kl_controller(self, coef: float, floor: float = 0.0) -> F.KLController:
        """Beta is online DPO's KL coefficient: fixed, or raised towards ``kl.target`` from ``preference.beta``
        (its floor)."""
        beta = self.preference.beta
        return super().build_kl_controller(beta, floor=beta)

    @override
    def configure_settings(self, groups: dict, engine: Any, reward_model, reward_fn, max_rollouts) -> Any:
        """The base's checked settings groups, then the pairs' own checks (before any model is loaded)."""
        engine = super().configure_settings(groups, engine, reward_model, reward_fn, max_rollouts)
        self.check_pairs_settings()
        return engine

    def check_pairs_settings(self) -> None:
        """Refuse settings under which a prompt has no pair, or its pair is split across micro-batches."""
        name, K = type(self).__name__, self.num_samples
        if K < 2:
            raise ValueError(
                f"{name}: generation.num_samples must be >= 2 (a pair of responses per prompt), got {K}"
            )
        if self.scoring.forward_batch_size % K:
            raise ValueError(
                f"{name}: scoring.forward_batch_size ({self.scoring.forward_batch_size}) must be a multiple of "
                f"generation.num_samples ({K}): a prompt's responses are scored in one micro-batch"
            )

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.restore_rng()
        # 1. Generate K >= 2 responses per prompt with the current policy (each prompt's K rows contiguous).
        sample = self.sample(batch)
        ids, attention, mask, T = sample.input_ids, sample.attention_mask, sample.loss_mask, sample.responses.ids.shape[1]
        # 2. Score without gradients: old and reference log-probs, entropy, and the sequence scores.
        old_logprobs, ref_logprobs, _, entropy = self.score_rollout(ids, attention, T, responses=sample.responses)
        scores, keep = self.score_responses(
            ids, attention, T, sample.responses.truncated, sample.columns, sample.env_scores
        )  # (B,), (B,)
        kl = F.masked_kl(old_logprobs, ref_logprobs, mask, self.kl.estimator)  # (B, T)
        sequence_kl = F.masked_row_sum(kl, mask)  # (B,)
        # 3. Rank each prompt's responses by score - kl.coef x KL (by score with coef 0): chosen = the best
        #    kept, rejected = the worst; a tie has no pair.
        ranking = F.kl_regularized_scores(scores, sequence_kl, self.kl.coef)  # (B,)
        chosen, rejected, paired = F.best_worst_pairs(ranking, self.num_samples, keep)  # (G,), (G,), (G,)
        self.pair_roles = self.log_pairs(scores, chosen, rejected, paired)  # (B,)
        # 4. update.epochs passes of the preference loss over minibatches of whole prompts (no advantages).
        rollout = self.build_rollout(sample, old_logprobs, ref_logprobs, torch.zeros_like(old_logprobs), scores)
        self.buffer.put(rollout, group_size=self.num_samples)
        self.run_update_epochs(self.preference_loss, [(self.optimizers(), self.actor)])
        self.buffer.clear()
        self.pair_roles = None
        # 5. Rollout statistics (rollout/reward = score - beta * KL, TRL's objective/rlhf_reward), beta's
        #    controller (with kl.target), schedules, metrics and samples.
        beta = self.kl_ctl.value  # the beta of this rollout's update
        self.log_rollout_stats(sample, scores, scores - beta * sequence_kl, kl, entropy, old_logprobs)
        self.update_metrics.update({"beta": torch.tensor(beta, dtype=torch.float32)})
        schedule = self.schedule_metrics()  # the learning rate this rollout used
        self.update_kl_controller(kl, mask)
        for scheduler in self.lr_schedulers_list():
            scheduler.step()
        self.finish_rollout(sample.prompts, sample.responses.ids, sample.responses.mask, scores, schedule)

    def log_pairs(self, scores, chosen, rejected, paired) -> torch.Tensor:
        """Log the rollout's prompts with and without a pair (``pairs``, ``ties``, over all ranks); returns
        the (B,) role of each row: +1 chosen, -1 rejected, 0 in no pair."""
        counts = torch.stack([paired.sum(), (~paired).sum()]).float()  # (2,)
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum")  # (2,) every rank's
        self.update_metrics.update({"pairs": counts[0], "ties": counts[1]})
        roles = torch.zeros_like(scores, dtype=torch.long)  # (B,)
        roles[chosen[paired]], roles[rejected[paired]] = 1, -1
        return roles

    def preference_loss(self, part: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The DPO / IPO loss of one micro-batch's pairs (whole prompts), 0 with no gradient without any."""
        mask, T, K, pref = part.loss_mask, part.response_mask.shape[1], self.num_samples, self.preference
        beta = self.kl_ctl.value
        layout = self.shared_prefix_layout(part.input_ids, part.attention_mask, T)
        logprobs, _ = self.actor_forward(
            self.actor, part.input_ids, part.attention_mask, T, self.generation.temperature, layout, entropy=False
        )  # (b, T)
        drift = {
            "policy_kl": F.masked_mean(part.old_logprobs - logprobs.detach(), mask),
            "ratio_mean": F.masked_mean(torch.exp(logprobs.detach() - part.old_logprobs), mask),
        }
        chosen, rejected = pair_rows(self.pair_roles[part.rows], K)  # (p,), (p,)
        if chosen.numel() == 0:
            zeros = {name: torch.zeros((), device=logprobs.device) for name in ONLINE_DPO_LOSS_STATS}
            return logprobs.sum() * 0.0, {**zeros, **drift}
        policy, sums, tokens = sequence_logps(logprobs, mask, pref.loss_type)  # (b,), (b,), (b,)
        reference, _, _ = sequence_logps(part.ref_logprobs, mask, pref.loss_type)  # (b,)
        loss, stats = F.dpo_loss(
            policy[chosen], policy[rejected], reference[chosen], reference[rejected], beta, pref.loss_type,
            pref.label_smoothing,
        )  # fmt: skip
        nll = F.chosen_nll(sums[chosen], tokens[chosen])  # ()
        if pref.nll_coef:
            loss = loss + pref.nll_coef * nll
        scores_margin = (part.scores[chosen] - part.scores[rejected]).mean()
        return loss, {**stats, NLL_METRIC: nll.detach(), "loss": loss.detach(), "scores_margin": scores_margin, **drift}

    @override
    def minibatch_step(self, loss_fn, mb, optimized, params):
        """A minibatch in which every prompt tied (no pair on any rank) has no loss: it is not stepped (AdamW's
        momentum would repeat the last update) and its zero DPO statistics stay out of the rollout's; only its
        drift statistics are kept, and it counts in ``skipped_minibatches``."""
        pairs = (self.pair_roles[mb.rows] == 1).sum().float()
        if self.trainer.strategy.reduce(pairs, reduce_op="sum") > 0:
            return super().minibatch_step(loss_fn, mb, optimized, params)
        stats = self.accumulate_minibatch(loss_fn, mb)  # the drift statistics; the loss is 0
        for opt, _ in optimized:
            opt.zero_grad(set_to_none=True)
        drift = {name: stats[name] for name in ("policy_kl", "ratio_mean")}
        self.update_metrics.update({**drift, "skipped_minibatches": 1.0, "nonfinite_steps": 0.0})
        return stats, False

    @override
    def micro_batch_weight(self, part: Rollout, mb: Rollout) -> torch.Tensor:
        """The micro-batch's share of the minibatch's pairs (the loss is a mean over pairs); a minibatch
        without pairs (its loss is 0) weighs its drift statistics by learned tokens."""
        # float32 whatever the default dtype (Lightning's bf16-true makes it bfloat16 inside training_step)
        in_part = (self.pair_roles[part.rows] == 1).sum().float()
        in_minibatch = (self.pair_roles[mb.rows] == 1).sum().float()
        if in_minibatch == 0:
            return super().micro_batch_weight(part, mb)
        return in_part / in_minibatch

    @override
    def schedule_metrics(self) -> dict[str, torch.Tensor]:
        """The actor's learning rate (no ``kl_coef``: beta, logged with the update's metrics, is that coefficient)."""
        return {"lr_actor": torch.tensor(self.optimizers().param_groups[0]["lr"])}

    @override
    def configure_optimizers(self):
        return self.optimizers_and_schedulers([self.actor], self.factories)


def pair_rows(roles: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b,) roles of whole groups of K consecutive rows (+1 chosen, -1 rejected, 0) -> the (p,) rows of each
    paired group's chosen and of its rejected response."""
    grouped = roles.view(-1, group_size)  # (g, K)
    paired = (grouped == 1).any(dim=1)  # (g,)
    offsets = torch.arange(grouped.shape[0], device=roles.device) * group_size  # (g,)
    chosen = offsets + (grouped == 1).long().argmax(dim=1)  # (g,)
    rejected = offsets + (grouped == -1).long().argmax(dim=1)  # (g,)
    return chosen[paired], rejected[paired]


def sequence_logps(
    logprobs: torch.Tensor, mask: torch.Tensor, loss_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, T) token log-probs -> the (b,) sequence log-probs of ``loss_type`` over the learned tokens: summed
    (DPO) or averaged over them (IPO's per-token log-likelihoods, as ``DPOModule``); with the (b,) sums and
    the (b,) learned-token counts (RPO's NLL term reads them)."""
    total, tokens = F.masked_row_sum(logprobs, mask), mask.sum(dim=1)  # (b,), (b,)
    reduced = total / tokens.clamp(min=1) if loss_type == "ipo" else total  # (b,)
    return reduced, total, tokens

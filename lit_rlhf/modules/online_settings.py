"""The settings groups of the online modules, and where the old flat arguments went.

Each group is one constructor argument (a dataclass, a dict of its fields in YAML or Python, or None for
its defaults) that checks itself with messages naming the key (``update.clip_coef must be > 0``):

======================  =======================================================================
``update``              the update phase: epochs, minibatches, clip ranges, loss aggregation, the
                        engine/trainer importance-sampling correction (``update.is_correction``), ...
``kl``                  the KL to the reference: in the reward (coefficient, adaptive target) and in the loss
``scoring``             the rollout's no-grad forwards and its scores: batch size, bucketing, shared prefix,
                        score clip, missing-EOS penalty, what a non-finite score does
``advantage``           the estimator's settings (GAE for PPO, the critic-free estimator and its discount)
``samples``             the sample tables
``evaluation``          the evaluation rollouts of ``validate`` / ``test``
======================  =======================================================================

Where the flat arguments of the earlier layout went: :mod:`lit_rlhf.modules.online_migration`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Literal

from lit_rlhf.batching import Bucketing
from lit_rlhf.functional.registry import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    SEQUENCE_ESTIMATORS,
)
from lit_rlhf.modules.online_correction import ISCorrectionSettings
from lit_rlhf.rollout import GenerationSettings
from lit_rlhf.settings import Settings

EMBEDDING_GRADS = ("auto", "dense")  # update.embedding_grads

__all__ = [
    "AdvantageSettings",
    "CriticFreeUpdate",
    "EvaluationSettings",
    "GAESettings",
    "ISCorrectionSettings",
    "KLSettings",
    "PPOUpdate",
    "SampleSettings",
    "ScoringSettings",
    "UpdateSettings",
]

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "abs", "k2", "k3"]
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def _positive_or_none(value: float | None) -> bool:
    return value is None or value > 0


@dataclass
class UpdateSettings(Settings):
    """The update phase of a rollout: ``epochs`` passes of clipped-surrogate steps over its minibatches.

    Attributes:
        epochs: passes over each rollout (PPO's ``ppo_epochs``, verl's ``ppo_epochs``).
        num_minibatches: optimiser steps per pass (the rollout's rows, or whole groups, split evenly).
        clip_coef: epsilon of the clipped ratio: its lower bound is 1 - clip_coef.
        clip_coef_high: upper epsilon (1 + clip_coef_high), DAPO's "clip-higher" (Yu et al. 2025,
            arXiv:2503.14476 sec. 3.1); None = clip_coef.
        loss_aggregation: how the policy loss reduces its token terms: ``token_mean`` (every learned token
            of the minibatch weighs the same), ``seq_mean_token_mean`` (mean per response, then over
            responses: the original GRPO) or ``seq_mean_token_sum_norm`` (token sums / max_new_tokens:
            Dr. GRPO); see ``functional.aggregate_loss``.
        importance_sampling_level: ``token`` ratios (PPO, GRPO) or one ``sequence`` ratio per response, the
            geometric mean of its token ratios (GSPO, Zheng et al. 2025, arXiv:2507.18071).
        ent_coef: weight of the entropy bonus.
        max_grad_norm: gradient-norm clip per optimiser (None = off).
        ratio_threshold: skip a minibatch whose mean ratio exceeds this (None = never skip).
        is_correction: the importance-sampling correction of the engine/trainer mismatch
            (``ISCorrectionSettings`` or a dict of its fields: ``mode`` auto, none, token_truncate,
            token_mask, sequence_truncate or sequence_mask, ``cap``, ``low``, ``sequence_ratio``); the default
            ``auto`` corrects (TIS, C = 2) only for an engine that is not the trainer's own policy.
        embedding_grads: ``auto`` accumulates the input embeddings' gradients row by row, in place, into one
            dense gradient per optimiser step where that changes nothing but the cost (one process, CPU,
            untied tables of >= 2**20 weights; ``lit_rlhf.models.embedding_grads``), and the fused LM head's
            (the output embedding's) micro-batch by micro-batch into the weight's gradient (one process;
            ``lit_rlhf.models.fused_head``); ``dense`` keeps the plain backwards' (V, H) gradient per
            micro-batch. Equal up to the order of float additions.
    """

    group: ClassVar[str] = "update"
    renamed: ClassVar[dict[str, str]] = {"ppo_epochs": "epochs"}

    epochs: int = 4
    num_minibatches: int = 2
    clip_coef: float = 0.2
    clip_coef_high: float | None = None
    loss_aggregation: LossAggregation = "token_mean"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    ent_coef: float = 0.0
    max_grad_norm: float | None = 1.0
    ratio_threshold: float | None = 10.0
    is_correction: ISCorrectionSettings | None = None
    embedding_grads: Literal["auto", "dense"] = "auto"

    def __post_init__(self) -> None:
        self.check_types()
        self.is_correction = ISCorrectionSettings.coerce(self.is_correction, "update.is_correction")
        self.require_finite(*(f.name for f in fields(self)))
        for name in ("epochs", "num_minibatches", "clip_coef"):
            self.require(name, getattr(self, name) > 0, "> 0")
        for name in ("clip_coef_high", "max_grad_norm", "ratio_threshold"):
            self.require(name, _positive_or_none(getattr(self, name)), "> 0 or None")
        self.require("ent_coef", self.ent_coef >= 0, ">= 0")
        self.require_choice("loss_aggregation", LOSS_AGGREGATIONS)
        self.require_choice("importance_sampling_level", IMPORTANCE_SAMPLING_LEVELS)
        self.require_choice("embedding_grads", EMBEDDING_GRADS)


@dataclass
class PPOUpdate(UpdateSettings):
    """:class:`UpdateSettings` of PPO, with its policy-loss choice and the critic's value loss.

    Attributes:
        policy_loss: ``clip`` (PPO-Clip, Schulman et al. 2017 arXiv:1707.06347 eq. 7) or ``kl_penalty``
            (PPO-Penalty with adaptive beta, eq. 8). ``kl_penalty`` clips no ratio: ``clip_coef`` does not
            apply to it (the value clip ``clip_coef_value`` does), ``clip_coef_high`` must stay None and
            ``importance_sampling_level`` ``token``.
        init_beta: initial beta of the ``kl_penalty`` policy loss.
        beta_target: target KL(old || new) per token of the ``kl_penalty`` policy loss.
        vf_coef: weight of the value loss.
        clip_coef_value: clip range of the new values around the old ones.
    """

    policy_loss: Literal["clip", "kl_penalty"] = "clip"
    init_beta: float = 0.1
    beta_target: float = 0.01
    vf_coef: float = 0.5
    clip_coef_value: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_choice("policy_loss", POLICY_LOSSES)
        for name in ("init_beta", "beta_target", "clip_coef_value"):  # clip_coef_value 0 pins the values
            self.require(name, getattr(self, name) > 0, "> 0")
        self.require("vf_coef", self.vf_coef >= 0, ">= 0")
        if self.policy_loss == "kl_penalty":  # PPO-Penalty has no ratio clip (clip_coef is not read either)
            self.require("importance_sampling_level", self.importance_sampling_level == "token",
                         "'token' with policy_loss='kl_penalty'")  # fmt: skip
            self.require("clip_coef_high", self.clip_coef_high is None,
                         "None with policy_loss='kl_penalty' (PPO-Penalty clips no ratio)")  # fmt: skip


@dataclass
class CriticFreeUpdate(UpdateSettings):
    """:class:`UpdateSettings` of the critic-free module.

    Attributes:
        old_logprobs_from_update: when each rollout gets exactly one optimiser step (``epochs`` =
            ``num_minibatches`` = 1) and no KL penalty in the reward (``kl.coef`` = 0), take the old
            log-probs and the rollout entropy from that step's own forward instead of a separate scoring
            forward of the actor: its policy is the rollout policy, so the ratio is exactly 1 (TRL's
            GRPOTrainer does the same). False always runs the scoring forward, and so does a rollout
            that ``is_correction`` weights (its weights need the old log-probs before the update).
    """

    old_logprobs_from_update: bool = True


@dataclass
class KLSettings(Settings):
    """The KL to the reference policy: a per-token penalty in the reward and/or a loss term.

    Attributes:
        coef: initial coefficient of the per-token KL penalty in the reward (0 = none; InstructGPT,
            Ouyang et al. 2022 arXiv:2203.02155 eq. 2).
        target: target sequence KL of the adaptive controller of ``coef`` (Ziegler et al. 2019,
            arXiv:1909.08593 sec. 2.2); None = a fixed ``coef``.
        horizon: horizon (in rollout rows) of the adaptive controller.
        estimator: per-token estimator of the KL in the reward: k1, k2, k3 or abs (Schulman 2020,
            http://joschu.net/blog/kl-approx.html).
        loss_coef: weight of the KL-to-reference loss term (GRPO's, Shao et al. 2024 arXiv:2402.03300
            eq. 3; 0 = off); independent of ``coef``.
        loss_estimator: per-token estimator of that term (GRPO uses k3).
    """

    group: ClassVar[str] = "kl"
    renamed: ClassVar[dict[str, str]] = {
        "kl_coef": "coef", "kl_target": "target", "kl_horizon": "horizon", "kl_estimator": "estimator",
        "kl_loss_coef": "loss_coef", "kl_loss_estimator": "loss_estimator",
    }  # fmt: skip

    coef: float = 0.05
    target: float | None = None
    horizon: int = 10000
    estimator: KLEstimator = "k1"
    loss_coef: float = 0.0
    loss_estimator: KLEstimator = "k3"

    def __post_init__(self) -> None:
        self.check_types()
        self.require_finite(*(f.name for f in fields(self)))
        self.require("coef", self.coef >= 0, ">= 0")
        self.require("loss_coef", self.loss_coef >= 0, ">= 0")
        self.require("target", _positive_or_none(self.target), "> 0 or None")
        self.require("horizon", self.horizon >= 1, ">= 1")
        self.check_adaptive_target()
        self.require_choice("estimator", KL_ESTIMATORS)
        self.require_choice("loss_estimator", KL_ESTIMATORS)

    def check_adaptive_target(self) -> None:
        """The adaptive controller scales the coefficient it steers: ``coef`` must be > 0 with a ``target``."""
        if self.target is not None:
            self.require("coef", self.coef > 0, "> 0 with an adaptive target (it scales a zero coefficient)")


@dataclass
class ScoringSettings(Settings):
    """The rollout's no-grad forwards (old and reference log-probs, values) and its sequence scores.

    Attributes:
        forward_batch_size: the most rows per forward pass (rollout scoring and the update's
            gradient-accumulation micro-batches).
        bucketing: length-bucketed micro-batches (``lit_rlhf.batching.Bucketing`` or a dict of its fields;
            None = its defaults): where it saves at least ``min_saving`` of the padded tokens, rows are
            sorted by length into micro-batches of at most ``token_budget`` padded tokens whose all-padding
            columns are dropped; results are unchanged up to float rounding. ``{enabled: false}`` keeps every
            forward at the full width.
        shared_prefix: ``auto``, ``on`` or ``off``: compute each prompt once for its K responses (one row
            ``[prompt | r1 | ... | rK]`` with a block attention mask, ``models.shared_prefix``) in the actor
            and reference forwards. ``auto`` packs a batch when its estimated cost falls below 0.75 of the
            padded one and the module's forwards have a packed form (not PPO's critic); ``on`` always packs
            (refused where the forwards have no packed form). Either only where the model can run the layout
            (``models.shared_prefix.unsupported_reason``: sdpa/eager attention, no sliding window, an
            architecture of ``SHARED_PREFIX_MODEL_TYPES``); ``on`` is refused elsewhere.
        score_clip: clip the sequence scores to [-score_clip, score_clip] (None = off).
        missing_eos_penalty: subtracted from the score of a response truncated without a stop token.
        on_nonfinite: what a NaN/inf score of the reward model or function does: ``raise`` (the fit stops,
            naming the rollout, the scorer and the prompt/response, before anything is learnt from it) or
            ``drop`` (those rows get no gradient and are counted in ``rollout/nonfinite_scores``).
            Non-finite losses or gradients are always skipped.
        old_logprobs: where the rollout's old log-probs (and its logged entropy) come from
            (``lit_rlhf.modules.online_old_logprobs``): ``auto`` (default) from the sampler that drew the
            tokens where it samples from the trainer's own policy in full precision (the Hugging Face
            engine, ``precision: 32-true``, single-turn, no engine/trainer correction, no value head on
            the actor): the same figures to float rounding, without the actor's scoring forward; else from
            that forward. ``sampler`` the same, or an error saying why not; ``forward`` always the forward.
    """

    group: ClassVar[str] = "scoring"

    forward_batch_size: int = 16
    bucketing: Bucketing | None = None
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    score_clip: float | None = None
    missing_eos_penalty: float | None = None
    on_nonfinite: Literal["raise", "drop"] = "raise"
    old_logprobs: Literal["auto", "sampler", "forward"] = "auto"

    def __post_init__(self) -> None:
        self.check_types()
        self.bucketing = Bucketing.coerce(self.bucketing, "scoring.bucketing")
        self.require_finite("score_clip", "missing_eos_penalty")
        self.require("forward_batch_size", self.forward_batch_size > 0, "> 0")
        self.require("score_clip", _positive_or_none(self.score_clip), "> 0 or None")
        ok = self.missing_eos_penalty is None or self.missing_eos_penalty >= 0  # a negative one rewards truncation
        self.require("missing_eos_penalty", ok, ">= 0 or None")
        self.require_choice("shared_prefix", ("auto", "on", "off"))
        self.require_choice("on_nonfinite", ("raise", "drop"))
        self.require_choice("old_logprobs", ("auto", "sampler", "forward"))


@dataclass
class GAESettings(Settings):
    """PPO's advantages: GAE over the KL-shaped rewards (Schulman et al. 2016, arXiv:1506.02438 eq. 16).

    Attributes:
        gamma: discount factor.
        gae_lambda: GAE's lambda.
        whiten: whiten the advantages per rollout (mean 0, std 1 over the learned tokens of all ranks).
        whiten_rewards: whiten the shaped rewards (keeping their mean) before GAE.
    """

    group: ClassVar[str] = "advantage"
    renamed: ClassVar[dict[str, str]] = {"whiten_advantages": "whiten"}

    gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten: bool = True
    whiten_rewards: bool = False

    def __post_init__(self) -> None:
        self.check_types()
        for name in ("gamma", "gae_lambda"):
            self.require(name, 0.0 <= getattr(self, name) <= 1.0, "in [0, 1]")


@dataclass
class AdvantageSettings(Settings):
    """The critic-free advantage estimator (``functional.registry.ADVANTAGE_ESTIMATORS``).

    Attributes:
        estimator: ``grpo`` (group mean and std; Shao et al. 2024), ``dr_grpo`` (group mean only; Liu et
            al. 2025), ``rloo`` (leave-one-out mean; Ahmadian et al. 2024), ``reinforce_pp`` (batch-whitened
            returns; Hu 2025) or ``reinforce_pp_baseline`` (group mean subtracted first). All but
            ``reinforce_pp`` need ``generation.num_samples`` >= 2; ``gae`` needs a critic: PPOModule.
        gamma: discount of the per-token returns (1.0 = every token gets the sequence's advantage).
    """

    group: ClassVar[str] = "advantage"
    renamed: ClassVar[dict[str, str]] = {"advantage_estimator": "estimator"}

    estimator: AdvantageEstimator = "grpo"
    gamma: float = 1.0

    def __post_init__(self) -> None:
        self.check_types()
        if self.estimator == "gae":
            raise ValueError("advantage.estimator='gae' needs a critic; use lit_rlhf.modules.PPOModule for GAE")
        self.require_choice("estimator", SEQUENCE_ESTIMATORS)
        self.require("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]")


@dataclass
class SampleSettings(Settings):
    """The ``rollout/samples`` (and ``val/samples``, ``test/samples``) tables.

    Attributes:
        every: log a prompt/response/score table every this many rollouts (0 = never).
        rows: rows of each table.
    """

    group: ClassVar[str] = "samples"
    renamed: ClassVar[dict[str, str]] = {"log_samples_every": "every", "num_log_samples": "rows"}

    every: int = 10
    rows: int = 4

    def __post_init__(self) -> None:
        self.check_types()
        self.require("every", self.every >= 0, ">= 0")
        self.require("rows", self.rows >= 0, ">= 0")


@dataclass
class EvaluationSettings(Settings):
    """The evaluation rollouts of ``validate`` / ``test`` (and of validation during fit).

    Attributes:
        generation: ``GenerationSettings`` fields overriding the training ``generation`` (whose
            ``num_samples`` becomes 1 unless given here); None = exactly that.
        greedy: decode greedily (argmax) instead of sampling.
    """

    group: ClassVar[str] = "evaluation"

    generation: dict[str, Any] | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        self.check_types()
        if isinstance(self.generation, GenerationSettings):
            self.generation = self.generation.as_dict()
        if self.generation is not None and not isinstance(self.generation, dict):
            raise TypeError(
                "evaluation.generation: expected a dict of GenerationSettings fields or None, "
                f"got {type(self.generation).__name__}"
            )
        resolved = self.resolve(GenerationSettings())  # unknown fields and bad values fail now, not at validation
        if self.greedy and resolved.num_samples > 1:  # vLLM refuses it; with HF the K samples would be one
            raise ValueError(
                f"evaluation.generation.num_samples={resolved.num_samples} with evaluation.greedy: greedy decoding"
                " gives one response per prompt; leave num_samples at 1 or sample (greedy: false)"
            )

    def resolve(self, generation: GenerationSettings) -> GenerationSettings:
        """The settings of evaluation rollouts: ``generation`` with one sample per prompt, overridden."""
        overrides = GenerationSettings.migrate(dict(self.generation or {}))
        names = [f.name for f in fields(GenerationSettings)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"evaluation.generation: unknown GenerationSettings field(s) {unknown}; valid ones are {names}")
        return replace(generation, **{"num_samples": 1, **overrides})

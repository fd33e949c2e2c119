"""Pure tensor math of RLHF: no Lightning, no transformers, no I/O.

Shapes: B batch, T response length, V vocabulary. Log-probs and everything computed from them are
float32. A (B, T) mask is the loss mask: 1/True on the tokens learned from. It may have holes (tool or
environment tokens between the model's tokens of a multi-turn rollout), which are skipped as if removed:
every result equals that of the same inputs with the hole positions deleted (rows compacted left), and
(B, T) outputs are 0 at the holes. A right-padded mask (1...1 0...0) is the case without holes.
"""

from lit_rlhf.functional.advantages import (
    compute_gae,
    discounted_returns,
    fill_dropped_scores,
    grpo_advantages,
    rloo_advantages,
    sequence_advantages,
)
from lit_rlhf.functional.behavior import BEHAVIOR_MISMATCH_STATS, behavior_mismatch_stats
from lit_rlhf.functional.ensembles import (
    ENSEMBLE_AGGREGATIONS,
    aggregate_ensemble,
    disagreement_loss,
    ensemble_std,
    poisson_bootstrap_weights,
    standardize_members,
)
from lit_rlhf.functional.is_correction import (
    IS_CORRECTION_STATS,
    band_weights,
    behavior_log_ratio,
    is_correction_weights,
    normalized_ess,
    sequence_log_ratio,
    truncated_weights,
)
from lit_rlhf.functional.kl import kl_penalty, kl_shaped_rewards, masked_kl
from lit_rlhf.functional.kl_controllers import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    PPOPenaltyKLController,
)
from lit_rlhf.functional.logprobs import (
    entropy_from_logits,
    label_logprobs_and_entropy,
    label_logprobs_and_entropy_grad_,
    logprobs_from_logits,
    scaled_label_scores,
    scaled_logits,
)
from lit_rlhf.functional.losses import (
    aggregate_loss,
    aggregation_weight,
    clipped_value_loss,
    kl_penalty_policy_loss,
    pairwise_reward_loss,
    ppo_policy_loss,
    reference_kl_loss,
)
from lit_rlhf.functional.preference import (
    DPO_LOSS_TYPES,
    best_worst_pairs,
    chosen_nll,
    dpo_loss,
    kl_regularized_scores,
)
from lit_rlhf.functional.registry import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTION_MODES,
    IS_SEQUENCE_RATIOS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    SEQUENCE_ESTIMATORS,
    AdvantageEstimatorInfo,
)
from lit_rlhf.functional.rewards import soft_overlong_penalty, weighted_reward_sum
from lit_rlhf.functional.stats import (
    as_groups,
    compact_left,
    explained_variance,
    group_score_stats,
    masked_mean,
    masked_moments,
    masked_row_sum,
    masked_std,
    masked_sum,
    masked_var,
    masked_whiten,
    scatter_back,
    whiten_from_moments,
)
from lit_rlhf.functional.truncation import truncated_logprobs
from lit_rlhf.functional.uncertainty import elliptical_width, feature_precision

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimatorInfo",
    "BEHAVIOR_MISMATCH_STATS",
    "POLICY_LOSSES",
    "behavior_mismatch_stats",
    "IS_CORRECTION_MODES",
    "IS_CORRECTION_STATS",
    "IS_SEQUENCE_RATIOS",
    "band_weights",
    "behavior_log_ratio",
    "is_correction_weights",
    "normalized_ess",
    "sequence_log_ratio",
    "truncated_weights",
    "GROUP_ESTIMATORS",
    "SEQUENCE_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "DPO_LOSS_TYPES",
    "ENSEMBLE_AGGREGATIONS",
    "aggregate_ensemble",
    "disagreement_loss",
    "best_worst_pairs",
    "ensemble_std",
    "elliptical_width",
    "feature_precision",
    "poisson_bootstrap_weights",
    "standardize_members",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "PPOPenaltyKLController",
    "aggregate_loss",
    "aggregation_weight",
    "as_groups",
    "clipped_value_loss",
    "compact_left",
    "compute_gae",
    "fill_dropped_scores",
    "discounted_returns",
    "grpo_advantages",
    "group_score_stats",
    "chosen_nll",
    "dpo_loss",
    "kl_regularized_scores",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "kl_penalty_policy_loss",
    "kl_shaped_rewards",
    "masked_kl",
    "label_logprobs_and_entropy",
    "label_logprobs_and_entropy_grad_",
    "logprobs_from_logits",
    "scaled_label_scores",
    "scaled_logits",
    "masked_mean",
    "masked_moments",
    "masked_row_sum",
    "masked_sum",
    "masked_std",
    "masked_var",
    "masked_whiten",
    "scatter_back",
    "whiten_from_moments",
    "pairwise_reward_loss",
    "ppo_policy_loss",
    "reference_kl_loss",
    "rloo_advantages",
    "sequence_advantages",
    "soft_overlong_penalty",
    "truncated_logprobs",
    "weighted_reward_sum",
]

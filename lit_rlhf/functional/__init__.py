"""Pure tensor math of RLHF: no Lightning, no transformers, no I/O.

Shapes: B batch, T response length, V vocabulary. Masks are 1/True for real tokens. Log-probs and
everything computed from them are float32. See DESIGN.md "functional/ — the public math API".
"""

from lit_rlhf.functional.advantages import (
    GROUP_ESTIMATORS,
    SEQUENCE_ESTIMATORS,
    compute_gae,
    discounted_returns,
    fill_dropped_scores,
    grpo_advantages,
    rloo_advantages,
    sequence_advantages,
)
from lit_rlhf.functional.kl import KL_ESTIMATORS, kl_penalty, kl_shaped_rewards, masked_kl
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
    DPO_LOSS_TYPES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_weight,
    clipped_value_loss,
    dpo_loss,
    kl_penalty_policy_loss,
    pairwise_reward_loss,
    ppo_policy_loss,
    reference_kl_loss,
)
from lit_rlhf.functional.stats import (
    as_groups,
    explained_variance,
    group_score_stats,
    masked_mean,
    masked_moments,
    masked_row_sum,
    masked_sum,
    masked_var,
    masked_whiten,
    whiten_from_moments,
)

__all__ = [
    "GROUP_ESTIMATORS",
    "SEQUENCE_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "DPO_LOSS_TYPES",
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
    "compute_gae",
    "fill_dropped_scores",
    "discounted_returns",
    "grpo_advantages",
    "group_score_stats",
    "dpo_loss",
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
    "masked_var",
    "masked_whiten",
    "whiten_from_moments",
    "pairwise_reward_loss",
    "ppo_policy_loss",
    "reference_kl_loss",
    "rloo_advantages",
    "sequence_advantages",
]

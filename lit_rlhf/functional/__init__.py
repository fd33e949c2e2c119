"""Pure tensor math of RLHF: no Lightning, no transformers, no I/O.

Shapes: B batch, T response length, V vocabulary. Masks are 1/True for real tokens. Log-probs and
everything computed from them are float32. See DESIGN.md "functional/ — the public math API".
"""

from lit_rlhf.functional.advantages import compute_gae
from lit_rlhf.functional.kl import KL_ESTIMATORS, kl_penalty, kl_shaped_rewards
from lit_rlhf.functional.kl_controllers import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    PPOPenaltyKLController,
)
from lit_rlhf.functional.logprobs import entropy_from_logits, logprobs_from_logits
from lit_rlhf.functional.losses import (
    DPO_LOSS_TYPES,
    clipped_value_loss,
    dpo_loss,
    kl_penalty_policy_loss,
    pairwise_reward_loss,
    ppo_policy_loss,
)
from lit_rlhf.functional.stats import (
    explained_variance,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    whiten_from_moments,
)

__all__ = [
    "DPO_LOSS_TYPES",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "PPOPenaltyKLController",
    "clipped_value_loss",
    "compute_gae",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "kl_penalty_policy_loss",
    "kl_shaped_rewards",
    "logprobs_from_logits",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "whiten_from_moments",
    "pairwise_reward_loss",
    "ppo_policy_loss",
]

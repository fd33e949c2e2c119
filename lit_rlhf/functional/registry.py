"""The names of the online algorithms' estimators and losses, in one place.

Config choices (the modules' ``Literal`` types), the settings checks, the README tables and the demo read
these registries; a test pins that every ``Literal`` lists exactly their keys.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTION_MODES",
    "IS_SEQUENCE_RATIOS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "SEQUENCE_ESTIMATORS",
    "AdvantageEstimatorInfo",
]


@dataclass(frozen=True)
class AdvantageEstimatorInfo:
    """What an advantage estimator needs and does.

    Attributes:
        module: the module that offers it (``PPOModule``: a learned critic; ``CriticFreeModule``).
        needs_group: its baseline is the other responses to the same prompt (K >= 2).
        whiten_returns: its per-token returns are whitened over the batch of every rank (REINFORCE++).
        reference: the paper it comes from.
    """

    module: str
    needs_group: bool
    whiten_returns: bool
    reference: str


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimatorInfo] = {
    "gae": AdvantageEstimatorInfo("PPOModule", False, False, "Schulman et al. 2016, arXiv:1506.02438"),
    "grpo": AdvantageEstimatorInfo("CriticFreeModule", True, False, "Shao et al. 2024, arXiv:2402.03300"),
    "dr_grpo": AdvantageEstimatorInfo("CriticFreeModule", True, False, "Liu et al. 2025, arXiv:2503.20783"),
    "rloo": AdvantageEstimatorInfo("CriticFreeModule", True, False, "Ahmadian et al. 2024, arXiv:2402.14740"),
    "reinforce_pp": AdvantageEstimatorInfo("CriticFreeModule", False, True, "Hu 2025, arXiv:2501.03262"),
    "reinforce_pp_baseline": AdvantageEstimatorInfo("CriticFreeModule", True, True, "Hu 2025, arXiv:2501.03262"),
}
# the estimators of sequence scores (critic-free), and those whose baseline is the group of K responses
SEQUENCE_ESTIMATORS = tuple(k for k, v in ADVANTAGE_ESTIMATORS.items() if v.module == "CriticFreeModule")
GROUP_ESTIMATORS = tuple(k for k, v in ADVANTAGE_ESTIMATORS.items() if v.needs_group)

# how a policy loss reduces its token terms (functional.aggregate_loss)
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# token ratios (PPO, GRPO) or one ratio per response (GSPO, Zheng et al. 2025, arXiv:2507.18071)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# the engine/trainer importance-sampling correction (functional.is_correction; TRL's
# vllm_importance_sampling_mode names), and how a response's ratio is formed in its sequence modes
IS_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_SEQUENCE_RATIOS = ("product", "geometric_mean")
# per-token KL estimators (Schulman 2020, http://joschu.net/blog/kl-approx.html)
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
# PPO's policy losses: clipped surrogate (arXiv:1707.06347 eq. 7) or adaptive KL penalty (eq. 8)
POLICY_LOSSES = ("clip", "kl_penalty")

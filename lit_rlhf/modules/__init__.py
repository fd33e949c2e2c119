"""LightningModules of lit_rlhf."""

from lit_rlhf.modules.critic_free import CriticFreeModule
from lit_rlhf.modules.dpo import DPOModule
from lit_rlhf.modules.online import OnlineRLModule
from lit_rlhf.modules.online_dpo import OnlineDPOModule
from lit_rlhf.modules.optim import WarmupCosineLR
from lit_rlhf.modules.ppo import PPOModule
from lit_rlhf.modules.reward_ensemble import RewardEnsembleModule
from lit_rlhf.modules.reward_model import RewardModelModule
from lit_rlhf.modules.sft import SFTModule

__all__ = [
    "CriticFreeModule",
    "DPOModule",
    "OnlineDPOModule",
    "OnlineRLModule",
    "PPOModule",
    "RewardEnsembleModule",
    "RewardModelModule",
    "SFTModule",
    "WarmupCosineLR",
]

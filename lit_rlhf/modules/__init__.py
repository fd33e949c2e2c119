"""LightningModules of lit_rlhf."""

from lit_rlhf.modules.dpo import DPOModule
from lit_rlhf.modules.optim import WarmupCosineLR
from lit_rlhf.modules.ppo import PPOModule
from lit_rlhf.modules.reward_model import RewardModelModule
from lit_rlhf.modules.sft import SFTModule

__all__ = ["DPOModule", "PPOModule", "RewardModelModule", "SFTModule", "WarmupCosineLR"]

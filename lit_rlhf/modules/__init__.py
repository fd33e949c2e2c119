"""LightningModules of lit_rlhf."""

from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.optim import WarmupCosineLR
from lit_rlhf.modules.ppo import PPOModule
from lit_rlhf.modules.ppo_bookkeeping import PPOBookkeeping
from lit_rlhf.modules.reward_model import RewardModelModule
from lit_rlhf.modules.sft import SFTModule

# PPOModule's mixin is no model of its own: keep it out of the CLI's --model choices.
internal_base(PPOBookkeeping)

__all__ = ["PPOModule", "RewardModelModule", "SFTModule", "WarmupCosineLR"]

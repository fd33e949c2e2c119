"""lit_rlhf: RLHF (SFT, reward modelling and ensembles, PPO, GRPO/RLOO/REINFORCE++, DPO, online DPO) the
PyTorch Lightning way.

The public classes are importable from the top level; they are loaded on first access, so
``import lit_rlhf`` stays cheap (no torch/transformers import until a class is used)::

    from lit_rlhf import SFTModule, RewardModelModule, PPOModule, CriticFreeModule, DPOModule, ModelSpec
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "SFTModule": "lit_rlhf.modules",
    "RewardModelModule": "lit_rlhf.modules",
    "PPOModule": "lit_rlhf.modules",
    "CriticFreeModule": "lit_rlhf.modules",
    "DPOModule": "lit_rlhf.modules",
    "OnlineDPOModule": "lit_rlhf.modules",
    "RewardEnsembleModule": "lit_rlhf.modules",
    "WarmupCosineLR": "lit_rlhf.modules",
    "SFTDataModule": "lit_rlhf.data",
    "PreferenceDataModule": "lit_rlhf.data",
    "PromptDataModule": "lit_rlhf.data",
    "DataFormatError": "lit_rlhf.data",
    "ModelSpec": "lit_rlhf.models",
    "HFExport": "lit_rlhf.callbacks",
    "PeakMemory": "lit_rlhf.callbacks",
    "RolloutProgressBar": "lit_rlhf.progress",
    "LitProgressBar": "lit_rlhf.progress",
    "GenerationSettings": "lit_rlhf.rollout",
}

__all__ = [  # noqa: RUF022 (grouped like _EXPORTS)
    "SFTModule", "RewardModelModule", "PPOModule", "CriticFreeModule", "DPOModule", "OnlineDPOModule",
    "RewardEnsembleModule", "WarmupCosineLR",
    "SFTDataModule", "PreferenceDataModule", "PromptDataModule", "DataFormatError",
    "ModelSpec", "HFExport", "PeakMemory", "RolloutProgressBar", "LitProgressBar", "GenerationSettings",
]  # fmt: skip

if TYPE_CHECKING:
    from lit_rlhf.callbacks import HFExport, PeakMemory
    from lit_rlhf.data import DataFormatError, PreferenceDataModule, PromptDataModule, SFTDataModule
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import (
        CriticFreeModule,
        DPOModule,
        OnlineDPOModule,
        PPOModule,
        RewardEnsembleModule,
        RewardModelModule,
        SFTModule,
        WarmupCosineLR,
    )
    from lit_rlhf.progress import LitProgressBar, RolloutProgressBar
    from lit_rlhf.rollout import GenerationSettings


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_rlhf' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # cache: the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

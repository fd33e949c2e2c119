"""Data layer: LightningDataModules for preference pairs, prompts and SFT rows, with formats and collators."""

from lit_rlhf.data.base import LengthPolicy, RLHFDataModule
from lit_rlhf.data.collators import IGNORE_INDEX, PreferenceCollator, PromptCollator, SFTCollator, pad
from lit_rlhf.data.formats import (
    IMPLICIT_PROMPT_MARKER,
    DataFormatError,
    PreferenceFormat,
    split_implicit_prompt,
)
from lit_rlhf.data.preference import PreferenceDataModule
from lit_rlhf.data.prompt import PromptDataModule
from lit_rlhf.data.render import plain_chat, render_chat
from lit_rlhf.data.sampler import ResumableSampler
from lit_rlhf.data.sft import SFTDataModule
from lit_rlhf.data.sources import load_source

__all__ = [
    "IGNORE_INDEX",
    "IMPLICIT_PROMPT_MARKER",
    "DataFormatError",
    "LengthPolicy",
    "PreferenceCollator",
    "PreferenceDataModule",
    "PreferenceFormat",
    "PromptCollator",
    "PromptDataModule",
    "RLHFDataModule",
    "ResumableSampler",
    "SFTCollator",
    "SFTDataModule",
    "load_source",
    "pad",
    "plain_chat",
    "render_chat",
    "split_implicit_prompt",
]

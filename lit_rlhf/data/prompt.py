"""PromptDataModule: prompts for PPO rollouts, in a deterministic, resumable order."""

from __future__ import annotations

from typing import Any

from lit_rlhf.data.base import LengthPolicy, RLHFDataModule
from lit_rlhf.data.collators import ROW_COLUMN_PREFIX, PromptCollator
from lit_rlhf.data.formats import RowRef, Text, detect_prompt_format, parse_prompt_row


def parse_prompt(row: dict, fmt: str, ref: RowRef) -> tuple[Text, tuple[Text, ...], dict[str, Any]]:
    prompt = parse_prompt_row(row, fmt, ref)
    # a chat prompt reaches TRL-form reward functions as TRL's conversational ``prompt`` column (a final
    # assistant turn dropped, ShareGPT turns as role/content); a column holds chats in every row or in none
    return prompt, (), {ROW_COLUMN_PREFIX + "prompt": prompt} if isinstance(prompt, list) else {}


class PromptDataModule(RLHFDataModule):
    """Prompts from a hub dataset, a ``save_to_disk`` folder or a json/jsonl/parquet/csv file.

    Rows have ``prompt`` (string or chat), ``messages`` or ``conversations`` (a final assistant turn is
    dropped). Chats get the tokenizer's generation prompt. Batches are LEFT-padded for generation:
    ``{"input_ids": (B, P), "attention_mask": (B, P)}``, plus ``"columns"``: ``{name: [B values]}`` of the
    rows' other columns (e.g. a gold ``answer``), as read, for the reward functions (``lit_rlhf.reward_fns``).
    The training order is a function of (seed, epoch) and resumes mid-epoch from checkpoints (see
    :mod:`lit_rlhf.data.sampler`).
    """

    example_test_file = "data/tiny/prompts_test.jsonl"
    slots = ()
    collator_class = PromptCollator
    parse = staticmethod(parse_prompt)

    def __init__(
        self,
        tokenizer: str,
        train_path: str,
        val_path: str | None = None,
        val_fraction: float = 0.0,
        max_prompt_length: int = 256,
        length_policy: LengthPolicy = "truncate",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        split: str = "train",
        val_split: str | None = None,
        test_path: str | None = None,
        test_split: str | None = None,
        drop_last: bool = True,
        cache_dir: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        """
        Args:
            tokenizer: tokenizer hub id or folder (loaded with the project's pad-token policy).
            train_path: hub dataset name, ``save_to_disk`` folder, or .json/.jsonl/.parquet/.csv file.
            val_path: validation source like ``train_path``; None carves ``val_fraction`` from the training rows
                (unless ``val_split`` names a held-out split of ``train_path``).
            val_fraction: seeded fraction of the training rows held out for validation when ``val_path`` is None.
            max_prompt_length: token limit of a prompt (its end is kept when truncating, after a leading BOS).
            length_policy: over-long prompts are "truncate"d or "drop"ped; counts are logged and kept in ``stats``.
            batch_size: prompts per training batch (per rank).
            val_batch_size: prompts per validation batch; None means ``batch_size``.
            num_workers: DataLoader worker processes.
            seed: seed of the validation carve-out and of the training order; None follows the global
                seed (``seed_everything``).
            split: split of a hub dataset or saved DatasetDict; of a local file: "train" (all rows) or
                a slice such as "train[:1200]".
            val_split: split to load from ``val_path``; None means ``split``. Without ``val_path``, a split
                or slice of ``train_path`` (e.g. "test", or "train[90%:]" beside split="train[:90%]"), and no rows are carved.
            test_path: held-out source for ``test`` (``lit-rlhf test``), read like ``train_path``.
            test_split: split to load from ``test_path``; None means ``split``. Without ``test_path``, a split
                or slice of ``train_path`` (e.g. "test", or "train[90%:]" beside split="train[:90%]").
            drop_last: drop the last incomplete training batch, so every rollout has ``batch_size`` prompts.
            cache_dir: ``datasets`` cache folder for loading hub/file data; None uses the HF default.
            trust_remote_code: load a tokenizer shipped as custom code (as ``ModelSpec.trust_remote_code``).
        """
        super().__init__()
        self.save_hyperparameters()
        self._build()

    def detect_format(self, columns: list[str], source: str) -> str:
        return detect_prompt_format(columns, source)

    def row_columns(self, columns: list[str], fmt: str) -> list[str]:
        """Every column but the prompt's (``fmt``), as TRL's GRPOTrainer passes a row's columns to rewards (a
        chat prompt is passed as ``prompt``: see :func:`parse_prompt`)."""
        return [c for c in columns if c != fmt]

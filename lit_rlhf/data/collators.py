"""Collators: lists of token-id rows -> padded tensors. Masks are 1 on real tokens.

Rows come from the data modules with ``prompt_input_ids`` and, per response slot, ``<slot>_input_ids``
(responses already end with EOS unless truncated). Prompts are left-padded for generation, training
sequences (prompt + response) right-padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label value skipped by torch/transformers cross-entropy
# a source column kept beside the tokens (PromptDataModule: the prompt rows' other columns) is stored under
# this prefix, so that no source column can collide with the encoded ones
ROW_COLUMN_PREFIX = "column:"


def pad(rows: Sequence[Sequence[int]], value: int, side: Literal["left", "right"]) -> tuple[Tensor, Tensor]:
    """Pad ragged rows to their longest length: (B,) lists -> values (B, L) long, mask (B, L) long."""
    length = max(len(r) for r in rows)
    # One torch.tensor() per output from padded lists: ~2.5x faster than a tensor and two slice writes
    # per row, and the collator runs on every training step.
    fill = [length - len(r) for r in rows]
    if side == "left":
        values = [[value] * f + list(r) for r, f in zip(rows, fill)]
        mask = [[0] * f + [1] * len(r) for r, f in zip(rows, fill)]
    else:
        values = [list(r) + [value] * f for r, f in zip(rows, fill)]
        mask = [[1] * len(r) + [0] * f for r, f in zip(rows, fill)]
    return torch.tensor(values, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


@dataclass
class PromptCollator:
    """Prompts for generation: ``{"input_ids": (B, P), "attention_mask": (B, P)}``, LEFT-padded, and
    ``"columns"``: ``{name: [B values]}`` of the rows' other source columns, as they were read (strings,
    numbers, lists; not tensors), when the rows have any."""

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        input_ids, attention_mask = pad([r["prompt_input_ids"] for r in rows], self.pad_token_id, "left")
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        kept = [key for key in rows[0] if key.startswith(ROW_COLUMN_PREFIX)]
        if kept:
            batch["columns"] = {key[len(ROW_COLUMN_PREFIX) :]: [r[key] for r in rows] for key in kept}
        return batch


@dataclass
class PreferenceCollator:
    """Preference pairs as one concatenated batch for a single forward pass.

    Returns ``input_ids``, ``attention_mask``, ``response_mask``: (2B, L), RIGHT-padded to a common L;
    rows 0..B-1 are prompt + chosen, rows B..2B-1 prompt + rejected of the same pairs; plus ``margin``
    (B,) float32 and ``row_index`` (B,) long (the pair's position in its split, a key for precomputed
    reference log-probs) when the rows have them.
    """

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        sequences, response_masks = [], []
        for slot in ("chosen", "rejected"):
            for r in rows:
                prompt, response = r["prompt_input_ids"], r[f"{slot}_input_ids"]
                sequences.append(prompt + response)
                response_masks.append([0] * len(prompt) + [1] * len(response))
        input_ids, attention_mask = pad(sequences, self.pad_token_id, "right")
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        batch["response_mask"] = pad(response_masks, 0, "right")[0]
        if "margin" in rows[0]:
            batch["margin"] = torch.tensor([r["margin"] for r in rows], dtype=torch.float32)
        if "row_index" in rows[0]:
            batch["row_index"] = torch.tensor([r["row_index"] for r in rows], dtype=torch.long)
        return batch


@dataclass
class SFTCollator:
    """Prompt + completion, RIGHT-padded: ``input_ids``, ``attention_mask``, ``labels``, ``response_mask`` (B, L).

    ``labels`` equal ``input_ids`` on completion tokens and are -100 on prompt and padding (the loss is on
    the response only; a multi-turn completion is trained on its assistant turns, ``completion_loss_mask``);
    the causal-LM shift is left to the model, as in transformers.
    """

    pad_token_id: int

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        sequences = [r["prompt_input_ids"] + r["completion_input_ids"] for r in rows]
        # a multi-turn completion's loss mask leaves out its user turns (empty or absent: all trained)
        masks = [
            [0] * len(r["prompt_input_ids"]) + (r.get("completion_loss_mask") or [1] * len(r["completion_input_ids"]))
            for r in rows
        ]
        input_ids, attention_mask = pad(sequences, self.pad_token_id, "right")
        response_mask = pad(masks, 0, "right")[0]
        labels = input_ids.masked_fill(response_mask == 0, IGNORE_INDEX)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "response_mask": response_mask,
        }

"""The batch contract between the DataModules and the modules, as pure checks with helpful messages.

Each layout names the keys a module reads, their shapes and which DataModule produces them:

- ``sft`` (:class:`~lit_rlhf.data.SFTDataModule`): ``input_ids``, ``attention_mask``, ``response_mask``
  (B, L), right-padded; ``labels`` optional.
- ``preference`` (:class:`~lit_rlhf.data.PreferenceDataModule`): ``input_ids``, ``attention_mask``
  (2B, L), right-padded, rows 0..B-1 prompt + chosen and B..2B-1 prompt + rejected; ``margin`` (B,) optional.
- ``prompt`` (:class:`~lit_rlhf.data.PromptDataModule`): ``input_ids``, ``attention_mask`` (B, P),
  LEFT-padded for generation (:func:`left_pad_prompts` repairs right-padded prompts); ``columns``
  (``{name: [B values]}``, the rows' other columns for the reward functions) optional.

A batch in another library's layout (TRL's ``input_ids_chosen``/``chosen_input_ids``, untokenised text
rows) is recognised and the message says what to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

Layout = Literal["sft", "preference", "prompt"]

LAYOUTS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # layout: (required keys, shape legend, producing DataModule)
    "sft": (
        ("input_ids", "attention_mask", "response_mask"),
        "input_ids, attention_mask, response_mask: (B, L) right-padded (labels optional)",
        "lit_rlhf.data.SFTDataModule",
    ),
    "preference": (
        ("input_ids", "attention_mask"),
        "input_ids, attention_mask: (2B, L) right-padded, the B chosen rows first, then the B rejected "
        "rows of the same pairs (margin (B,) optional)",
        "lit_rlhf.data.PreferenceDataModule",
    ),
    "prompt": (
        ("input_ids", "attention_mask"),
        "input_ids, attention_mask: (B, P) LEFT-padded prompts",
        "lit_rlhf.data.PromptDataModule",
    ),
}

# Keys of other layouts -> what they are, for the error message.
FOREIGN_KEYS: dict[str, str] = {
    "input_ids_chosen": "TRL RewardTrainer's paired layout (input_ids_chosen/input_ids_rejected)",
    "chosen_input_ids": "TRL DPOTrainer's layout (prompt_input_ids/chosen_input_ids/rejected_input_ids)",
    "completion_mask": "TRL SFTTrainer's layout (completion_mask; lit_rlhf calls it response_mask)",
    "prompt_input_ids": "untensorised lit_rlhf rows (prompt_input_ids before the collator)",
    "chosen": "untokenised text rows (prompt/chosen/rejected strings)",
    "prompt": "untokenised text rows (prompt strings)",
    "messages": "untokenised chat rows (messages)",
    "completion": "untokenised text rows (prompt/completion strings)",
}


class BatchContractError(ValueError):
    """A batch does not have the layout the module reads."""


def check_batch(batch: Mapping[str, Any], layout: Layout, module: str = "the module") -> None:
    """Check that ``batch`` has ``layout``'s keys and consistent shapes; raise a message naming the layout.

    Args:
        batch: the collated batch a ``*_step`` receives.
        layout: ``"sft"``, ``"preference"`` or ``"prompt"``.
        module: name of the reading module, for the message.

    Raises:
        BatchContractError: missing keys (naming a recognised foreign layout and the DataModule to use),
            tensors that are not (rows, length) of one shape, or an odd row count for a preference batch.
    """
    required, legend, producer = LAYOUTS[layout]
    expected = f"{module} expects a {layout!r} batch ({legend}), as {producer} produces"
    if not isinstance(batch, Mapping):
        raise BatchContractError(f"{expected}; got a {type(batch).__name__}, not a dict of tensors")
    missing = [k for k in required if k not in batch]
    if missing:
        foreign = [desc for key, desc in FOREIGN_KEYS.items() if key in batch]
        seen = f"this looks like {foreign[0]}; " if foreign else ""
        raise BatchContractError(
            f"{expected}. The batch lacks {missing} ({seen}its keys: {sorted(batch)}). "
            f"Use {producer} (its collator builds this layout) or convert the batch."
        )
    shape = batch["input_ids"].shape if isinstance(batch["input_ids"], torch.Tensor) else None
    for key in required:
        value = batch[key]
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape != shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise BatchContractError(f"{expected}; {key!r} must be a 2-D tensor shaped like input_ids, got {got}")
    if layout == "preference":
        if shape[0] % 2:
            raise BatchContractError(f"{expected}; got an odd number of rows ({shape[0]})")
        margin = batch.get("margin")
        if margin is not None and tuple(margin.shape) != (shape[0] // 2,):
            raise BatchContractError(f"{expected}; 'margin' must be ({shape[0] // 2},), got {tuple(margin.shape)}")


def is_left_padded(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, P) mask -> (B,) bool: whether each row is padding (0s) then real tokens (1s), nothing after."""
    mask = attention_mask.bool()
    # a 1 followed later by a 0 breaks left padding
    return ~(mask[:, :-1] & ~mask[:, 1:]).any(dim=1)


def left_pad_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_token_id: int,
    on_right_padded: Literal["repad", "refuse"] = "repad",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts ready for generation: LEFT-padded, the real tokens of every row flush right.

    A decoder continues from the last column, so a right-padded prompt would be continued after its
    padding (and, for models with absolute positions, at shifted positions). Left-padded input is
    returned unchanged (same tensors).

    Args:
        input_ids: (B, P) prompt token ids.
        attention_mask: (B, P), 1 on real tokens.
        pad_token_id: id written at the padding positions of moved rows.
        on_right_padded: ``"repad"`` moves the real tokens of offending rows to the right (keeping
            their order); ``"refuse"`` raises instead.

    Returns:
        input_ids (B, P) and attention_mask (B, P), left-padded.

    Raises:
        BatchContractError: a row is not left-padded and ``on_right_padded="refuse"``.
    """
    ok = is_left_padded(attention_mask)  # (B,)
    if bool(ok.all()):
        return input_ids, attention_mask
    if on_right_padded == "refuse":
        rows = (~ok).nonzero().flatten().tolist()
        raise BatchContractError(
            f"prompts must be LEFT-padded for generation (as lit_rlhf.data.PromptDataModule makes them); "
            f"rows {rows[:8]} have padding after real tokens"
        )
    mask = attention_mask.long()
    # stable sort of the 0/1 mask: padding positions first, then the real tokens in their order
    order = torch.sort(mask, dim=1, stable=True).indices  # (B, P)
    new_mask = torch.gather(mask, 1, order)  # (B, P)
    new_ids = torch.gather(input_ids, 1, order).masked_fill(new_mask == 0, pad_token_id)  # (B, P)
    return new_ids, new_mask.to(attention_mask.dtype)

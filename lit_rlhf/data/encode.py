"""Encoding a batch of source rows for ``Dataset.map``: validate (each data module's parser), render (chat
template), tokenise and clip to the length limits (:func:`encode_batch`), the data modules' shared step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from lit_rlhf.data.formats import DataFormatError, RowRef, Text
from lit_rlhf.data.render import clip_lengths, render, tokenize_rendered
from lit_rlhf.data.sources import FILE_ROW_COLUMN

__all__ = ["RowParser", "encode_batch"]

# parse(row, fmt, ref) -> (prompt, responses in slot order, extra columns such as margin); ``row`` also
# holds the kept source columns (``row_columns``) under ``ROW_COLUMN_PREFIX``
RowParser = Callable[[dict, str, RowRef], tuple[Text, tuple[Text, ...], dict[str, Any]]]


def encode_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    parse: RowParser,
    fmt: str,
    source: str,
    slots: tuple[str, ...],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    max_length: int | None,
    loss_masks: bool = False,
    first_row: tuple[int, Text, tuple[str, ...]] | None = None,
) -> dict[str, list]:
    """Batched ``Dataset.map`` function: validate, render, tokenise and clip rows.

    ``first_row`` (the source's first row: its number, prompt and extra columns) is what every row must match
    in extra columns; None: the batch's first row.

    Returns ``prompt_input_ids``, ``<slot>_input_ids`` per response slot, the extra columns,
    ``over_length`` (whether the limits cut the row; the length policy reads it) and, with two or more
    slots, ``identical`` (whether the clipped responses are all equal: a pair whose texts differ only past
    ``max_length`` teaches nothing, its loss gradient is zero; the length policy drops it); with
    ``loss_masks``, ``<slot>_loss_mask`` per response slot (1 on the tokens trained, empty when all are: see
    :func:`~lit_rlhf.data.render.tokenize_rendered`).
    """
    indices = batch.pop(FILE_ROW_COLUMN, indices)  # a slice of a local file: the rows' numbers in the file
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    parsed = [parse(row, fmt, RowRef(source, i)) for row, i in zip(rows, indices)]
    rendered = []
    for (prompt, row_responses, _), i in zip(parsed, indices):
        try:
            rendered.append(render(tokenizer, prompt, row_responses, spans=loss_masks))
        except Exception as err:  # a template's own checks (e.g. "roles must alternate") raise anything
            raise DataFormatError(source, f"the tokenizer's chat template failed: {err}", row=i) from err
    prompts, responses, masks = tokenize_rendered(tokenizer, rendered)
    out: dict[str, list] = {
        "prompt_input_ids": [],
        "over_length": [],
        **{f"{s}_input_ids": [] for s in slots},
        **({f"{s}_loss_mask": [] for s in slots} if loss_masks else {}),
        **({"identical": []} if len(slots) > 1 else {}),
    }
    for (_, _, extras), prompt, row_responses, row_masks in zip(parsed, prompts, responses, masks):
        prompt, row_responses, over = clip_lengths(
            prompt, row_responses, max_prompt_length, max_length, tokenizer.bos_token_id
        )
        out["prompt_input_ids"].append(prompt)
        out["over_length"].append(over)
        for slot, ids, mask in zip(slots, row_responses, row_masks):
            out[f"{slot}_input_ids"].append(ids)
            if loss_masks:
                out[f"{slot}_loss_mask"].append(mask[: len(ids)])
        if len(slots) > 1:
            out["identical"].append(all(ids == row_responses[0] for ids in row_responses[1:]))
        for name, value in extras.items():
            out.setdefault(name, []).append(value)
    if parsed:
        _check_extras(parsed, indices, source, first_row or (indices[0], parsed[0][0], tuple(sorted(parsed[0][2]))))
    return out


def _check_extras(
    parsed: list[tuple], indices: list[int], source: str, first: tuple[int, Text, tuple[str, ...]]
) -> None:
    """Every row must give the first row's extra columns (a chat ``prompt`` gives one, a string none): a source
    whose column mixes the two forms is refused at the first row that differs."""

    def form(prompt: Text) -> str:
        return "a chat (a list of messages)" if isinstance(prompt, list) else "a string"

    for (prompt, _, extras), i in zip(parsed, indices):
        if tuple(sorted(extras)) != first[2]:
            raise DataFormatError(
                source, f"the prompt is {form(prompt)} here and {form(first[1])} in row {first[0]}; use one form"
                " in every row", row=i, field="prompt",
            )  # fmt: skip

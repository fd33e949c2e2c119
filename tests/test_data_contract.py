"""Batch contract checks (messages naming the expected layout) and left-padding of prompts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.data.contract import BatchContractError, check_batch, is_left_padded, left_pad_prompts


def _pref_batch(rows: int = 4, length: int = 5) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.ones(rows, length, dtype=torch.long), "attention_mask": torch.ones(rows, length)}


def test_valid_batches_pass():
    check_batch(_pref_batch(), "preference")
    check_batch({**_pref_batch(), "margin": torch.zeros(2)}, "preference")
    check_batch({**_pref_batch(3), "response_mask": torch.ones(3, 5)}, "sft")
    check_batch(_pref_batch(3), "prompt")


def test_trl_reward_layout_is_named_with_what_to_use():
    trl = {k: torch.ones(2, 4) for k in ("input_ids_chosen", "attention_mask_chosen", "input_ids_rejected")}
    with pytest.raises(BatchContractError) as err:
        check_batch(trl, "preference", "RewardModelModule")
    msg = str(err.value)
    assert "RewardModelModule expects a 'preference' batch" in msg
    assert "TRL RewardTrainer" in msg and "lit_rlhf.data.PreferenceDataModule" in msg
    assert "chosen rows first" in msg and "lacks ['input_ids', 'attention_mask']" in msg


def test_sft_without_response_mask_and_text_rows():
    with pytest.raises(BatchContractError, match=r"lacks \['response_mask'\].*SFTDataModule"):
        check_batch({"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3)}, "sft")
    trl_sft = {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3), "completion_mask": torch.ones(2, 3)}
    with pytest.raises(BatchContractError, match="TRL SFTTrainer's layout"):
        check_batch(trl_sft, "sft")
    with pytest.raises(BatchContractError, match="untokenised text rows"):
        check_batch({"prompt": ["a"], "completion": ["b"]}, "sft")


def test_shape_errors():
    with pytest.raises(BatchContractError, match="odd number of rows"):
        check_batch(_pref_batch(3), "preference")
    with pytest.raises(BatchContractError, match=r"'attention_mask' must be a 2-D tensor shaped like input_ids, got \(4, 4\)"):
        check_batch({"input_ids": torch.ones(4, 5), "attention_mask": torch.ones(4, 4)}, "preference")
    with pytest.raises(BatchContractError, match=r"'margin' must be \(2,\)"):
        check_batch({**_pref_batch(), "margin": torch.zeros(4)}, "preference")
    with pytest.raises(BatchContractError, match="not a dict"):
        check_batch([1, 2], "prompt")


def test_left_pad_prompts_hand_computed():
    ids = torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0], [0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]])
    new_ids, new_mask = left_pad_prompts(ids, mask, pad_token_id=0)
    assert new_ids.tolist() == [[0, 0, 5, 6], [0, 7, 8, 9], [0, 1, 2, 3]]
    assert new_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]
    assert is_left_padded(new_mask).all()
    assert is_left_padded(mask).tolist() == [False, False, True]
    with pytest.raises(BatchContractError, match=r"LEFT-padded.*rows \[0, 1\]"):
        left_pad_prompts(ids, mask, 0, on_right_padded="refuse")


def test_left_padded_input_is_returned_unchanged():
    ids, mask = torch.tensor([[0, 4, 5]]), torch.tensor([[0, 1, 1]])
    out_ids, out_mask = left_pad_prompts(ids, mask, 0, on_right_padded="refuse")
    assert out_ids is ids and out_mask is mask


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=5), st.booleans())
def test_repadding_keeps_each_rows_tokens_in_order(rows, right):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), -1, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if right else slice(width - len(r), width)
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    new_ids, new_mask = left_pad_prompts(ids, mask, pad_token_id=99)
    assert is_left_padded(new_mask).all()
    for i, r in enumerate(rows):
        assert new_ids[i][new_mask[i].bool()].tolist() == r
        assert (new_ids[i][~new_mask[i].bool()] == 99).all() or not right

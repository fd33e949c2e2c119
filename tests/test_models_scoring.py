"""Scoring helpers: positions and last-token indices, and padding-side invariance of logits, values
and scores on tiny GPT-2 and Llama models."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import logprobs_from_logits
from lit_rlhf.models import (
    ModelSpec,
    ValueHead,
    build_causal_lm,
    build_score_model,
    causal_lm_logits,
    causal_lm_logits_and_hidden,
    last_token_index,
    load_tokenizer,
    position_ids_from_mask,
    sequence_scores,
    token_values,
)

MASKS = torch.tensor(
    [
        [0, 0, 1, 1, 1],  # left-padded
        [1, 1, 1, 0, 0],  # right-padded
        [1, 1, 1, 1, 1],  # no padding
        [0, 0, 1, 0, 0],  # a single real token
        [0, 0, 0, 0, 0],  # no real token
    ]
)


def test_position_ids_from_mask_by_hand():
    # cumsum - 1 = [-1,-1,0,1,2], [0,1,2,2,2], [0..4], [-1,-1,0,0,0], [-1]*5; then clamp at 0.
    expected = torch.tensor(
        [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    )
    assert torch.equal(position_ids_from_mask(MASKS), expected)


def test_last_token_index_by_hand():
    # arange*mask: [0,0,2,3,4] -> 4; [0,1,2,0,0] -> 2; [0..4] -> 4; [0,0,2,0,0] -> 2; zeros -> 0.
    assert last_token_index(MASKS).tolist() == [4, 2, 4, 2, 0]
    assert last_token_index(MASKS.bool()).tolist() == [4, 2, 4, 2, 0]


@given(n_real=st.integers(1, 12), n_pad=st.integers(0, 12), left=st.booleans())
def test_positions_and_last_index_on_any_padding(n_real, n_pad, left):
    real, pad = torch.ones(n_real, dtype=torch.long), torch.zeros(n_pad, dtype=torch.long)
    mask = torch.cat([pad, real] if left else [real, pad]).unsqueeze(0)
    first = n_pad if left else 0
    assert last_token_index(mask).item() == first + n_real - 1
    assert torch.equal(position_ids_from_mask(mask)[0, first : first + n_real], torch.arange(n_real))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def models(request, tokenizer_dir):
    """(tokenizer, causal LM, score model) of one architecture, random init, eval mode."""
    tokenizer = load_tokenizer(tokenizer_dir)
    config = gpt2_config() if request.param == "gpt2" else llama_config()
    spec = ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0)
    return (
        request.param,
        tokenizer,
        build_causal_lm(spec, tokenizer).eval(),
        build_score_model(spec, tokenizer).eval(),
    )


def _pad(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, cols], mask[i, cols] = torch.tensor(row), 1
    return ids, mask


def _row_outputs(models, rows, left):
    """Scores, values and next-token log-probs of rows[0], on its real tokens only."""
    _, tokenizer, lm, scorer = models
    ids, mask = _pad(rows, tokenizer.pad_token_id, left)
    real = mask[0].bool()
    with torch.no_grad():
        logits = causal_lm_logits(lm, ids, mask)
        values = token_values(scorer, ids, mask)
        scores = sequence_scores(scorer, ids, mask)
    assert torch.isfinite(logits).all() and torch.isfinite(values).all()  # masking by multiplication is safe
    logprobs = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    return scores[0], values[0][real], logprobs[0][real[:-1] & real[1:]]


token_rows = st.lists(st.integers(2, 319), min_size=1, max_size=12)


@settings(max_examples=8, deadline=None)
@given(target=token_rows, others=st.lists(token_rows, min_size=1, max_size=3))
def test_outputs_do_not_depend_on_padding(models, target, others):
    alone = _row_outputs(models, [target], left=False)
    for left in (True, False):
        padded = _row_outputs(models, [target, *others, target + [5] * 4], left=left)
        for got, want in zip(padded, alone):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_sequence_scores_match_hf_forward(models):
    # HF finds the last non-pad token from input_ids; with a dedicated pad (!= EOS) it must agree with
    # the mask-based index, also for rows that end with EOS.
    _, tokenizer, _, scorer = models
    rows = [[7, 8, 9, tokenizer.eos_token_id], [7, 8, 9, 10, 11, 12, tokenizer.eos_token_id], [4]]
    for left in (True, False):
        ids, mask = _pad(rows, tokenizer.pad_token_id, left)
        with torch.no_grad():
            hf = scorer(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
            ours = sequence_scores(scorer, ids, mask)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, hf.squeeze(-1).float(), atol=1e-6, rtol=0)


def test_position_ids_matter_for_absolute_positions(tokenizer, tokenizer_dir):
    # Why the helpers pass position ids: HF numbers positions 0..L-1 regardless of left padding, which
    # changes GPT-2's (learned absolute) position embeddings of a left-padded row. (Llama's rotary
    # embeddings depend on relative positions only, so it is not a witness.)
    lm = build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=0), tokenizer).eval()
    ids, mask = _pad([[7, 8, 9], [7, 8, 9, 10, 11, 12]], tokenizer.pad_token_id, left=True)
    with torch.no_grad():
        naive = lm(input_ids=ids, attention_mask=mask).logits[0, -1]
        fixed = causal_lm_logits(lm, ids, mask)[0, -1]
        alone = causal_lm_logits(lm, ids[:1, -3:], mask[:1, -3:])[0, -1]
    torch.testing.assert_close(fixed, alone, atol=1e-5, rtol=0)
    assert (naive - alone).abs().max() > 1e-3


def test_logits_and_hidden_share_one_forward(models):
    _, tokenizer, lm, _ = models
    ids, mask = _pad([[7, 8, 9], [7, 8, 9, 10, 11]], tokenizer.pad_token_id, left=True)
    with torch.no_grad():
        logits, hidden = causal_lm_logits_and_hidden(lm, ids, mask)
        torch.testing.assert_close(logits, causal_lm_logits(lm, ids, mask))
        # The hidden state is the one the LM head reads (after the final norm).
        torch.testing.assert_close(lm.get_output_embeddings()(hidden), logits, atol=1e-5, rtol=0)
    assert hidden.shape == (2, 5, lm.config.get_text_config().hidden_size)


def test_token_values_needs_a_score_head(models):
    _, tokenizer, lm, _ = models
    ids = torch.tensor([[7, 8, 9]])
    with pytest.raises(TypeError, match="`score` head"):
        token_values(lm, ids, torch.ones_like(ids))


def test_value_head_starts_at_zero_and_returns_float32():
    head = ValueHead(hidden_size=4)
    hidden = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    values = head(hidden)
    assert values.shape == (2, 3) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(2, 3))
    # Zero init must not block learning: d(sum V)/dW = sum of the hidden states.
    values.sum().backward()
    torch.testing.assert_close(head.linear.weight.grad[0], hidden.float().sum((0, 1)))

"""kl_penalty estimators and kl_shaped_rewards: hand values and properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import kl_penalty, kl_shaped_rewards, masked_kl

# d = lp - ref = 0.5 and -1.0
LP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", [0.5, -1.0]),  # d
        ("abs", [0.5, 1.0]),  # |d|
        ("k2", [0.125, 0.5]),  # 0.5 * d^2: 0.5 * 0.25, 0.5 * 1
        # exp(-d) - 1 + d: e^-0.5 - 1 + 0.5 = 0.606531 - 0.5 = 0.106531; e^1 - 1 - 1 = 0.718282
        ("k3", [0.106531, 0.718282]),
    ],
)
def test_estimators_hand_computed(estimator, expected):
    torch.testing.assert_close(kl_penalty(LP, REF, estimator), torch.tensor([expected]), atol=1e-6, rtol=0)


def test_unknown_estimator():
    with pytest.raises(ValueError, match=r"unknown `estimator` 'k4'.*k1, abs, k2, k3"):
        kl_penalty(LP, REF, "k4")


def test_float32_output_for_bf16_input():
    assert kl_penalty(LP.bfloat16(), REF.bfloat16(), "k3").dtype == torch.float32


@settings(max_examples=200, deadline=None)
@given(
    lp=st.floats(-60, 0, width=32),
    ref=st.floats(-60, 0, width=32),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_k3_is_non_negative(lp, ref, dtype):
    k3 = kl_penalty(torch.tensor([lp], dtype=dtype), torch.tensor([ref], dtype=dtype), "k3")
    assert k3.item() >= 0.0
    # and it is the unbiased estimator: exp(-d) - 1 + d
    d = lp - ref
    assert k3.item() == pytest.approx(math.expm1(-d) + d, rel=1e-5, abs=1e-6)


def test_kl_shaped_rewards_hand_computed():
    # row 0: 3 real tokens, k1 = (0.5, -1, 0.2); row 1: 2 real tokens, k1 = (0.3, 0.4), then garbage
    logprobs = torch.tensor([[-0.5, -2.0, -0.3], [-0.7, -0.6, float("nan")]])
    ref = torch.tensor([[-1.0, -1.0, -0.5], [-1.0, -1.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores = torch.tensor([1.0, -2.0])
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.2], [0.3, 0.4, 0.0]]))
    # -0.1 * kl, plus the score at the last real token: -0.02 + 1 = 0.98; -0.04 - 2 = -2.04
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 0.98], [-0.03, -2.04, 0.0]]))
    assert rewards.dtype == kl.dtype == torch.float32


def test_kl_shaped_rewards_other_estimator_and_padding_side():
    # The score goes to the last real token wherever the padding is (left-padded row here).
    logprobs = torch.tensor([[0.0, -1.0, -2.0]])
    ref = torch.tensor([[5.0, -1.5, -1.0]])
    mask = torch.tensor([[0, 1, 1]])
    rewards, kl = kl_shaped_rewards(torch.tensor([3.0]), logprobs, ref, mask, kl_coef=0.5, estimator="k2")
    # k2 = 0.5 * d^2: d = 0.5 -> 0.125, d = -1 -> 0.5; rewards = -0.5 * k2 (+3 at position 2)
    torch.testing.assert_close(kl, torch.tensor([[0.0, 0.125, 0.5]]))
    torch.testing.assert_close(rewards, torch.tensor([[0.0, -0.0625, 2.75]]))


def test_kl_shaped_rewards_rejects_empty_rows_and_bad_scores():
    lp = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] have no real token"):
        kl_shaped_rewards(torch.zeros(3), lp, lp, torch.tensor([[1, 0], [0, 0], [1, 1]]), 0.1)
    with pytest.raises(ValueError, match="`scores` must be"):
        kl_shaped_rewards(torch.zeros(3, 1), lp, lp, torch.ones(3, 2), 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_shaped_rewards(torch.zeros(3), lp, lp, torch.ones(3, 2), -0.1)


def test_masked_kl_by_hand():
    # k1 = logp - ref on real tokens, 0 on padding even where the padded log-probs are not finite
    logp = torch.tensor([[-1.0, -2.0, float("nan")]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(masked_kl(logp, ref, mask, "k1"), torch.tensor([[0.5, -1.0, 0.0]]))

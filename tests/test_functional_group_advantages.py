"""Critic-free advantage estimators: GRPO, Dr. GRPO, RLOO and REINFORCE++ returns, by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf import functional as F


def test_grpo_by_hand():
    # group 1: [1, 2, 3] -> mean 2, unbiased std 1 -> [-1, 0, 1]
    scores = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
    # group 2: [0, 0, 6] -> mean 2, var (4 + 4 + 16) / 2 = 12 -> std 2*sqrt(3) -> [-1, -1, 2] / sqrt(3)
    got = F.grpo_advantages(scores, group_size=3, eps=0.0)
    s3 = 3**0.5
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0, -1 / s3, -1 / s3, 2 / s3]))
    with_eps = F.grpo_advantages(scores, group_size=3, eps=1.0)  # std 1 -> / 2
    torch.testing.assert_close(with_eps[:3], torch.tensor([-0.5, 0.0, 0.5]))


def test_dr_grpo_subtracts_the_mean_only():
    scores = torch.tensor([1.0, 2.0, 4.0, 10.0, 10.0, 13.0])
    got = F.grpo_advantages(scores, group_size=3, scale_by_std=False)
    torch.testing.assert_close(got, torch.tensor([-4 / 3, -1 / 3, 5 / 3, -1.0, -1.0, 2.0]))


def test_rloo_by_hand():
    # [1, 2, 4]: 1 - (2+4)/2 = -2; 2 - (1+4)/2 = -0.5; 4 - (1+2)/2 = 2.5. K = 2: [3, 5] -> [-2, 2], [1, 1] -> [0, 0].
    torch.testing.assert_close(
        F.rloo_advantages(torch.tensor([1.0, 2.0, 4.0]), group_size=3), torch.tensor([-2.0, -0.5, 2.5])
    )
    torch.testing.assert_close(
        F.rloo_advantages(torch.tensor([3.0, 5.0, 1.0, 1.0]), group_size=2),
        torch.tensor([-2.0, 2.0, 0.0, 0.0]),
    )


@pytest.mark.parametrize(
    "estimator",
    [
        lambda s, k: F.grpo_advantages(s, k),
        lambda s, k: F.grpo_advantages(s, k, scale_by_std=False),
        lambda s, k: F.rloo_advantages(s, k),
    ],
    ids=["grpo", "dr_grpo", "rloo"],
)
def test_all_equal_groups_give_exactly_zero_and_k1_is_refused(estimator):
    # 0.1 five times: the float32 mean is not exactly 0.1, yet the advantages must be exactly 0 (not NaN,
    # not 1e-9 / eps); a second, informative group is unaffected.
    scores = torch.tensor([0.1] * 5 + [7.3] * 5 + [0.0, 1.0, 0.0, 0.0, 0.0])
    got = estimator(scores, 5)
    assert torch.equal(got[:10], torch.zeros(10))
    assert got[11] > 0 and got[10] < 0 and not torch.isnan(got).any()
    with pytest.raises(ValueError, match="group_size` must be >= 2"):
        estimator(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="cannot be split into groups"):
        estimator(torch.tensor([1.0, 2.0, 3.0]), 2)


@settings(max_examples=50, deadline=None)
@given(
    st.integers(min_value=2, max_value=6),
    st.lists(st.integers(min_value=-5, max_value=5), min_size=12, max_size=12),
)
def test_group_invariants(k, values):
    # every group's advantages sum to 0; RLOO = K / (K - 1) * Dr. GRPO; GRPO (eps = 0) has unit std
    scores = torch.tensor(values[: (len(values) // k) * k], dtype=torch.float64)
    grpo = F.grpo_advantages(scores, k, eps=0.0).view(-1, k)
    dr = F.grpo_advantages(scores, k, scale_by_std=False).view(-1, k)
    rloo = F.rloo_advantages(scores, k).view(-1, k)
    torch.testing.assert_close(dr.sum(1), torch.zeros(len(dr), dtype=torch.float64))
    torch.testing.assert_close(rloo, dr * k / (k - 1))
    informative = scores.view(-1, k).std(1) > 0
    if not informative.any():
        return
    torch.testing.assert_close(
        grpo[informative].std(1), torch.ones(int(informative.sum()), dtype=torch.float64)
    )
    assert torch.equal(grpo[~informative], torch.zeros_like(grpo[~informative]))


def test_discounted_returns_by_hand():
    # row 0: r = [1, 2, 3] on 2 real tokens, gamma 0.5: G_1 = 2, G_0 = 1 + 0.5 * 2 = 2, padding 0.
    # row 1: three real tokens [0, 0, 4]: G = [1, 2, 4].
    rewards = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    torch.testing.assert_close(
        F.discounted_returns(rewards, mask, gamma=0.5), torch.tensor([[2.0, 2.0, 0.0], [1.0, 2.0, 4.0]])
    )


def test_reinforce_pp_pipeline_whitens_the_kl_shaped_returns():
    # REINFORCE++: KL-shaped rewards -> returns (gamma = 1) -> whitening over the batch's real tokens.
    scores = torch.tensor([1.0, 0.0])
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    rewards, kl = F.kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.1)
    # kl = [[0.5, 0], [0, -1]] -> rewards [[-0.05, 1], [0, 0.1]] -> returns [[0.95, 1], [0.1, 0.1]]
    returns = F.discounted_returns(rewards, mask, gamma=1.0)
    torch.testing.assert_close(returns, torch.tensor([[0.95, 1.0], [0.1, 0.1]]))
    whitened = F.masked_whiten(returns, mask)
    torch.testing.assert_close(whitened.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_group_score_stats_and_masked_row_sum():
    std, equal = F.group_score_stats(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3)
    assert std.item() == pytest.approx(0.5) and equal.item() == 0.5
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    assert F.masked_row_sum(x, mask).tolist() == [3.0, 4.0]


def test_sequence_advantages_dispatch_by_hand():
    # two groups of K = 2: (1, 3) and (5, 5)
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0])
    s = 2.0**0.5  # unbiased std of (1, 3)
    expected = {
        "grpo": [-1.0 / (s + 1e-6), 1.0 / (s + 1e-6), 0.0, 0.0],
        "dr_grpo": [-1.0, 1.0, 0.0, 0.0],
        "rloo": [-2.0, 2.0, 0.0, 0.0],
        "reinforce_pp_baseline": [-1.0, 1.0, 0.0, 0.0],
        "reinforce_pp": [1.0, 3.0, 5.0, 5.0],
    }
    assert set(expected) == set(F.SEQUENCE_ESTIMATORS)
    for estimator, values in expected.items():
        torch.testing.assert_close(F.sequence_advantages(scores, estimator, 2), torch.tensor(values))
    with pytest.raises(ValueError, match="`estimator` must be one of"):
        F.sequence_advantages(scores, "gae", 2)


def test_a_keep_mask_of_another_shape_is_refused_not_broadcast():
    scores, short = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), torch.tensor([True, False])
    for call in (
        lambda: F.grpo_advantages(scores, 2, keep=short),
        lambda: F.rloo_advantages(scores, 2, keep=short),
        lambda: F.sequence_advantages(scores, "reinforce_pp", 2, keep=short),
        lambda: F.fill_dropped_scores(scores, short, 2),
    ):
        with pytest.raises(ValueError, match=r"`keep` has shape \(2,\) but `scores` has shape \(6,\)"):
            call()


@pytest.mark.parametrize("dtype", [torch.int64, torch.bfloat16, torch.float16])
def test_reinforce_pp_scores_become_float32_advantages(dtype):
    out = F.sequence_advantages(torch.tensor([1, 2, 3, 4]).to(dtype), "reinforce_pp", 2)
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 2.0, 3.0, 4.0]

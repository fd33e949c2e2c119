"""weighted_reward_sum and soft_overlong_penalty (DAPO eq. 13): hand values at the boundaries, properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import soft_overlong_penalty, weighted_reward_sum

NAN = float("nan")


def test_weighted_sum_hand_computed():
    # two functions, three responses: 1.0 * [1, 0, 1] + 0.5 * [-1, -0.5, 0] = [0.5, -0.25, 1.0]
    scores = torch.tensor([[1.0, 0.0, 1.0], [-1.0, -0.5, 0.0]])
    out = weighted_reward_sum(scores, torch.tensor([1.0, 0.5]))
    assert out.dtype == torch.float32 and out.tolist() == [0.5, -0.25, 1.0]
    # a negative weight turns a score into a penalty: 2 * [1, 0, 1] - 1 * [-1, -0.5, 0] = [3, 0.5, 2]
    assert weighted_reward_sum(scores, torch.tensor([2.0, -1.0])).tolist() == [3.0, 0.5, 2.0]


def test_weighted_sum_nonfinite_reaches_the_total_unless_the_weight_is_zero():
    scores = torch.tensor([[1.0, NAN, 2.0], [NAN, 1.0, float("inf")]])
    out = weighted_reward_sum(scores, torch.tensor([1.0, 1.0]))
    assert all(math.isnan(v) for v in out[:2].tolist()) and out[2] == float("inf")
    # weight 0: only logged, its NaN/inf does not reach the total
    out = weighted_reward_sum(scores, torch.tensor([1.0, 0.0]))
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 2.0


def test_weighted_sum_leaves_out_what_a_function_did_not_score():
    # TRL's None (the row is another task's): the term is left out (nansum), NaN where no weighted term scored
    scores = torch.tensor([[2.0, NAN, 3.0, NAN, NAN], [NAN, 4.0, 1.0, NAN, 5.0]])
    scored = torch.tensor([[True, False, True, False, True], [False, True, True, False, True]])
    out = weighted_reward_sum(scores, torch.tensor([1.0, 0.5]), scored)
    # [1*2, 0.5*4, 1*3 + 0.5*1, nothing scored it, a real NaN of function 0]
    assert out[:3].tolist() == [2.0, 2.0, 3.5] and math.isnan(out[3]) and math.isnan(out[4])
    # a weight-0 function only logs: a row that only it scored has no total
    out = weighted_reward_sum(scores, torch.tensor([1.0, 0.0]), scored)
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == 3.0
    # every weight 0 (only logged terms): the total stays 0, as without `scored`
    assert weighted_reward_sum(scores, torch.zeros(2), scored).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match=r"`scored` must be \(N, B\) like `scores`, got \(5,\)"):
        weighted_reward_sum(scores, torch.ones(2), scored[0])


@pytest.mark.parametrize(
    ("scores", "weights", "message"),
    [
        (torch.zeros(3), torch.ones(1), r"must be \(N, B\)"),
        (torch.zeros(2, 3), torch.ones(3), r"must be \(N, B\) and `weights` \(N,\), got \(2, 3\) and \(3,\)"),
        (torch.zeros(2, 3), torch.tensor([1.0, NAN]), "must be finite"),
    ],
)
def test_weighted_sum_refuses_bad_shapes_and_weights(scores, weights, message):
    with pytest.raises(ValueError, match=message):
        weighted_reward_sum(scores, weights)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(-10, 10), min_size=4, max_size=4), min_size=1, max_size=5), st.data())
def test_weighted_sum_equals_a_loop(rows, data):
    weights = data.draw(st.lists(st.floats(-3, 3), min_size=len(rows), max_size=len(rows)))
    out = weighted_reward_sum(torch.tensor(rows), torch.tensor(weights))
    for b in range(4):
        expected = sum(torch.tensor(w).item() * torch.tensor(r[b]).item() for w, r in zip(weights, rows))
        assert out[b].item() == pytest.approx(expected, abs=1e-4)


def test_soft_overlong_penalty_at_the_boundaries():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, then (6 - |y|) / 4 down to -1 at 10, -1 beyond
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 100])
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    out = soft_overlong_penalty(lengths, max_length=10, cache_length=4)
    assert out.dtype == torch.float32 and out.tolist() == expected
    # the whole length as cache: the penalty starts at 1 token, -1/8 per token
    assert soft_overlong_penalty(torch.tensor([0, 1, 4, 8, 9]), 8, 8).tolist() == [0.0, -0.125, -0.5, -1.0, -1.0]
    # no cache: a hard limit
    assert soft_overlong_penalty(torch.tensor([9, 10, 11]), 10, 0).tolist() == [0.0, 0.0, -1.0]


@pytest.mark.parametrize(
    ("max_length", "cache_length", "message"),
    [(0, 0, "`max_length` must be >= 1"), (10, -1, "`cache_length` must be >= 0"), (10, 11, "<= 10")],
)
def test_soft_overlong_penalty_refuses_bad_limits(max_length, cache_length, message):
    with pytest.raises(ValueError, match=message):
        soft_overlong_penalty(torch.tensor([1]), max_length, cache_length)
    with pytest.raises(ValueError, match="must be 1-D"):
        soft_overlong_penalty(torch.ones(2, 2), 10, 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 64), st.data())
def test_soft_overlong_penalty_is_non_increasing_in_minus_one_to_zero(max_length, data):
    cache_length = data.draw(st.integers(0, max_length))
    out = soft_overlong_penalty(torch.arange(0, 2 * max_length + 2), max_length, cache_length)
    assert bool((out <= 0).all() and (out >= -1).all())
    assert bool((out[1:] <= out[:-1]).all())
    assert out[max_length - cache_length] == 0.0 and out[max_length + 1] == -1.0

"""masked_mean / masked_var / masked_whiten (and its moments) / explained_variance: hand values, properties."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import (
    explained_variance,
    masked_mean,
    masked_moments,
    masked_var,
    masked_whiten,
    whiten_from_moments,
)

NAN = float("nan")
# x = [[1, 2, pad], [4, pad, pad]] with garbage (nan, inf) at the padding
X = torch.tensor([[1.0, 2.0, NAN], [4.0, float("inf"), NAN]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_mean_hand_computed():
    # (1 + 2 + 4) / 3 = 7/3
    torch.testing.assert_close(masked_mean(X, MASK), torch.tensor(7 / 3))
    # per row: (1 + 2) / 2 = 1.5, 4 / 1 = 4
    torch.testing.assert_close(masked_mean(X, MASK, dim=1), torch.tensor([1.5, 4.0]))
    # per column: (1 + 4) / 2 = 2.5, 2 / 1 = 2, no real element: 0/0 = nan (documented, no error)
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([2.5, 2.0, NAN]), equal_nan=True)


def test_masked_mean_dtypes():
    assert masked_mean(X.to(torch.bfloat16), MASK).dtype == torch.float32
    assert masked_mean(X.double(), MASK.bool()).dtype == torch.float64


def test_masked_var_hand_computed():
    # mean 7/3; squared deviations (4/3)^2 + (1/3)^2 + (5/3)^2 = 16/9 + 1/9 + 25/9 = 42/9
    torch.testing.assert_close(masked_var(X, MASK), torch.tensor(42 / 9 / 2))  # unbiased: / (3 - 1) = 7/3
    torch.testing.assert_close(masked_var(X, MASK, unbiased=False), torch.tensor(42 / 9 / 3))  # biased: 14/9


def test_masked_var_needs_enough_elements():
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="1 real element"):
        masked_var(X, one)
    torch.testing.assert_close(masked_var(X, one, unbiased=False), torch.tensor(0.0))
    with pytest.raises(ValueError, match="0 real element"):
        masked_var(X, torch.zeros_like(one), unbiased=False)


def test_masked_whiten_hand_computed():
    # mean 7/3, unbiased var 7/3: (x - 7/3) / sqrt(7/3 + 1e-8)
    s = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor([[(1 - 7 / 3) / s, (2 - 7 / 3) / s, 0.0], [(4 - 7 / 3) / s, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(X, MASK), expected)
    # shift_mean=False adds the mean back on real tokens (padding stays 0)
    torch.testing.assert_close(masked_whiten(X, MASK, shift_mean=False), expected + 7 / 3 * MASK)


def test_whiten_constant_input_is_finite():
    # var = 0: (x - mean) / sqrt(0 + 1e-8) = 0, not nan
    out = masked_whiten(torch.full((2, 3), 5.0), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    loc=st.floats(-100, 100),
    scale=st.floats(0.01, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_whiten_gives_zero_mean_unit_variance(lengths, loc, scale, seed):
    assume(sum(lengths) >= 2)
    mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])
    x = loc + scale * torch.randn(
        mask.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    var = masked_var(x, mask)
    assume(var > 1e-6 * scale**2)
    white = masked_whiten(x, mask)
    torch.testing.assert_close(
        masked_mean(white, mask), torch.tensor(0.0, dtype=torch.float64), atol=1e-9, rtol=0
    )
    # unit variance up to the 1e-8 of the denominator: var / (var + 1e-8). The moments' one-pass variance
    # (sum of squares - n mean^2, in float64) has a relative error of about eps64 x mean^2 / var (e.g. 4.5e-7
    # at loc 92, scale 0.01, 2 elements): the tolerance grows with that condition number.
    rtol = 1e-7 + 16 * torch.finfo(torch.float64).eps * float(masked_mean(x, mask) ** 2 / var)
    torch.testing.assert_close(masked_var(white, mask), var / (var + 1e-8), rtol=rtol, atol=0)
    kept = masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(masked_mean(kept, mask), masked_mean(x, mask))
    torch.testing.assert_close(masked_var(kept, mask), var / (var + 1e-8), rtol=rtol, atol=0)
    assert (white[~mask.bool()] == 0).all() and (kept[~mask.bool()] == 0).all()


def test_masked_moments_hand_computed():
    # real elements 1, 2, 4 (nan/inf padding ignored): count 3, sum 7, sum of squares 1 + 4 + 16 = 21
    moments = masked_moments(X, MASK)
    assert moments.dtype == torch.float64
    torch.testing.assert_close(moments, torch.tensor([3.0, 7.0, 21.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="at least 2 real elements"):
        whiten_from_moments(X, MASK, torch.tensor([1.0, 4.0, 16.0]))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=2, max_size=6),
    cut=st.integers(1, 5),
    loc=st.floats(-100, 100),
    seed=st.integers(0, 2**31 - 1),
)
def test_whitening_shards_with_summed_moments_equals_whitening_the_whole(lengths, cut, loc, seed):
    # What data-parallel ranks do: each whitens its rows with the moments summed over all ranks.
    assume(sum(lengths) >= 2 and cut < len(lengths))
    mask = torch.tensor([[1] * n + [0] * (max(lengths) + 1 - n) for n in lengths])
    x = loc + torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    shards = [(x[:cut], mask[:cut]), (x[cut:], mask[cut:])]
    total = sum(masked_moments(xs, ms) for xs, ms in shards)
    for shift_mean in (True, False):
        whole = masked_whiten(x, mask, shift_mean=shift_mean)
        parts = torch.cat([whiten_from_moments(xs, ms, total, shift_mean) for xs, ms in shards])
        torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_explained_variance_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 3.0, NAN]])
    values = torch.tensor([[1.0, 2.0, 2.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # returns - values = (0, 0, 1): mean 1/3, biased var (1/9 + 1/9 + 4/9) / 3 = 2/9
    # returns: mean 2, biased var (1 + 0 + 1) / 3 = 2/3;  1 - (2/9) / (2/3) = 2/3
    torch.testing.assert_close(explained_variance(values, returns, mask), torch.tensor(2 / 3))
    # perfect critic: 1
    torch.testing.assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0))
    # constant returns: undefined -> nan
    assert explained_variance(values, torch.ones(1, 4), mask).isnan()


def test_shape_mismatch_is_reported():
    with pytest.raises(ValueError, match="`mask` has shape"):
        masked_mean(X, MASK[:, :2])


def test_masked_std_is_the_unbiased_std_and_0_for_one_element():
    from lit_rlhf.functional import masked_std

    torch.testing.assert_close(masked_std(X, MASK), torch.tensor(7 / 3).sqrt())  # unbiased var 7/3 (above)
    assert masked_std(X, torch.tensor([[1, 0, 0], [0, 0, 0]])) == 0.0  # one element: no spread seen
    with pytest.raises(ValueError, match="0 real element"):
        masked_std(X, torch.zeros_like(MASK))

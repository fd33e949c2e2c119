"""The engine/trainer importance-sampling correction (``functional/is_correction.py``) and the ``weights`` of
the policy losses: hand-computed weights and statistics of every mode, then hypothesis invariants (weights
in [0, C], all 1 without a mismatch, masking monotone in the band, holes skipped as if removed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lit_rlhf.functional as F
from lit_rlhf.functional.is_correction import band_weights, truncated_weights

NAN = float("nan")
# Row 0: 3 learned tokens then padding; row 1: a learned token, a tool token (a hole), 2 learned tokens.
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]]).bool()
# The token ratios rho_t = pi_old / mu on the learned tokens (row by row).
RATIOS = [[1.0, 3.0, 0.5], [4.0, 1.0, 0.25]]
Z = 0.8  # the engine's top-k/top-p kept mass at every step: not part of mu (the trainer's support)


def _inputs(ratios=RATIOS, mask=MASK, kept: float = Z):
    """(old, behavior, log_kept_mass): behavior is the engine's truncated log-prob log(mu / Z), so that
    behavior + log Z = log mu; NaN at padding and holes (which must never matter)."""
    old = torch.full(mask.shape, NAN, dtype=torch.float64)
    log_mu = torch.full(mask.shape, NAN, dtype=torch.float64)
    for b, row in enumerate(ratios):
        idx = mask[b].nonzero().flatten()
        old[b, idx] = torch.tensor([-1.0, -2.0, -0.5][: len(idx)], dtype=torch.float64)
        log_mu[b, idx] = old[b, idx] - torch.tensor(row, dtype=torch.float64).log()
    log_kept = torch.full(mask.shape, math.log(kept), dtype=torch.float64)
    return old, log_mu - log_kept, log_kept


def _placed(rows, mask=MASK) -> torch.Tensor:
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b, row in enumerate(rows):
        out[b, mask[b].nonzero().flatten()] = torch.tensor(row, dtype=torch.float64)
    return out


def _run(mode, **kw):
    return F.is_correction_weights(*_inputs(), MASK, mode, **kw)


def _close(stats: dict, expected: dict) -> None:
    assert set(stats) == set(expected), sorted(stats)
    for key, value in expected.items():
        assert float(stats[key]) == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_the_log_ratio_is_on_the_trainers_untruncated_support():
    d = F.behavior_log_ratio(*_inputs(), MASK)
    torch.testing.assert_close(d, _placed([[math.log(r) for r in row] for row in RATIOS]))
    # without log_kept_mass the kept mass would read as a ratio of 1 / Z at every token
    old, behavior, _ = _inputs()
    no_kept = F.behavior_log_ratio(old, behavior, None, MASK)
    torch.testing.assert_close(no_kept, _placed([[math.log(r * Z) for r in row] for row in RATIOS]))


def test_token_truncate_by_hand():
    weights, stats = _run("token_truncate", cap=2.0)
    torch.testing.assert_close(weights, _placed([[1.0, 2.0, 0.5], [2.0, 1.0, 0.25]]))
    w = [1.0, 2.0, 0.5, 2.0, 1.0, 0.25]  # the 6 learned tokens
    ess = sum(w) ** 2 / (6 * sum(x * x for x in w))  # 6.75^2 / (6 * 10.3125) = 0.7364
    _close(stats, {"is_weight_mean": 6.75 / 6, "is_weight_max": 2.0, "is_clipped_frac": 2 / 6, "is_ess": ess})


def test_token_mask_by_hand():
    weights, stats = _run("token_mask", cap=2.0, low=0.3)  # 3, 4 above the band, 0.25 below
    torch.testing.assert_close(weights, _placed([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0]]))
    _close(
        stats,
        {
            "is_weight_mean": 2.5 / 6,
            "is_weight_max": 1.0,
            "is_masked_frac": 3 / 6,
            "is_ess": 2.5**2 / (6 * 2.25),
        },
    )
    no_low, _ = _run("token_mask", cap=2.0)  # TRL's band: above the cap only
    torch.testing.assert_close(no_low, _placed([[1.0, 0.0, 0.5], [0.0, 1.0, 0.25]]))


def test_sequence_modes_by_hand():
    # product: rho_0 = 1 * 3 * 0.5 = 1.5, rho_1 = 4 * 1 * 0.25 = 1 (the hole is not a token of row 1)
    weights, stats = _run("sequence_truncate", cap=2.0)
    torch.testing.assert_close(weights, _placed([[1.5] * 3, [1.0] * 3]))
    _close(
        stats,
        {
            "is_weight_mean": 1.25,
            "is_weight_max": 1.5,
            "is_clipped_frac": 0.0,
            "is_ess": 6.25 / 6.5,
            "is_seq_ratio_mean": 1.25,
            "is_seq_ratio_max": 1.5,
        },
    )
    weights, stats = _run("sequence_truncate", cap=1.2)
    torch.testing.assert_close(weights, _placed([[1.2] * 3, [1.0] * 3]))
    assert float(stats["is_clipped_frac"]) == 0.5
    weights, stats = _run("sequence_mask", cap=1.2, low=0.3)
    torch.testing.assert_close(weights, _placed([[0.0] * 3, [1.0] * 3]))
    _close(
        stats,
        {
            "is_weight_mean": 0.5,
            "is_weight_max": 1.0,
            "is_masked_frac": 0.5,
            "is_ess": 0.5,
            "is_seq_ratio_mean": 1.25,
            "is_seq_ratio_max": 1.5,
        },
    )


def test_geometric_mean_sequence_ratio_by_hand():
    geo = 1.5 ** (1 / 3)  # 1.1447: row 0's per-token geometric mean; row 1's is 1
    torch.testing.assert_close(
        F.sequence_log_ratio(F.behavior_log_ratio(*_inputs(), MASK), MASK, "geometric_mean"),
        torch.tensor([math.log(geo), 0.0], dtype=torch.float64),
    )
    weights, stats = _run("sequence_mask", cap=1.1, low=0.9, sequence_ratio="geometric_mean")
    torch.testing.assert_close(weights, _placed([[0.0] * 3, [1.0] * 3]))
    assert float(stats["is_seq_ratio_max"]) == pytest.approx(geo)
    weights, _ = _run("sequence_mask", cap=1.2, low=0.9, sequence_ratio="geometric_mean")
    torch.testing.assert_close(weights, _placed([[geo] * 3, [1.0] * 3]))


def test_a_row_without_learned_tokens_is_no_unit_and_an_empty_mask_gives_zeros():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]).bool()
    old, behavior, kept = _inputs([[1.0, 3.0, 0.5], []], mask)
    weights, stats = F.is_correction_weights(old, behavior, kept, mask, "sequence_truncate")
    torch.testing.assert_close(weights, _placed([[1.5] * 3, []], mask))
    assert float(stats["is_weight_mean"]) == pytest.approx(1.5) and float(stats["is_ess"]) == pytest.approx(
        1.0
    )
    empty = torch.zeros_like(mask)
    for mode in F.IS_CORRECTION_MODES:
        weights, stats = F.is_correction_weights(old, behavior, kept, empty, mode)
        assert (weights == 0).all() and all(float(v) == 0.0 for v in stats.values()), mode


def test_a_huge_sequence_ratio_neither_overflows_the_weights_nor_the_stats():
    mask = torch.ones(1, 200, dtype=torch.bool)
    old, behavior = torch.zeros(1, 200), torch.full((1, 200), -1.0)  # rho_t = e: the product is e^200
    for mode in ("sequence_truncate", "sequence_mask"):
        weights, stats = F.is_correction_weights(old, behavior, None, mask, mode)
        assert torch.isfinite(weights).all() and all(torch.isfinite(v) for v in stats.values()), mode
    assert float(F.is_correction_weights(old, behavior, None, mask, "sequence_truncate")[0].max()) == 2.0


def test_normalized_ess_by_hand():
    assert float(F.normalized_ess(torch.tensor([1.0, 1.0, 1.0]))) == 1.0
    assert float(F.normalized_ess(torch.tensor([1.0, 0.0, 0.0, 0.0]))) == 0.25  # one sample of four counts
    assert float(F.normalized_ess(torch.tensor([2.0, 1.0]))) == pytest.approx(9 / 10)
    assert float(F.normalized_ess(torch.zeros(3))) == 0.0 and float(F.normalized_ess(torch.zeros(0))) == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "token_clip"}, "unknown `mode` 'token_clip'"),
        ({"mode": "token_truncate", "cap": 0.5}, "`cap` must be >= 1.0"),
        ({"mode": "token_mask", "low": 1.5}, "`low` must be >= 0.0 and <= 1.0"),
        ({"mode": "sequence_mask", "sequence_ratio": "sum"}, "unknown `sequence_ratio` 'sum'"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        F.is_correction_weights(*_inputs(), MASK, **kwargs)
    with pytest.raises(ValueError, match="`behavior_logprobs` has shape"):
        F.behavior_log_ratio(torch.zeros(2, 4), torch.zeros(2, 3), None, MASK)


# -- the losses' weights --------------------------------------------------------------------------------


def _loss_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(2, 4, generator=g) - 2).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(2, 4, generator=g)
    advantages = torch.randn(2, 4, generator=g)
    return logprobs, old, advantages


@pytest.mark.parametrize("aggregation", F.LOSS_AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_ppo_policy_loss_weights_each_tokens_term_by_hand(aggregation, level):
    logprobs, old, advantages = _loss_inputs()
    weights = _placed([[1.0, 2.0, 0.0], [0.5, 1.0, 1.5]]).float().requires_grad_()
    kw = dict(loss_aggregation=aggregation, max_response_length=4, importance_sampling_level=level)
    loss, stats = F.ppo_policy_loss(logprobs, old, advantages, MASK, 0.2, weights=weights, **kw)
    # by hand: the clipped term per token, times its weight, aggregated
    log_ratio = torch.where(MASK, logprobs - old, 0.0)
    ratio = log_ratio.exp()
    if level == "sequence":
        seq = (log_ratio.sum(1) / MASK.sum(1)).exp()[:, None]
        ratio = torch.where(MASK, seq, 0.0)
    adv = torch.where(MASK, advantages, 0.0)
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    expected = F.aggregate_loss(terms * weights.detach(), MASK, aggregation, 4)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert weights.grad is None, "the weights are constants"
    unweighted, unweighted_stats = F.ppo_policy_loss(logprobs, old, advantages, MASK, 0.2, **kw)
    ones, _ = F.ppo_policy_loss(logprobs, old, advantages, MASK, 0.2, weights=torch.ones(2, 4), **kw)
    assert torch.equal(ones, unweighted), "weights of 1 change nothing"
    assert stats.keys() == unweighted_stats.keys() and float(stats["ratio_mean"]) == float(
        unweighted_stats["ratio_mean"]
    )


def test_kl_penalty_policy_loss_weights_the_whole_token_term_and_ignores_padding():
    logprobs, old, advantages = _loss_inputs(1)
    weights = _placed([[1.0, 2.0, 0.0], [0.5, 1.0, 1.5]]).float()
    weights[~MASK] = NAN  # never read
    loss, _ = F.kl_penalty_policy_loss(logprobs, old, advantages, MASK, beta=0.1, weights=weights)
    log_ratio = torch.where(MASK, logprobs - old, 0.0)
    terms = log_ratio.exp() * torch.where(MASK, advantages, 0.0) + 0.1 * log_ratio
    torch.testing.assert_close(loss, -F.masked_mean(terms * torch.nan_to_num(weights), MASK))
    with pytest.raises(ValueError, match="kl_penalty_policy_loss: `weights` has shape"):
        F.kl_penalty_policy_loss(logprobs, old, advantages, MASK, beta=0.1, weights=torch.ones(2, 3))


# -- invariants ---------------------------------------------------------------------------------------------

_ROWS = st.lists(st.lists(st.floats(-3.0, 3.0), min_size=4, max_size=4), min_size=1, max_size=4)
_MASKS = st.lists(st.lists(st.booleans(), min_size=4, max_size=4), min_size=4, max_size=4)


def _case(log_ratios, mask_rows):
    d = torch.tensor(log_ratios, dtype=torch.float64)  # (B, 4)
    mask = torch.tensor(mask_rows[: len(log_ratios)])  # (B, 4)
    old = torch.randn(d.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 2
    kept = torch.full(d.shape, math.log(0.7), dtype=torch.float64)
    return old, old - d - kept, kept, mask


@settings(max_examples=60, deadline=None)
@given(
    _ROWS,
    _MASKS,
    st.sampled_from(F.IS_CORRECTION_MODES),
    st.floats(1.0, 5.0),
    st.floats(0.0, 1.0),
    st.sampled_from(F.IS_SEQUENCE_RATIOS),
)
def test_weights_lie_in_zero_to_cap_and_vanish_off_the_mask(log_ratios, mask_rows, mode, cap, low, ratio):
    old, behavior, kept, mask = _case(log_ratios, mask_rows)
    weights, stats = F.is_correction_weights(old, behavior, kept, mask, mode, cap, low, ratio)
    assert (weights >= 0).all() and (weights <= cap * (1 + 1e-12)).all()
    assert (weights[~mask] == 0).all()
    assert 0.0 <= float(stats["is_ess"]) <= 1.0 + 1e-12


@settings(max_examples=40, deadline=None)
@given(
    _ROWS,
    _MASKS,
    st.sampled_from(F.IS_CORRECTION_MODES),
    st.floats(1.0, 5.0),
    st.floats(0.0, 1.0),
    st.sampled_from(F.IS_SEQUENCE_RATIOS),
)
def test_no_mismatch_gives_weight_one_everywhere(log_ratios, mask_rows, mode, cap, low, ratio):
    old, _, kept, mask = _case([[0.0] * 4 for _ in log_ratios], mask_rows)
    weights, stats = F.is_correction_weights(old, old - kept, kept, mask, mode, cap, low, ratio)
    assert (weights[mask] == 1).all()
    if mask.any():
        assert float(stats["is_ess"]) == 1.0 and float(stats["is_weight_mean"]) == 1.0
        assert float(stats.get("is_clipped_frac", 0.0)) == float(stats.get("is_masked_frac", 0.0)) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    _ROWS,
    _MASKS,
    st.sampled_from(["token_mask", "sequence_mask"]),
    st.floats(1.0, 4.0),
    st.floats(0.0, 3.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_masking_is_monotone_in_the_band(log_ratios, mask_rows, mode, cap, more, low, less):
    # a band that contains another masks a subset of its tokens, and keeps the weight of every kept one
    old, behavior, kept, mask = _case(log_ratios, mask_rows)
    narrow, _ = F.is_correction_weights(old, behavior, kept, mask, mode, cap, low)
    wide, _ = F.is_correction_weights(old, behavior, kept, mask, mode, cap + more, low * less)
    assert ((wide == 0) & mask <= (narrow == 0) & mask).all()
    kept_narrow = mask & (narrow > 0)
    torch.testing.assert_close(wide[kept_narrow], narrow[kept_narrow])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30.0, 30.0), min_size=1, max_size=8), st.floats(1.0, 5.0), st.floats(0.0, 2.0))
def test_truncation_is_the_ratio_capped_and_monotone_in_the_cap(log_ratios, cap, more):
    d = torch.tensor(log_ratios, dtype=torch.float64)
    w = truncated_weights(d, cap)
    torch.testing.assert_close(w, torch.minimum(d.exp(), torch.tensor(cap, dtype=torch.float64)))
    assert (truncated_weights(d, cap + more) >= w).all()
    inside = band_weights(d, 0.0, cap) > 0
    torch.testing.assert_close(band_weights(d, 0.0, cap)[inside], w[inside])  # kept tokens: the same weight


@settings(max_examples=40, deadline=None)
@given(_ROWS, _MASKS, st.sampled_from(F.IS_CORRECTION_MODES), st.sampled_from(F.IS_SEQUENCE_RATIOS))
def test_holes_are_skipped_as_if_removed(log_ratios, mask_rows, mode, ratio):
    old, behavior, kept, mask = _case(log_ratios, mask_rows)
    weights, stats = F.is_correction_weights(old, behavior, kept, mask, mode, 2.0, 0.0, ratio)
    packed = [F.compact_left(x, mask) for x in (old, behavior, kept)]
    compact_mask = packed[0][1]
    compact, compact_stats = F.is_correction_weights(
        *(p[0] for p in packed), compact_mask, mode, 2.0, 0.0, ratio
    )
    torch.testing.assert_close(F.scatter_back(compact, packed[0][2], mask), weights)
    for key, value in stats.items():
        torch.testing.assert_close(compact_stats[key], value, msg=key)

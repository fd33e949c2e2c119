"""Loss masks with holes: tool/environment tokens between the model's tokens of a multi-turn rollout.

A loss-mask row such as ``1 1 0 0 1 0`` has holes at 2, 3 and padding at 5. Every masked function must
give exactly what it gives on the same row with the holes removed (the row compacted left: ``1 1 1 0 0
0``), with 0 written at the holes of (B, T) outputs. The hand-computed tests below write the numbers out;
the hypothesis tests compare against compacting with a plain Python reference and scattering back. Last,
right-padded inputs (no holes) must give bit-for-bit what the loop used before holes were supported gives.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_weight,
    clipped_value_loss,
    compact_left,
    compute_gae,
    discounted_returns,
    explained_variance,
    kl_penalty_policy_loss,
    kl_shaped_rewards,
    masked_kl,
    masked_mean,
    masked_moments,
    masked_row_sum,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reference_kl_loss,
    scatter_back,
    whiten_from_moments,
)

NAN, INF = float("nan"), float("inf")

# Two rows of T = 6. Row 0: tokens 0, 1, 4 learned from, tool tokens at 2, 3, padding at 5.
# Row 1: a tool token first (0), tokens 1 and 3, a tool token at 2, padding at 4, 5.
MASK = torch.tensor([[1, 1, 0, 0, 1, 0], [0, 1, 0, 1, 0, 0]])
# The same rows with the holes removed.
COMPACT_MASK = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])


def _place(rows: list[list[float]], mask: torch.Tensor = MASK, fill: float = NAN) -> torch.Tensor:
    """(B, T) float64 tensor with row b's values at its masked positions, ``fill`` elsewhere."""
    out = torch.full(mask.shape, fill, dtype=torch.float64)
    for b, values in enumerate(rows):
        idx = mask[b].bool().nonzero().flatten()
        assert len(idx) == len(values)
        out[b, idx] = torch.tensor(values, dtype=torch.float64)
    return out


def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain reference: each row's masked values moved left in order, 0 after; and the compacted mask."""
    out, out_mask = torch.zeros_like(x), torch.zeros_like(mask)
    for b in range(x.shape[0]):
        idx = mask[b].bool().nonzero().flatten()
        out[b, : len(idx)] = x[b, idx]
        out_mask[b, : len(idx)] = 1
    return out, out_mask


def _scatter(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_compact``: the compacted values back at the masked positions of ``mask``, 0 elsewhere."""
    out = torch.zeros_like(y)
    for b in range(y.shape[0]):
        idx = mask[b].bool().nonzero().flatten()
        out[b, idx] = y[b, : len(idx)]
    return out


def _compact_pair(a, b, mask=MASK):
    """(a, b, mask) compacted: the arguments of a function of two (B, T) tensors and the mask."""
    return _compact(a, mask)[0], _compact(b, mask)[0], _compact(a, mask)[1]


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Hand-computed examples


def test_gae_skips_holes_by_hand():
    # Row 0's learned-from tokens carry the example of tests/test_functional_gae.py: r = (0.1, -0.2, 1.0),
    # V = (0.5, 0.4, 0.3); the tool tokens between them hold garbage. gamma 0.9, lambda 0.8:
    # t=4: delta = 1.0 - 0.3 = 0.7                                   A = 0.7
    # t=1: delta = -0.2 + 0.9 * 0.3 - 0.4 = -0.33 (V_{t+1} is V_4)    A = -0.33 + 0.72 * 0.7 = 0.174
    # t=0: delta = 0.1 + 0.9 * 0.4 - 0.5 = -0.04                     A = -0.04 + 0.72 * 0.174 = 0.08528
    # Row 1: r = (0.5, 2.0), V = (1.0, 0.0):
    # t=3: delta = 2.0                                               A = 2.0
    # t=1: delta = 0.5 + 0.9 * 0.0 - 1.0 = -0.5                      A = -0.5 + 0.72 * 2.0 = 0.94
    rewards = _place([[0.1, -0.2, 1.0], [0.5, 2.0]])
    values = _place([[0.5, 0.4, 0.3], [1.0, 0.0]], fill=INF)
    advantages, returns = compute_gae(rewards, values, MASK, gamma=0.9, gae_lambda=0.8)
    _close(advantages, [[0.08528, 0.174, 0, 0, 0.7, 0], [0, 0.94, 0, 2.0, 0, 0]])
    _close(returns, [[0.58528, 0.574, 0, 0, 1.0, 0], [0, 1.94, 0, 2.0, 0, 0]])
    # exactly the advantages and returns of the rows with the holes removed
    compact_adv, compact_ret = compute_gae(
        _compact(rewards, MASK)[0], _compact(values, MASK)[0], COMPACT_MASK, 0.9, 0.8
    )
    _close(compact_adv, [[0.08528, 0.174, 0.7, 0, 0, 0], [0.94, 2.0, 0, 0, 0, 0]])
    assert torch.equal(advantages, _scatter(compact_adv, MASK))
    assert torch.equal(returns, _scatter(compact_ret, MASK))


def test_discounted_returns_skip_holes_by_hand():
    # REINFORCE++ returns, gamma 0.9. Row 0: r = (0.1, -0.2, 1.0) -> G = (0.1 + 0.9 * 0.7, -0.2 + 0.9, 1.0)
    # = (0.73, 0.7, 1.0); row 1: r = (0.5, 2.0) -> G = (0.5 + 1.8, 2.0) = (2.3, 2.0).
    rewards = _place([[0.1, -0.2, 1.0], [0.5, 2.0]], fill=-7.0)
    returns = discounted_returns(rewards, MASK, gamma=0.9)
    _close(returns, [[0.73, 0.7, 0, 0, 1.0, 0], [0, 2.3, 0, 2.0, 0, 0]])
    compact = discounted_returns(_compact(rewards, MASK)[0], COMPACT_MASK, gamma=0.9)
    assert torch.equal(returns, _scatter(compact, MASK))


def test_kl_shaped_rewards_skip_holes_by_hand():
    # k1: d = logprobs - ref = (0.5, -1.0, 0.0) and (0.25, -0.5); kl_coef 0.1 -> r = -0.1 * d, plus the
    # score (2.0 and -1.0) on the last learned-from token: position 4 of row 0 and 3 of row 1. Holes get
    # no KL whatever their log-probs hold.
    logprobs = _place([[-1.0, -2.0, -0.5], [-0.75, -1.5]])
    ref = _place([[-1.5, -1.0, -0.5], [-1.0, -1.0]], fill=INF)
    scores = torch.tensor([2.0, -1.0], dtype=torch.float64)
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, MASK, kl_coef=0.1)
    _close(kl, [[0.5, -1.0, 0, 0, 0.0, 0], [0, 0.25, 0, -0.5, 0, 0]])
    _close(rewards, [[-0.05, 0.1, 0, 0, 2.0, 0], [0, -0.025, 0, 0.05 - 1.0, 0, 0]])
    compact = kl_shaped_rewards(
        scores, _compact(logprobs, MASK)[0], _compact(ref, MASK)[0], COMPACT_MASK, 0.1
    )
    assert torch.equal(rewards, _scatter(compact[0], MASK)) and torch.equal(kl, _scatter(compact[1], MASK))
    assert torch.equal(
        masked_kl(logprobs, ref, MASK, "k3"), _scatter(masked_kl(*_compact_pair(logprobs, ref), "k3"), MASK)
    )


def test_kl_shaped_rewards_score_before_a_trailing_tool_token():
    # the response ends in a tool call whose output (positions 2, 3) is not learned from
    mask = torch.tensor([[1, 1, 0, 0]])
    logprobs, ref = torch.tensor([[-1.0, -1.0, NAN, NAN]]), torch.tensor([[-1.0, -1.0, 5.0, 5.0]])
    rewards, _ = kl_shaped_rewards(torch.tensor([3.0]), logprobs, ref, mask, kl_coef=0.5)
    assert rewards.tolist() == [[0.0, 3.0, 0.0, 0.0]]


# Policy-loss example. Ratios r = exp(logprobs - old) on the learned-from tokens: row 0 (1.1, 1.5, 0.5),
# row 1 (0.9, 1.3); advantages (1.0, 2.0, -1.0) and (-2.0, -0.5); eps 0.2 (clip to [0.8, 1.2]).
# Token terms max(-A r, -A clip(r)):
#   row 0: -1.1 (inside);  max(-3.0, -2.4) = -2.4 (clipped);  max(0.5, 0.8) = 0.8 (clipped)
#   row 1: 1.8 (inside);   max(0.65, 0.6) = 0.65 (unclipped)
RATIOS = [[1.1, 1.5, 0.5], [0.9, 1.3]]
ADVANTAGES = [[1.0, 2.0, -1.0], [-2.0, -0.5]]
TOKEN_TERMS = [[-1.1, -2.4, 0.8], [1.8, 0.65]]
T = MASK.shape[1]


def _policy_inputs():
    old = _place([[-1.0, -2.0, -0.5], [-0.5, -3.0]], fill=-INF)
    logprobs = old + _place([[math.log(r) for r in row] for row in RATIOS], fill=NAN)
    return logprobs.requires_grad_(), old, _place(ADVANTAGES, fill=INF)


def _aggregate_by_hand(terms: list[list[float]], aggregation: str) -> float:
    if aggregation == "token_mean":
        return sum(sum(row) for row in terms) / sum(len(row) for row in terms)
    if aggregation == "seq_mean_token_mean":
        return sum(sum(row) / len(row) for row in terms) / len(terms)
    return sum(sum(row) / T for row in terms) / len(terms)  # the constant max_response_length = T


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_ppo_token_level_skips_holes_by_hand(aggregation):
    # token_mean: (-1.1 - 2.4 + 0.8 + 1.8 + 0.65) / 5 = -0.05; seq_mean_token_mean: (-2.7 / 3 + 2.45 / 2) / 2
    # = 0.1625; seq_mean_token_sum_norm: (-2.7 / 6 + 2.45 / 6) / 2 = -0.25 / 12
    expected = {"token_mean": -0.05, "seq_mean_token_mean": 0.1625, "seq_mean_token_sum_norm": -0.25 / 12}
    assert _aggregate_by_hand(TOKEN_TERMS, aggregation) == pytest.approx(expected[aggregation])
    logprobs, old, adv = _policy_inputs()
    loss, stats = ppo_policy_loss(
        logprobs, old, adv, MASK, 0.2, loss_aggregation=aggregation, max_response_length=T
    )
    assert loss.item() == pytest.approx(expected[aggregation], rel=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)  # two of the five tokens take the clipped term
    ratios = [r for row in RATIOS for r in row]
    assert stats["ratio_mean"].item() == pytest.approx(sum(ratios) / 5) and stats[
        "ratio_max"
    ].item() == pytest.approx(1.5)
    loss.backward()
    assert (logprobs.grad[~MASK.bool()] == 0).all()
    _check_against_compact(
        ppo_policy_loss, logprobs, old, adv, 0.2, loss_aggregation=aggregation, max_response_length=T
    )


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_ppo_sequence_level_skips_holes_by_hand(aggregation):
    # GSPO: s_i = exp(mean of the log-ratios over the learned-from tokens), s_0 = (1.1 * 1.5 * 0.5)^(1/3)
    # ~ 0.938 and s_1 = (0.9 * 1.3)^(1/2) ~ 1.082, both inside [0.8, 1.2], so every token term is -A s_i.
    s0, s1 = (1.1 * 1.5 * 0.5) ** (1 / 3), (0.9 * 1.3) ** 0.5
    terms = [[-a * s0 for a in ADVANTAGES[0]], [-a * s1 for a in ADVANTAGES[1]]]
    expected = {
        "token_mean": (-2.0 * s0 + 2.5 * s1) / 5,
        "seq_mean_token_mean": (-2.0 * s0 / 3 + 2.5 * s1 / 2) / 2,
        "seq_mean_token_sum_norm": (-2.0 * s0 / T + 2.5 * s1 / T) / 2,
    }[aggregation]
    assert _aggregate_by_hand(terms, aggregation) == pytest.approx(expected)
    logprobs, old, adv = _policy_inputs()
    kwargs = {
        "loss_aggregation": aggregation,
        "max_response_length": T,
        "importance_sampling_level": "sequence",
    }
    loss, stats = ppo_policy_loss(logprobs, old, adv, MASK, 0.2, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["clipfrac"].item() == 0.0
    loss.backward()
    assert (logprobs.grad[~MASK.bool()] == 0).all()
    _check_against_compact(ppo_policy_loss, logprobs, old, adv, 0.2, **kwargs)


def _check_against_compact(loss_fn, logprobs, old, adv, *args, **kwargs):
    """loss, stats and gradient of the holed batch equal those of the compacted batch (scattered back)."""
    logprobs = logprobs.detach().requires_grad_()
    loss, stats = loss_fn(logprobs, old, adv, MASK, *args, **kwargs)
    loss.backward()
    compact_lp = _compact(logprobs.detach(), MASK)[0].requires_grad_()
    compact_loss, compact_stats = loss_fn(
        compact_lp, _compact(old, MASK)[0], _compact(adv, MASK)[0], COMPACT_MASK, *args, **kwargs
    )
    compact_loss.backward()
    _close(loss, compact_loss)
    assert stats.keys() == compact_stats.keys()
    for key in stats:
        _close(stats[key], compact_stats[key])
    _close(logprobs.grad, _scatter(compact_lp.grad, MASK))


def test_kl_penalty_policy_loss_skips_holes():
    logprobs, old, adv = _policy_inputs()
    # -(r A - beta * (old - lp)) per token, with beta = 0.5: ratios and log-ratios from RATIOS
    terms = [
        [-(r * a + 0.5 * math.log(r)) for r, a in zip(rr, aa, strict=True)]
        for rr, aa in zip(RATIOS, ADVANTAGES, strict=True)
    ]
    for aggregation in LOSS_AGGREGATIONS:
        loss, _ = kl_penalty_policy_loss(logprobs, old, adv, MASK, 0.5, aggregation, T)
        assert loss.item() == pytest.approx(_aggregate_by_hand(terms, aggregation), rel=1e-12)
        _check_against_compact(kl_penalty_policy_loss, logprobs, old, adv, 0.5, aggregation, T)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_reference_kl_loss_skips_holes_by_hand(aggregation):
    # k3(d) = exp(-d) - 1 + d with d = lp - ref: row 0 d = (0.5, -1.0, 0.0), row 1 d = (0.2, 0.0)
    ds = [[0.5, -1.0, 0.0], [0.2, 0.0]]
    terms = [[math.expm1(-d) + d for d in row] for row in ds]
    ref = _place([[-1.0, -1.0, -2.0], [-0.5, -0.5]], fill=INF)
    logprobs = (ref + _place(ds, fill=NAN)).requires_grad_()
    loss, stats = reference_kl_loss(logprobs, ref, MASK, "k3", aggregation, T)
    assert loss.item() == pytest.approx(_aggregate_by_hand(terms, aggregation), rel=1e-12)
    assert stats["kl_loss"].item() == pytest.approx(loss.item())
    loss.backward()
    assert (logprobs.grad[~MASK.bool()] == 0).all()
    compact_loss, _ = reference_kl_loss(*_compact_pair(logprobs.detach(), ref), "k3", aggregation, T)
    _close(loss, compact_loss)


def test_clipped_value_loss_skips_holes_by_hand():
    # eps 0.2. Row 0: v = (1.0, 0.5, -0.3), old = (0.9, 0.0, -0.2), R = (1.2, 1.0, 0.0):
    #   0.04 (inside);  v clipped to 0.2: max(0.25, 0.64) = 0.64 (clipped larger);  0.09 (inside)
    # Row 1: v = (2.0, 0.0), old = (1.0, 0.1), R = (1.5, -1.0):
    #   v clipped to 1.2: max(0.25, 0.09) = 0.25;  1.0 (inside)
    # loss = 0.5 * (0.04 + 0.64 + 0.09 + 0.25 + 1.0) / 5 = 0.202; one of five tokens clipped
    values = _place([[1.0, 0.5, -0.3], [2.0, 0.0]], fill=NAN).requires_grad_()
    old = _place([[0.9, 0.0, -0.2], [1.0, 0.1]], fill=INF)
    returns = _place([[1.2, 1.0, 0.0], [1.5, -1.0]], fill=-INF)
    loss, stats = clipped_value_loss(values, old, returns, MASK, 0.2)
    assert loss.item() == pytest.approx(0.202, rel=1e-12)
    assert stats["value_clipfrac"].item() == pytest.approx(0.2)
    loss.backward()
    assert (values.grad[~MASK.bool()] == 0).all()
    compact_loss, compact_stats = clipped_value_loss(
        _compact(values.detach(), MASK)[0],
        _compact(old, MASK)[0],
        _compact(returns, MASK)[0],
        COMPACT_MASK,
        0.2,
    )
    _close(loss, compact_loss)
    _close(stats["value_clipfrac"], compact_stats["value_clipfrac"])


def test_masked_whitening_skips_holes_by_hand():
    # values (1, 2, 3) and (4, 5) on the learned-from tokens: mean 3, unbiased var (4 + 1 + 0 + 1 + 4) / 4 = 2.5
    x = _place([[1.0, 2.0, 3.0], [4.0, 5.0]], fill=1e30)
    scale = 1 / math.sqrt(2.5 + 1e-8)
    whitened = masked_whiten(x, MASK)
    _close(whitened, [[-2 * scale, -scale, 0, 0, 0, 0], [0, scale, 0, 2 * scale, 0, 0]])
    _close(
        masked_whiten(x, MASK, shift_mean=False),
        [[-2 * scale + 3, -scale + 3, 0, 0, 3, 0], [0, scale + 3, 0, 2 * scale + 3, 0, 0]],
    )
    compact_x, _ = _compact(x, MASK)
    _close(whitened, _scatter(masked_whiten(compact_x, COMPACT_MASK), MASK))
    assert masked_moments(x, MASK).tolist() == [5.0, 15.0, 55.0]
    assert masked_mean(x, MASK).item() == 3.0 and masked_var(x, MASK).item() == 2.5
    assert masked_row_sum(x, MASK).tolist() == [6.0, 9.0]
    assert masked_mean(x, MASK, dim=1).tolist() == [2.0, 4.5]


def test_aggregation_weight_counts_learned_from_tokens():
    part, total = MASK[:1], MASK  # 3 of the 5 learned-from tokens; 1 of 2 rows
    assert aggregation_weight(part, total, "token_mean").item() == pytest.approx(3 / 5)
    assert aggregation_weight(part, total, "seq_mean_token_mean").item() == pytest.approx(1 / 2)


def test_compact_left_and_scatter_back():
    x = torch.arange(12.0).view(2, 6)
    packed, packed_mask, order = compact_left(x, MASK)
    assert packed_mask.tolist() == COMPACT_MASK.bool().tolist()
    assert packed[packed_mask].tolist() == [0.0, 1.0, 4.0, 7.0, 9.0]
    # holes and padding follow in their order
    assert packed.tolist() == [[0, 1, 4, 2, 3, 5], [7, 9, 6, 8, 10, 11]]
    assert scatter_back(packed, order, MASK).tolist() == [[0, 1, 0, 0, 4, 0], [0, 7, 0, 9, 0, 0]]
    # a right-padded mask is left as it is
    right = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    packed, _, order = compact_left(x, right)
    assert torch.equal(packed, x) and order.tolist() == [list(range(6))] * 2


# ---------------------------------------------------------------------------------------------------------
# Property tests: random masks with holes against compacting and scattering back


@st.composite
def holed_batches(draw):
    rows = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 8))
    mask = torch.tensor(
        draw(st.lists(st.lists(st.booleans(), min_size=steps, max_size=steps), min_size=rows, max_size=rows))
    )
    garbage = draw(st.sampled_from([NAN, INF, -INF, 1e30, -7.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    return mask, garbage, gen


def _random(mask, garbage, gen, scale=1.0):
    x = scale * torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    return torch.where(mask, x, garbage)


SETTINGS = settings(max_examples=80, deadline=None)


@SETTINGS
@given(batch=holed_batches(), gamma=st.floats(0, 1), gae_lambda=st.floats(0, 1))
def test_gae_and_returns_equal_compacted(batch, gamma, gae_lambda):
    mask, garbage, gen = batch
    rewards, values = _random(mask, garbage, gen), _random(mask, garbage, gen)
    compact_mask = _compact(mask, mask)[1]
    advantages, returns = compute_gae(rewards, values, mask, gamma, gae_lambda)
    c_adv, c_ret = compute_gae(
        _compact(rewards, mask)[0], _compact(values, mask)[0], compact_mask, gamma, gae_lambda
    )
    assert torch.equal(advantages, _scatter(c_adv, mask)) and torch.equal(returns, _scatter(c_ret, mask))
    g = discounted_returns(rewards, mask, gamma)
    assert torch.equal(g, _scatter(discounted_returns(_compact(rewards, mask)[0], compact_mask, gamma), mask))


@SETTINGS
@given(batch=holed_batches(), estimator=st.sampled_from(["k1", "abs", "k2", "k3"]), kl_coef=st.floats(0, 2))
def test_kl_rewards_equal_compacted(batch, estimator, kl_coef):
    mask, garbage, gen = batch
    mask = mask[mask.any(dim=1)]
    if not len(mask):
        return
    logprobs, ref = _random(mask, garbage, gen), _random(mask, garbage, gen)
    scores = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef, estimator)
    c_lp, c_ref, c_mask = _compact_pair(logprobs, ref, mask)
    c_rewards, c_kl = kl_shaped_rewards(scores, c_lp, c_ref, c_mask, kl_coef, estimator)
    assert torch.equal(rewards, _scatter(c_rewards, mask)) and torch.equal(kl, _scatter(c_kl, mask))


@SETTINGS
@given(
    batch=holed_batches(),
    aggregation=st.sampled_from(LOSS_AGGREGATIONS),
    level=st.sampled_from(["token", "sequence"]),
    clip=st.floats(0.05, 0.5),
    beta=st.floats(0, 1),
)
def test_losses_equal_compacted(batch, aggregation, level, clip, beta):
    mask, garbage, gen = batch
    steps = mask.shape[1]
    logprobs, old = _random(mask, garbage, gen, 0.5), _random(mask, garbage, gen, 0.5)
    adv, ref = _random(mask, garbage, gen), _random(mask, garbage, gen, 0.5)
    compact_mask = _compact(mask, mask)[1]

    def both(fn, tensors, *args, **kwargs):
        lp = tensors[0].clone().requires_grad_()
        out, stats = fn(lp, *tensors[1:], mask, *args, **kwargs)
        c_lp = _compact(tensors[0], mask)[0].requires_grad_()
        c_out, c_stats = fn(c_lp, *[_compact(t, mask)[0] for t in tensors[1:]], compact_mask, *args, **kwargs)
        torch.testing.assert_close(out, c_out, equal_nan=True)
        for key in stats:
            torch.testing.assert_close(stats[key], c_stats[key], equal_nan=True)
        if mask.any() and torch.isfinite(out):
            out.backward()
            c_out.backward()
            torch.testing.assert_close(lp.grad, _scatter(c_lp.grad, mask))

    both(ppo_policy_loss, (logprobs, old, adv), clip, clip * 1.3, aggregation, steps, level)
    both(kl_penalty_policy_loss, (logprobs, old, adv), beta, aggregation, steps)
    both(reference_kl_loss, (logprobs, ref), "k3", aggregation, steps)
    both(clipped_value_loss, (logprobs, old, adv), clip)
    torch.testing.assert_close(
        aggregate_loss(adv, mask, aggregation, steps),
        aggregate_loss(_compact(adv, mask)[0], compact_mask, aggregation, steps),
        equal_nan=True,
    )


@SETTINGS
@given(batch=holed_batches(), shift_mean=st.booleans())
def test_stats_equal_compacted(batch, shift_mean):
    mask, garbage, gen = batch
    x, y = _random(mask, garbage, gen, 3.0), _random(mask, garbage, gen)
    (cx, c_mask), (cy, _) = _compact(x, mask), _compact(y, mask)
    close = {"equal_nan": True, "rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(masked_mean(x, mask), masked_mean(cx, c_mask), **close)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), masked_mean(cx, c_mask, dim=1), **close)
    torch.testing.assert_close(masked_row_sum(x, mask), masked_row_sum(cx, c_mask), **close)
    torch.testing.assert_close(masked_moments(x, mask), masked_moments(cx, c_mask), **close)
    if mask.sum() >= 1:
        torch.testing.assert_close(
            explained_variance(x, y, mask), explained_variance(cx, cy, c_mask), **close
        )
    if mask.sum() >= 2:
        torch.testing.assert_close(masked_var(x, mask), masked_var(cx, c_mask), **close)
        whitened = masked_whiten(x, mask, shift_mean)
        torch.testing.assert_close(whitened, _scatter(masked_whiten(cx, c_mask, shift_mean), mask), **close)
        moments = masked_moments(cx, c_mask)  # the moments of the compacted rows whiten the holed ones
        torch.testing.assert_close(whiten_from_moments(x, mask, moments, shift_mean), whitened, **close)
        assert (whitened[~mask] == 0).all()


@SETTINGS
@given(batch=holed_batches())
def test_compact_left_matches_reference(batch):
    mask, garbage, gen = batch
    x = _random(mask, garbage, gen)
    packed, packed_mask, order = compact_left(x, mask)
    reference, reference_mask = _compact(x, mask)
    assert torch.equal(packed_mask, reference_mask)
    assert torch.equal(torch.where(packed_mask, packed, 0.0), reference)
    assert torch.equal(scatter_back(packed, order, mask), torch.where(mask, x, 0.0))


# ---------------------------------------------------------------------------------------------------------
# Right-padded inputs: bit-for-bit the loop used before holes were supported


def _right_padded_gae(rewards, values, response_mask, gamma, gae_lambda):
    """compute_gae as it was for right-padded masks only (the loop over T, vectorised over the batch)."""
    mask = response_mask.bool()
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    rewards = torch.where(mask, rewards.to(dtype), 0.0)
    values = torch.where(mask, values.to(torch.promote_types(values.dtype, torch.float32)), 0.0)
    steps = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(steps)):
        next_value = values[:, t + 1] if t + 1 < steps else next_advantage.new_zeros(())
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(mask[:, t], delta + gamma * gae_lambda * next_advantage, 0.0)
        advantages[:, t] = next_advantage
    return advantages, torch.where(mask, advantages + values, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    extra=st.integers(0, 3),
    gamma=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.0]),
    gae_lambda=st.sampled_from([1.0, 0.95, 0.3, 0.0]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_right_padded_is_bit_for_bit_unchanged(lengths, extra, gamma, gae_lambda, dtype, seed):
    steps = max(lengths) + extra
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1] * n + [0] * (steps - n) for n in lengths])
    rewards = torch.randn(mask.shape, generator=gen).to(dtype)
    values = torch.randn(mask.shape, generator=gen).to(dtype)
    rewards[~mask.bool()], values[~mask.bool()] = NAN, INF
    advantages, returns = compute_gae(rewards, values, mask, gamma, gae_lambda)
    ref_adv, ref_ret = _right_padded_gae(rewards, values, mask, gamma, gae_lambda)
    assert advantages.dtype == ref_adv.dtype
    assert torch.equal(advantages, ref_adv) and torch.equal(returns, ref_ret)
    zeros = torch.zeros(mask.shape, dtype=torch.promote_types(rewards.dtype, torch.float32))
    ref_g, _ = _right_padded_gae(rewards, zeros, mask, gamma, 1.0)
    assert torch.equal(discounted_returns(rewards, mask, gamma), ref_g)

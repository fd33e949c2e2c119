"""compute_gae: a hand-computed example and a plain Python reference loop on ragged batches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import compute_gae

NAN, INF = float("nan"), float("inf")


def _reference_gae(rewards, values, lengths, gamma, lam):
    """Per row, over its real tokens only, straight from A_t = delta_t + gamma * lambda * A_{t+1}."""
    advantages, returns = [], []
    for r, v, n in zip(rewards.tolist(), values.tolist(), lengths):
        adv = [0.0] * n
        next_adv, next_value = 0.0, 0.0  # V and A after the last real token are 0
        for t in reversed(range(n)):
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[t]
            adv[t] = next_adv
        advantages.append(adv)
        returns.append([a + v[t] for t, a in enumerate(adv)])
    return advantages, returns


def test_gae_hand_computed():
    # one row, 3 real tokens and a padded 4th with garbage; gamma 0.9, lambda 0.8 (gamma * lambda = 0.72)
    rewards = torch.tensor([[0.1, -0.2, 1.0, NAN]])
    values = torch.tensor([[0.5, 0.4, 0.3, INF]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # t=2: delta = 1.0 + 0.9 * 0 - 0.3 = 0.7;               A2 = 0.7
    # t=1: delta = -0.2 + 0.9 * 0.3 - 0.4 = -0.33;          A1 = -0.33 + 0.72 * 0.7 = 0.174
    # t=0: delta = 0.1 + 0.9 * 0.4 - 0.5 = -0.04;           A0 = -0.04 + 0.72 * 0.174 = 0.08528
    # returns = A + V = (0.58528, 0.574, 1.0)
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, gae_lambda=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.08528, 0.174, 0.7, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.58528, 0.574, 1.0, 0.0]]))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 7), min_size=1, max_size=5),
    extra=st.integers(0, 3),
    gamma_lambda=st.one_of(
        st.sampled_from([(1.0, 1.0), (0.99, 0.95), (1.0, 0.95), (0.9, 0.0), (0.0, 0.5)]),
        st.tuples(st.floats(0, 1), st.floats(0, 1)),
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_gae_matches_reference_loop(lengths, extra, gamma_lambda, seed):
    gamma, lam = gamma_lambda
    steps = max(lengths) + extra
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(len(lengths), steps, generator=gen, dtype=torch.float64)
    values = torch.randn(len(lengths), steps, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (steps - n) for n in lengths])
    garbage = ~mask.bool()
    rewards[garbage], values[garbage] = NAN, -INF
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _reference_gae(rewards, values, lengths, gamma, lam)
    for b, n in enumerate(lengths):
        assert advantages[b, :n].tolist() == pytest.approx(ref_adv[b], rel=1e-9, abs=1e-9)
        assert returns[b, :n].tolist() == pytest.approx(ref_ret[b], rel=1e-9, abs=1e-9)
    assert (advantages[garbage] == 0).all() and (returns[garbage] == 0).all()


def test_gamma_lambda_one_gives_reward_to_go():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    lengths = [5, 2, 3]
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in lengths])
    _, returns = compute_gae(rewards, values, mask, gamma=1.0, gae_lambda=1.0)
    for b, n in enumerate(lengths):
        # returns_t = sum_{k >= t} r_k over the real tokens, whatever the critic says
        reward_to_go = rewards[b, :n].flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(returns[b, :n], reward_to_go)


def test_leading_hole_is_skipped():
    # a row whose loss mask starts with a hole (0 1 1) is the row of its last two tokens (1 1)
    rewards, values = torch.tensor([[NAN, 0.1, 1.0]]), torch.tensor([[INF, 0.5, 0.3]])
    advantages, returns = compute_gae(rewards, values, torch.tensor([[0, 1, 1]]), 0.9, 0.8)
    compact_adv, compact_ret = compute_gae(rewards[:, 1:], values[:, 1:], torch.ones(1, 2), 0.9, 0.8)
    assert torch.equal(advantages, torch.cat([torch.zeros(1, 1), compact_adv], dim=1))
    assert torch.equal(returns, torch.cat([torch.zeros(1, 1), compact_ret], dim=1))


def test_bad_coefficients_and_shapes():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(x, x, torch.ones(2, 3), 1.5, 0.9)
    with pytest.raises(ValueError, match="gae_lambda"):
        compute_gae(x, x, torch.ones(2, 3), 0.9, -0.1)
    with pytest.raises(ValueError, match="`values` has shape"):
        compute_gae(x, torch.zeros(2, 4), torch.ones(2, 3), 0.9, 0.9)

"""Reward-model ensembles' math (aggregations, spread, bootstrap weights, weighted pairwise loss) and online
DPO's pairs, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf import functional as F

# 3 members x 2 responses: response 0 scored 1, 2, 3 (mean 2, deviations -1, 0, 1: variance 2/3);
# response 1 scored 4, 0, 2 (mean 2, deviations 2, -2, 0: variance 8/3)
SCORES = torch.tensor([[1.0, 4.0], [2.0, 0.0], [3.0, 2.0]])


def test_aggregations_by_hand():
    std0, std1 = math.sqrt(2 / 3), math.sqrt(8 / 3)
    torch.testing.assert_close(F.ensemble_std(SCORES), torch.tensor([std0, std1]))
    torch.testing.assert_close(F.aggregate_ensemble(SCORES, "mean"), torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(F.aggregate_ensemble(SCORES, "min"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(
        F.aggregate_ensemble(SCORES, "mean_minus_std", 0.5), torch.tensor([2 - std0 / 2, 2 - std1 / 2])
    )
    torch.testing.assert_close(
        F.aggregate_ensemble(SCORES, "mean_minus_var", 1.0), torch.tensor([2 - 2 / 3, 2 - 8 / 3])
    )
    # coef 0: the mean; min and mean ignore the coefficient
    torch.testing.assert_close(F.aggregate_ensemble(SCORES, "mean_minus_std", 0.0), torch.tensor([2.0, 2.0]))
    assert torch.equal(F.aggregate_ensemble(SCORES, "min", 7.0), F.aggregate_ensemble(SCORES, "min"))
    # one member: no spread; float32 out of bf16 in
    assert torch.equal(F.ensemble_std(torch.tensor([[3.0, -1.0]])), torch.zeros(2))
    assert F.aggregate_ensemble(SCORES.bfloat16(), "mean").dtype == torch.float32


def test_a_non_finite_member_score_makes_the_aggregate_non_finite():
    scores = torch.tensor([[1.0, 2.0], [float("nan"), 1.0], [0.0, 3.0]])
    for aggregation in F.ENSEMBLE_AGGREGATIONS:
        out = F.aggregate_ensemble(scores, aggregation)
        assert math.isnan(out[0]) and math.isfinite(out[1]), aggregation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"aggregation": "median"}, "`aggregation` must be one of"),
        ({"aggregation": "mean_minus_std", "coef": -1.0}, "`coef` must be >= 0"),
        ({"aggregation": "mean_minus_std", "coef": float("inf")}, "`coef` must be finite"),
    ],
)
def test_aggregation_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        F.aggregate_ensemble(SCORES, **kwargs)


def test_scores_must_be_members_by_responses():
    with pytest.raises(ValueError, match=r"`scores` must be \(K, B\)"):
        F.aggregate_ensemble(torch.ones(4), "mean")
    with pytest.raises(ValueError, match=r"`scores` must be \(K, B\)"):
        F.ensemble_std(torch.ones(0, 3))


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.lists(st.floats(-100, 100), min_size=3, max_size=3), min_size=2, max_size=5), st.floats(0, 3)
)
def test_conservative_aggregates_never_exceed_the_mean(rows, coef):
    scores = torch.tensor(rows, dtype=torch.float64)  # (K, 3)
    mean = F.aggregate_ensemble(scores, "mean")
    for aggregation in ("min", "mean_minus_std", "mean_minus_var"):
        assert bool((F.aggregate_ensemble(scores, aggregation, coef) <= mean + 1e-9).all()), aggregation
    # members in any order give the same aggregate
    flipped = scores.flip(0)
    for aggregation in F.ENSEMBLE_AGGREGATIONS:
        torch.testing.assert_close(
            F.aggregate_ensemble(flipped, aggregation, coef), F.aggregate_ensemble(scores, aggregation, coef)
        )


def test_bootstrap_weights_are_poisson_counts_of_seed_and_row():
    rows = torch.arange(20000)
    weights = F.poisson_bootstrap_weights(rows, [0, 1, 2])  # (3, 20000)
    assert weights.shape == (3, 20000) and weights.dtype == torch.float32
    assert torch.equal(weights, weights.round()) and bool((weights >= 0).all())
    # Poisson(1): mean 1, variance 1, P(0) = e^-1 (20000 draws: standard errors ~0.007, 0.01, 0.0034)
    assert torch.allclose(weights.mean(1), torch.ones(3), atol=0.04)
    assert torch.allclose(weights.var(1), torch.ones(3), atol=0.06)
    assert torch.allclose((weights == 0).float().mean(1), torch.full((3,), math.exp(-1)), atol=0.02)
    # a function of (seed, row) alone: the same in any batch, order or epoch; members differ
    some = torch.tensor([7, 123, 5, 7])
    again = F.poisson_bootstrap_weights(some, [0, 1, 2])
    assert torch.equal(again, weights[:, [7, 123, 5, 7]])
    assert not torch.equal(weights[0], weights[1]) and not torch.equal(weights[1], weights[2])
    assert torch.equal(F.poisson_bootstrap_weights(some, torch.tensor([2])), weights[2:, [7, 123, 5, 7]])


def test_bootstrap_weights_refuse_bad_rows():
    with pytest.raises(ValueError, match="1-D integer tensor"):
        F.poisson_bootstrap_weights(torch.tensor([0.0, 1.0]), [0])
    with pytest.raises(ValueError, match=">= 0"):
        F.poisson_bootstrap_weights(torch.tensor([3, -1]), [0])


def test_weighted_pairwise_loss_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0])
    losses = -torch.nn.functional.logsigmoid(torch.tensor([1.0, 0.0, -1.0]))
    loss, _ = F.pairwise_reward_loss(chosen, rejected, weights=torch.tensor([2.0, 0.0, 1.0]))
    torch.testing.assert_close(loss, (2 * losses[0] + losses[2]) / 3)
    # weight 2 = the pair twice; weights of 1 = unweighted; all 0 = no loss
    twice, _ = F.pairwise_reward_loss(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    torch.testing.assert_close(loss, twice)
    plain, _ = F.pairwise_reward_loss(chosen, rejected)
    ones, _ = F.pairwise_reward_loss(chosen, rejected, weights=torch.ones(3))
    torch.testing.assert_close(ones, plain)
    zero, _ = F.pairwise_reward_loss(chosen, rejected, weights=torch.zeros(3))
    assert zero == 0.0
    with pytest.raises(ValueError, match="`weights` must be >= 0"):
        F.pairwise_reward_loss(chosen, rejected, weights=torch.tensor([1.0, -1.0, 1.0]))


def test_best_worst_pairs_by_hand():
    # K = 3: group 0 picks rows 1 (3.0) and 0 (1.0); group 1 ties; group 2's first maximum (row 6) and first
    # minimum (row 7); group 3's NaN row is dropped (keep), leaving rows 10 (4.0) and 11 (-1.0)
    scores = torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 5.0, 2.0, 0.0, 2.0, float("nan"), 4.0, -1.0])
    keep = torch.isfinite(scores)
    chosen, rejected, paired = F.best_worst_pairs(scores, 3, keep)
    assert paired.tolist() == [True, False, True, True]
    assert chosen[paired].tolist() == [1, 6, 10] and rejected[paired].tolist() == [0, 7, 11]
    # without keep a NaN row cannot be ranked: no pair for its group
    _, _, paired = F.best_worst_pairs(scores, 3)
    assert paired.tolist() == [True, False, True, False]
    # one kept response: no pair; K = 2 pairs a prompt's two responses
    _, _, paired = F.best_worst_pairs(torch.tensor([1.0, 2.0]), 2, torch.tensor([True, False]))
    assert paired.tolist() == [False]
    chosen, rejected, paired = F.best_worst_pairs(torch.tensor([0.5, -0.5, -2.0, 1.0]), 2)
    assert (chosen.tolist(), rejected.tolist(), paired.tolist()) == ([0, 3], [1, 2], [True, True])
    with pytest.raises(ValueError, match="`group_size` must be >= 2"):
        F.best_worst_pairs(scores, 1)
    with pytest.raises(ValueError, match="cannot be split into groups"):
        F.best_worst_pairs(scores, 5)


def test_kl_regularized_scores_by_hand_and_the_pairs_they_give():
    # K = 2, two prompts: scores 3.0 / 2.0 at KL 4.0 / 0.5 nats, and 1.0 / 0.0 at KL 0.0 / 0.0.
    scores, kl = torch.tensor([3.0, 2.0, 1.0, 0.0]), torch.tensor([4.0, 0.5, 0.0, 0.0])
    # coef 0.5: 3 - 2 = 1.0 < 2 - 0.25 = 1.75: the drifted response loses its pair; prompt 1 keeps its order
    ranked = F.kl_regularized_scores(scores, kl, 0.5)
    torch.testing.assert_close(ranked, torch.tensor([1.0, 1.75, 1.0, 0.0]))
    chosen, rejected, _ = F.best_worst_pairs(ranked, 2)
    assert (chosen.tolist(), rejected.tolist()) == ([1, 2], [0, 3])
    # coef 0.2 (3 - 0.8 = 2.2 > 2 - 0.1 = 1.9): the score still decides
    chosen, _, _ = F.best_worst_pairs(F.kl_regularized_scores(scores, kl, 0.2), 2)
    assert chosen.tolist() == [0, 2]
    # coef 0 is the score itself, even where the KL is not finite; at least float32 out of bf16 in
    torch.testing.assert_close(F.kl_regularized_scores(scores, torch.full((4,), float("inf")), 0.0), scores)
    assert F.kl_regularized_scores(scores.bfloat16(), kl.bfloat16(), 0.5).dtype == torch.float32
    with pytest.raises(ValueError, match="`coef` must be >= 0"):
        F.kl_regularized_scores(scores, kl, -0.1)
    with pytest.raises(ValueError, match="kl_regularized_scores"):
        F.kl_regularized_scores(scores, kl[:3], 0.5)


def test_standardised_members_by_hand():
    # member 1 is member 0 shifted by 9 and scaled by 10: standardised, the two agree exactly
    scores = torch.tensor([[1.0, 3.0], [10.0, 30.0]])  # (K=2, B=2)
    out = F.standardize_members(scores, torch.tensor([2.0, 20.0]), torch.tensor([1.0, 10.0]))
    # z = [[-1, 1], [-1, 1]]; back to the members' mean mean 11 and mean std 5.5
    torch.testing.assert_close(out, torch.tensor([[5.5, 16.5], [5.5, 16.5]]))
    assert torch.equal(F.ensemble_std(out), torch.zeros(2))
    # raw, their spread is mostly the offset between them
    torch.testing.assert_close(F.ensemble_std(scores), torch.tensor([4.5, 13.5]))


@settings(max_examples=50, deadline=None)
@given(
    K=st.integers(1, 5),
    B=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    shift=st.floats(-50, 50),
    scale=st.floats(0.1, 10),
)
def test_standardised_members_ignore_each_members_offset_and_scale(K, B, seed, shift, scale):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(K, B, generator=gen)
    means, stds = torch.randn(K, generator=gen), torch.rand(K, generator=gen) + 0.5
    base = F.standardize_members(scores, means, stds)
    # members with equal statistics are left as they are
    same = F.standardize_members(scores, means.new_full((K,), 0.3), stds.new_full((K,), 1.7))
    torch.testing.assert_close(same, scores, rtol=1e-5, atol=1e-5)
    # a member moved by any affine map, its statistics with it: its standard units are unchanged
    offsets = torch.randn(K, generator=gen) * shift
    moved = F.standardize_members(scores * scale + offsets[:, None], means * scale + offsets, stds * scale)
    z, z_moved = (base - base.mean()) / stds.mean(), (moved - moved.mean()) / (stds * scale).mean()
    torch.testing.assert_close(z_moved, z, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("means", "stds", "message"),
    [
        ([0.0], [1.0, 1.0], r"must have shape \(2,\)"),
        ([0.0, 0.0], [1.0, 0.0], "finite and > 0"),
        ([0.0, float("nan")], [1.0, 1.0], "finite and > 0"),
    ],
)
def test_standardised_members_refuse_bad_statistics(means, stds, message):
    with pytest.raises(ValueError, match=f"standardize_members: .*{message}"):
        F.standardize_members(torch.zeros(2, 3), torch.tensor(means), torch.tensor(stds))


def test_disagreement_loss_by_hand():
    # labelled: two members, texts (1, 3) and (1, 1): spreads 1 and 0 -> agree = (1 + 0) / 2 = 0.5 (eps aside)
    # unlabelled: spreads 0.5 (scores 0, 1) and 2 (scores -2, 2): relu(1 - 0.5) = 0.5, relu(1 - 2) = 0
    # -> disagree = 0.25; loss = 0.75
    labelled = torch.tensor([[1.0, 1.0], [3.0, 1.0]])
    unlabelled = torch.tensor([[0.0, -2.0], [1.0, 2.0]])
    loss = F.disagreement_loss(labelled, unlabelled, target=1.0, eps=1e-12)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss.item() == pytest.approx(0.75, abs=1e-5)


def test_disagreement_loss_gradients_pull_labelled_together_and_unlabelled_apart():
    labelled = torch.tensor([[0.0, 2.0], [1.0, 2.0]], requires_grad=True)
    unlabelled = torch.tensor([[0.0], [0.2]], requires_grad=True)
    F.disagreement_loss(labelled, unlabelled, target=1.0).backward()
    # text 0 of the labelled set: member 0 below member 1 -> its gradient step raises it, member 1's lowers
    assert labelled.grad[0, 0] < 0 < labelled.grad[1, 0]
    # the unlabelled text, spread 0.1 < target: a step moves the members apart
    assert unlabelled.grad[0, 0] > 0 > unlabelled.grad[1, 0]
    # a spread beyond the target adds nothing: no gradient
    far = torch.tensor([[-3.0], [3.0]], requires_grad=True)
    F.disagreement_loss(torch.zeros(2, 1), far, target=1.0).backward()
    assert torch.equal(far.grad, torch.zeros(2, 1))


def test_disagreement_loss_with_identical_members_has_finite_gradients():
    scores = torch.ones(3, 4, requires_grad=True)
    F.disagreement_loss(scores, scores, target=0.5).backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize(
    ("labelled", "unlabelled", "target", "message"),
    [
        (torch.zeros(3, 2), torch.zeros(2, 2), 1.0, "same number of members"),
        (torch.zeros(1, 2), torch.zeros(1, 2), 1.0, "K >= 2"),
        (torch.zeros(2, 2), torch.zeros(2, 2), 0.0, "`target` must be > 0"),
        (torch.zeros(4), torch.zeros(2, 2), 1.0, "must be \\(K, B\\)"),
    ],
)
def test_disagreement_loss_refuses_bad_arguments(labelled, unlabelled, target, message):
    with pytest.raises(ValueError, match=message):
        F.disagreement_loss(labelled, unlabelled, target)

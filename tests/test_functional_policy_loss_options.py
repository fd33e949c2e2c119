"""Policy-loss options of the 2025 papers, by hand: loss aggregations, clip-higher, GSPO, KL in the loss."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rlhf import functional as F

TOKEN_LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),  # every real token weighs the same
        ("seq_mean_token_mean", ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # per-response means, then their mean
        ("seq_mean_token_sum_norm", ((1 + 2 + 3) / 4 + 4 / 4) / 2),  # token sums / L = 4, then the mean
    ],
)
def test_aggregations_by_hand(aggregation, expected):
    got = F.aggregate_loss(TOKEN_LOSSES, MASK, aggregation, max_response_length=4)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", F.LOSS_AGGREGATIONS)
def test_micro_batch_weights_recompose_the_minibatch_loss(aggregation):
    torch.manual_seed(0)
    losses = torch.randn(6, 5)
    mask = torch.arange(5) < torch.tensor([5, 1, 3, 2, 4, 5]).unsqueeze(1)
    whole = F.aggregate_loss(losses, mask, aggregation, max_response_length=5)
    parts = sum(
        F.aggregation_weight(mask[rows], mask, aggregation)
        * F.aggregate_loss(losses[rows], mask[rows], aggregation, max_response_length=5)
        for rows in (slice(0, 4), slice(4, 6))
    )
    torch.testing.assert_close(parts, whole)


def test_aggregation_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown `loss_aggregation`"):
        F.aggregate_loss(TOKEN_LOSSES, MASK, "sum")
    with pytest.raises(ValueError, match="needs `max_response_length`"):
        F.aggregate_loss(TOKEN_LOSSES, MASK, "seq_mean_token_sum_norm")


def _one_token(log_ratio: float, advantage: float):
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    return logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1, dtype=torch.bool)


def test_clip_higher_by_hand():
    # r = 1.3, A = +1: the symmetric clip (0.2) caps the gain at 1.2, clip-higher (0.28) at 1.28.
    lp, old, adv, mask = _one_token(math.log(1.3), 1.0)
    sym, sym_stats = F.ppo_policy_loss(lp, old, adv, mask, clip_coef=0.2)
    high, _ = F.ppo_policy_loss(lp, old, adv, mask, clip_coef=0.2, clip_coef_high=0.28)
    assert sym.item() == pytest.approx(-1.2) and high.item() == pytest.approx(-1.28)
    assert sym_stats["clipfrac"].item() == 1.0
    # r = 0.7, A = -1: the lower bound 1 - 0.2 = 0.8 still applies with clip-higher: max(0.7, 0.8) = 0.8.
    lp, old, adv, mask = _one_token(math.log(0.7), -1.0)
    low, _ = F.ppo_policy_loss(lp, old, adv, mask, clip_coef=0.2, clip_coef_high=0.28)
    assert low.item() == pytest.approx(0.8)
    # r = 1.25, A = +1: inside the higher bound, so the gradient flows (d loss / d lp = -r).
    lp, old, adv, mask = _one_token(math.log(1.25), 1.0)
    loss, _ = F.ppo_policy_loss(lp, old, adv, mask, clip_coef=0.2, clip_coef_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25) and lp.grad.item() == pytest.approx(-1.25)


def test_sequence_level_ratio_is_the_geometric_mean_of_token_ratios():
    # GSPO: token log-ratios [0.1, 0.3] (third token padding) -> s = exp(0.2) on every real token.
    logprobs = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    old, adv = torch.zeros(1, 3), torch.ones(1, 3)
    mask = torch.tensor([[1, 1, 0]]).bool()
    loss, stats = F.ppo_policy_loss(
        logprobs, old, adv, mask, clip_coef=10.0, importance_sampling_level="sequence"
    )
    loss.backward()
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(-s)
    # d(-s)/d lp_t = -s / |y| for each real token, 0 on padding
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))
    # the token-level ratio stats are unchanged: mean(exp(0.1), exp(0.3))
    assert stats["ratio_mean"].item() == pytest.approx((math.exp(0.1) + math.exp(0.3)) / 2)
    clipped, clipped_stats = F.ppo_policy_loss(
        logprobs.detach(), old, adv, mask, clip_coef=0.1, importance_sampling_level="sequence"
    )
    assert clipped.item() == pytest.approx(-1.1) and clipped_stats["clipfrac"].item() == 1.0


def test_reference_kl_loss_k3_by_hand():
    # d = lp - ref = ln 2 -> k3 = exp(-d) - 1 + d = 0.5 - 1 + ln 2; d = 0 -> 0; padding (nan) ignored.
    logprobs = torch.tensor([[math.log(2.0), -1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]]).bool()
    loss, stats = F.reference_kl_loss(logprobs, ref, mask)
    expected = (0.5 - 1 + math.log(2.0)) / 2
    assert loss.item() == pytest.approx(expected) and stats["kl_loss"].item() == pytest.approx(expected)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp): 1 - 0.5 = 0.5 at the first token, 0 at the second, halved by the mean
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.25, 0.0, 0.0]]))
    seq, _ = F.reference_kl_loss(logprobs.detach(), ref, mask, loss_aggregation="seq_mean_token_sum_norm",
                                 max_response_length=4)  # fmt: skip
    assert seq.item() == pytest.approx((0.5 - 1 + math.log(2.0)) / 4)


def test_ppo_defaults_are_the_symmetric_token_mean_clip():
    torch.manual_seed(1)
    lp, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.arange(4) < torch.tensor([[4], [2], [3]])
    loss, _ = F.ppo_policy_loss(lp, old, adv, mask, clip_coef=0.2)
    r = torch.exp(lp - old)
    expected = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))[mask].mean()
    torch.testing.assert_close(loss, expected)

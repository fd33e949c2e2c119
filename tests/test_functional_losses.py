"""PPO-Clip, PPO-Penalty, clipped value loss and pairwise RM loss: hand values and gradients."""

import math

import pytest
import torch

from lit_rlhf.functional import (
    clipped_value_loss,
    kl_penalty_policy_loss,
    pairwise_reward_loss,
    ppo_policy_loss,
)

NAN = float("nan")
EPS = 0.2
# Three real tokens and one padded (garbage) token:
#   t0: ratio 1,   A =  2 -> inside the clip range
#   t1: ratio 1.5, A =  1 -> clipped to 1 + eps = 1.2
#   t2: ratio 0.5, A = -1 -> clipped to 1 - eps = 0.8
OLD = torch.tensor([[-1.0, -2.0, -0.5, NAN]])
LOG_RATIO = torch.tensor([[0.0, math.log(1.5), math.log(0.5), NAN]])
ADV = torch.tensor([[2.0, 1.0, -1.0, NAN]])
MASK = torch.tensor([[1, 1, 1, 0]])


def _leaf(x):
    return x.clone().requires_grad_()


def test_ppo_policy_loss_hand_computed():
    logprobs = _leaf(OLD + LOG_RATIO)
    loss, stats = ppo_policy_loss(logprobs, OLD, ADV, MASK, clip_coef=EPS)
    # t0: min(1 * 2, 1 * 2) = 2; t1: min(1.5 * 1, 1.2 * 1) = 1.2; t2: min(0.5 * -1, 0.8 * -1) = -0.8
    # loss = -(2 + 1.2 - 0.8) / 3 = -0.8
    torch.testing.assert_close(loss, torch.tensor(-0.8))
    expected = {
        "clipfrac": 2 / 3,  # t1 and t2 take the clipped term
        # 0.5 * (0 + 0.164402 + 0.480453) / 3
        "approx_kl": 0.5 * (0 + math.log(1.5) ** 2 + math.log(0.5) ** 2) / 3,
        "policy_kl": -(0 + math.log(1.5) + math.log(0.5)) / 3,  # -log(0.75) / 3 = 0.095894
        "ratio_mean": (1 + 1.5 + 0.5) / 3,
        "ratio_max": 1.5,
    }
    assert set(stats) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(stats[key], torch.tensor(value), msg=key)
        assert not stats[key].requires_grad and stats[key].dtype == torch.float32
    loss.backward()
    # d loss / d lp: t0 = -A * r / 3 = -2/3; clipped t1, t2 -> 0; padding -> exactly 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2 / 3, 0.0, 0.0, 0.0]]))


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([[0.3, -1.2, 2.0], [0.7, 5.0, -3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = ppo_policy_loss(OLD[:, :3].expand(2, 3), OLD[:, :3].expand(2, 3), adv, mask, clip_coef=EPS)
    # -(0.3 - 1.2 + 2.0 + 0.7) / 4 = -0.45
    torch.testing.assert_close(loss, torch.tensor(-0.45))
    assert stats["clipfrac"] == 0 and stats["approx_kl"] == 0 and stats["ratio_max"] == 1


@pytest.mark.parametrize(
    ("ratio", "advantage", "zero_grad"),
    [
        (1.5, 1.0, True),  # A > 0 and r > 1 + eps: improving further is not rewarded
        (0.5, -1.0, True),  # A < 0 and r < 1 - eps: same on the other side
        (1.1, 1.0, False),  # inside the clip range
        (0.5, 1.0, False),  # A > 0 but r < 1 - eps: moving back towards 1 is still pushed
        (1.5, -1.0, False),  # A < 0 but r > 1 + eps: the unclipped (larger) loss keeps its gradient
    ],
)
def test_policy_gradient_beyond_clip(ratio, advantage, zero_grad):
    old = torch.tensor([[-1.0]])
    logprobs = _leaf(old + math.log(ratio))
    loss, _ = ppo_policy_loss(logprobs, old, torch.tensor([[advantage]]), torch.ones(1, 1), clip_coef=EPS)
    loss.backward()
    if zero_grad:
        assert logprobs.grad.item() == 0.0
    else:
        # unclipped: d(-A * r) / d lp = -A * r
        assert logprobs.grad.item() == pytest.approx(-advantage * ratio)


def test_kl_penalty_policy_loss_hand_computed():
    logprobs = _leaf(OLD + LOG_RATIO)
    # beta = 0: the clip-free surrogate -mean(r * A) = -(1 * 2 + 1.5 * 1 + 0.5 * -1) / 3 = -1.0
    loss, stats = kl_penalty_policy_loss(logprobs, OLD, ADV, MASK, beta=0.0)
    torch.testing.assert_close(loss, torch.tensor(-1.0))
    assert set(stats) == {"approx_kl", "policy_kl", "ratio_mean", "ratio_max"}
    # beta = 0.5: kl_t = old - lp = (0, -log 1.5, -log 0.5) = (0, -0.405465, 0.693147), mean 0.287682 / 3
    # loss = -1.0 + 0.5 * 0.095894 = -0.952053
    loss, _ = kl_penalty_policy_loss(logprobs, OLD, ADV, MASK, beta=0.5)
    torch.testing.assert_close(loss, torch.tensor(-1.0 + 0.5 * -math.log(0.75) / 3))
    loss.backward()
    # d/d lp of -(r * A - beta * (old - lp)) / 3 = -(r * A + beta) / 3: -(2 + 0.5) / 3, -(1.5 + 0.5) / 3, -(-0.5 + 0.5) / 3
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.5 / 3, -2.0 / 3, 0.0, 0.0]]))


def test_clipped_value_loss_three_cases():
    # old value 1, return 2, eps 0.2 (trust region [0.8, 1.2]); seeds/000 cases:
    #   1. v = 1.1 inside:               (1.1 - 2)^2 = 0.81 both terms, gradient (v - R) = -0.9
    #   2. v = 0.5 outside, away from R: unclipped (0.5 - 2)^2 = 2.25 > clipped (0.8 - 2)^2 = 1.44, grad -1.5
    #   3. v = 1.5 outside, towards R:   clipped (1.2 - 2)^2 = 0.64 > unclipped (1.5 - 2)^2 = 0.25, grad 0
    values = _leaf(torch.tensor([[1.1, 0.5, 1.5, NAN]]))
    old = torch.tensor([[1.0, 1.0, 1.0, NAN]])
    returns = torch.tensor([[2.0, 2.0, 2.0, float("inf")]])
    loss, stats = clipped_value_loss(values, old, returns, MASK, clip_coef_value=EPS)
    # 0.5 * (0.81 + 2.25 + 0.64) / 3 = 0.616667
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.81 + 2.25 + 0.64) / 3))
    torch.testing.assert_close(stats["value_clipfrac"], torch.tensor(1 / 3))
    loss.backward()
    # 0.5 * 2 * (v - R) / 3 for cases 1 and 2, 0 for case 3 and the padding
    torch.testing.assert_close(values.grad, torch.tensor([[-0.9 / 3, -1.5 / 3, 0.0, 0.0]]))


def test_clipped_value_loss_without_clipping():
    values = torch.tensor([[3.0, -1.0]])
    loss, stats = clipped_value_loss(
        values, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), float("inf")
    )
    # plain 0.5 * MSE: 0.5 * (9 + 1) / 2 = 2.5
    torch.testing.assert_close(loss, torch.tensor(2.5))
    assert stats["value_clipfrac"] == 0


def test_pairwise_reward_loss_hand_computed():
    chosen = torch.tensor([2.0, 0.0], dtype=torch.bfloat16)
    rejected = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    loss, stats = pairwise_reward_loss(chosen, rejected)
    # diff (1, -1): (log(1 + e^-1) + log(1 + e^1)) / 2 = (0.313262 + 1.313262) / 2 = 0.813262
    torch.testing.assert_close(loss, torch.tensor(0.813262), atol=1e-6, rtol=0)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(stats["accuracy"], torch.tensor(0.5))
    torch.testing.assert_close(stats["margin_mean"], torch.tensor(0.0))
    # margin 0.5: diff - margin = (0.5, -1.5): (log(1 + e^-0.5) + log(1 + e^1.5)) / 2 = (0.474077 + 1.701413) / 2
    loss, stats = pairwise_reward_loss(chosen, rejected, margin=torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(loss, torch.tensor(1.087745), atol=1e-6, rtol=0)
    torch.testing.assert_close(pairwise_reward_loss(chosen, rejected, margin=0.5)[0], loss)
    torch.testing.assert_close(stats["accuracy"], torch.tensor(0.5))  # margin does not change accuracy


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda x: ppo_policy_loss(x, x, x, x, clip_coef=0.0), "clip_coef"),
        (lambda x: kl_penalty_policy_loss(x, x, x, x, beta=-1.0), "beta"),
        (lambda x: clipped_value_loss(x, x, x, x, clip_coef_value=-0.1), "clip_coef_value"),
        (lambda x: ppo_policy_loss(x, x[:, :1], x, x, 0.2), "`old_logprobs` has shape"),
        (lambda x: pairwise_reward_loss(x[0], x[0, :1]), "`rejected_scores` has shape"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.ones(2, 3))

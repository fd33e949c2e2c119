"""dpo_loss: hand-computed values of every loss type, gradients against beta, and invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import chosen_nll, dpo_loss, pairwise_reward_loss

# Two pairs (summed log-probs). Pair 0: policy log-ratios chosen +0.5, rejected -0.5, so h = 1.
# Pair 1: chosen -1, rejected +1, so h = -2 (the policy prefers the rejected response).
PC = torch.tensor([-1.0, -3.0])
PR = torch.tensor([-2.0, -1.0])
RC = torch.tensor([-1.5, -2.0])
RR = torch.tensor([-1.5, -2.0])


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def _leaf(x):
    return x.clone().requires_grad_()


def test_sigmoid_hand_computed():
    loss, stats = dpo_loss(PC, PR, RC, RR, beta=0.5)
    # -log sigmoid(0.5 * 1) = log(1 + e^-0.5) = 0.474077; -log sigmoid(0.5 * -2) = log(1 + e) = 1.313262
    torch.testing.assert_close(loss, torch.tensor((softplus(-0.5) + softplus(1.0)) / 2))
    torch.testing.assert_close(loss, torch.tensor(0.8936693))
    expected = {
        "rewards/chosen": 0.5 * (0.5 + -1.0) / 2,  # beta * (pc - rc), mean over pairs
        "rewards/rejected": 0.5 * (-0.5 + 1.0) / 2,
        "rewards/margins": 0.5 * (1.0 + -2.0) / 2,
        "rewards/accuracies": 0.5,  # pair 0 only
        "logps/chosen": -2.0,
        "logps/rejected": -1.5,
    }
    assert set(stats) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(stats[key], torch.tensor(value), msg=key)
        assert stats[key].dtype == torch.float32 and not stats[key].requires_grad


def test_label_smoothing_is_conservative_dpo():
    loss, _ = dpo_loss(PC[:1], PR[:1], RC[:1], RR[:1], beta=0.5, label_smoothing=0.1)
    # 0.9 * log(1 + e^-0.5) + 0.1 * log(1 + e^0.5) = 0.9 * 0.474077 + 0.1 * 0.974077 = 0.524077
    torch.testing.assert_close(loss, torch.tensor(0.9 * softplus(-0.5) + 0.1 * softplus(0.5)))
    torch.testing.assert_close(loss, torch.tensor(0.5240770))


def test_ipo_hand_computed():
    # beta = 0.5: target 1 / (2 beta) = 1; pair 0 sits on it (h = 1), pair 1 is 3 below (h = -2)
    loss, stats = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")
    torch.testing.assert_close(loss, torch.tensor((0.0 + 9.0) / 2))
    torch.testing.assert_close(stats["rewards/margins"], torch.tensor(-0.25))


def test_simpo_hand_computed():
    # length-averaged log-probs; beta = 2, gamma = 0.5: logits = 2 * (-0.5 - -1.0) - 0.5 = 0.5
    pc, pr = torch.tensor([-0.5]), torch.tensor([-1.0])
    loss, stats = dpo_loss(pc, pr, None, None, beta=2.0, loss_type="simpo", simpo_gamma=0.5)
    torch.testing.assert_close(loss, torch.tensor(softplus(-0.5)))
    torch.testing.assert_close(stats["rewards/chosen"], torch.tensor(-1.0))  # beta * pc, reference-free
    torch.testing.assert_close(stats["rewards/rejected"], torch.tensor(-2.0))
    torch.testing.assert_close(stats["rewards/accuracies"], torch.tensor(1.0))
    # label smoothing: 0.8 * log(1 + e^-0.5) + 0.2 * log(1 + e^0.5)
    loss, _ = dpo_loss(pc, pr, None, None, beta=2.0, loss_type="simpo", simpo_gamma=0.5, label_smoothing=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.8 * softplus(-0.5) + 0.2 * softplus(0.5)))


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_sigmoid_gradient_sign_and_size_scale_with_beta(beta):
    # At h = 0: d/dpc -log sigmoid(beta h) = -beta * sigmoid(0) = -beta / 2, and +beta / 2 for pr.
    pc, pr, zero = _leaf(torch.zeros(1)), _leaf(torch.zeros(1)), torch.zeros(1)
    loss, _ = dpo_loss(pc, pr, zero, zero, beta=beta)
    loss.backward()
    torch.testing.assert_close(pc.grad, torch.tensor([-beta / 2]))  # descent raises the chosen log-prob
    torch.testing.assert_close(pr.grad, torch.tensor([beta / 2]))  # and lowers the rejected one


def test_sigmoid_gradient_fades_once_pair_is_won():
    # d/dpc = -beta * sigmoid(-beta h): at h = 10, beta = 1 it is -sigmoid(-10) = -4.54e-5
    pc, zero = _leaf(torch.tensor([10.0])), torch.zeros(1)
    dpo_loss(pc, zero, zero, zero, beta=1.0)[0].backward()
    torch.testing.assert_close(pc.grad, torch.tensor([-1.0 / (1.0 + math.exp(10.0))]))


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_ipo_gradient_is_inverse_in_beta_and_reverses_past_target(beta):
    # d/dpc (h - 1/(2 beta))^2 = 2 (h - 1/(2 beta)): at h = 0 it is -1/beta (a smaller beta pulls harder)
    pc, zero = _leaf(torch.zeros(1)), torch.zeros(1)
    dpo_loss(pc, zero, zero, zero, beta=beta, loss_type="ipo")[0].backward()
    torch.testing.assert_close(pc.grad, torch.tensor([-1.0 / beta]))
    # past the target (h = 1 / beta > 1 / (2 beta)) the gradient pushes h back: 2 * (1/beta - 1/(2 beta))
    pc = _leaf(torch.tensor([1.0 / beta]))
    dpo_loss(pc, zero, zero, zero, beta=beta, loss_type="ipo")[0].backward()
    torch.testing.assert_close(pc.grad, torch.tensor([1.0 / beta]))


def test_float32_from_bfloat16():
    loss, stats = dpo_loss(*(t.bfloat16() for t in (PC, PR, RC, RR)), beta=0.5)
    assert loss.dtype == torch.float32 and stats["logps/chosen"].dtype == torch.float32


logps = st.lists(st.floats(-50.0, 0.0), min_size=4, max_size=4)


@settings(max_examples=50, deadline=None)
@given(st.lists(logps, min_size=1, max_size=6), st.floats(0.01, 5.0))
def test_sigmoid_equals_pairwise_reward_loss_of_implicit_rewards(rows, beta):
    pc, pr, rc, rr = torch.tensor(rows, dtype=torch.float64).T
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=beta)
    rm_loss, rm_stats = pairwise_reward_loss(beta * (pc - rc), beta * (pr - rr))
    torch.testing.assert_close(loss, rm_loss)
    torch.testing.assert_close(stats["rewards/accuracies"], rm_stats["accuracy"])
    torch.testing.assert_close(stats["rewards/margins"], rm_stats["margin_mean"])


@settings(max_examples=50, deadline=None)
@given(st.lists(logps, min_size=1, max_size=6), st.floats(0.01, 5.0), st.floats(0.0, 0.49))
def test_label_smoothing_adds_eps_beta_h(rows, beta, eps):
    # log(1 + e^x) = x + log(1 + e^-x), so cDPO = DPO + eps * beta * mean(h): linear in eps
    pc, pr, rc, rr = torch.tensor(rows, dtype=torch.float64).T
    plain, _ = dpo_loss(pc, pr, rc, rr, beta=beta)
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    h = (pc - rc) - (pr - rr)
    torch.testing.assert_close(smoothed, plain + eps * beta * h.mean())


@settings(max_examples=50, deadline=None)
@given(st.lists(logps, min_size=1, max_size=6), st.floats(0.01, 5.0), st.floats(-20.0, 20.0))
def test_shifting_policy_and_reference_together_changes_nothing(rows, beta, shift):
    # Only log-ratios enter DPO and IPO: adding a constant to a response's policy and reference log-probs
    # (e.g. a shared prefix token) leaves loss and rewards unchanged.
    pc, pr, rc, rr = torch.tensor(rows, dtype=torch.float64).T
    for loss_type in ("sigmoid", "ipo"):
        a, sa = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type)
        b, sb = dpo_loss(pc + shift, pr - shift, rc + shift, rr - shift, beta=beta, loss_type=loss_type)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(sa["rewards/margins"], sb["rewards/margins"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(loss_type="hinge"), "loss_type"),
        (dict(beta=0.0), "beta"),
        (dict(label_smoothing=0.5), "label_smoothing"),
        (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
        (dict(simpo_gamma=0.5), "simpo_gamma"),
        (dict(loss_type="simpo"), "must be None"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    kwargs = {"beta": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        dpo_loss(PC, PR, RC, RR, **kwargs)


def test_bad_shapes_and_missing_reference():
    with pytest.raises(ValueError, match="are required"):
        dpo_loss(PC, PR, None, None, beta=0.1)
    with pytest.raises(ValueError, match="ref_rejected_logps"):
        dpo_loss(PC, PR, RC, RR[:1], beta=0.1)
    with pytest.raises(ValueError, match="1-D"):
        dpo_loss(PC[None], PR[None], RC[None], RR[None], beta=0.1)


def test_chosen_nll_hand_computed():
    # -(-6 / 3) = 2 and -(-1 / 2) = 0.5: mean 1.25; a zero token count is taken as one token
    assert chosen_nll(torch.tensor([-6.0, -1.0]), torch.tensor([3, 2])).item() == pytest.approx(1.25)
    assert chosen_nll(torch.tensor([-2.0]), torch.tensor([0])).item() == pytest.approx(2.0)
    logps = torch.tensor([-6.0, -1.0], dtype=torch.bfloat16, requires_grad=True)
    nll = chosen_nll(logps, torch.tensor([3, 2]))
    nll.backward()
    assert nll.dtype == torch.float32
    # d/d logp_i of mean(-logp_i / n_i) = -1 / (2 n_i): raising a chosen log-prob lowers the term
    torch.testing.assert_close(logps.grad.float(), torch.tensor([-1 / 6, -1 / 4]), atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="chosen_nll"):
        chosen_nll(torch.zeros(2), torch.ones(3))


def test_pairwise_reward_loss_refuses_a_margin_that_would_broadcast():
    chosen, rejected = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.5, 4.0])
    with pytest.raises(ValueError, match=r"`margin` has shape \(3, 1\) but `chosen_scores` has shape \(3,\)"):
        pairwise_reward_loss(chosen, rejected, margin=torch.ones(3, 1))
    per_pair, _ = pairwise_reward_loss(chosen, rejected, margin=torch.ones(3))
    scalar, _ = pairwise_reward_loss(chosen, rejected, margin=torch.tensor(1.0))  # a 0-d margin is one number
    assert per_pair == scalar

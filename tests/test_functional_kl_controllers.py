"""KL controllers: hand-computed updates, state_dict round trip, argument checks."""

import pytest

from lit_rlhf.functional import AdaptiveKLController, FixedKLController, KLController, PPOPenaltyKLController


def test_fixed_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 256)
    ctl.update(0.0, 256)
    assert ctl.value == 0.05
    assert FixedKLController(0.0).value == 0.0  # 0 turns the penalty off


def test_adaptive_hand_computed():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    # kl 9: error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; factor 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.2 * 1.00512)  # 0.201024
    # kl 5.4: error = 5.4/6 - 1 = -0.1 (inside the clip); factor 1 - 0.1 * 1000 / 10000 = 0.99
    ctl.update(5.4, 1000)
    assert ctl.value == pytest.approx(0.201024 * 0.99)  # 0.19901376
    # kl 0: error clipped to -0.2; factor 1 - 0.2 * 10000 / 10000 = 0.8
    ctl.update(0.0, 10000)
    assert ctl.value == pytest.approx(0.19901376 * 0.8)
    # kl on target: unchanged
    before = ctl.value
    ctl.update(6.0, 500)
    assert ctl.value == pytest.approx(before)


def test_adaptive_floor_makes_it_one_sided():
    ctl = AdaptiveKLController(init_kl_coef=0.5, target=3.0, horizon=100, floor=0.5)
    ctl.update(0.0, 50)  # below target: 0.5 * (1 - 0.2 * 0.5) = 0.45, held at the floor
    assert ctl.value == 0.5
    ctl.update(6.0, 50)  # above: 0.5 * 1.1
    assert ctl.value == pytest.approx(0.55)
    ctl.update(0.0, 50)  # down again, to 0.55 * 0.9 = 0.495, held at 0.5
    assert ctl.value == 0.5
    lower = AdaptiveKLController(init_kl_coef=0.5, target=3.0, horizon=100, floor=0.46)
    lower.update(0.0, 50)
    lower.update(0.0, 50)  # 0.45, then 0.405: held at 0.46
    assert lower.value == pytest.approx(0.46)


def test_ppo_penalty_hand_computed():
    ctl = PPOPenaltyKLController(init_beta=1.0, target=0.015)
    ctl.update(0.005, 1)  # 0.005 < 0.015 / 1.5 = 0.01: halve
    assert ctl.value == 0.5
    ctl.update(0.015, 1)  # within [0.01, 0.0225]: unchanged
    assert ctl.value == 0.5
    ctl.update(0.03, 1)  # 0.03 > 0.015 * 1.5 = 0.0225: double
    assert ctl.value == 1.0
    ctl.update(0.0225, 1)  # boundaries are not crossed (strict inequalities)
    ctl.update(0.015 / 1.5, 1)
    assert ctl.value == 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: FixedKLController(0.1),
        lambda: AdaptiveKLController(0.1, target=6.0, horizon=10000),
        lambda: PPOPenaltyKLController(0.1, target=0.01),
    ],
)
def test_state_dict_round_trip(make):
    ctl = make()
    ctl.update(20.0, 5000)
    ctl.update(25.0, 5000)
    state = ctl.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.value == ctl.value
    ctl.update(0.001, 3000)
    resumed.update(0.001, 3000)
    assert resumed.value == ctl.value
    assert isinstance(resumed, KLController)
    with pytest.raises(KeyError, match="value"):
        resumed.load_state_dict({})


def test_a_resumed_fixed_coefficient_is_the_configured_one():
    saved = FixedKLController(0.05).state_dict()
    resumed = FixedKLController(0.5)  # the resumed run's kl.coef
    resumed.load_state_dict(saved)
    assert resumed.value == 0.5
    with pytest.raises(KeyError, match="value"):
        resumed.load_state_dict({})


def test_a_resumed_adaptive_coefficient_is_at_least_the_configured_floor():
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=100, floor=0.1)
    ctl.update(20.0, 50)
    assert ctl.value == pytest.approx(0.11)
    raised = AdaptiveKLController(0.5, target=6.0, horizon=100, floor=0.5)
    raised.load_state_dict(ctl.state_dict())
    assert raised.value == 0.5  # lifted to the new floor
    lowered = AdaptiveKLController(0.01, target=6.0, horizon=100, floor=0.01)
    lowered.load_state_dict(ctl.state_dict())
    assert lowered.value == pytest.approx(0.11)  # above its floor: the adapted coefficient goes on


def test_adaptive_moves_towards_target_over_many_updates():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    for _ in range(20):
        ctl.update(3.0, 50)  # KL above target: the coefficient keeps growing
    assert ctl.value == pytest.approx(0.1 * 1.1**20)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FixedKLController(-0.1), "kl_coef"),
        (lambda: AdaptiveKLController(0.0, 6.0, 10000), "init_kl_coef"),
        (lambda: AdaptiveKLController(0.1, -1.0, 10000), "target"),
        (lambda: AdaptiveKLController(0.1, 6.0, 0), "horizon"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10, floor=0.2), "floor"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10, floor=-0.1), "floor"),
        (lambda: PPOPenaltyKLController(0.0, 0.01), "init_beta"),
        (lambda: PPOPenaltyKLController(1.0, 0.0), "target"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(float("nan"), 1), "current_kl"),
        (lambda: PPOPenaltyKLController(1.0, 0.01).update(0.1, -1), "n_steps"),
        (lambda: AdaptiveKLController(0.1, 6.0, 10).update(0.0, 60), "n_steps=60 is too large"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()

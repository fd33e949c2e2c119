"""KL coefficient controllers: fixed, adaptive (Ziegler et al. 2019) and PPO-Penalty (Schulman et al. 2017).

A controller holds the current coefficient in ``.value``; the PPO module calls
``update(current_kl, n_steps)`` once per rollout and stores ``state_dict()`` in its checkpoint so a
resumed run continues with the same coefficient. Only an adapted coefficient is state: the hyperparameters
come from the (possibly changed) configuration of the resumed run, and so does a fixed coefficient (a run resumed
with another ``kl.coef`` uses it) and an adaptive one's floor (a coefficient saved below a raised floor is lifted
to it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

from lit_rlhf.functional._checks import check_number

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController", "PPOPenaltyKLController"]


class KLController(ABC):
    """Base class: ``.value`` is the current coefficient."""

    def __init__(self, value: float) -> None:
        self.value = float(value)

    @abstractmethod
    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt ``value`` to the KL measured on the last rollout of ``n_steps`` samples."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "value" not in state_dict:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: missing key 'value' in {sorted(state_dict)}"
            )
        self.value = float(state_dict["value"])

    def _check_update(self, current_kl: float, n_steps: int) -> float:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise ValueError(f"{type(self).__name__}.update: `current_kl` must be finite, got {current_kl}")
        if n_steps < 0:
            raise ValueError(f"{type(self).__name__}.update: `n_steps` must be >= 0, got {n_steps}")
        return current_kl

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value})"


class FixedKLController(KLController):
    """A constant coefficient; ``update`` leaves it unchanged.

    Args:
        kl_coef: >= 0 (0 turns the KL penalty off).
    """

    def __init__(self, kl_coef: float) -> None:
        check_number("FixedKLController", "kl_coef", kl_coef, low=0.0, low_inclusive=True)
        super().__init__(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        self._check_update(current_kl, n_steps)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Checks the state's layout and keeps the configured coefficient: a fixed one is a setting, not state."""
        configured = self.value
        super().load_state_dict(state_dict)
        self.value = configured


class AdaptiveKLController(KLController):
    """Proportional controller of Ziegler et al. 2019.

    "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593, sec. 2.2:

    error = clip(KL / target - 1, -0.2, 0.2);   value <- max(value * (1 + error * n_steps / horizon), floor).

    Args:
        init_kl_coef: > 0 starting coefficient.
        target: > 0 KL (nats per sequence, as measured by the caller) to steer towards.
        horizon: > 0 number of samples over which an error is corrected (Ziegler et al. use 10000); an
            ``update`` of ``n_steps`` >= 5 x horizon samples with the error at -0.2 is refused.
        floor: in [0, init_kl_coef], the least value (0: none, as in the paper). A floor at the start makes the
            controller one-sided: it only ever raises the coefficient above where it began.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float, floor: float = 0.0) -> None:
        name = "AdaptiveKLController"
        check_number(name, "init_kl_coef", init_kl_coef, low=0.0, low_inclusive=False)
        check_number(name, "target", target, low=0.0, low_inclusive=False)
        check_number(name, "horizon", horizon, low=0.0, low_inclusive=False)
        check_number(name, "floor", floor, low=0.0, low_inclusive=True, high=init_kl_coef)
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)
        self.floor = float(floor)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = self._check_update(current_kl, n_steps)
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        factor = 1.0 + error * n_steps / self.horizon
        if factor <= 0:
            # Only reachable when n_steps >= 5 * horizon: the coefficient would reach 0 or flip sign (the online
            # modules refuse such a kl.horizon when the fit starts: OnlineUpdate.check_kl_horizon_fit).
            raise ValueError(
                f"AdaptiveKLController.update: n_steps={n_steps} is too large for horizon={self.horizon} "
                f"(factor {factor} <= 0); use n_steps < 5 * horizon"
            )
        self.value = max(self.value * factor, self.floor)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved coefficient, at least the configured ``floor``."""
        super().load_state_dict(state_dict)
        self.value = max(self.value, self.floor)


class PPOPenaltyKLController(KLController):
    """Adaptive beta of PPO-Penalty (Schulman et al. 2017, arXiv 1707.06347, sec. 4).

    With d the measured KL(pi_old || pi_theta): beta <- beta / 2 if d < target / 1.5,
    beta <- beta * 2 if d > target * 1.5, unchanged otherwise. ``n_steps`` is not used.

    Args:
        init_beta: > 0 starting coefficient.
        target: > 0 the d_targ of the paper.
    """

    def __init__(self, init_beta: float, target: float) -> None:
        check_number("PPOPenaltyKLController", "init_beta", init_beta, low=0.0, low_inclusive=False)
        check_number("PPOPenaltyKLController", "target", target, low=0.0, low_inclusive=False)
        super().__init__(init_beta)
        self.target = float(target)

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = self._check_update(current_kl, n_steps)
        if current_kl < self.target / 1.5:
            self.value /= 2.0
        elif current_kl > self.target * 1.5:
            self.value *= 2.0

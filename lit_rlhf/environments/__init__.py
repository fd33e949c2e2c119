"""Multi-turn environments and tools for the online modules (``environment=`` of PPO and the critic-free
family): the :class:`Environment` interface, :class:`ToolEnvironment` for plain-function tools, and the
rollout that alternates engine generation and environment steps (:func:`run_episodes`)."""

from lit_rlhf.environments.base import Environment, StepResult, check_reset, check_step, import_environment
from lit_rlhf.environments.rollout import (
    ENDED,
    EPISODE_METRICS,
    Episodes,
    left_pad,
    open_episodes,
    run_episodes,
)
from lit_rlhf.environments.settings import EnvironmentSettings
from lit_rlhf.environments.tools import ToolCallError, ToolEnvironment

__all__ = [
    "ENDED",
    "EPISODE_METRICS",
    "Environment",
    "EnvironmentSettings",
    "Episodes",
    "StepResult",
    "ToolCallError",
    "ToolEnvironment",
    "check_reset",
    "check_step",
    "import_environment",
    "left_pad",
    "open_episodes",
    "run_episodes",
]

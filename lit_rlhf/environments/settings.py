"""The ``environment`` settings group of the online modules: which environment, and how long an episode runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lit_rlhf.settings import Settings

__all__ = ["EnvironmentSettings"]


@dataclass
class EnvironmentSettings(Settings):
    """A multi-turn environment for the rollouts (``lit_rlhf.environments``); ``env`` None = single-turn.

    Each model turn is sampled under the module's ``generation`` settings (``max_new_tokens`` is the
    length limit of one turn); these fields bound the episode.

    Attributes:
        env: ``package.module:Class`` of the environment (an :class:`~lit_rlhf.environments.Environment`),
            one instance per episode; None = no environment (one response per prompt row). A plain string
            given for the whole group is read as this field.
        kwargs: keyword arguments of every instance's constructor.
        max_turns: the most model turns of an episode (>= 1); an episode still running after them ends
            (counted as ``rollout/episode_max_turns``).
        max_total_tokens: the most response-side tokens of an episode, the model's and the observations'
            together (None = ``max_turns`` x ``generation.max_new_tokens``); an episode that reaches it ends
            there, cut mid-turn if need be, as truncated (``rollout/episode_length_limit``).
        stop_strings: strings that end a model turn besides EOS and ``generation.stop_strings`` (e.g.
            ``"</tool_call>"``): the environment answers the turn there.
    """

    group: ClassVar[str] = "environment"

    env: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 4
    max_total_tokens: int | None = None
    stop_strings: list[str] = field(default_factory=list)

    @classmethod
    def coerce(cls, value: Any, argument: str | None = None) -> EnvironmentSettings:
        if isinstance(value, str):  # environment: package.module:Class
            value = {"env": value}
        return super().coerce(value, argument)

    def __post_init__(self) -> None:
        ok = self.env is None or (isinstance(self.env, str) and all(self.env.partition(":")[::2]) and ":" in self.env)
        self.require("env", ok, "'package.module:Class' or None")
        self.require("kwargs", isinstance(self.kwargs, Mapping), "a mapping of constructor arguments")
        self.require("max_turns", isinstance(self.max_turns, int) and self.max_turns >= 1, "an integer >= 1")
        ok = self.max_total_tokens is None or (isinstance(self.max_total_tokens, int) and self.max_total_tokens >= 1)
        self.require("max_total_tokens", ok, "an integer >= 1 or None")
        ok = isinstance(self.stop_strings, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop_strings)
        self.require("stop_strings", ok, "a list of non-empty strings")
        self.kwargs, self.stop_strings = dict(self.kwargs), list(self.stop_strings)

    @property
    def enabled(self) -> bool:
        return self.env is not None

    def token_budget(self, max_new_tokens: int) -> int:
        """The episode's response-side token limit under a per-turn limit of ``max_new_tokens``."""
        return self.max_total_tokens if self.max_total_tokens is not None else self.max_turns * max_new_tokens

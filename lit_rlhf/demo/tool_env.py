"""The calculator environment of the tool world (``lit_rlhf.demo.tool_env:Calculator``).

A config names it on an online module with the stop string that ends a call::

    environment:
      env: lit_rlhf.demo.tool_env:Calculator
      max_turns: 3
      max_total_tokens: 64
      stop_strings: ["</calc>"]

Each model turn that ends with ``<calc> EXPRESSION </calc>`` is answered with ``" = VALUE"`` (a call; a
malformed expression gets ``" = error"``, a failed call); any other turn is the final answer and ends the
episode. The calculator gives no reward: the episode is scored by the module's ``reward_fn``
(``lit_rlhf.demo.tool_world:exact_match``) on the whole transcript, the same reward as a run without the
tool. See :mod:`lit_rlhf.demo.tool_world` for the answer format.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lit_rlhf.demo.tool_world import ERROR_OBSERVATION, tool_call
from lit_rlhf.environments import Environment, StepResult


class Calculator(Environment):
    """One episode with a calculator: a call gets its value, anything else ends the episode.

    Args:
        error_observation: what a call with a malformed expression (or without ``<calc>``) gets back.
    """

    def __init__(self, error_observation: str = ERROR_OBSERVATION) -> None:
        if not isinstance(error_observation, str) or not error_observation:
            raise ValueError(f"Calculator: error_observation must be a non-empty string, got {error_observation!r}")
        self.error_observation = error_observation
        self.calls = 0

    @override
    def reset(self, row: dict[str, Any]) -> None:
        self.calls = 0
        return None  # the dataset's prompt (the word problem) opens the episode

    @override
    def step(self, response: str) -> StepResult:
        observation, is_call = tool_call(response)
        if not is_call:
            return StepResult(None, done=True)
        self.calls += 1
        if observation == ERROR_OBSERVATION:
            return StepResult(self.error_observation, tool_call=True, tool_error=True)
        return StepResult(observation, tool_call=True)

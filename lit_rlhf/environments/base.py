"""What a multi-turn environment is: ``reset(row)`` opens an episode, ``step(response)`` answers each model turn.

A user writes a class with these two methods (or subclasses :class:`~lit_rlhf.environments.ToolEnvironment`
and passes plain Python functions as tools) and names it in a config as ``package.module:Class``, as reward
functions are named. The rollout (:func:`lit_rlhf.environments.run_episodes`) makes one instance per episode
(each of a prompt's K samples gets its own), so an instance may keep the episode's state in ``self``.

Token-in, token-out: the model's tokens are kept as sampled, and an observation is tokenised once, on its
own, and appended after them. The transcript is never re-tokenised from text, which would change the tokens
the log-probs are computed on.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lit_rlhf.reward_fns import import_object

__all__ = ["Environment", "StepResult", "check_reset", "check_step", "import_environment"]


class StepResult(NamedTuple):
    """What :meth:`Environment.step` returns after a model turn (a plain 3-tuple ``(observation, reward,
    done)`` is accepted too).

    Attributes:
        observation: text appended to the transcript after the model's turn (tokenised once, without special
            tokens), a list of token ids appended as they are (e.g. a chat template's tool-message tokens),
            or None: the episode ends.
        reward: this turn's reward; the episode's score is the sum of its turns' rewards (plus the
            ``reward_fn`` / ``reward_model`` score of the whole transcript when the module has one).
        done: the episode ends after this turn (its observation, if any, is not appended).
        tool_call: the turn called a tool (counted as ``rollout/tool_calls``).
        tool_error: the call failed: an unknown tool, bad arguments, or the tool raised
            (``rollout/tool_errors``).
    """

    observation: str | list[int] | None
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False


class Environment(ABC):
    """One episode of a multi-turn task: the model talks, the environment answers.

    Example (a guessing game; the episode ends when the model names the number)::

        class Guess(Environment):
            def reset(self, row):
                self.secret = int(row["secret"])        # a column of the prompt row
                return None                             # keep the dataset's prompt

            def step(self, response):
                guess = int(response.split()[-1]) if response.split()[-1].isdigit() else None
                if guess == self.secret:
                    return StepResult(None, reward=1.0, done=True)
                return StepResult(" higher:" if guess is None or guess < self.secret else " lower:")
    """

    def reset(self, row: dict[str, Any]) -> str | list[dict] | None:
        """Open the episode of one prompt row.

        Args:
            row: the prompt row's columns (``lit_rlhf.data.PromptDataModule``'s extra columns, e.g. the
                gold answer) and ``prompt``, the row's prompt text.

        Returns:
            None to keep the dataset's prompt; a string, the prompt text (tokenised as the prompt data
            are, with the tokenizer's special tokens); or chat messages (``[{"role": "user", "content":
            ...}]``), rendered by the tokenizer's chat template with the generation prompt and, for a
            :class:`ToolEnvironment`, its tools.
        """
        return None

    @abstractmethod
    def step(self, response: str) -> StepResult | tuple:
        """Answer the model's last turn (its decoded text, special tokens skipped): a :class:`StepResult`."""

    def close(self) -> None:
        """Release what the episode holds (called once the episode has ended); optional."""
        return None


def import_environment(path: str, argument: str = "environment.env") -> type[Environment]:
    """Import ``package.module:Class``; errors name ``argument``, the module and what went wrong."""
    cls = import_object(path, argument, "Class")
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise TypeError(
            f"{argument} {path!r}: expected a class with reset(row) and step(response) (e.g. a subclass of "
            f"lit_rlhf.environments.Environment), got {type(cls).__name__}"
        )
    return cls


def check_reset(value: Any, where: str) -> str | list[dict] | None:
    """``reset``'s return value, checked: None, a string, or a list of ``{role, content}`` messages."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and "role" in m for m in value):
        return list(value)
    raise TypeError(
        f"{where}: reset must return None, the prompt text or a list of chat messages ({{role, content}} "
        f"dicts), got {value!r:.200}"
    )


def check_step(value: Any, where: str) -> StepResult:
    """``step``'s return value as a :class:`StepResult`; anything else is refused naming ``where``."""
    if isinstance(value, tuple) and not isinstance(value, StepResult) and len(value) in (3, 4, 5):
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise TypeError(
            f"{where}: step must return a StepResult or an (observation, reward, done) tuple, got {value!r:.200}"
        )
    observation, reward = value.observation, value.reward
    ok = observation is None or isinstance(observation, str) or (
        isinstance(observation, Sequence)
        and not isinstance(observation, (bytes, bytearray))  # bytes are text to decode, not token ids
        and all(isinstance(t, numbers.Integral) and t >= 0 for t in observation)
    )
    if not ok:
        raise TypeError(
            f"{where}: the observation must be a string, a list of token ids or None, got {observation!r:.200}"
        )
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"{where}: the reward must be a finite number, got {reward!r}")
    for name in ("done", "tool_call", "tool_error"):  # numpy's bools and ints too (np.isclose(...) is one)
        if not isinstance(getattr(value, name), (bool, numbers.Integral, np.bool_)):
            raise TypeError(f"{where}: {name} must be a bool, got {getattr(value, name)!r}")
    return value._replace(reward=float(reward), done=bool(value.done), tool_call=bool(value.tool_call),
                          tool_error=bool(value.tool_error))  # fmt: skip

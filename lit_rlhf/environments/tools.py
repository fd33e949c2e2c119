"""Tools as plain Python functions: an environment that runs the model's tool calls and returns their results.

A tool is a function with type hints and a Google-style docstring; Hugging Face's ``get_json_schema`` turns
it into the JSON schema a chat template shows the model (``apply_chat_template(..., tools=...)``), so a
tool the template cannot describe is refused when the environment is built. The default call format is the
Hermes / Qwen one, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, and the result comes back
as ``<tool_response>...</tool_response>``; a subclass changes either by overriding :meth:`parse_call` or
:meth:`format_result`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from lit_rlhf.environments.base import Environment, StepResult
from lit_rlhf.reward_fns import import_object

__all__ = ["ToolCallError", "ToolEnvironment"]

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


class ToolCallError(ValueError):
    """The model's tool call cannot be run (malformed, unknown tool, bad arguments)."""


# a JSON-schema type (as transformers' get_json_schema describes a tool's typed arguments) -> a value's check
JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class ToolEnvironment(Environment):
    """Calls the model's tools turn by turn; a turn without a tool call is the final answer (done).

    Args:
        tools: the tool functions, or ``package.module:function`` names of them (from a config); a
            subclass may set them as the class attribute ``tools`` instead.
        result_template: how a result is shown to the model (``{result}`` is replaced).

    The final turn's reward is :meth:`final_reward` (0 by default: score the transcript with the
    module's ``reward_fn`` instead, e.g. ``lit_rlhf.verifiable.accuracy``). A failed call is answered with
    ``error: <why>`` and counted as a tool error; the episode goes on.

    Example::

        def multiply(a: int, b: int) -> int:
            \"\"\"Multiply two integers.

            Args:
                a: the first factor.
                b: the second factor.
            \"\"\"
            return a * b

        class Calculator(ToolEnvironment):
            tools = [multiply]
    """

    tools: Sequence[Callable] = ()
    result_template: str = "<tool_response>\n{result}\n</tool_response>\n"

    def __init__(self, tools: Sequence[Callable | str] | None = None, result_template: str | None = None) -> None:
        from transformers.utils import get_json_schema

        functions = [
            import_object(t, f"environment.kwargs.tools[{i}]") if isinstance(t, str) else t
            for i, t in enumerate(type(self).tools if tools is None else tools)
        ]
        self.tool_map: dict[str, Callable] = {}
        self.parameters: dict[str, dict[str, Any]] = {}  # each tool's JSON-schema properties
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"{type(self).__name__}: a tool must be a function, got {fn!r:.100}")
            try:
                schema = get_json_schema(fn)
            except Exception as err:  # transformers' DocstringParsingException / TypeHintParsingException
                raise TypeError(f"{type(self).__name__}: tool {fn.__name__!r} cannot be described to the model: {err}") from err
            self.tool_map[schema["function"]["name"]] = fn
            self.parameters[schema["function"]["name"]] = schema["function"].get("parameters", {}).get("properties", {})
        self.tools = functions
        if result_template is not None:
            self.result_template = result_template
        if "{result}" not in self.result_template:
            raise ValueError(f"{type(self).__name__}: result_template must contain '{{result}}'")
        try:  # other braces must be doubled ({{ and }}): str.format reads them as fields
            self.result_template.format(result="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"{type(self).__name__}: result_template {self.result_template!r} cannot be filled ({type(err).__name__}: "
                f"{err}); write literal braces as '{{{{' and '}}}}'"
            ) from err

    def parse_call(self, response: str) -> tuple[str, dict[str, Any]] | None:
        """The (tool name, arguments) of the first tool call in ``response``; None: no call (the final
        answer). Raises :class:`ToolCallError` for a call that cannot be read."""
        match = TOOL_CALL.search(response)
        if match is None:
            return None
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError as err:
            raise ToolCallError(f"the tool call is not JSON ({err.msg})") from err
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError('a tool call is {"name": ..., "arguments": {...}}')
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ToolCallError("the tool call's arguments must be an object")
        return call["name"], arguments

    def format_result(self, result: Any) -> str:
        return self.result_template.format(result=result)

    def final_reward(self, response: str) -> float:
        """The reward of the turn without a tool call (the answer); 0 unless a subclass scores it."""
        return 0.0

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Run a tool; :class:`ToolCallError` for an unknown tool or arguments it does not take."""
        fn = self.tool_map.get(name)
        if fn is None:
            raise ToolCallError(f"unknown tool {name!r} (tools: {sorted(self.tool_map)})")
        for key, value in arguments.items():  # the types the model was shown (a "3" for an int would run as text)
            schema = self.parameters.get(name, {}).get(key, {})
            expected = schema.get("type")
            types = [expected] if isinstance(expected, str) else list(expected or [])
            if value is None and schema.get("nullable") or not all(t in JSON_TYPES for t in types) or not types:
                continue  # a type not checked here (or none given) is the tool's to refuse
            if not any(JSON_TYPES[t](value) for t in types):
                raise ToolCallError(f"{name}: argument {key!r} must be of type {' or '.join(types)}, got {value!r:.50}")
        try:
            return fn(**arguments)
        except TypeError as err:
            raise ToolCallError(f"{name}: {err}") from err

    def step(self, response: str) -> StepResult:
        try:
            call = self.parse_call(response)
        except Exception as err:  # a call that cannot be read is the model's to see, not the run's
            return StepResult(self.format_result(f"error: {err}"), tool_call=True, tool_error=True)
        if call is None:  # the answer: an error in scoring it is the environment's own, and ends the fit
            return StepResult(None, reward=self.final_reward(response), done=True)
        try:
            result = self.call(*call)
        except Exception as err:  # the tool's own failure is the model's to see, not the run's
            return StepResult(self.format_result(f"error: {err}"), tool_call=True, tool_error=True)
        return StepResult(self.format_result(result), tool_call=True)

"""Reward functions named in a config (``reward_fn: package.module:function``): import, calling form, checks.

Importing a reward module runs its code (as any ``class_path`` in a LightningCLI config does); whatever
it raises is reported with the argument and the module named. A reward function's output is checked
before it becomes a tensor: one real number per response, anything else is named with its position.
Finiteness is checked later, per rollout, by :func:`lit_rlhf.guards.screen_scores` (the online modules'
``on_nonfinite`` policy), so NaN/inf pass through here.

Two calling forms are accepted, told apart by the function's signature (:func:`reward_call`):

- this project's ``fn(prompts, responses, **columns)``: two positional parameters, given the decoded
  prompt and response strings positionally;
- TRL's ``fn(completions, **kwargs)``: a parameter named ``completions``, one named ``completion_ids``
  with fewer than two positional parameters before it, or ``**kwargs`` with fewer than two positional
  parameters (``fn(**kwargs)``); called with keywords only, ``prompts`` and ``completions`` (the decoded
  responses) among them. When the prompt rows were chats (a ``prompt`` column of message lists, as in TRL's
  conversational data), they are passed as TRL passes them: ``prompts`` the message lists, ``completions``
  ``[[{"role": "assistant", "content": response}], ...]``. TRL's ``None`` means "this function does not
  score this row" (e.g. a row of another task): in a ``reward_fn`` list the row's total is the weighted
  sum of the functions that scored it, as TRL's ``nansum`` (NaN where none did); a lone function's None is
  NaN. A NaN or inf a function returns is a non-finite score.

Both forms may take by keyword ``completion_ids`` (each response's token ids, a list of ints, its stop
token included), the prompt rows' other columns (``answer=[...]``) and the fixed ``kwargs`` a config gives
the function. Every keyword but the fixed ones is a list with one entry per response (a prompt's K
responses share its row's values). A function without ``**kwargs`` receives only the keywords it names; one
naming a keyword that is neither given nor a column is refused at the call, with the columns listed. A
column named like one of the pairs form's two positional parameters (TRL's prompt-completion data has a
``completion`` column, ``fn(prompt, completion, **columns)``) is not passed: the parameter already holds
the decoded text (TRL, too, leaves its ``prompt`` and ``completion`` columns out of the keywords).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

RewardFn = Callable[..., Sequence[float]]
# the keywords lit_rlhf passes to a TRL-form function besides the rows' columns
PASSED = ("prompts", "completions", "completion_ids")
# the column of the prompt rows that, holding chats (message lists), makes the call conversational
CHAT_COLUMN = "prompt"
FORMS = (
    "this project's fn(prompts, responses, **columns) (two positional parameters) nor TRL's "
    "fn(completions, **kwargs) (a parameter named `completions` or `completion_ids`, or only **kwargs)"
)


def import_object(path: str, argument: str, kind: str = "function") -> Any:
    """Import ``package.module:<kind>``; errors name ``argument``, the module and what went wrong.

    Args:
        path: ``package.module:name`` (the module is imported, so its top-level code runs).
        argument: the config argument that gave ``path`` (e.g. ``"monitor_reward_fn"``), for messages.
        kind: what the name is, in messages (``function``, ``Class``).
    """
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{argument} must look like 'package.module:{kind}', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name + ".").startswith(err.name + "."):  # one of its own imports
            raise ValueError(
                f"{argument} {path!r}: importing module {module_name!r} raised ModuleNotFoundError: {err}"
            ) from err
        if "." in err.name:  # its package was found
            raise ValueError(f"{argument} {path!r}: module {module_name!r} not found ({err})") from err
        searched = [os.path.abspath(entry or os.curdir) for entry in sys.path]
        raise ValueError(
            f"{argument} {path!r}: module {module_name!r} not found ({err}); searched the directories of "
            f"sys.path: {searched}. Put it in one of them (e.g. the working directory) or add its directory "
            "to PYTHONPATH"
        ) from err
    except BaseException as err:  # the module's own top-level code failed (any exception, even SystemExit)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise ValueError(
            f"{argument} {path!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
        ) from err
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{argument} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def import_reward_fn(path: str, argument: str = "reward_fn") -> RewardFn:
    """Import ``package.module:function`` (:func:`import_object`); errors name ``argument``, the module and
    what went wrong."""
    fn = import_object(path, argument)
    if not callable(fn):
        raise ValueError(f"{argument} {path!r} is not callable (a {type(fn).__name__})")
    return fn


def reward_scores(
    name: str, scores: Any, n: int, device: torch.device | str | None = None, none_as_nan: bool = False
) -> torch.Tensor:
    """Check a reward function's output (``n`` responses) and return it as (n,) float32 scores.

    Accepted: a sequence (list, tuple, 1-D array/tensor) of ``n`` real numbers (bool refused; NaN/inf
    pass, see the module docstring), and None as NaN with ``none_as_nan`` (TRL's form). Anything else
    raises ``TypeError``/``ValueError`` naming the function ``name``, the position and the bad value.
    """
    if isinstance(scores, torch.Tensor) or hasattr(scores, "tolist") and not isinstance(scores, (str, bytes)):
        scores = scores.tolist()
    if isinstance(scores, (str, bytes, dict)) or not isinstance(scores, Sequence):
        raise TypeError(f"{name} must return a list of {n} numbers, got {type(scores).__name__}: {scores!r:.200}")
    if len(scores) != n:
        raise ValueError(f"{name} returned {len(scores)} scores for {n} responses")
    if none_as_nan:
        scores = [float("nan") if value is None else value for value in scores]
    for i, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name} returned a {type(value).__name__} at position {i}: {value!r:.200}; expected a number"
            )
    limit = torch.finfo(torch.float32).max
    values = []
    for i, value in enumerate(scores):  # finite, but inf as float32: not the non-finite score it would read as
        try:
            number = float(value)
            beyond = math.isfinite(number) and abs(number) > limit
        except OverflowError:  # an int past float64's range
            number, beyond = math.inf, True
        if beyond:
            raise ValueError(f"{name} returned {value!r:.40} at position {i}, beyond float32's range (+-{limit:.3g})")
        values.append(number)
    return torch.tensor(values, dtype=torch.float32, device=device)


def none_rows(scores: Any) -> list[bool]:
    """Where a reward function's output (checked by :func:`reward_scores`) holds None: TRL's "this function
    does not score this row"."""
    if hasattr(scores, "tolist") and not isinstance(scores, (str, bytes)):
        scores = scores.tolist()
    return [value is None for value in scores]


@dataclass(frozen=True)
class RewardCall:
    """How a reward function is called, read from its signature by :func:`reward_call`.

    Attributes:
        form: ``"pairs"`` (``fn(prompts, responses, **columns)``) or ``"trl"``
            (``fn(completions, **kwargs)``).
        keywords: the keyword parameters it names (None: any, it has ``**kwargs``).
        required: the keyword parameters it needs (no default).
        positional: the names of the pairs form's two positional parameters (empty for TRL's form).
    """

    form: Literal["pairs", "trl"]
    keywords: frozenset[str] | None
    required: tuple[str, ...]
    positional: tuple[str, ...] = ()


def reward_call(fn: Callable, name: str, fixed: Mapping[str, Any] | None = None) -> RewardCall:
    """The calling form of ``fn`` (see the module docstring), checked against its fixed ``kwargs``.

    A callable without an inspectable signature (a builtin) is called as ``fn(prompts, responses)``.

    Raises:
        TypeError: the signature fits neither form, or a fixed keyword is one it cannot take (named
            with ``name`` and the signature).
    """
    fixed = dict(fixed or {})
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return RewardCall("pairs", frozenset(), ())
    params = list(signature.parameters.values())
    kind = inspect.Parameter
    var_keyword = any(p.kind is kind.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    form = "trl" if _names_trl_keywords(params) or (var_keyword and len(positional) < 2) else "pairs"
    where = f"{name}: {getattr(fn, '__name__', type(fn).__name__)}{signature}"
    given = [] if form == "trl" else positional[:2]  # the pairs form's (prompts, responses)
    if form == "pairs" and len(given) < 2 and not any(p.kind is kind.VAR_POSITIONAL for p in params):
        raise TypeError(f"{where} fits neither {FORMS}")
    unpassable = [
        p.name for p in positional
        if p.kind is kind.POSITIONAL_ONLY and p.default is p.empty and p not in given
    ]
    if unpassable:
        raise TypeError(
            f"{where}: positional-only parameter(s) {unpassable} cannot be passed; it fits neither {FORMS}"
        )
    keyword_kinds = (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)
    named = [p for p in params if p.kind in keyword_kinds and p not in given]
    keywords = None if var_keyword else frozenset(p.name for p in named)
    bad = sorted(k for k in fixed if k in PASSED or (keywords is not None and k not in keywords))
    if bad:
        raise TypeError(
            f"{where}: kwargs {bad} are not keywords it takes (lit_rlhf passes {list(PASSED)} itself)"
        )
    required = tuple(p.name for p in named if p.default is p.empty and p.name not in fixed)
    return RewardCall(form, keywords, required, tuple(p.name for p in given))


def _names_trl_keywords(params: list[inspect.Parameter]) -> bool:
    """Whether a signature marks TRL's form by name: a ``completions`` parameter, or a ``completion_ids`` one
    with fewer than two positional parameters before it (after two it is the pairs form's keyword, as in
    ``fn(prompts, responses, *, completion_ids)``)."""
    kind = inspect.Parameter
    positional = 0
    for p in params:
        if p.name in ("completions", "completion_ids") and p.kind is not kind.POSITIONAL_ONLY:
            if p.name == "completions" or positional < 2:
                return True
        if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD):
            positional += 1
    return False


def call_reward_fn(
    fn: Callable,
    call: RewardCall,
    name: str,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: Mapping[str, list] | None = None,
    fixed: Mapping[str, Any] | None = None,
) -> Any:
    """Call ``fn`` in its form (``call``) on B responses; returns what it returns (check it with
    :func:`reward_scores`).

    Args:
        fn: the reward function; ``call``: its form from :func:`reward_call`; ``name``: for messages.
        prompts, completions: B decoded prompt and response strings.
        completion_ids: B lists of response token ids.
        columns: the prompt rows' other columns, each a list of B values (or None: no columns). A
            ``prompt`` column of chats (:func:`chat_prompts`) is no column: TRL's form gets it as ``prompts``
            and the responses as assistant messages; the pairs form gets the strings.
        fixed: the fixed keyword arguments of the config.

    Raises:
        ValueError: a column with the name of a keyword lit_rlhf or the config passes, or a keyword the
            function needs that is neither.
    """
    columns, fixed = dict(columns or {}), dict(fixed or {})
    chats = chat_prompts(columns)
    if chats is not None:
        del columns[CHAT_COLUMN]
    offered: dict[str, Any] = {"completion_ids": completion_ids}
    if call.form == "trl" and chats is not None:  # TRL's conversational format
        conversations = [[{"role": "assistant", "content": c}] for c in completions]
        offered.update(prompts=chats, completions=conversations)
    elif call.form == "trl":
        offered.update(prompts=prompts, completions=completions)

    def accepts(key: str) -> bool:
        return call.keywords is None or key in call.keywords

    # a column named like a positional parameter cannot reach the function: that name holds the text
    columns = {k: v for k, v in columns.items() if k not in call.positional}
    clash = sorted(k for k in columns if accepts(k) and (k in offered or k in fixed or k in PASSED))
    if clash:
        raise ValueError(
            f"{name}: the prompt rows' column(s) {clash} have the name of a keyword lit_rlhf or the config's "
            "kwargs pass; rename the column(s)"
        )
    offered.update(columns)
    offered.update(fixed)
    missing = [key for key in call.required if key not in offered]
    if missing:
        raise ValueError(
            f"{name} needs {missing}: neither in its kwargs nor a column of the prompt rows (their columns: "
            f"{sorted(columns)}; lit_rlhf passes {list(PASSED)})"
        )
    kwargs = {k: v for k, v in offered.items() if accepts(k)}
    return fn(**kwargs) if call.form == "trl" else fn(prompts, completions, **kwargs)


def chat_prompts(columns: Mapping[str, list]) -> list[list[dict]] | None:
    """The rows' chat prompts: the ``prompt`` column when every value is a message list (dicts with a
    ``role``, as TRL's ``is_conversational`` reads them), else None (a string ``prompt`` column is an
    ordinary column)."""
    values = columns.get(CHAT_COLUMN)
    if not values:
        return None
    def is_chat(value: Any) -> bool:
        return (
            isinstance(value, (list, tuple))
            and bool(value)
            and all(isinstance(m, Mapping) and "role" in m for m in value)
        )

    return [list(v) for v in values] if all(map(is_chat, values)) else None

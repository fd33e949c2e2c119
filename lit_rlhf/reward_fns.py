"""Reward functions named in a config (``reward_fn: package.module:function``): import and output checks.

Importing a reward module runs its code (as any ``class_path`` in a LightningCLI config does); whatever
it raises is reported with the argument and the module named. A reward function's output is checked
before it becomes a tensor: one real number per response, anything else is named with its position.
Finiteness is checked later, per rollout, by :func:`lit_rlhf.guards.screen_scores` (the online modules'
``on_nonfinite`` policy), so NaN/inf pass through here.
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

RewardFn = Callable[[list[str], list[str]], Sequence[float]]


def import_reward_fn(path: str, argument: str = "reward_fn") -> RewardFn:
    """Import ``package.module:function``; errors name ``argument``, the module and what went wrong.

    Args:
        path: ``package.module:function`` (the module is imported, so its top-level code runs).
        argument: the config argument that gave ``path`` (e.g. ``"monitor_reward_fn"``), for messages.
    """
    module_name, sep, attr = path.partition(":") if isinstance(path, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{argument} must look like 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ValueError(f"{argument} {path!r}: module {module_name!r} not found ({err})") from err
    except BaseException as err:  # the module's own top-level code failed (any exception, even SystemExit)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise ValueError(
            f"{argument} {path!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
        ) from err
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{argument} {path!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{argument} {path!r} is not callable (a {type(fn).__name__})")
    return fn


def reward_scores(name: str, scores: Any, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Check a reward function's output (``n`` responses) and return it as (n,) float32 scores.

    Accepted: a sequence (list, tuple, 1-D array/tensor) of ``n`` real numbers (bool refused; NaN/inf
    pass, see the module docstring). Anything else raises ``TypeError``/``ValueError`` naming the function
    ``name``, the position and the bad value.
    """
    if isinstance(scores, torch.Tensor) or hasattr(scores, "tolist") and not isinstance(scores, (str, bytes)):
        scores = scores.tolist()
    if isinstance(scores, (str, bytes, dict)) or not isinstance(scores, Sequence):
        raise TypeError(f"{name} must return a list of {n} numbers, got {type(scores).__name__}: {scores!r:.200}")
    if len(scores) != n:
        raise ValueError(f"{name} returned {len(scores)} scores for {n} responses")
    for i, value in enumerate(scores):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name} returned a {type(value).__name__} at position {i}: {value!r:.200}; expected a number"
            )
    return torch.tensor([float(s) for s in scores], dtype=torch.float32, device=device)

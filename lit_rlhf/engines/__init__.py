"""Rollout engines: what generates an online module's responses, behind one protocol.

- :class:`RolloutEngine`: the protocol (``generate``, ``sync_weights``, ``sleep``/``wake_up``, ``close``);
- :class:`Responses`: what ``generate`` returns (ids, masks, truncation flags, behaviour log-probs);
- :class:`HFEngine`: Hugging Face ``generate`` on the trainer's policy (the default);
- ``lit_rlhf.engines.vllm.VLLMEngine`` (``engine: vllm``): vLLM in the trainer process, synced after every
  update (the optional ``vllm`` extra; imported only when used);
- :func:`build_engine`: an engine from what a user passes (an instance, a name, a ``class_path`` dict).
"""

from __future__ import annotations

import importlib
from typing import Any

from lit_rlhf.engines.base import ENGINE_STATS, Responses, RolloutEngine, check_responses
from lit_rlhf.engines.hf import HFEngine

# short names an ``engine:`` argument may give instead of a class path
ENGINES: dict[str, str] = {"hf": "lit_rlhf.engines.HFEngine", "vllm": "lit_rlhf.engines.vllm.VLLMEngine"}

__all__ = ["ENGINE_STATS", "ENGINES", "HFEngine", "Responses", "RolloutEngine", "build_engine", "check_responses", "engine_hparams"]


def _import_class(path: str, argument: str) -> type:
    module_name, _, name = path.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{argument}: cannot import engine class {path!r} ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"{argument}: {path!r} is not a lit_rlhf.engines.RolloutEngine subclass")
    return cls


def build_engine(value: Any, argument: str = "engine") -> RolloutEngine:
    """The engine ``value`` stands for.

    Args:
        value: a :class:`RolloutEngine`; None (the Hugging Face engine with its defaults); a name of
            :data:`ENGINES` or a class path (``package.module.Class``); a dict ``{class_path, init_args}``.
        argument: the constructor argument it came from (named in messages).
    """
    if isinstance(value, RolloutEngine):
        return value
    if value is None:
        return HFEngine()
    if isinstance(value, str):
        return _import_class(ENGINES.get(value, value), argument)()
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"class_path", "init_args"})
        if unknown or "class_path" not in value:
            raise TypeError(f"{argument}: unknown key(s) {unknown}; expected class_path and init_args")
        cls = _import_class(ENGINES.get(value["class_path"], value["class_path"]), argument)
        return cls(**(value.get("init_args") or {}))
    raise TypeError(
        f"{argument}: expected a RolloutEngine, a name ({sorted(ENGINES)}), a class path or a "
        f"{{class_path, init_args}} dict, got {type(value).__name__}"
    )


def engine_hparams(engine: RolloutEngine) -> dict[str, Any]:
    """The plain ``{class_path, init_args}`` of ``engine`` that :func:`build_engine` rebuilds it from."""
    cls = type(engine)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": engine.init_args()}

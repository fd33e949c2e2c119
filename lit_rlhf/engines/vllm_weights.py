"""The weights a vLLM engine loads: the actor's full state dict in Hugging Face names, LoRA merged.

Under FSDP the state dict is gathered from every rank's shards (a collective: every rank calls
:func:`hf_weights`); a peft LoRA actor gives its base weights with each adapter's delta added
(``W + scale * B @ A``, peft's own ``get_delta_weight``), computed on copies so the trainer's weights and
adapters are untouched (merging in place and unmerging would leave float rounding in the base weights).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "architecture", "base_model", "call_with_timeout", "check_manifest", "hf_weights", "is_fsdp2", "is_lora",
    "lora_rank_limit", "unwrapped",
]  # fmt: skip

R = TypeVar("R")


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside an FSDP1 wrapper (FSDP2 and DDP keep the model object)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return model.module if isinstance(model, FSDP) else model


def is_lora(model: nn.Module) -> bool:
    """True for a peft model, wrapped by FSDP1 or not (its weights are merged before vLLM loads them)."""
    from peft import PeftModel

    return isinstance(unwrapped(model), PeftModel)


def base_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model vLLM builds: inside FSDP1's wrapper and peft's."""
    model = unwrapped(model)
    return model.get_base_model() if is_lora(model) else model


def architecture(model: nn.Module) -> str:
    """The class name of ``model`` as its checkpoint's ``architectures`` gives it (FSDP2's ``fully_shard``
    swaps the class for a generated ``FSDP<Name>`` subclass: its first non-FSDP base is the model's)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of ``model``'s state dict; a collective under FSDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    sharded = isinstance(model, FSDP) or any(isinstance(p, DTensor) for p in model.parameters())
    if not sharded:
        return {name: t.detach() for name, t in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _strip(name: str) -> str:
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def _merged_lora(model: nn.Module, state: dict[str, torch.Tensor], merge: bool = True) -> dict[str, torch.Tensor]:
    """The base model's weights of a peft LoRA ``model`` with every active adapter's delta added (``merge``;
    else the base weights alone), in the base model's own names (``model.layers.0.self_attn.q_proj.weight``)."""
    from peft.tuners.lora import LoraLayer

    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if merge and isinstance(module, LoraLayer) and not module.merged:
            weight = _strip(f"{name}.base_layer.weight")
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            if isinstance(delta, torch.Tensor):
                deltas[weight] = delta.detach()
    prefix = "base_model.model."
    out: dict[str, torch.Tensor] = {}
    for raw_name, tensor in state.items():
        name = _strip(raw_name)
        if "lora_" in name or not name.startswith(prefix):
            continue  # adapters (merged below) and peft's own bookkeeping
        merged = tensor + deltas[name].to(tensor.dtype) if name in deltas else tensor
        out[name[len(prefix) :].replace(".base_layer.", ".")] = merged
    return out


def hf_weights(model: nn.Module, merge_lora: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``model`` as a Hugging Face checkpoint names them (LoRA merged, or the
    base weights without the adapters when not ``merge_lora``).

    Every rank of a sharded model must call it (the gather is collective); the tensors are detached and
    never the trainer's own storage for merged weights.
    """
    state = _full_state_dict(model)
    if is_lora(model):
        state = _merged_lora(model, state, merge=merge_lora)
    else:
        state = {_strip(name): tensor for name, tensor in state.items()}
    return list(state.items())


Manifest = dict[str, tuple[tuple[int, ...], torch.dtype]]


def check_manifest(weights: list[tuple[str, torch.Tensor]], expected: Manifest | None) -> Manifest:
    """The names, shapes and dtypes of ``weights``, checked against those of the first sync (``expected``).

    vLLM's reload rebuilds its parameters from what it is given, so weights of another model would leave
    the engine half-replaced; they are refused before vLLM sees them.

    Raises:
        ValueError: a tensor missing, extra, or of another shape or dtype (the first few named).
    """
    manifest = {name: (tuple(t.shape), t.dtype) for name, t in weights}
    if expected is None or manifest == expected:
        return manifest
    missing = sorted(set(expected) - set(manifest))
    extra = sorted(set(manifest) - set(expected))
    changed = [f"{k}: {manifest[k][0]} {manifest[k][1]} (was {expected[k][0]} {expected[k][1]})"
               for k in sorted(set(manifest) & set(expected)) if manifest[k] != expected[k]]  # fmt: skip
    parts = [f"missing {missing[:3]}" if missing else "", f"extra {extra[:3]}" if extra else "",
             f"changed {changed[:3]}" if changed else ""]  # fmt: skip
    raise ValueError(
        "VLLMEngine.sync_weights: these weights are not those of the model the engine was started with ("
        + "; ".join(p for p in parts if p) + "); nothing was loaded"
    )


def call_with_timeout(fn: Callable[[], R], timeout_s: float, what: str) -> tuple[R, float]:
    """``fn()`` and its duration in seconds; a ``TimeoutError`` naming ``what`` after ``timeout_s``.

    ``fn`` runs in a daemon thread so a call that never returns (a weight reload blocked in the engine)
    is reported instead of hanging the run; the error says what was being done and how long it waited.

    Raises:
        TimeoutError: ``fn`` did not return within ``timeout_s`` seconds.
        RuntimeError: ``fn`` raised (chained), with ``what`` in the message.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    start = time.perf_counter()
    worker = threading.Thread(target=target, name=f"lit_rlhf: {what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    elapsed = time.perf_counter() - start
    if worker.is_alive():
        raise TimeoutError(
            f"{what} did not finish within {timeout_s:g} s (raise the engine's sync_timeout_s if the model "
            "is that large; otherwise the engine is stuck)"
        )
    if "error" in result:
        err = result["error"]
        raise RuntimeError(f"{what} failed after {elapsed:.2f} s: {type(err).__name__}: {err}") from err
    return result["value"], elapsed


def lora_rank_limit(r: int) -> int:
    """The smallest LoRA rank vLLM accepts for ``max_lora_rank`` that holds ``r``."""
    return next((size for size in (8, 16, 32, 64, 128, 256, 320, 512) if size >= r), r)


def is_fsdp2(model: torch.nn.Module) -> bool:
    """True when ``model`` or one of its submodules is sharded by FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())

"""Which models the shared-prompt layout (:mod:`lit_rlhf.models.shared_prefix`) runs on, and why not the others.

The layout's block 4D mask goes through ``transformers`` as is: ``sdpa`` takes a bool mask, ``eager`` an
additive float one; other attention implementations are not supported. The architectures are those measured
exact against the padded layout (:data:`SHARED_PREFIX_MODEL_TYPES`); windowed attention (Mistral, Gemma 2/3,
Qwen2 with a window, GPT-Neo's local layers) is refused, since the block mask holds no window.
"""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ATTENTION = ("sdpa", "eager")
# Architectures whose packed log-probs (causal LM) and scores (sequence classifier) were measured equal to
# the padded layout's (<= 8e-6 in float32, transformers 5.25; tests/test_shared_prefix_archs.py re-measures
# every one): they take a 4D mask as is and place each token by its position ids. Others are refused
# (``auto`` keeps the padded layout): ALiBi biases (BLOOM, MPT, Falcon with alibi) come from the 2D mask, not
# the position ids (BLOOM and Falcon crash on a 4D mask, MPT gives other log-probs), and
# FalconForSequenceClassification does not pass position_ids to its backbone.
SHARED_PREFIX_MODEL_TYPES = frozenset(
    {
        "codegen", "cohere", "gemma", "gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "granite",
        "llama", "mistral", "mixtral", "olmo", "olmo2", "opt", "persimmon", "phi", "phi3", "qwen2", "qwen2_moe",
        "qwen3", "stablelm", "starcoder2",
    }
)  # fmt: skip


def mask_dtype(model: nn.Module) -> torch.dtype | None:
    """The 4D mask ``model`` takes: bool for sdpa, its float dtype for eager; None when unsupported."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation == "sdpa":
        return torch.bool
    return model.dtype if implementation == "eager" else None


def sliding_window(model: nn.Module) -> int | None:
    """The attention window of ``model``'s sliding-window layers (Mistral, Gemma 2/3, Qwen2 with
    ``use_sliding_window``), None when every layer attends to the whole sequence."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return None if types is not None and "sliding_attention" not in types else int(window)


def _architecture_reason(model: nn.Module) -> str | None:
    """Why ``model``'s architecture cannot run the layout: a ``model_type`` not in
    :data:`SHARED_PREFIX_MODEL_TYPES`, or GPT-Neo with local (windowed) attention layers."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SHARED_PREFIX_MODEL_TYPES:
        return (
            f"model_type {model_type!r} (the shared-prompt layout is vouched for only on the architectures of "
            "lit_rlhf.models.shared_prefix_support.SHARED_PREFIX_MODEL_TYPES; ALiBi models such as BLOOM and MPT ignore "
            "its position ids, Falcon's sequence classifier drops them)"
        )
    if model_type == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or ()):
        window = getattr(config, "window_size", None)
        return f"GPT-Neo local attention layers (window {window}; the shared-prompt layout's block mask has none)"
    return None


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run the shared-prompt layout (None when it can): its attention implementation,
    a sliding window or GPT-Neo's local layers (the block mask holds no window, so a response would see
    prompt tokens its own padded row does not: other scores and log-probs), or an architecture the layout
    is not vouched for (:data:`SHARED_PREFIX_MODEL_TYPES`)."""
    window = sliding_window(model)
    if window is not None:
        return f"sliding-window attention (window {window}; the shared-prompt layout's block mask has none)"
    architecture = _architecture_reason(model)
    if architecture is not None:
        return architecture
    if mask_dtype(model) is None:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        return (
            f"attention implementation {implementation!r} (the shared-prompt layout's 4D mask is vouched for "
            f"with {SUPPORTED_ATTENTION} only)"
        )
    return None


def refuse_unsupported_shared_prefix(argument: str, mode: str, **models: nn.Module | None) -> None:
    """``shared_prefix: on`` refused when a module is built (not at its first batch) if one of ``models``
    (role -> model, None skipped) cannot run the layout; ``argument`` names the setting in the message."""
    if mode != "on":
        return
    for role, model in models.items():
        reason = None if model is None else unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"{argument}='on' cannot run the {role} with {reason}; use 'auto' (packs only where "
                "it can) or 'off'"
            )

"""The prompt prefill shared by a group of samples: one forward per distinct prompt, its KV cache repeated.

Group estimators (GRPO, RLOO, ...) sample K responses per prompt from K copies of it. Without sharing,
``generate`` runs the prompt's prefill forward on all K copies; here it runs once per prompt and the KV
cache is repeated K times along the batch, so ``generate`` only runs the last prompt token and the decode
steps on the K rows (the cache-continuation path of Hugging Face ``generate``: ``input_ids`` are the full
rows, the cache holds the first tokens, ``generate`` slices the rest).

Shapes: G distinct prompts, K copies of each (contiguous rows), P prompt length (left-padded).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from lit_rlhf.models.scoring import position_ids_from_mask


def _accepts(model: torch.nn.Module, argument: str) -> bool:
    """Whether the Hugging Face forward of ``model`` (a peft model's base model) takes ``argument``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return argument in inspect.signature(base.forward).parameters


def cache_argument(model: torch.nn.Module) -> str | None:
    """The name the model's forward takes its KV cache by: ``cache`` (transformers >= 5.20),
    ``past_key_values`` (earlier releases), or None."""
    return next((name for name in ("cache", "past_key_values") if _accepts(model, name)), None)


def is_grouped(input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int) -> bool:
    """Whether the rows come in contiguous groups of ``group_size`` copies of one prompt.

    Args:
        input_ids, attention_mask: (G*K, P) prompts, K = ``group_size``.
    """
    rows, _ = input_ids.shape
    if rows % group_size:
        return False
    firsts = slice(None, None, group_size)
    return all(
        torch.equal(t.view(rows // group_size, group_size, -1), t[firsts].unsqueeze(1).expand(-1, group_size, -1))
        for t in (input_ids, attention_mask)
    )


@torch.no_grad()
def prefill_groups(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int
) -> DynamicCache | None:
    """KV cache of every prompt but its last token, computed once per group and repeated for its rows.

    The forward takes the explicit position ids of the real tokens (as ``generation_kwargs`` does), so a
    left-padded row is cached at the positions the unshared ``generate`` would use. Only models whose cache
    is a plain :class:`~transformers.cache_utils.DynamicCache` of full-attention layers are supported
    (sliding-window, linear-attention, quantized or static layers are not repeated here).

    Args:
        model: causal LM (or peft model), in the mode it generates in.
        input_ids: (G*K, P) left-padded prompts, each prompt's K = ``group_size`` copies contiguous, P >= 2.
        attention_mask: (G*K, P) 1 on real tokens.
        group_size: K.

    Returns:
        The cache of the (G*K, P-1) first prompt columns for ``generate(..., cache=...)``, or None where the
        model's cache is not supported (the caller then generates without it).
    """
    ids = input_ids[::group_size, :-1]  # (G, P-1)
    mask = attention_mask[::group_size, :-1]  # (G, P-1)
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True, **extra
    )
    cache = getattr(out, cache_argument(model) or "cache", None)
    if type(cache) is not DynamicCache or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.batch_repeat_interleave(group_size)  # (G, ...) -> (G*K, ...) per layer
    return cache

"""A decoding-friendly LM head: the head's weight transposed once per ``generate`` call on CPU.

A decoding step multiplies a few rows (B, 1, H) by the LM head's (V, H) weight. ``nn.Linear`` computes
``x @ W.T`` from the (V, H) layout, and on CPU the BLAS then packs (copies) the transposed weight on
every call: at V = 32,000, H = 256 that copy costs as much as the product (measured 9-11 ms vs 5.9 ms
per step for B = 8 on one core of this project's EPYC), and the head is most of a small model's
decoding time. Multiplying by a (H, V) copy made once per ``generate`` call streams the weight
without that copy. Same products, same sums: the logits agree with ``nn.Linear``'s to float rounding
(bit-identical in the measured case); generation does not enter any loss (the old log-probs come from
a scoring or update forward), so only which tokens are drawn could differ, and only by rounding.

Only where it is a plain dense ``nn.Linear`` head on CPU, unsharded, not wrapped by an adapter, and
big enough to matter (``TRANSPOSED_HEAD_MIN_ELEMENTS``); elsewhere nothing changes (cuBLAS reads
transposed operands without copies).

Under CPU autocast (Lightning's ``precision: bf16-mixed``) the copy is made in the autocast dtype:
autocast casts a float32 weight to bfloat16 for every matmul, and Lightning runs it without its weight
cache, so the (H, V) copy would be cast again at every decoding step; cast once, it gives the same
bfloat16 products (measured under autocast on the W1 benchmark's 20.6M-parameter Llama at V = 32,000, 8
rows x <= 64 new tokens, one core of an AMX Xeon: 1.22-1.29 -> 0.89-0.95 CPU s per ``generate`` call).

The same holds for every other weight under autocast: :func:`cached_autocast_casts` lets autocast cast each
trainable float32 weight once per ``generate`` call instead of at every decoding step (autocast's own weight
cache, which Lightning's ``bf16-mixed`` and ``16-mixed`` turn off), on any device. The weights do not change
while a call draws, so the products are the ones the per-step casts give, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_rlhf.models.lm_head import _sharded

__all__ = ["TRANSPOSED_HEAD_MIN_ELEMENTS", "cached_autocast_casts", "output_vocab_size", "transposed_lm_head"]

# Below 2**20 weight elements (4 MiB of float32) the per-call copy is cheap and stays in cache.
TRANSPOSED_HEAD_MIN_ELEMENTS = 1 << 20


def output_vocab_size(model: nn.Module) -> int | None:
    """V, the rows of ``model``'s output embedding (None if it has none)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _plain_head(model: nn.Module) -> nn.Linear | None:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is not nn.Linear:  # peft's lora.Linear and other wrappers keep their own forward
        return None
    weight = head.weight
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() < TRANSPOSED_HEAD_MIN_ELEMENTS:
        return None
    if "forward" in head.__dict__ or _sharded(model, head):  # already swapped, or FSDP-managed
        return None
    return head


def _autocast_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes ``weight``'s products in: its own outside CPU autocast or for a weight
    that is not float32 (autocast leaves bfloat16 weights alone)."""
    if weight.dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return weight.dtype


@contextmanager
def transposed_lm_head(model: nn.Module, enabled: bool = True) -> Iterator[bool]:
    """Within the block, ``model``'s LM head multiplies by a (H, V) copy of its weight (no grad).

    Args:
        model: a causal LM (plain, or a peft model whose head is not adapted).
        enabled: False leaves the head alone.

    Yields:
        Whether the head was swapped.
    """
    head = _plain_head(model) if enabled else None
    if head is None:
        yield False
        return
    dtype = _autocast_dtype(head.weight)
    weight_t = head.weight.detach().to(dtype).t().contiguous()  # (H, V)
    bias = None if head.bias is None else head.bias.detach().to(dtype)

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., V)
        logits = torch.matmul(hidden, weight_t)
        return logits if bias is None else logits + bias

    head.forward = forward  # an instance attribute: nn.Module.__call__ dispatches to it, hooks still run
    try:
        yield True
    finally:
        del head.forward


@contextmanager
def cached_autocast_casts(model: nn.Module) -> Iterator[bool]:
    """Within the block, autocast casts each of ``model``'s trainable float32 weights once, not per forward.

    Autocast keeps a cast of a leaf tensor that requires grad for as long as its outermost region lasts
    when its cache is on (``torch.autocast(cache_enabled=True)``); Lightning's mixed precision opens its
    region with the cache off (a training step's weights change between forwards), so a decoding loop of
    T steps casts every weight T times: at the W1 benchmark's size that is most of a bf16 decoding step on
    a CPU. A decoding loop does not change the weights, so this opens a nested region with the cache on,
    in the enclosing region's device and dtype, and clears the cache when it ends: the casts are the same,
    made once, and no later forward can see a cast of a weight the optimiser has since changed.

    Only where an autocast region with its cache off encloses the call and FSDP does not manage the model
    (the cache would hold a whole unsharded copy of the weights on each rank); elsewhere nothing changes.

    Yields:
        Whether the nested, caching region is open.
    """
    param = next(model.parameters(), None)
    if (
        param is None
        or not torch.is_autocast_enabled(device_type := param.device.type)
        or torch.is_autocast_cache_enabled()
        or _sharded(model, model)  # any DTensor parameter, or an FSDP1/FSDP2 module
    ):
        yield False
        return
    try:
        with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=True):
            yield True
    finally:
        torch.clear_autocast_cache()

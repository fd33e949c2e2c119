"""A decoding-friendly LM head: the head's weight laid out for few-row products once per ``generate`` call.

A decoding step multiplies a few rows (B, 1, H) by the LM head's (V, H) weight, which does not fit in
cache: each step streams it from memory, and how a kernel walks it bounds the step. ``nn.Linear``
computes ``x @ W.T`` from the (V, H) layout, and on CPU the BLAS (MKL) then packs (copies) the
transposed weight on every call: at V = 32,000, H = 256 that copy costs as much as the product
(measured 9-11 ms vs 5.9 ms per step for B = 8 on one core of this project's AMD EPYC), and the head is
most of a small model's decoding time. Two layouts, made once per call, remove it:

* ``"transposed"``: a (H, V) copy, multiplied with ``torch.matmul``; the BLAS streams it without a copy.
  Same products and sums as ``nn.Linear``'s (bit-identical in the measured cases).
* ``"packed"``: oneDNN's own blocked layout for few-row products (``torch.ops.mkldnn._reorder_linear_weight``,
  multiplied by ``torch.ops.mkldnn._linear_pointwise``: the pair PyTorch's inductor uses for linear layers
  on CPU). On the AMD EPYC, one core, cold cache, 8 rows: 2.6-2.8 ms against the transposed copy's 5.0 at
  32,000 x 256, 10.6 against 26.0 at 50,257 x 768, 35.7 against 77.7 at 151,936 x 896; from 3 rows on it
  is faster (4 rows: 2.0 against 4.2 ms), at 1-2 rows it is not (1 row: 2.4 against 1.4 ms), hence
  ``PACKED_HEAD_MIN_ROWS``. Its logits differ from ``nn.Linear``'s by float rounding (<= 2.6e-6 in those
  cases, 8.1e-6 at 32,000 x 2,048: another summation order), and each row's are the same whatever rows
  share the batch (1-16 rows probed on that CPU; ``engines.lean_decode.min_rows`` probes this product too).

Generation does not enter a loss through its logits except as the sampler's behaviour log-probs, which
match a scoring forward to float rounding either way (``scoring.old_logprobs``), so only which tokens are
drawn could differ from ``nn.Linear``'s, and only where a uniform falls within rounding of a boundary of
the cumulative distribution. ``generate`` and the lean loop multiply by the same layout within a call,
so their tokens stay identical to each other.

Only where it is a plain dense ``nn.Linear`` head on CPU, unsharded, not wrapped by an adapter, and
big enough to matter (``TRANSPOSED_HEAD_MIN_ELEMENTS``); elsewhere nothing changes (cuBLAS reads
transposed operands without copies). ``"auto"`` takes the packed layout for float32 heads of calls of at
least ``PACKED_HEAD_MIN_ROWS`` rows on an x86-64 CPU whose PyTorch has oneDNN, the transposed one
otherwise.

Under CPU autocast (Lightning's ``precision: bf16-mixed``) the transposed copy is made in the autocast
dtype (never packed): autocast casts a float32 weight to bfloat16 for every matmul, and Lightning runs it
without its weight cache, so the (H, V) copy would be cast again at every decoding step; cast once, it
gives the same bfloat16 products (measured under autocast on the W1 benchmark's 20.6M-parameter Llama at
V = 32,000, 8 rows x <= 64 new tokens, one core of an AMX Xeon: 1.22-1.29 -> 0.89-0.95 CPU s per
``generate`` call).

The same holds for every other weight under autocast: :func:`cached_autocast_casts` lets autocast cast each
trainable float32 weight once per ``generate`` call instead of at every decoding step (autocast's own weight
cache, which Lightning's ``bf16-mixed`` and ``16-mixed`` turn off), on any device. The weights do not change
while a call draws, so the products are the ones the per-step casts give, bit for bit.
"""

from __future__ import annotations

import platform
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_rlhf.models.lm_head import _sharded

__all__ = [
    "DECODING_HEADS",
    "PACKED_HEAD_MIN_ROWS",
    "TRANSPOSED_HEAD_MIN_ELEMENTS",
    "cached_autocast_casts",
    "decoding_lm_head",
    "onednn_packs",
    "output_vocab_size",
    "packed_linear",
    "transposed_linear",
]

# Below 2**20 weight elements (4 MiB of float32) the per-call copy is cheap and stays in cache.
TRANSPOSED_HEAD_MIN_ELEMENTS = 1 << 20
DECODING_HEADS = ("auto", "packed", "transposed", "plain")
PACKED_HEAD_MIN_ROWS = 3  # "auto" packs for calls of at least this many rows (see the module docstring)


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


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack ``weight`` for the ``"packed"`` head here: a float32 CPU weight, x86-64,
    PyTorch built with oneDNN and its linear-weight reorder."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """(out, in) ``weight`` packed once by oneDNN -> the product ``x -> x @ weight.T + bias`` over its last
    dimension (no grad: generation only), tagged ``layout = "packed"``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    bias = None if bias is None else bias.detach()

    def product(x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    product.layout = "packed"
    return product


def transposed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """(out, in) ``weight`` copied once as (in, out) in ``dtype`` (default: its own) -> the product ``x -> x @
    weight.T + bias`` from that copy (no grad: generation only), tagged ``layout = "transposed"``."""
    weight_t = weight.detach().to(dtype or weight.dtype).t().contiguous()  # (in, out)
    bias = None if bias is None else bias.detach().to(weight_t.dtype)

    def product(x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        out = torch.matmul(x, weight_t)
        return out if bias is None else out + bias

    product.layout = "transposed"
    return product


def _head_layout(weight: torch.Tensor, layout: str, rows: int) -> str:
    """``"packed"`` or ``"transposed"``: ``layout`` (not ``"plain"``) resolved for a head of ``weight`` in a call
    of ``rows`` rows (``"auto"``: packed where :func:`onednn_packs` and ``rows >= PACKED_HEAD_MIN_ROWS``);
    packed only outside autocast."""
    if layout == "transposed":
        return layout
    can_pack = onednn_packs(weight) and _autocast_dtype(weight) == weight.dtype
    if layout == "packed" and not can_pack:
        warnings.warn(
            "generation.decoding_head='packed': oneDNN cannot pack this head here (a float32 CPU weight on "
            "x86-64 outside autocast); the transposed layout is used",
            stacklevel=4,
        )
    return "packed" if can_pack and (layout == "packed" or rows >= PACKED_HEAD_MIN_ROWS) else "transposed"


@contextmanager
def decoding_lm_head(model: nn.Module, layout: str = "auto", rows: int = PACKED_HEAD_MIN_ROWS) -> Iterator[str | None]:
    """Within the block, ``model``'s LM head multiplies by a copy of its weight laid out for decoding (no grad).

    Args:
        model: a causal LM (plain, or a peft model whose head is not adapted).
        layout: ``"auto"``, ``"packed"``, ``"transposed"`` or ``"plain"`` (leaves the head alone); see the
            module docstring.
        rows: the rows of the generation call (``"auto"`` packs from ``PACKED_HEAD_MIN_ROWS`` on).

    Yields:
        The layout the head multiplies by (``"packed"`` or ``"transposed"``), or None where it is left alone.
        The swapped forward carries it as ``forward.layout`` (``engines.lean_decode.min_rows`` probes it).

    Raises:
        ValueError: ``layout`` is not one of ``DECODING_HEADS``.
    """
    if layout not in DECODING_HEADS:
        raise ValueError(f"decoding head layout must be one of {list(DECODING_HEADS)}, got {layout!r}")
    head = _plain_head(model) if layout != "plain" else None
    if head is None:
        yield None
        return
    forward = None
    if _head_layout(head.weight, layout, rows) == "packed":
        try:
            forward = packed_linear(head.weight, head.bias)
        except RuntimeError as error:  # a oneDNN build that cannot reorder this weight: the transposed copy
            warnings.warn(
                f"the LM head could not be packed by oneDNN ({error}); the transposed layout is used", stacklevel=3
            )
    if forward is None:
        forward = transposed_linear(head.weight, head.bias, _autocast_dtype(head.weight))
    head.forward = forward  # an instance attribute: nn.Module.__call__ dispatches to it, hooks still run
    try:
        yield forward.layout
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

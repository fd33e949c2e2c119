"""Input checks shared by the functional/ modules (private).

Errors name the function, the argument and, where it applies, the row, so a shape or mask bug in a
caller is found from the message alone.
"""

from __future__ import annotations

import torch


def as_float(x: torch.Tensor) -> torch.Tensor:
    """Cast to at least float32 (bf16/fp16/int -> float32, float64 stays float64).

    The convention of functional/ is float32 for log-probs and everything after them; float64 is kept so tests
    can check against float64 references.
    """
    return x.to(torch.promote_types(x.dtype, torch.float32))


def check_same_shape(fn: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless all named tensors have the same shape."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"{fn}: `{name}` has shape {tuple(t.shape)} but `{first_name}` has shape {tuple(first.shape)}; "
                "they must match"
            )


def check_2d(fn: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every named tensor is (B, T)."""
    for name, t in tensors.items():
        if t.dim() != 2:
            raise ValueError(f"{fn}: `{name}` must be 2-D (B, T), got shape {tuple(t.shape)}")


def check_number(
    fn: str, name: str, value: float, *, low: float, low_inclusive: bool, high: float | None = None
) -> None:
    """Raise ValueError unless ``low (<|<=) value (<= high)``."""
    ok_low = value >= low if low_inclusive else value > low
    ok_high = high is None or value <= high
    if not (ok_low and ok_high):
        bound = f"{'>=' if low_inclusive else '>'} {low}" + ("" if high is None else f" and <= {high}")
        raise ValueError(f"{fn}: `{name}` must be {bound}, got {value}")

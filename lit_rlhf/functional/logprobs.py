"""Token log-probabilities and entropies from logits, in float32 and without a full float32 copy.

Memory: (B, T, V) logits of a real vocabulary are the largest tensor of a PPO step (64 x 512 x 152k in
bf16 is 10 GB); ``log_softmax(logits.float())`` would add a float32 copy twice that size. Here
log p(label) = z[label] - logsumexp(z) with z = logits / temperature is computed on slices of at most
``_CHUNK_ELEMENTS`` logits, each upcast to float32 on its own. The slices are views (no copy of the
input, even when ``logits`` is a non-contiguous slice such as ``logits[:, P - 1:-1]``). When gradients
are needed, each slice runs under non-reentrant activation checkpointing, so autograd keeps only the
input views and recomputes a slice's float32 copy during backward instead of storing all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from lit_rlhf.functional._checks import as_float, check_number

__all__ = [
    "entropy_from_logits",
    "label_logprobs_and_entropy",
    "label_logprobs_and_entropy_grad_",
    "logprobs_from_logits",
    "scaled_label_scores",
    "scaled_logits",
]

# Logits upcast to float32 at a time: 2**24 elements = 64 MiB of float32 per slice.
_CHUNK_ELEMENTS = 1 << 24


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[label] per position.

    The PPO module passes its sampling temperature so that rollout (old) and update (new) log-probs refer
    to the distribution the tokens were sampled from.

    Args:
        logits: (B, T, V) any float dtype (bf16 is upcast per slice, see the module docstring).
        labels: (B, T) integer token ids in [0, V), also at padded positions (e.g. the pad id).
        temperature: > 0.

    Returns:
        (B, T) float32 (float64 kept) log-probabilities.
    """
    _check_logits("logprobs_from_logits", logits, temperature)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"logprobs_from_logits: `labels` has shape {tuple(labels.shape)} but `logits` is "
            f"{tuple(logits.shape)}; expected labels of shape {tuple(logits.shape[:-1])}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"logprobs_from_logits: `labels` must hold integer token ids, got {labels.dtype}")
    if labels.numel():
        low, high = torch.stack(torch.aminmax(labels)).tolist()  # one host sync for both bounds
        if low < 0 or high >= logits.shape[-1]:
            raise ValueError(
                f"logprobs_from_logits: `labels` must lie in [0, {logits.shape[-1]}) (the vocabulary of "
                f"`logits`), got values in [{low}, {high}]"
            )

    def label_logprob(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        return label_logprobs_and_entropy(chunk, chunk_labels, temperature, entropy=False)[0]

    return _apply_chunked(label_logprob, logits, labels)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logsumexp(z) - sum(softmax(z) * z).

    Args:
        logits: (B, T, V) any float dtype (upcast per slice, see the module docstring).
        temperature: > 0.

    Returns:
        (B, T) float32 (float64 kept) entropies in nats.
    """
    _check_logits("entropy_from_logits", logits, temperature)

    def entropy(chunk: torch.Tensor) -> torch.Tensor:
        z = scaled_logits(chunk, temperature)
        return _entropy(z, torch.logsumexp(z, dim=-1))

    return _apply_chunked(entropy, logits)


def label_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 math of one slice of logits, unchecked and unchunked (the caller bounds the slice).

    With z = logits / temperature (upcast first): log p(label) = z[label] - logsumexp(z) and
    H = logsumexp(z) - sum(softmax(z) * z). Shared by the functions above and the chunked LM head
    (``lit_rlhf.models.lm_head``), so both paths run the same operations.

    Args:
        logits: (..., V) any float dtype.
        labels: (...) token ids in [0, V).
        temperature: > 0.
        entropy: also compute the entropy (else None is returned for it).

    Returns:
        log-probs (...) and entropy (...) or None, float32 (float64 kept).
    """
    logp, ent, _ = scaled_label_scores(scaled_logits(logits, temperature), labels, entropy)
    return logp, ent


def scaled_label_scores(
    z: torch.Tensor, labels: torch.Tensor, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`label_logprobs_and_entropy` on logits already scaled and upcast (z = logits / temperature),
    also returning logsumexp(z), which a hand-written backward needs.

    Args:
        z: (..., V) float32 (or float64). labels: (...) token ids in [0, V). entropy: compute it.

    Returns:
        log-probs (...), entropy (...) or None, logsumexp(z) (...).
    """
    lse = torch.logsumexp(z, dim=-1)  # (...)
    logp = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse  # (...)
    return logp, _entropy(z, lse) if entropy else None, lse


def label_logprobs_and_entropy_grad_(
    z: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The gradient of ``label_logprobs_and_entropy`` with respect to the logits, computed in ``z``'s memory.

    With p = softmax(z) and E_p[z] = sum(p * z) = lse - H:
        d log p(y) / dz = onehot(y) - p
        d H / dz = -p * (z - E_p[z])
    so with upstream gradients g (of the log-prob) and h (of the entropy), and z = logits / temperature,
        dL/dlogits = (g * onehot(y) - p * (g + h * (z - E_p[z]))) / temperature.
    A fused LM-head backward (``lit_rlhf.models.fused_head``) calls it on each chunk of the scaled logits
    it kept or recomputed; nothing of (n, V) is allocated beyond ``z`` itself, plus one (n, V) buffer
    when the entropy has a gradient.

    Args:
        z: (n, V) float32 (or float64) logits / temperature; overwritten with the result.
        labels: (n,) token ids in [0, V).
        lse: (n,) logsumexp(z) from the forward.
        grad_logprobs: (n,) upstream gradient of the log-probs.
        grad_entropy: (n,) upstream gradient of the entropies, or None when the entropy has none.
        entropy: (n,) the entropies from the forward (needed with ``grad_entropy``).
        temperature: > 0, the divisor that made ``z``.

    Returns:
        ``z``, now (n, V) dL/dlogits.
    """
    g = grad_logprobs.unsqueeze(-1)  # (n, 1)
    weight = None
    if grad_entropy is not None:
        if entropy is None:
            raise ValueError("label_logprobs_and_entropy_grad_: `grad_entropy` needs the forward's `entropy`")
        expected_z = (lse - entropy).unsqueeze(-1)  # (n, 1) E_p[z]
        weight = (z - expected_z).mul_(grad_entropy.unsqueeze(-1)).add_(g)  # (n, V) g + h (z - E_p[z])
    p = z.sub_(lse.unsqueeze(-1)).exp_()  # (n, V) softmax(z), in place
    grad = p.mul_(weight if weight is not None else g).neg_()  # (n, V) -p * (g + h (z - E_p[z]))
    rows = torch.arange(labels.shape[0], device=labels.device)
    grad[rows, labels] += grad_logprobs  # (n, V) + g * onehot(y)
    return grad if temperature == 1.0 else grad.div_(temperature)


def _entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _check_logits(fn: str, logits: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"{fn}: `logits` must be (B, T, V), got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"{fn}: `logits` must be a float tensor, got {logits.dtype}")
    check_number(fn, "temperature", temperature, low=0.0, low_inclusive=False)


def scaled_logits(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) logits -> z = logits / temperature in float32 (float64 kept); upcast before dividing, so
    the division itself happens in float32. float32 logits at temperature 1 come back as the same tensor."""
    z = as_float(chunk)
    return z if temperature == 1.0 else z / temperature


def _apply_chunked(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *per_position: torch.Tensor
) -> torch.Tensor:
    """Apply a row-wise ``fn((..., V), *(...)) -> (...)`` over views of (B, T, V) logits; returns (B, T).

    ``per_position`` are (B, T) tensors sliced alongside the logits (the labels).
    """
    batch, steps, vocab = logits.shape
    if logits.numel() == 0:
        out_dtype = torch.promote_types(logits.dtype, torch.float32)
        return torch.zeros(batch, steps, dtype=out_dtype, device=logits.device)
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad

    def run(index: tuple) -> torch.Tensor:
        args = (logits[index], *(t[index] for t in per_position))
        if use_checkpoint:
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    positions = max(1, _CHUNK_ELEMENTS // vocab)
    if steps <= positions:
        # Whole sequences fit: slice along the batch only.
        rows = positions // steps
        return torch.cat([run((slice(b, b + rows),)) for b in range(0, batch, rows)])
    # Long sequences: slice each sequence along time.
    return torch.stack(
        [
            torch.cat([run((b, slice(t, t + positions))) for t in range(0, steps, positions)])
            for b in range(batch)
        ]
    )

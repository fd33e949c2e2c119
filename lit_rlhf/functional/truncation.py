"""Log-probs under a top-k / top-p truncated sampling distribution, and the mass the truncation kept.

Sampling with a temperature, top-k (Fan et al. 2018, "Hierarchical Neural Story Generation",
arXiv:1805.04833) and top-p / nucleus sampling (Holtzman et al. 2020, "The Curious Case of Neural Text
Degeneration", arXiv:1904.09751) draws from the tempered softmax restricted to a kept set of tokens and
renormalised over it. :func:`truncated_logprobs` computes that distribution exactly as Hugging Face's
``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and ``TopPLogitsWarper`` do (in ``generate``'s order,
with the same tensor operations, so the kept sets are the same, ties included), for a teacher-forced
(B, T, V) forward: the behaviour log-probs of sampled tokens without the decoding loop.

Shapes: B batch, T positions, V vocabulary.
"""

from __future__ import annotations

import torch

from lit_rlhf.functional._checks import as_float, check_number

__all__ = ["truncated_logprobs"]

# Rows of V logits processed at a time: bounds the sort's copies to ~2**24 elements (64 MiB of float32) each.
_CHUNK_ELEMENTS = 1 << 24


def truncated_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) under the tempered, top-k then top-p truncated and renormalised softmax, per position.

    With z = logits / temperature (upcast to float32 first, as ``generate`` upcasts its scores):

    1. top-k keeps the tokens whose z is at least the k-th largest (all tokens tied with it are kept);
    2. top-p sorts the remaining tokens by z ascending, takes the cumulative softmax mass of that order
       and drops every token at which it is ``<= 1 - top_p`` (the most likely token is always kept): the
       smallest set of most likely tokens whose mass reaches ``top_p``. Tied tokens are ordered by
       ``torch.sort``, so at the boundary one of two tied tokens may be kept and the other dropped, as
       ``TopPLogitsWarper`` does;
    3. log p(label) = z[label] - logsumexp(z over the kept set), -inf for a label outside it, and
       log_kept_mass = logsumexp(z over the kept set) - logsumexp(z): so
       ``logprobs + log_kept_mass = log_softmax(z)[label]``, the untruncated tempered log-prob.

    Suppressed tokens (-inf logits, e.g. a pad token ``generate`` never samples) have probability 0 in
    both distributions; to reproduce what ``generate`` drew from, pass the logits with them set to -inf.

    Args:
        logits: (B, T, V) any float dtype.
        labels: (B, T) integer token ids in [0, V).
        temperature: > 0 (1.0 = off).
        top_k: keep the k most likely tokens (0 = off; k >= V keeps all).
        top_p: nucleus mass in (0, 1] (1.0 = off).

    Returns:
        logprobs: (B, T) float32 (float64 kept) log-probs under the truncated distribution.
        log_kept_mass: (B, T) float32 (float64 kept) log of the tempered mass the truncation kept
            (exactly 0 with top_k = 0 and top_p = 1).
    """
    _check_truncation_args(logits, labels, temperature, top_k, top_p)
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)  # (N, V), N = B * T
    flat_labels = labels.reshape(-1, 1)  # (N, 1)
    rows = max(_CHUNK_ELEMENTS // max(vocab, 1), 1)
    parts = [
        _truncated_rows(chunk, chunk_labels, temperature, int(top_k), float(top_p))
        for chunk, chunk_labels in zip(flat_logits.split(rows), flat_labels.split(rows))
    ]
    if not parts:  # no positions
        empty = as_float(logits.new_zeros(labels.shape))
        return empty, empty.clone()
    logprobs, log_kept_mass = (torch.cat(values).view(labels.shape) for values in zip(*parts))
    return logprobs, log_kept_mass


def _check_truncation_args(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> None:
    """Raise ValueError for arguments of :func:`truncated_logprobs` outside its Args."""
    fn = "truncated_logprobs"
    check_number(fn, "temperature", temperature, low=0.0, low_inclusive=False)
    check_number(fn, "top_k", top_k, low=0, low_inclusive=True)
    check_number(fn, "top_p", top_p, low=0.0, low_inclusive=False, high=1.0)
    if logits.dim() != 3 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"{fn}: `logits` must be a (B, T, V) float tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    if labels.shape != logits.shape[:-1] or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(
            f"{fn}: `labels` must be integer token ids of shape {tuple(logits.shape[:-1])}, got "
            f"{labels.dtype} {tuple(labels.shape)}"
        )
    vocab = logits.shape[-1]
    if labels.numel() and not bool(((labels >= 0) & (labels < vocab)).all()):
        raise ValueError(f"{fn}: `labels` must lie in [0, {vocab}) (the vocabulary of `logits`)")


def _truncated_rows(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) logits, (N, 1) labels -> (N,) log-probs and (N,) log kept masses (the math of the docstring
    above, with the operations of Hugging Face's warpers)."""
    z = as_float(logits)
    if temperature != 1.0:
        z = z / temperature  # (N, V)
    kept = z
    if top_k:
        kth = torch.topk(kept, min(top_k, kept.shape[-1])).values[..., -1:]  # (N, 1)
        kept = kept.masked_fill(kept < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(kept, descending=False)  # (N, V) ascending
        drop_sorted = sorted_z.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop_sorted[..., -1:] = False  # the most likely token stays
        kept = kept.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
    log_kept_total = kept.logsumexp(dim=-1)  # (N,)
    logprobs = kept.gather(1, labels).squeeze(1) - log_kept_total  # -inf outside the kept set
    if kept is z:
        return logprobs, torch.zeros_like(logprobs)
    return logprobs, log_kept_total - z.logsumexp(dim=-1)

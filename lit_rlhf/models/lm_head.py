"""Log-probs, entropy and argmax from the final hidden states, the LM head applied to chunks of tokens.

A causal LM's forward materialises (B, L, V) logits: at a real vocabulary (32k-152k) the largest tensor
of an update, kept for the backward together with its gradient. Here the model's own forward runs with
its head fed an empty slice (a forward pre-hook captures the head's input, the final hidden states,
and hands the head zero positions), then the head is applied to at most ``chunk_elements // V``
tokens at a time (by default at least 64, see :func:`chunk_tokens`), each chunk under non-reentrant activation checkpointing: autograd keeps only the
(tokens, H) hidden states and recomputes a chunk's logits in the backward, so no more than one chunk of
logits exists at once (the idea of Liger-Kernel's fused linear cross-entropy, arXiv 2410.10989, here
without a fused kernel). The callers hand over the scored tokens' hidden states only (a rollout's real
response tokens, a sequence's label positions), so padding costs no head matmul and no float32 log-softmax;
with gradients and fewer than ``LOGITS_CHUNKING_THRESHOLD`` logits the head runs on them at once, nothing
recomputed (the route then saves the padding's work, not memory).

Exactness: the chunk's logits are the same head applied to the same hidden rows, and the float32 math
after them is :func:`~lit_rlhf.functional.label_logprobs_and_entropy`, the one the plain path uses, so
the results equal the plain path's up to the order of the matmul's row blocks. It is used only where
that holds (:func:`chunkable_head`): architectures whose ``*ForCausalLM.forward`` is ``logits =
lm_head(hidden)`` with nothing after the head (no softcapping or scaling) and a head whose weight is
whole on this rank (not sharded by FSDP). Everything else takes the plain path.

Shapes: B rows, L sequence length, H hidden size, V vocabulary, N scored tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lit_rlhf.functional import label_logprobs_and_entropy
from lit_rlhf.models.fused_head import fusable_head, fused_head_token_scores
from lit_rlhf.models.last_layer import scored_last_layer
from lit_rlhf.models.spec import LogitsChunking

__all__ = [
    "LOGITS_CHUNKING_THRESHOLD",
    "NO_GRAD_CHUNKING_VOCAB",
    "LogitsChunking",
    "TokenScores",
    "auto_chunks",
    "chunkable_head",
    "final_hidden_states",
    "head_settings",
    "head_token_scores",
    "set_logits_chunking",
]

# With gradients, "auto" chunks when the plain path's logits would hold at least this many elements
# (64 MiB of float32). Measured on a 4-layer H = 256 Llama at V = 32,000 (forward and backward of
# policy_forward, CPU, 1 thread, chunks of 2**22): chunked/plain time 1.10 at 2**22 logits, 1.09 at
# 2**23, 0.93 at 1.5 * 2**23, 0.92 at 2**24 and 0.83-0.92 above; below the threshold the head's
# recomputation in backward costs more than the smaller float32 temporaries save (the demo's
# 640-token vocabulary stays on the plain path).
LOGITS_CHUNKING_THRESHOLD = 1 << 24
# From this vocabulary size "auto" always takes the head route (with gradients unchunked below the
# threshold above, so nothing is recomputed): the logits and their float32 temporaries are then the
# largest tensors of a forward, and the head runs on the scored tokens only (W1's update: 224 real of
# 512 padded response positions). Measured (packed no-grad scoring of 8 responses to one
# 200-token prompt, same model): chunked/plain time 1.03 at V = 2,048 with no memory saved, 1.03 at
# 8,192 (-32 MB peak), 0.75 at 32,000 (-160 MB peak). The demo's 640-token vocabulary stays plain.
NO_GRAD_CHUNKING_VOCAB = 8192
# Logits per chunk with gradients: 2**22 elements = 16 MiB of float32 (131 tokens at V = 32,000);
# measured 7-10% faster than chunks of 2**24 at 2**24-2**25 logits (the float32 temporaries of a chunk,
# several times its logits, stay in cache).
_CHUNK_ELEMENTS = 1 << 22
# Without gradients: 2**21 elements (8 MiB, 65 tokens at V = 32,000): 24 MB of peak instead of 48 MB at
# 2**22 and 180 MB at 2**24, and the fastest measured (2**20: +15% time).
_NO_GRAD_CHUNK_ELEMENTS = 1 << 21
# At least this many tokens per default chunk: a chunk's (n, H) x (H, V) matmul reads the whole head weight,
# bound by that read when n is small. V = 128,000, H = 256, 520 tokens (Xeon, 1 thread): head and log-softmax
# without gradients 0.95 s in chunks of 16 (2**21 // V), 0.49 s of 64; with gradients 2.46 s (32), 2.2 s (64).
_MIN_CHUNK_TOKENS = 64
# ForCausalLM forwards read in transformers 5.24 to end in `logits = self.lm_head(hidden_states[...])`.
_EXACT_MODEL_TYPES = frozenset({"gpt2", "llama", "mistral", "qwen2", "qwen3"})
# Config fields of models that transform the logits after the head (Gemma 2/3, Cohere, Granite, ...).
_POST_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_SETTING_ATTR = "_lit_rlhf_logits_chunking"
_FUSED_ATTR = "_lit_rlhf_fused_lm_head"


class TokenScores(NamedTuple):
    """Per-token outputs of :func:`head_token_scores` (N scored tokens)."""

    logprobs: torch.Tensor  # (N,) float32 log softmax(z)[label]
    entropy: torch.Tensor | None  # (N,) float32, when asked for
    argmax: torch.Tensor | None  # (N,) long, when asked for


def set_logits_chunking(model: nn.Module, mode: LogitsChunking, fused: bool = True) -> None:
    """Record on ``model`` whether its log-probs are computed with the chunked LM head
    (``build_causal_lm`` records ``ModelSpec.logits_chunking`` and ``ModelSpec.fused_lm_head``).

    Args:
        model: a causal LM (plain or peft); the setting travels with copies (``frozen_copy``).
        mode: ``"auto"`` takes the head route at vocabularies of at least ``NO_GRAD_CHUNKING_VOCAB``
            tokens, and with gradients when the logits would hold at least ``LOGITS_CHUNKING_THRESHOLD``
            elements (:func:`auto_chunks`); ``"on"`` always, chunked and recomputed even when small;
            ``"off"`` never; ``"auto"``/``"on"`` fall back to the plain path where the route is not exact
            (see :func:`chunkable_head`).
        fused: with gradients, run a plain ``nn.Linear`` head's log-probs and entropy as one autograd
            function (``lit_rlhf.models.fused_head``) instead of autograd's graph of the same operations.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"logits_chunking: expected 'auto', 'on' or 'off', got {mode!r}")
    if not isinstance(fused, bool):
        raise TypeError(f"fused_lm_head: expected a bool, got {fused!r}")
    setattr(model, _SETTING_ATTR, mode)
    setattr(model, _FUSED_ATTR, fused)


def chunkable_head(model: nn.Module, n_tokens: int, mode: LogitsChunking | None = None) -> nn.Module | None:
    """The LM head to apply in chunks, or None when the plain path is to be used.

    Args:
        model: a causal LM (plain or peft).
        n_tokens: positions whose logits the plain path would materialise (B x L, or B x kept).
        mode: overrides the setting recorded by :func:`set_logits_chunking` (default ``"auto"``; its
            rule depends on whether gradients are enabled at the call, see :func:`auto_chunks`).

    Returns:
        ``model.get_output_embeddings()`` (a peft-wrapped head included, so adapters and
        ``disable_adapter`` apply) when chunking is asked for and exact, else None.
    """
    mode = mode if mode is not None else getattr(model, _SETTING_ATTR, "auto")
    if mode == "off":
        return None
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in _EXACT_MODEL_TYPES:
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _POST_HEAD_FIELDS):
        return None
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module) or not _whole_linear_weight(head) or _sharded(model, head):
        return None
    if mode == "auto" and not auto_chunks(n_tokens, head.weight.shape[0]):
        return None
    return head


def auto_chunks(n_tokens: int, vocab: int, grad: bool | None = None) -> bool:
    """The ``"auto"`` rule of the head route: a vocabulary of at least ``NO_GRAD_CHUNKING_VOCAB`` tokens
    always takes it (the logits are then the largest tensors, and the head runs on the scored tokens
    only), a smaller one with gradients (``grad``, default ``torch.is_grad_enabled()``) when the
    (n_tokens, vocab) logits hold at least ``LOGITS_CHUNKING_THRESHOLD`` elements. Whether the route
    splits into recomputed chunks is :func:`head_token_scores`'s rule."""
    grad = torch.is_grad_enabled() if grad is None else grad
    return vocab >= NO_GRAD_CHUNKING_VOCAB or (grad and n_tokens * vocab >= LOGITS_CHUNKING_THRESHOLD)


def head_settings(model: nn.Module) -> dict[str, bool]:
    """``model``'s recorded head-route settings as :func:`head_token_scores` arguments: ``force_chunks``
    (``logits_chunking="on"``: chunks even where they cost time) and ``fused`` (``fused_lm_head``)."""
    return {
        "force_chunks": getattr(model, _SETTING_ATTR, "auto") == "on",
        "fused": getattr(model, _FUSED_ATTR, True),
    }


def _whole_linear_weight(head: nn.Module) -> bool:
    weight = getattr(head, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def _sharded(model: nn.Module, head: nn.Module) -> bool:
    """Whether FSDP manages the model: FSDP2 (``fully_shard``: DTensor parameters, swapped for unsharded
    ones around a forward) or FSDP1 (``FullyShardedDataParallel``: flat parameters)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in head.parameters()):
        return True
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def final_hidden_states(
    model: nn.Module, head: nn.Module, forward_kwargs: dict, logits_to_keep: int = 0
) -> torch.Tensor:
    """The head's input (after the final norm) from the model's own forward, without the head's matmul.

    Going through the model's forward keeps peft, activation-checkpointing and other hooks of the
    top-level module in the path; a pre-hook on the head captures its input and gives it zero
    positions instead, so the (B, L, V) logits are never computed. With ``logits_to_keep`` the last
    decoder layer runs at those last positions only where it can (``models.last_layer``).

    Args:
        model: the causal LM. head: its ``get_output_embeddings()``.
        forward_kwargs: input_ids, attention_mask, position_ids, ... of the forward.
        logits_to_keep: > 0 keeps the last ``logits_to_keep`` positions (HF's argument).

    Returns:
        (B, L, H) hidden states (or (B, logits_to_keep, H)).
    """
    captured: list[torch.Tensor] = []

    def capture(_module: nn.Module, args: tuple) -> tuple:
        captured.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(capture)
    B, L = forward_kwargs["input_ids"].shape
    kept = torch.arange(L - logits_to_keep, L, device=forward_kwargs["input_ids"].device).expand(B, -1)  # (B, k)
    try:
        with scored_last_layer(model, kept) if 0 < logits_to_keep < L else nullcontext():
            model(**forward_kwargs, logits_to_keep=logits_to_keep)
    finally:
        handle.remove()
    return captured[-1]


def head_token_scores(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
    argmax: bool = False,
    chunk_elements: int | None = None,
    force_chunks: bool = False,
    fused: bool = True,
) -> TokenScores:
    """Log-probs (and entropy, argmax) of ``head(hidden) / temperature``, a chunk of tokens at a time.

    Args:
        head: the LM head, (..., H) -> (..., V).
        hidden: (N, H) final hidden states (the rows to score only).
        labels: (N,) token ids in [0, V), the token each row predicts.
        temperature: > 0, divides the logits (as during sampling).
        entropy: also return the entropy; entropy_grad: keep its autograd graph.
        argmax: also return the most likely token (SFT's token accuracy).
        chunk_elements: logits per chunk (tokens per chunk = chunk_elements // V, at least 1); None
            for :func:`chunk_tokens`'s default (2**22 logits with gradients, 2**21 without, and at least
            64 tokens).
        force_chunks: with gradients, chunk (and recompute) even below ``LOGITS_CHUNKING_THRESHOLD``
            logits (``logits_chunking="on"``). Otherwise, with gradients and fewer logits than that (and
            no ``chunk_elements``), the head runs on all N tokens at once and nothing is recomputed.
        fused: with gradients and a plain ``nn.Linear`` head, compute through
            :func:`~lit_rlhf.models.fused_head.fused_head_token_scores` (same values; its backward holds
            no (N, V) tensor beyond the kept logits, or one recomputed chunk, and one weight gradient).

    Returns:
        :class:`TokenScores`, each (N,).
    """
    n_tokens, _ = hidden.shape
    vocab = head.weight.shape[0]  # (V, H); peft wrappers expose their base layer's weight
    grad = torch.is_grad_enabled()
    small = chunk_elements is None and not force_chunks and n_tokens * vocab < LOGITS_CHUNKING_THRESHOLD
    tokens_per_chunk = chunk_tokens(vocab, grad, chunk_elements)
    if fused and grad and n_tokens and fusable_head(head, hidden):  # one autograd function: models/fused_head.py
        logp, ent, top = fused_head_token_scores(
            hidden, labels, head.weight, head.bias, temperature=temperature, tokens_per_chunk=tokens_per_chunk,
            entropy=entropy, entropy_grad=entropy_grad, argmax=argmax, keep_logits=small,
        )  # fmt: skip
        return TokenScores(logp, ent, top)
    use_checkpoint = grad and not small  # recompute a chunk's logits in backward only where memory asks
    if grad and small:
        tokens_per_chunk = n_tokens  # all at once, nothing recomputed
    return _chunked_scores(
        head, hidden, labels, temperature, entropy, entropy_grad, argmax, tokens_per_chunk, use_checkpoint
    )


def chunk_tokens(vocab: int, grad: bool, chunk_elements: int | None = None) -> int:
    """Tokens per chunk of the head route: ``chunk_elements // vocab`` (at least 1) when given, else
    ``_CHUNK_ELEMENTS // vocab`` with gradients, ``_NO_GRAD_CHUNK_ELEMENTS // vocab`` without, and at least
    ``_MIN_CHUNK_TOKENS`` (few-row matmuls are bound by reading the head weight)."""
    if chunk_elements:
        return max(1, chunk_elements // vocab)
    default = _CHUNK_ELEMENTS if grad else _NO_GRAD_CHUNK_ELEMENTS
    return max(_MIN_CHUNK_TOKENS, default // vocab)


def _chunked_scores(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
    argmax: bool,
    tokens_per_chunk: int,
    use_checkpoint: bool,
) -> TokenScores:
    """:func:`head_token_scores` through autograd's graph: the head applied ``tokens_per_chunk`` rows at a
    time, each chunk under activation checkpointing when ``use_checkpoint`` (other arguments as there)."""

    def score(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = head(h)  # (n, V), recomputed in backward
        logp, ent = label_logprobs_and_entropy(logits, y, temperature, entropy=entropy)  # (n,), (n,)
        outputs = (logp,) + ((ent,) if entropy else ()) + ((logits.argmax(-1),) if argmax else ())
        return outputs

    run: Callable[..., tuple[torch.Tensor, ...]] = (
        (lambda h, y: checkpoint(score, h, y, use_reentrant=False)) if use_checkpoint else score
    )
    if hidden.shape[0] == 0:
        parts = [score(hidden, labels)]
    else:
        parts = [run(h, y) for h, y in zip(hidden.split(tokens_per_chunk), labels.split(tokens_per_chunk))]
    columns = [torch.cat(column) for column in zip(*parts)]  # (N,) each
    logprobs = columns.pop(0)
    ent = columns.pop(0) if entropy else None
    if ent is not None and not entropy_grad:
        ent = ent.detach()
    return TokenScores(logprobs, ent, columns.pop(0) if argmax else None)

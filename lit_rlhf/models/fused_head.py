"""Log-probs and entropy through a plain ``nn.Linear`` LM head as one autograd function.

Autograd's own graph of ``label_logprobs_and_entropy(head(hidden), labels)`` keeps the (N, V) logits for
the backward and then allocates three more (N, V) float32 tensors in it (the one-hot of the gather's
backward, ``exp(z - lse)`` of the logsumexp's, their sum), and in chunks under activation checkpointing
the head's (V, H) weight gradient is allocated once per chunk and added up. Here the forward keeps either
the float32 scaled logits (``keep_logits``: no matmul recomputed) or nothing of (N, V) (their chunks are
recomputed in the backward), and the backward turns each chunk of them into its gradient in place
(:func:`~lit_rlhf.functional.label_logprobs_and_entropy_grad_`) and accumulates the weight gradient into
one (V, H) buffer: the update's peak holds one chunk beyond the kept logits (the fused linear
cross-entropy of Liger-Kernel, arXiv 2410.10989, for a log-prob and an entropy instead of a loss).

Same operations as the plain path in the forward (``scaled_label_scores`` on each chunk), so the
outputs are equal; the gradients equal autograd's up to the order of float sums. Used only with gradients,
for a plain ``nn.Linear`` head with floating-point weights outside autocast (:func:`fusable_head`);
everything else (a peft-wrapped or quantised head, autocast) takes the checkpointed route of
``lit_rlhf.models.lm_head``. Kept logits are overwritten by the backward, so a second backward through
the same graph (``retain_graph=True``) raises autograd's in-place modification error; recomputed ones
allow it.

Within :func:`head_grads_in_place` (one process only: DDP and FSDP hook each parameter's gradient as autograd
accumulates it) a backward that finds a dense ``weight.grad`` already there (a minibatch's second micro-batch
on) adds its chunks' products into it with ``addmm_`` and returns no weight gradient: the plain path writes a
fresh (V, H) tensor per micro-batch (32.8 MB at V = 32,000, H = 256) that autograd then adds to
``weight.grad``, two passes over memory per backward. Equal up to the order of float additions. Only where the
backward adds into ``.grad`` anyway: a ``torch.autograd.grad`` call, a weight with gradient hooks or in
bfloat16 take the plain path.

Shapes: N scored tokens, H hidden size, V vocabulary, n tokens of one chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn
from torch.nn import functional as torch_f

from lit_rlhf.functional import label_logprobs_and_entropy_grad_, scaled_label_scores, scaled_logits

__all__ = ["fused_head_token_scores", "fusable_head", "head_grads_in_place"]

_IN_PLACE: ContextVar[bool] = ContextVar("lit_rlhf_head_grads_in_place", default=False)


@contextmanager
def head_grads_in_place(enabled: bool = True) -> Iterator[None]:
    """Within the block, fused heads whose weight already holds a gradient add the next ones into it in place.

    Only for one process (``enabled=False`` otherwise): the weight's gradient hooks (DDP's reducer, FSDP,
    ``register_post_accumulate_grad_hook``) do not see the micro-batches added in place. Decided per forward.
    """
    token = _IN_PLACE.set(bool(enabled))
    try:
        yield
    finally:
        _IN_PLACE.reset(token)


def _in_place_target(weight: torch.Tensor) -> nn.Parameter | None:
    """The parameter whose ``.grad`` a backward may add into in place, when ``head_grads_in_place`` allows it."""
    if not _IN_PLACE.get() or not isinstance(weight, nn.Parameter) or not weight.requires_grad:
        return None
    if weight.dtype not in (torch.float32, torch.float64) or weight._backward_hooks:
        return None
    return None if getattr(weight, "_post_accumulate_grad_hooks", None) else weight


def fusable_head(head: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether :func:`fused_head_token_scores` applies: a plain ``nn.Linear`` (no subclass, e.g. no
    quantised layer, no peft wrapper, no hooks) with a floating-point weight, outside autocast."""
    if type(head) is not nn.Linear or not head.weight.dtype.is_floating_point:
        return False
    if head._forward_hooks or head._forward_pre_hooks:
        return False
    return not torch.is_autocast_enabled(hidden.device.type)


def fused_head_token_scores(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tokens_per_chunk: int,
    entropy: bool = False,
    entropy_grad: bool = True,
    argmax: bool = False,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(N,) float32 log-probs, (N,) entropies (None unless ``entropy``) and (N,) argmax token ids (None
    unless ``argmax``) of the head ``hidden @ weight.T + bias``, divided by ``temperature``.

    Args:
        hidden: (N, H). labels: (N,) token ids in [0, V). weight: (V, H). bias: (V,) or None.
        temperature: > 0. tokens_per_chunk: >= 1 rows of logits per chunk.
        entropy: compute the entropy; entropy_grad: let gradients flow through it (else it is detached).
        argmax: also return the most likely token of each row.
        keep_logits: keep the float32 (N, V) scaled logits for the backward instead of recomputing them.
    """
    if tokens_per_chunk < 1:
        raise ValueError(f"fused_head_token_scores: tokens_per_chunk must be >= 1, got {tokens_per_chunk}")
    options = (temperature, tokens_per_chunk, entropy, entropy_grad, argmax, keep_logits)
    logprobs, ent, top = _FusedHeadScores.apply(hidden, labels, weight, bias, options)
    return logprobs, ent if entropy else None, top if argmax else None


def _accumulates(node: torch.autograd.graph.Node) -> bool:
    """Whether the running backward will call ``node`` (the weight's AccumulateGrad), i.e. add into ``.grad``."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):  # an older or newer torch without it: the plain path
        return False


class _FusedHeadScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, labels, weight, bias, options):
        temperature, tokens_per_chunk, want_entropy, entropy_grad, want_argmax, keep_logits = options
        logprobs, entropies, lses, tops, kept = [], [], [], [], []
        for h, y in zip(hidden.split(tokens_per_chunk), labels.split(tokens_per_chunk)):
            logits = torch_f.linear(h, weight, bias)  # (n, V) in the weight's dtype
            z = scaled_logits(logits, temperature)  # (n, V) float32
            logp, ent, lse = scaled_label_scores(z, y, entropy=want_entropy)  # (n,), (n,) | None, (n,)
            logprobs.append(logp)
            lses.append(lse)
            entropies.append(ent if want_entropy else logp.new_zeros(logp.shape))
            tops.append(logits.argmax(-1) if want_argmax else y.new_zeros(y.shape))  # (n,)
            if keep_logits:
                kept.append(z)
        logprobs, entropies, lse, top = torch.cat(logprobs), torch.cat(entropies), torch.cat(lses), torch.cat(tops)
        ctx.options = options
        ctx.in_place = _in_place_target(weight)  # the parameter itself (a leaf that outlives the graph) or None
        # its AccumulateGrad node: a backward adds in place only when that node runs (a .backward() into the
        # leaves, not torch.autograd.grad, which returns the gradient instead)
        ctx.accumulator = None if ctx.in_place is None else torch.autograd.graph.get_gradient_edge(weight).node
        ctx.save_for_backward(hidden, labels, weight, bias, lse, entropies, *kept)
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(top, *(() if want_entropy and entropy_grad else (entropies,)))
        return logprobs, entropies, top

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropies, _grad_argmax):
        temperature, tokens_per_chunk, want_entropy, entropy_grad, _, keep_logits = ctx.options
        hidden, labels, weight, bias, lse, entropies, *kept = ctx.saved_tensors
        need_hidden, _, need_weight, need_bias, _ = ctx.needs_input_grad
        grad_entropies = grad_entropies if want_entropy and entropy_grad else None
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # (N, H)
        low_precision = weight.dtype not in (torch.float32, torch.float64)
        acc_dtype = torch.float32 if low_precision else weight.dtype
        # written by the first chunk's product, accumulated into by the others: no (V, H) zero fill; or, under
        # head_grads_in_place, the gradient already there accumulates every chunk's
        existing = ctx.in_place.grad if need_weight and ctx.in_place is not None else None
        if existing is not None and not _accumulates(ctx.accumulator):
            existing = None
        in_place = (
            existing is not None and existing.layout == torch.strided and existing.shape == weight.shape
            and existing.dtype == acc_dtype and existing.device == weight.device and not existing.requires_grad
        )  # fmt: skip
        grad_weight = None
        if need_weight:
            grad_weight = existing if in_place else torch.empty(weight.shape, dtype=acc_dtype, device=weight.device)
        grad_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if need_bias else None
        start = 0
        for i, h in enumerate(hidden.split(tokens_per_chunk)):
            rows = slice(start, start + h.shape[0])
            start = rows.stop
            z = kept[i] if keep_logits else scaled_logits(torch_f.linear(h, weight, bias), temperature)  # (n, V)
            grad_z = label_logprobs_and_entropy_grad_(
                z, labels[rows], lse[rows], grad_logprobs[rows],
                None if grad_entropies is None else grad_entropies[rows], entropies[rows], temperature,
            )  # fmt: skip  # (n, V) dL/dlogits, in z's memory
            grad_logits = grad_z.to(weight.dtype)  # (n, V)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])  # (n, H)
            if grad_weight is not None and i == 0 and not in_place:
                torch.mm(grad_logits.t().to(acc_dtype), h.to(acc_dtype), out=grad_weight)  # (V, H)
            elif grad_weight is not None:
                grad_weight.addmm_(grad_logits.t().to(acc_dtype), h.to(acc_dtype))  # (V, H)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0).to(acc_dtype)  # (V,)
        if in_place:
            grad_weight = None  # already added to weight.grad
        elif low_precision:
            grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
            grad_bias = None if grad_bias is None else grad_bias.to(weight.dtype)
        return grad_hidden, None, grad_weight, grad_bias, None

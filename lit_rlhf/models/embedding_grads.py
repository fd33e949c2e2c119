"""Input-embedding gradients accumulated in place, row by row, instead of as a dense (V, H) tensor per backward.

The backward of ``nn.Embedding`` builds a dense (V, H) gradient for every micro-batch: a fresh zero-filled
tensor the size of the vocabulary table (32.8 MB at V = 32,000, H = 256) into which the micro-batch's few
thousand token rows are added, and autograd then adds that whole tensor to ``weight.grad``. On a CPU both
passes over the table are memory-bound: measured on the W3 PPO benchmark (1 thread, an AMX Xeon) the 24 fills
and 24 adds of the actor's and the critic's tables took 0.5 s of a 3.4 s update, more than the optimiser.

Within :class:`EmbeddingGradAccumulator` each eligible embedding runs with ``sparse=True`` (its backward
returns the touched rows only, a sparse COO gradient), and a hook on its weight gives it a zeroed dense
(V, H) ``weight.grad`` the moment the first of these arrives after the gradient was removed (``zero_grad``);
autograd then adds each sparse gradient into that dense gradient in place (``AccumulateGrad``: dense +=
sparse). So ``weight.grad`` is the same dense tensor it always was wherever anything reads it (hooks,
clipping, the non-finite guard, the optimiser), equal to the dense path's up to the order of float additions,
and the table is zeroed once per optimiser step, in one buffer reused from step to step, instead of filled
and added once per micro-batch. The first step's buffer is made where the dense path makes its gradient, at
the embedding's backward, the last of the backward pass: not held through the first forward and the start of
its backward, where activations peak (the W1 benchmark, one optimiser step per update: 23 MB less peak RSS
than a buffer made before the forward).

Only where it cannot change anything else: a plain ``nn.Embedding`` (or subclass) with a trainable weight of
at least :data:`ACCUMULATE_MIN_ELEMENTS` elements on the CPU, not tied to a linear layer (a tied LM head's
gradient is dense anyway), not managed by FSDP, and only when the caller runs one process (DDP's reducer
hooks each parameter's gradient and does not take sparse ones on every backend). Elsewhere nothing changes.

Shapes: V vocabulary (rows of the table), H embedding width.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from types import TracebackType

import torch
from torch import nn

from lit_rlhf.models.lm_head import _sharded

__all__ = ["ACCUMULATE_MIN_ELEMENTS", "EmbeddingGradAccumulator", "accumulated_embeddings"]

# Below 2**20 elements (4 MiB of float32) the dense gradient stays in cache and costs little.
ACCUMULATE_MIN_ELEMENTS = 1 << 20


def accumulated_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The embeddings of ``model`` whose gradients :class:`EmbeddingGradAccumulator` accumulates in place."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    found = []
    for module in model.modules():
        if not isinstance(module, nn.Embedding) or module.sparse:
            continue
        weight = module.weight
        if (
            isinstance(weight, nn.Parameter)
            and weight.requires_grad
            and weight.device.type == "cpu"
            and weight.is_floating_point()
            and weight.numel() >= ACCUMULATE_MIN_ELEMENTS
            and id(weight) not in linear_weights
            and not _sharded(model, module)
        ):
            found.append(module)
    return found


class EmbeddingGradAccumulator:
    """Context manager: the eligible embeddings of ``models`` accumulate their gradients row by row.

    On entry each embedding runs sparse and its weight gets a gradient hook that, when the first sparse
    gradient of an optimiser step arrives, gives it the zeroed dense (V, H) buffer to accumulate into (made
    then, at the first step; a gradient already there, dense, is accumulated into as it is); on exit every
    embedding is dense again (``sparse`` restored), the hooks are removed and the buffers released.

    Args:
        models: the trained models (an actor, a critic, ...).
        enabled: False changes nothing (for example under DDP).
    """

    def __init__(self, models: Sequence[nn.Module], enabled: bool = True) -> None:
        seen: set[int] = set()
        self.embeddings: list[nn.Embedding] = []
        for model in models if enabled else ():
            for embedding in accumulated_embeddings(model):
                if id(embedding) not in seen:
                    seen.add(id(embedding))
                    self.embeddings.append(embedding)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._buffers: dict[int, torch.Tensor] = {}

    def __enter__(self) -> EmbeddingGradAccumulator:
        for embedding in self.embeddings:
            embedding.sparse = True
            self._hooks.append(embedding.weight.register_hook(partial(self._dense_grad_for, embedding.weight)))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._buffers.clear()
        for embedding in self.embeddings:
            embedding.sparse = False
            grad = embedding.weight.grad
            if grad is not None and grad.is_sparse:  # someone else's sparse gradient: dense again
                embedding.weight.grad = grad.to_dense()

    def _dense_grad_for(self, weight: torch.Tensor, grad: torch.Tensor) -> None:
        """Gradient hook of ``weight``: before autograd accumulates ``grad`` (sparse, the touched rows), give
        ``weight`` the zeroed dense buffer to add it into, unless it has a gradient."""
        if weight.grad is not None or not grad.is_sparse:
            return
        buffer = self._buffers.get(id(weight))
        if buffer is None:
            buffer = self._buffers[id(weight)] = torch.zeros_like(weight)  # (V, H)
        else:
            buffer.zero_()
        weight.grad = buffer

"""Input-embedding gradients accumulated in place, row by row, instead of as a dense (V, H) tensor per backward.

The backward of ``nn.Embedding`` builds a dense (V, H) gradient for every micro-batch: a fresh zero-filled
tensor the size of the vocabulary table (32.8 MB at V = 32,000, H = 256) into which the micro-batch's few
thousand token rows are added, and autograd then adds that whole tensor to ``weight.grad``. On a CPU both
passes over the table are memory-bound: measured on the W3 PPO benchmark (1 thread, an AMX Xeon) the 24 fills
and 24 adds of the actor's and the critic's tables took 0.5 s of a 3.4 s update, more than the optimiser.

Within :class:`EmbeddingGradAccumulator` each eligible embedding runs with ``sparse=True`` (its backward
returns the touched rows only, a sparse COO gradient) and, before the first backward of every optimiser
step, gets a zeroed dense buffer as its ``weight.grad``; autograd then adds each sparse gradient into that
dense gradient in place (``AccumulateGrad``: dense += sparse). So ``weight.grad`` is the same dense tensor
it always was wherever anything reads it (hooks, clipping, the non-finite guard, the optimiser), equal to the
dense path's up to the order of float additions, and the table is zeroed once per step in memory that stays
mapped instead of filled and added once per micro-batch.

Only where it cannot change anything else: a plain ``nn.Embedding`` (or subclass) with a trainable weight of
at least :data:`ACCUMULATE_MIN_ELEMENTS` elements on the CPU, not tied to a linear layer (a tied LM head's
gradient is dense anyway), not managed by FSDP, and only when the caller runs one process (DDP's reducer
hooks each parameter's gradient and does not take sparse ones on every backend). Elsewhere nothing changes.

Shapes: V vocabulary (rows of the table), H embedding width.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    Call :meth:`attach` before the first backward of every optimiser step (after ``zero_grad``); on exit
    every embedding is dense again (``sparse`` restored) and the buffers are released.

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
        self._buffers: dict[int, torch.Tensor] = {}

    def __enter__(self) -> EmbeddingGradAccumulator:
        for embedding in self.embeddings:
            embedding.sparse = True
        return self

    def attach(self) -> None:
        """Give every embedding without a gradient a zeroed (V, H) dense one to accumulate into."""
        for embedding in self.embeddings:
            weight = embedding.weight
            if weight.grad is not None:  # already accumulating (or a gradient someone else put there)
                continue
            buffer = self._buffers.get(id(embedding))
            if buffer is None or buffer.shape != weight.shape or buffer.dtype != weight.dtype:
                buffer = self._buffers[id(embedding)] = torch.zeros_like(weight)
            else:
                buffer.zero_()
            weight.grad = buffer  # (V, H)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for embedding in self.embeddings:
            embedding.sparse = False
            grad = embedding.weight.grad
            if grad is not None and grad.is_sparse:  # a backward after the last attach: make it dense again
                embedding.weight.grad = grad.to_dense()
        self._buffers.clear()

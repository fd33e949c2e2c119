"""The rollout's replay buffer (seeded minibatches for the update epochs) and the record of the old
log-probs an on-policy update computes itself.

Shapes: B rollout rows, T response length.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from lit_rlhf.rollout import Rollout

__all__ = ["ReplayBuffer", "UpdateRecord"]


class ReplayBuffer:
    """Holds the current rollout and yields seeded, shuffled minibatches for the inner PPO epochs.

    Its generator state is part of the PPO checkpoint, so a resumed run draws the same minibatches.
    A rollout put with ``group_size`` K > 1 is shuffled by groups of K consecutive rows (a prompt's
    K responses stay together and in order, for the shared-prompt layout): the minibatches then hold
    whole groups, a different composition (and a different draw of the generator) than row shuffling.

    Args:
        num_minibatches: minibatches per PPO epoch; the rollout's rows are split evenly among them.
        seed: seed of the shuffling generator.
    """

    def __init__(self, num_minibatches: int, seed: int = 0) -> None:
        if num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
        self.num_minibatches = num_minibatches
        self.generator = torch.Generator().manual_seed(seed)
        self.rollout: Rollout | None = None
        self.group_size = 1

    def put(self, rollout: Rollout, group_size: int = 1) -> None:
        """Hold ``rollout``; ``group_size`` > 1 shuffles groups of that many consecutive rows."""
        if group_size < 1 or rollout.batch_size % group_size:
            raise ValueError(
                f"group_size={group_size} must be >= 1 and divide the rollout's {rollout.batch_size} rows"
            )
        units = rollout.batch_size // group_size
        if units < self.num_minibatches:
            what = "rows" if group_size == 1 else f"groups of {group_size} rows"
            raise ValueError(
                f"a rollout of {units} {what} cannot be split into "
                f"num_minibatches={self.num_minibatches}; raise the prompt batch size or lower num_minibatches"
            )
        self.rollout, self.group_size = rollout, group_size

    def minibatches(self) -> Iterator[Rollout]:
        """One PPO epoch: a fresh permutation of the rows (or groups) cut into ``num_minibatches`` parts."""
        if self.rollout is None:
            raise RuntimeError("ReplayBuffer is empty: put() a rollout first")
        K = self.group_size
        order = torch.randperm(self.rollout.batch_size // K, generator=self.generator)  # (B / K,)
        for groups in order.tensor_split(self.num_minibatches):
            index = (groups[:, None] * K + torch.arange(K)).flatten()  # the groups' rows, in order
            minibatch = self.rollout.select(index.to(self.rollout.input_ids.device))
            yield minibatch if minibatch.rows is not None else replace(minibatch, rows=index)

    def clear(self) -> None:
        self.rollout = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


class UpdateRecord:
    """The old log-probs and entropy of a rollout, written back row by row from the update's forwards.

    When a rollout is used for exactly one optimiser step, the policy of that step's forwards is the
    rollout policy itself, so their log-probs are the old log-probs (the ratio is exactly 1) and the
    separate no-grad scoring forward of the actor can be skipped; this record collects them (and the
    entropy) for the rollout statistics. Rows come from :attr:`Rollout.rows`; columns a micro-batch
    trimmed stay 0, as in ``score_rollout``.

    Args:
        like: a (B, T) tensor of the rollout (shape, device).
    """

    def __init__(self, like: torch.Tensor) -> None:
        self.logprobs = torch.zeros_like(like, dtype=torch.float32)  # (B, T)
        self.entropy = torch.zeros_like(like, dtype=torch.float32)  # (B, T)

    def put(self, rows: torch.Tensor | None, logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Store a micro-batch's (b, t) log-probs and entropy at its rollout ``rows``; return the
        log-probs detached (the micro-batch's old log-probs)."""
        if rows is None:
            raise ValueError("UpdateRecord.put: the micro-batch has no `rows` (take it from ReplayBuffer.minibatches)")
        old = logprobs.detach()
        t = old.shape[1]
        self.logprobs[rows, :t] = old.float()
        self.entropy[rows, :t] = entropy.detach().float()
        return old

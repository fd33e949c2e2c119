"""A seeded, rank-aware training sampler that can resume in the middle of an epoch.

Exact resume: the order of epoch ``e`` is a pure function of ``(seed, e)``, so a restarted run only has
to know how many samples of that epoch were already consumed. The data modules save
``{"epoch", "consumed"}`` in their ``state_dict`` (Lightning stores it in every checkpoint) and hand it
to a new sampler in ``train_dataloader``; a resumed ``Trainer.fit(ckpt_path=...)`` therefore continues
with exactly the batch that would have come next. Code driving the sampler by hand calls
``set_epoch(e)`` then ``set_consumed(batches_done * batch_size * num_replicas)``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, Sampler


class ResumableSampler(DistributedSampler):
    """Shuffle with ``randperm(n, seed + epoch)``, shard over ranks, optionally skip consumed samples.

    With nothing consumed the order is exactly ``torch.utils.data.DistributedSampler``'s: the global
    permutation, padded by repeating its head to a multiple of ``num_replicas`` (or cut when
    ``drop_last``), rank ``r`` taking positions ``r, r + num_replicas, ...``. ``set_consumed(k)`` removes
    the first ``k`` positions of the global permutation (samples consumed by all ranks together) before
    padding and sharding, so a resume may even use a different number of ranks.

    Subclassing ``DistributedSampler`` keeps Lightning from wrapping it in another distributed sampler;
    ``num_replicas``/``rank`` default to torch.distributed's when it is initialised, else 1/0.
    ``len()`` is the full epoch's count per rank even after a skip: Lightning counts the batches done
    before a restart itself and ends the epoch at the full count.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
        epoch_offset: int = 0,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        num_replicas = (
            num_replicas if num_replicas is not None else dist.get_world_size() if distributed else 1
        )
        rank = rank if rank is not None else dist.get_rank() if distributed else 0
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.consumed = 0
        self.epoch_offset = epoch_offset

    def set_epoch(self, epoch: int) -> None:
        """Select the order of epoch ``epoch - epoch_offset`` (Lightning passes its own epoch number; the
        offset counts the epochs a run cut short and then resumed had continued in the next one); a *different*
        epoch starts from its beginning (``consumed = 0``)."""
        if epoch - self.epoch_offset != self.epoch:
            self.consumed = 0
        super().set_epoch(epoch - self.epoch_offset)

    def set_consumed(self, consumed: int) -> None:
        """Skip the first ``consumed`` samples (all ranks together) of the current epoch."""
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        self.consumed = consumed

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        rest = order[self.consumed :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        else:
            pad = -len(rest) % self.num_replicas
            rest += (order * math.ceil(pad / n))[:pad] if pad else []
        return iter(rest[self.rank :: self.num_replicas])


class HeldOutBatches(BatchSampler):
    """Batches of held-out rows (validation, test), every row once, on every number of ranks.

    One process: plain batches of ``batch_size`` in order. Several: Lightning injects a
    ``DistributedSampler`` as ``sampler`` (it re-instantiates this class with it), which pads the ranks
    to equal shares by repeating rows: metrics would count those rows twice. Here rank ``r`` takes rows
    ``r, r + world, ...`` (the unshuffled sampler's shares without the padding), cut into as many batches
    as padding would give every rank (``ceil(rows / (world * batch_size))``), sized as evenly as possible
    and never above ``batch_size``: every rank runs the same number of steps (FSDP's collective forwards,
    synced generation and per-step reductions stay in step) and each row counts once in the means,
    which Lightning and torchmetrics reduce weighted by rows. Where some rank would hold fewer rows than that
    number of batches (fewer rows than ranks; or a batch size of 1 with rows that do not divide by the ranks)
    the sampler's padding is kept, and a warning says how many rows it repeats.
    """

    def __init__(self, sampler: Sampler[int] | Iterable[int], batch_size: int, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)

    def _shares(self) -> list[list[int]] | None:
        """This rank's batches (None: one process, or too few rows: the sampler's own batches)."""
        sampler = self.sampler
        if not isinstance(sampler, DistributedSampler) or sampler.num_replicas == 1:
            return None
        rows, world = len(sampler.dataset), sampler.num_replicas
        own = list(range(sampler.rank, rows, world))  # this rank's rows, unpadded
        batches = math.ceil(rows / (world * self.batch_size))
        if rows < world * batches:  # some rank would hold fewer rows than batches
            if not getattr(self, "_warned", False):
                self._warned = True
                repeated = math.ceil(rows / world) * world - rows
                warnings.warn(
                    f"held-out rows: {rows} rows over {world} ranks in batches of {self.batch_size} cannot give every"
                    f" rank the same number of batches; {repeated} rows are evaluated twice (a batch size that"
                    " spreads the rows, or a row count that divides by the ranks, avoids it)",
                    stacklevel=2,
                )
            return None
        size, extra = divmod(len(own), batches)
        bounds = [i * size + min(i, extra) for i in range(batches + 1)]
        return [own[bounds[i] : bounds[i + 1]] for i in range(batches)]

    def __iter__(self) -> Iterator[list[int]]:
        shares = self._shares()
        return iter(shares) if shares is not None else super().__iter__()

    def __len__(self) -> int:
        shares = self._shares()
        return len(shares) if shares is not None else super().__len__()

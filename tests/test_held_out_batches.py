"""Held-out batches on several ranks (lit_rlhf.data.sampler.HeldOutBatches): every row once, the same number of
batches on every rank, none above the batch size; one process batches as a plain DataLoader does. Lightning's
re-instantiation with the DistributedSampler it injects is exercised here; the two-process validation whose
metrics equal one process's is in tests/test_distributed.py (23 DPO pairs on two ranks)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

from lit_rlhf.data.sampler import HeldOutBatches


def _ranks(rows: int, world: int, batch_size: int) -> list[list[list[int]]]:
    data = list(range(rows))
    return [
        list(HeldOutBatches(DistributedSampler(data, num_replicas=world, rank=r, shuffle=False), batch_size))
        for r in range(world)
    ]


@pytest.mark.filterwarnings("ignore:held-out rows")  # the padded cases warn (tested below)
@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 60), world=st.integers(2, 5), batch_size=st.integers(1, 9))
def test_every_row_once_and_the_same_number_of_batches_on_every_rank(rows, world, batch_size):
    ranks = _ranks(rows, world, batch_size)
    counts = {len(batches) for batches in ranks}
    assert counts == {math.ceil(math.ceil(rows / world) / batch_size)}, "as many steps as the padded sampler gives"
    assert all(0 < len(b) <= batch_size for batches in ranks for b in batches)
    seen = sorted(i for batches in ranks for b in batches for i in b)
    if rows >= world * counts.pop():
        assert seen == list(range(rows)), "each row exactly once"
    else:  # fewer rows than ranks x batches: the padding sampler's rows, some repeated (and a warning)
        assert sorted(set(seen)) == list(range(rows))
        assert len(seen) == math.ceil(rows / world) * world, "the padding sampler's count"


def test_by_hand_and_in_one_process():
    # 9 rows, 2 ranks, batch 2: padding would give each rank 5 rows (3 batches, row 0 twice);
    # here rank 0 holds 0 2 4 6 8 and rank 1 holds 1 3 5 7, each in 3 batches
    assert _ranks(9, 2, 2) == [[[0, 2], [4, 6], [8]], [[1, 3], [5], [7]]]
    single = HeldOutBatches(SequentialSampler(range(5)), 2, drop_last=False)
    assert list(single) == [[0, 1], [2, 3], [4]] and len(single) == 3


def test_a_batch_size_of_one_over_uneven_rows_keeps_the_padding_and_warns():
    with pytest.warns(UserWarning, match="5 rows over 2 ranks in batches of 1 .* 1 rows are evaluated twice"):
        ranks = _ranks(5, 2, 1)
    assert [len(b) for b in ranks] == [3, 3] and sorted(i for r in ranks for b in r for i in b) == [0, 0, 1, 2, 3, 4]


def test_lightning_injects_its_distributed_sampler_into_it():
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    data = list(range(23))
    loader = DataLoader(data, batch_sampler=HeldOutBatches(SequentialSampler(data), 4, drop_last=False))
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)
        batches = [b.tolist() for b in _update_dataloader(loader, sampler, mode=RunningStage.VALIDATING)]
        assert len(batches) == 3
        seen += [i for b in batches for i in b]
    assert sorted(seen) == data

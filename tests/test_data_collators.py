"""Collators (shapes, padding sides, masks, labels) and the resumable sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.data.collators import PreferenceCollator, PromptCollator, SFTCollator, pad
from lit_rlhf.data.sampler import ResumableSampler

PAD, EOS = 0, 9


def test_prompt_collator_left_pads():
    batch = PromptCollator(PAD)([{"prompt_input_ids": [5, 6, 7]}, {"prompt_input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert set(batch) == {"input_ids", "attention_mask"}


def test_preference_collator_chosen_first_right_padded():
    rows = [
        {
            "prompt_input_ids": [1, 2],
            "chosen_input_ids": [3, EOS],
            "rejected_input_ids": [4, 5, EOS],
            "margin": 2,
        },
        {"prompt_input_ids": [6], "chosen_input_ids": [7, EOS], "rejected_input_ids": [EOS], "margin": 0.5},
    ]
    batch = PreferenceCollator(PAD)(rows)
    # rows: chosen of pair 0, chosen of pair 1, rejected of pair 0, rejected of pair 1; L = 2 + 3 = 5
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9, 0], [6, 7, 9, 0, 0], [1, 2, 4, 5, 9], [6, 9, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
    ]
    assert batch["response_mask"].tolist() == [
        [0, 0, 1, 1, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1],
        [0, 1, 0, 0, 0],
    ]
    assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [2.0, 0.5]


def test_preference_collator_without_margin():
    rows = [{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}]
    assert set(PreferenceCollator(PAD)(rows)) == {"input_ids", "attention_mask", "response_mask"}


def test_sft_collator_labels_only_on_the_completion():
    rows = [
        {"prompt_input_ids": [1, 2], "completion_input_ids": [3, EOS]},
        {"prompt_input_ids": [4, 5, 6], "completion_input_ids": [EOS]},
    ]
    batch = SFTCollator(PAD)(rows)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 5, 6, 9]]
    assert batch["labels"].tolist() == [[-100, -100, 3, 9], [-100, -100, -100, 9]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    short = SFTCollator(PAD)([rows[0], {"prompt_input_ids": [4], "completion_input_ids": [EOS]}])
    # the second row is padded on the right; padding is -100 in labels and 0 in both masks
    assert short["labels"].tolist()[1] == [-100, 9, -100, -100]
    assert short["attention_mask"].tolist()[1] == [1, 1, 0, 0]


rows_strategy = st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=6), min_size=1, max_size=5)


@given(rows=rows_strategy, side=st.sampled_from(["left", "right"]))
def test_pad_properties(rows, side):
    values, mask = pad(rows, PAD, side)
    assert values.shape == mask.shape == (len(rows), max(map(len, rows)))
    assert mask.sum(1).tolist() == [len(r) for r in rows]
    for i, row in enumerate(rows):
        assert values[i][mask[i].bool()].tolist() == row
        assert (values[i][~mask[i].bool()] == PAD).all()
    # padding sits on the requested side: a left-padded row's last token is real, a right-padded row's first
    assert bool(mask[:, -1 if side == "left" else 0].all())


# ------------------------------------------------------------------------------------------------ sampler
def test_sampler_matches_torch_distributed_sampler():
    data = range(11)
    for rank in range(3):
        ours = ResumableSampler(data, seed=5, num_replicas=3, rank=rank)
        ref = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=rank, seed=5)
        ours.set_epoch(2)
        ref.set_epoch(2)
        assert list(ours) == list(ref) and len(ours) == len(ref) == 4  # ceil(11 / 3)


def test_sampler_deterministic_per_seed_and_epoch():
    sampler = ResumableSampler(range(40), seed=1)
    epoch0 = list(sampler)
    assert epoch0 == list(ResumableSampler(range(40), seed=1))
    assert sorted(epoch0) == list(range(40))
    sampler.set_epoch(1)
    assert list(sampler) != epoch0  # 40! orders; equality would mean the epoch is ignored
    assert list(ResumableSampler(range(40), seed=2)) != epoch0


def test_sampler_defaults_to_a_single_replica_without_distributed():
    sampler = ResumableSampler(range(5))
    assert (sampler.num_replicas, sampler.rank) == (1, 0)


def test_set_epoch_to_a_new_epoch_forgets_consumed():
    sampler = ResumableSampler(range(10), seed=0)
    sampler.set_epoch(3)
    sampler.set_consumed(4)
    sampler.set_epoch(3)  # Lightning calls set_epoch again for the resumed epoch: keep the skip
    assert len(list(sampler)) == 6 and len(sampler) == 10
    sampler.set_epoch(4)
    assert len(list(sampler)) == 10
    with pytest.raises(ValueError):
        sampler.set_consumed(-1)


@settings(max_examples=60)
@given(
    n=st.integers(1, 40),
    replicas=st.integers(1, 4),
    batches=st.integers(0, 12),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_resume_yields_the_remaining_order(n, replicas, batches, epoch, drop_last):
    # consumed counts all ranks together: k per-rank samples done on each of `replicas` ranks
    for rank in range(replicas):
        full = ResumableSampler(range(n), seed=7, num_replicas=replicas, rank=rank, drop_last=drop_last)
        full.set_epoch(epoch)
        resumed = ResumableSampler(range(n), seed=7, num_replicas=replicas, rank=rank, drop_last=drop_last)
        resumed.set_epoch(epoch)
        resumed.set_consumed(batches * replicas)
        assert list(resumed) == list(full)[batches:]


@given(n=st.integers(1, 30), replicas=st.integers(1, 4))
def test_ranks_partition_the_epoch(n, replicas):
    shards = [
        list(ResumableSampler(range(n), seed=3, num_replicas=replicas, rank=r)) for r in range(replicas)
    ]
    assert len({len(s) for s in shards}) == 1  # equal shares, or ranks would wait on each other
    assert set().union(*shards) == set(range(n))
    assert sum(map(len, shards)) - n < replicas  # only the padding repeats samples


def _shard_in_process_group(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        sampler = ResumableSampler(range(10), seed=4)  # replicas and rank from torch.distributed
        torch.save((sampler.num_replicas, sampler.rank, list(sampler)), f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_sampler_takes_rank_and_world_size_from_torch_distributed(tmp_path):
    torch.multiprocessing.spawn(
        _shard_in_process_group, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True
    )
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert [(r[0], r[1]) for r in results] == [(2, 0), (2, 1)]
    expected = [list(ResumableSampler(range(10), seed=4, num_replicas=2, rank=rank)) for rank in range(2)]
    assert [r[2] for r in results] == expected and not set(expected[0]) & set(expected[1])

"""Data-parallel ranks: each samples its rollouts from its own random stream (OnlineGeneration.rank_sampling_rng),

``seed_everything`` seeds every rank alike: ranks that drew from the global RNG sampled the same variates, and
for identical prompts the same responses. With several ranks a rollout's draws come from a fork seeded by
(rng_seed, rank, rollout): different across ranks, the same on a rerun or a resume, the global streams left
alone. One process keeps sampling from the global RNG (single-process runs are unchanged).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import torch
from conftest import gpt2_config
from ppo_helpers import tiny_critic_free


def _draws(module, world: int, rank: int, rollouts: int) -> tuple[torch.Tensor, float, float]:
    module._trainer = SimpleNamespace(world_size=world, global_rank=rank)
    module.rollouts_done = rollouts
    with module.rank_sampling_rng():
        return torch.rand(4), random.random(), float(np.random.rand())


def test_ranks_draw_apart_and_repeat_per_rollout(tokenizer_dir):
    module = tiny_critic_free(tokenizer_dir, gpt2_config())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    rank0, rank1 = _draws(module, 2, 0, 3), _draws(module, 2, 1, 3)
    assert not torch.equal(rank0[0], rank1[0]) and rank0[1] != rank1[1] and rank0[2] != rank1[2]
    again = _draws(module, 2, 1, 3)  # a rerun (or a resume) of that rollout on that rank
    assert torch.equal(again[0], rank1[0]) and again[1:] == rank1[1:]
    assert not torch.equal(_draws(module, 2, 1, 4)[0], rank1[0]), "the next rollout draws anew"
    # the global streams are where they were
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_one_process_samples_from_the_global_stream(tokenizer_dir):
    module = tiny_critic_free(tokenizer_dir, gpt2_config())
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(_draws(module, 1, 0, 3)[0], expected)


def test_the_ratio_threshold_decides_on_every_ranks_mean(tokenizer_dir, monkeypatch):
    """update.ratio_threshold skipped a minibatch on the rank whose own ratio exceeded it while another rank
    stepped: DDP's copies of the model parted ways. The decision now reads the ranks' mean ratio."""
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), update={"ratio_threshold": 1.5, "max_grad_norm": None})
    reduced = []

    def reduce(tensor, reduce_op):  # another rank's ratio 2.6: the mean of (1.0, 2.6) is 1.8
        reduced.append(reduce_op)
        return (tensor + 2.6) / 2

    module._trainer = SimpleNamespace(world_size=2, global_rank=0,
                                      strategy=SimpleNamespace(reduce=reduce, reduce_boolean_decision=lambda d, all: d))  # fmt: skip
    monkeypatch.setattr(module, "accumulate_minibatch", lambda loss_fn, mb: {"ratio_mean": torch.tensor(1.0)})
    monkeypatch.setattr(module.step_guard, "allow_step", lambda params, reduce: True)
    stepped = []
    optimizer = SimpleNamespace(step=lambda: stepped.append(1), zero_grad=lambda set_to_none: None)
    monkeypatch.setattr(module.update_metrics, "update", lambda values: None)
    _, took_step = module.minibatch_step(None, None, [(optimizer, module.actor)], [])
    assert reduced == ["mean"] and not took_step and not stepped, "skipped on every rank: the mean 1.8 > 1.5"

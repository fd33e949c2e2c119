"""PeakMemory logs ``memory/*`` on the loggers' step axis: for an online module the rollout index (one
optimiser step per minibatch and epoch would put it far past the last rollout)."""

from __future__ import annotations

import csv

from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf import PeakMemory


def test_an_online_modules_memory_figures_are_logged_at_the_rollout_count(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=2, update={"epochs": 2, "num_minibatches": 2})
    fit = trainer(tmp_path, callbacks=[PeakMemory()])
    fit.fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    assert fit.global_step > 2 * module.rollouts_done  # optimiser steps: epochs x minibatches per rollout
    rows = list(csv.DictReader(open(f"{fit.logger.log_dir}/metrics.csv")))
    rollouts = [int(r["step"]) for r in rows if r.get("rollout/score")]
    memory = [int(r["step"]) for r in rows if r.get("memory/train_peak_rss_mb")]
    assert rollouts == [0, 1]
    assert memory == [2], "memory/* belongs after the last rollout on the rollout axis"

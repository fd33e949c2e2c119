"""Evaluation rollouts screen their scores as training rollouts do (``scoring.on_nonfinite``)."""

from __future__ import annotations

import math

import ppo_rewards
import pytest
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf.guards import NonFiniteError


def test_a_nan_score_stops_the_evaluation_under_raise(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn="ppo_rewards:always_nan")
    with pytest.raises(NonFiniteError, match=r"val after rollout 0: .*always_nan.* returned non-finite"):
        trainer(tmp_path).validate(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))


def test_nan_scores_are_left_out_of_the_means_under_drop(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn="ppo_rewards:nan_every_other",
                              monitor_reward_fn="ppo_rewards:nan_every_other", scoring={"on_nonfinite": "drop"},
                              )  # fmt: skip
    seen = []
    real = ppo_rewards.nan_every_other
    module.rewards.fn = lambda p, r: (seen.extend(real(p, r)) or real(p, r))
    (metrics,) = trainer(tmp_path).validate(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    kept = [s for s in seen if not math.isnan(s)]
    assert 0 < len(kept) < len(seen), "some rows were NaN, some were not"
    assert metrics["val/score"] == pytest.approx(sum(kept) / len(kept))
    assert math.isfinite(metrics["val/monitor_score"])

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


def test_an_evaluation_batch_without_a_finite_score_adds_no_rows_under_drop(tokenizer_dir, tmp_path):
    # batch 0 ('the food was') scores finitely, batch 1 ('i loved the', e.g. an unparseable gold answer) has
    # no finite row: under drop it adds no rows to the means instead of stopping the evaluation
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn="ppo_rewards:the_count",
                              monitor_reward_fn="ppo_rewards:the_count", scoring={"on_nonfinite": "drop"})  # fmt: skip
    seen = []

    def nan_for_loved(prompts, responses):
        scores = [math.nan if "loved" in p else 1.0 + len(r) for p, r in zip(prompts, responses)]
        seen.extend(scores)
        return scores

    module.rewards.fn = module.monitor.fn = nan_for_loved
    (metrics,) = trainer(tmp_path).validate(module, prompt_loader(tokenizer_dir, n=2, batch_size=1))
    kept = [s for s in seen if not math.isnan(s)]
    assert 0 < len(kept) == len(seen) / 2  # the reward's and the monitor's rows of batch 0
    assert metrics["val/score"] == pytest.approx(sum(kept) / len(kept))
    assert metrics["val/monitor_score"] == pytest.approx(sum(kept) / len(kept))

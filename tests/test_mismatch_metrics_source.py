"""The engine-vs-trainer mismatch (``rollout/logprob_diff_*``, ``rollout/is_ratio_*``) is logged only where a
trainer forward computed the old log-probs: where they are the sampler's own record (``scoring.old_logprobs``
auto/sampler with the HF engine in float32) it would compare the sampler with itself, 0 / 1 by construction."""

from __future__ import annotations

import csv

import pytest
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer

COMPARED = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/is_ratio_min", "rollout/is_ratio_max")


def rollout_rows(fit) -> list[dict[str, str]]:
    rows = csv.DictReader(open(f"{fit.logger.log_dir}/metrics.csv"))
    return [{k: v for k, v in r.items() if v} for r in rows if r.get("rollout/score")]


@pytest.mark.parametrize(
    "build, overrides, compared",
    [
        (tiny_critic_free, {"scoring": {"old_logprobs": "auto"}}, False),
        (tiny_critic_free, {"scoring": {"old_logprobs": "sampler"}}, False),
        (tiny_ppo, {"scoring": {"old_logprobs": "auto"}}, False),
        (tiny_critic_free, {"scoring": {"old_logprobs": "forward"}}, True),
        (tiny_ppo, {"scoring": {"old_logprobs": "forward"}}, True),
        # an on-policy critic-free update: the old log-probs come from the update's own forward
        (tiny_critic_free, {"update": {"epochs": 1, "num_minibatches": 1}, "kl": {"coef": 0.0}}, True),
    ],
    ids=["grpo auto", "grpo sampler", "ppo auto", "grpo forward", "ppo forward", "grpo on-policy"],
)
def test_the_mismatch_is_logged_only_against_a_trainer_forward(tokenizer_dir, tmp_path, build, overrides, compared):
    module = build(tokenizer_dir, gpt2_config(), max_rollouts=2, **overrides)
    fit = trainer(tmp_path)
    fit.fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    rows = rollout_rows(fit)
    assert len(rows) == 2
    for row in rows:
        assert "rollout/kept_mass_mean" in row, "the engine's truncation is reported either way"
        if compared:
            assert set(COMPARED) <= set(row)
            assert float(row["rollout/logprob_diff_max"]) < 1e-4  # the HF engine: float rounding only
        else:
            assert not set(COMPARED) & set(row), sorted(set(COMPARED) & set(row))

"""Verifiable rewards in a run: GRPO with two weighted reward functions (one reading a prompt-row column through
PromptDataModule) learns and logs each function's raw score by name, in training and evaluation rollouts;
unparseable gold answers are counted and dropped; the config is parsed and run through the lit-rlhf CLI."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import gpt2_config, make_corpus
from ppo_helpers import tiny_critic_free, trainer

from lit_rlhf.data import PromptDataModule
from lit_rlhf.guards import NonFiniteError

TERMS = [
    {"fn": "ppo_rewards:target_count", "weight": 1.0},  # TRL's form: reads each row's `target` column
    {"fn": "lit_rlhf.verifiable:repetition_penalty", "weight": 0.2, "name": "repetition", "kwargs": {"ngram_size": 2}},
]


def all_rows(folder) -> list[dict[str, float]]:
    (path,) = folder.glob("**/metrics.csv")
    with open(path) as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def prompt_data(tokenizer_dir, tmp_path, rows: list[dict], **kwargs) -> PromptDataModule:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataModule(tokenizer_dir, str(path), cache_dir=str(tmp_path / "cache"), seed=0, **kwargs)


def test_grpo_with_two_weighted_reward_functions_learns_and_logs_both(tokenizer_dir, tmp_path):
    rows = [{"prompt": " ".join(t.split()[:3]), "target": "the"} for t in make_corpus(40, seed=5)]
    data = prompt_data(tokenizer_dir, tmp_path, rows, batch_size=4, val_fraction=0.1, val_batch_size=4)
    generation = {"max_new_tokens": 8, "num_samples": 4, "sampler": "multinomial"}
    torch.manual_seed(0)
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=TERMS, max_rollouts=20, generation=generation)
    fit = trainer(tmp_path, check_val_every_n_epoch=None, val_check_interval=10, limit_val_batches=1)
    fit.fit(module, datamodule=data)
    rows = all_rows(tmp_path)
    rollouts = [r for r in rows if "rollout/score" in r]
    assert len(rollouts) == 20
    for row in rollouts:  # every rollout logs each function's raw score; the score is their weighted sum
        expected = 1.0 * row["rollout/reward/target_count"] + 0.2 * row["rollout/reward/repetition"]
        assert row["rollout/score"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert row["rollout/reward/repetition"] <= 0.0
        assert row["rollout/reward_nonfinite/target_count"] == row["rollout/reward_nonfinite/repetition"] == 0.0
    first = sum(r["rollout/reward/target_count"] for r in rollouts[:5]) / 5
    last = sum(r["rollout/reward/target_count"] for r in rollouts[-5:]) / 5
    assert first < 0.5 and last > first + 1.5, (first, last)
    evaluations = [r for r in rows if "val/score" in r]
    assert len(evaluations) == 2  # after rollouts 10 and 20
    for row in evaluations:
        expected = 1.0 * row["val/reward/target_count"] + 0.2 * row["val/reward/repetition"]
        assert row["val/score"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert row["val/reward_nonfinite/target_count"] == 0.0
    assert module.hparams.reward_fn == [
        {"fn": "ppo_rewards:target_count", "weight": 1.0, "name": "target_count", "kwargs": None},
        {**TERMS[1]},
    ]
    (hparams,) = tmp_path.glob("ppo/version_*/hparams.yaml")
    assert "!!python" not in hparams.read_text()
    rebuilt = type(module)(**module.hparams)  # a checkpoint's hyper-parameters rebuild the same terms
    assert rebuilt.rewards.terms == module.rewards.terms


def math_rows(n: int) -> list[dict]:
    """Prompts whose gold answers alternate between a good one and one math-verify cannot parse."""
    return [{"prompt": f"the food was {i}", "answer": "1/2" if i % 2 == 0 else "???"} for i in range(n)]


def test_unparseable_gold_answers_are_counted_and_dropped(tokenizer_dir, tmp_path):
    data = prompt_data(tokenizer_dir, tmp_path, math_rows(8), batch_size=4, val_path=None, val_fraction=0.5)
    terms = [{"fn": "lit_rlhf.verifiable:accuracy"}, {"fn": "lit_rlhf.verifiable:format_reward", "weight": 0.5}]
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=terms, max_rollouts=2,
                              scoring={"on_nonfinite": "drop"}, generation={"max_new_tokens": 4, "num_samples": 2})  # fmt: skip
    with pytest.warns(UserWarning, match=r"cannot parse the gold answer '\?\?\?'"):
        trainer(tmp_path, check_val_every_n_epoch=None, val_check_interval=1).fit(module, datamodule=data)
    rows = all_rows(tmp_path)
    bad = [sum(a == "???" for a in split["column:answer"]) for split in (data.train_dataset, data.val_dataset)]
    assert bad[0] > 0 and 0 < bad[1] < 4  # the seeded carve: bad gold answers in both splits, a good one in val
    rollouts = [r for r in rows if "rollout/score" in r]
    assert len(rollouts) == 2
    for row in rollouts:  # each bad prompt's K = 2 rows are counted and dropped
        assert row["rollout/reward_nonfinite/accuracy"] == row["rollout/nonfinite_scores"] == 2.0 * bad[0]
        assert row["rollout/reward_nonfinite/format_reward"] == 0.0
        assert row["rollout/reward/accuracy"] == 0.0  # the finite ones: the random policy writes no 1/2
    evaluations = [r for r in rows if "val/score" in r]
    k = module.eval_generation.num_samples  # the evaluation's responses per prompt
    assert evaluations and all(r["val/reward_nonfinite/accuracy"] == k * bad[1] for r in evaluations)


def test_an_unparseable_gold_answer_stops_the_run_under_raise(tokenizer_dir, tmp_path):
    data = prompt_data(tokenizer_dir, tmp_path, math_rows(8), batch_size=4)
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=[{"fn": "lit_rlhf.verifiable:accuracy"}],
                              max_rollouts=1, generation={"max_new_tokens": 4, "num_samples": 2})  # fmt: skip
    with pytest.warns(UserWarning), pytest.raises(NonFiniteError, match=r"rollout 1: reward_fn \[accuracy x 1\] returned"):
        trainer(tmp_path).fit(module, datamodule=data)


CONFIG = """
seed_everything: 0
trainer:
  max_epochs: 1
  enable_checkpointing: false
  enable_progress_bar: false
  log_every_n_steps: 1
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {out}}}
model:
  class_path: lit_rlhf.modules.CriticFreeModule
  init_args:
    actor: {{config: {{model_type: gpt2, n_embd: 32, n_layer: 2, n_head: 2, n_positions: 128}}, tokenizer: {tok}}}
    reward_fn:
      - {{fn: lit_rlhf.verifiable:accuracy, weight: 1.0}}
      - {{fn: lit_rlhf.verifiable:soft_overlong_punishment, weight: 0.5, name: overlong,
         kwargs: {{max_length: 6, cache_length: 2}}}}
      - ppo_rewards:the_count
    generation: {{max_new_tokens: 6, num_samples: 2}}
    scoring: {{on_nonfinite: drop}}
    max_rollouts: 2
data:
  class_path: lit_rlhf.data.PromptDataModule
  init_args: {{tokenizer: {tok}, train_path: {prompts}, batch_size: 2, seed: 0}}
"""


def test_the_cli_parses_and_runs_a_weighted_reward_list(tokenizer_dir, tmp_path, monkeypatch):
    from test_configs import print_config

    from lit_rlhf.cli import run_cli

    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in math_rows(4)))
    path = tmp_path / "verifiable.yaml"
    path.write_text(CONFIG.format(out=tmp_path / "logs", tok=tokenizer_dir, prompts=prompts))
    printed = print_config(path)
    assert "name: overlong" in printed and "max_length: 6" in printed
    again = tmp_path / "printed.yaml"
    again.write_text(printed)
    assert print_config(again) == printed
    with pytest.warns(UserWarning, match="cannot parse the gold answer"):
        cli = run_cli(["fit", "--config", str(path)])
    assert [t.name for t in cli.model.rewards.terms] == ["accuracy", "overlong", "the_count"]
    rollouts = [r for r in all_rows(tmp_path / "logs") if "rollout/score" in r]
    assert len(rollouts) == 2
    for row in rollouts:
        assert {"rollout/reward/accuracy", "rollout/reward/overlong", "rollout/reward/the_count"} <= set(row)
        assert row["rollout/reward_nonfinite/accuracy"] == 2.0  # 1 of 2 prompts x K = 2

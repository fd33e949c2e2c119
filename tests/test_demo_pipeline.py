"""The demo pipeline: a miniature end-to-end run (--small) and its helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from lit_rlhf.demo import pipeline, report

REQUIRED_KEYS = (
    "rm_val_accuracy", "sft_gold_mean", "sft_gold_std", "ppo_gold_mean", "ppo_gold_std", "ppo_kl_ref",
    "sft_grammatical_rate", "ppo_grammatical_rate", "wall_s",
)  # fmt: skip


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    pipeline.main(["--out", str(out), "--small"])  # the over-optimisation run is on by default
    return out


def test_small_pipeline_writes_the_report(small_run):
    for name in ("report.md", "report.json", "samples.md", "ppo_reward_vs_kl.png", "rm_accuracy.png",
                 "ppo_overoptimize_reward_vs_kl.png"):  # fmt: skip
        assert (small_run / name).stat().st_size > 0, name
    summary = json.loads((small_run / "report.json").read_text())
    for key in REQUIRED_KEYS:
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    stages = summary["wall_s_per_stage"]
    assert set(stages) == {"assets", "sft", "rm", "ppo", "rm_weak", "ppo_overoptimize", "evaluate", "report"}
    assert summary["wall_s"] >= sum(stages.values()) - 1e-6
    # The SFT policy is its own reference: its KL is exactly zero.
    assert summary["sft_kl_ref"] == 0.0
    assert 0.0 <= summary["rm_val_accuracy"] <= 1.0
    assert summary["max_new_tokens"] >= summary["max_response_tokens"]
    assert summary["ppo_kl_budget"] == report.KL_BUDGET
    assert summary["ppo_within_kl_budget"] == (summary["ppo_kl_ref"] <= report.KL_BUDGET)


def test_small_pipeline_keeps_models_and_tensorboard_logs(small_run):
    for folder in ("sft", "rm", "ppo/actor", "ppo/critic", "rm_weak", "ppo_overoptimize/actor"):
        assert (small_run / folder / "config.json").exists(), folder
    for stage in ("sft", "rm", "ppo", "rm_weak", "ppo_overoptimize"):
        assert list((small_run / "tb" / stage).glob("events.out.tfevents.*")), stage
    ppo = report.read_scalars(small_run / "tb" / "ppo")
    # one point per rollout for the curves of the report
    assert len(ppo["rollout/kl_ref"]) == len(ppo["rollout/monitor_score"]) == 2


def test_assets_are_reused_for_the_same_settings(small_run, capsys):
    manifest = pipeline.build_or_reuse_assets(small_run / "assets", small=True, seed=0)
    assert "reusing" in capsys.readouterr().out
    assert manifest["args"]["n_sft"] == 256


def test_stage_configs_move_every_demo_path_under_out(tmp_path):
    for stage in ("sft", "rm", "ppo", "rm_weak", "ppo_overoptimize"):
        text = pipeline.stage_config(stage, tmp_path, small=False).read_text()
        assert "runs/demo" not in text, stage
        config = yaml.safe_load(text)
        assert config["trainer"]["logger"]["init_args"]["save_dir"] == str(tmp_path / "tb")


def test_small_overrides_merge_into_nested_config():
    base = {"model": {"init_args": {"lr": 1, "model": {"config": {"n_embd": 128}, "seed": 0}}}}
    merged = pipeline._merge(base, {"model": {"init_args": {"model": {"config": {"n_embd": 32}}}}})
    assert merged == {"model": {"init_args": {"lr": 1, "model": {"config": {"n_embd": 32}, "seed": 0}}}}
    assert base["model"]["init_args"]["model"]["config"] == {"n_embd": 128}  # not mutated


def test_window_means_by_hand():
    # windows of 2 over [1, 3, 5, 7, 9]: (1+3)/2 = 2, (5+7)/2 = 6; the lone 9 is dropped
    assert report.window_means([1.0, 3.0, 5.0, 7.0, 9.0], 2) == [2.0, 6.0]
    # fewer values than one window: a single mean of what there is
    assert report.window_means([1.0, 2.0], 4) == [1.5]


@given(st.lists(st.floats(-100, 100), min_size=1, max_size=50), st.integers(1, 10))
def test_window_means_cover_whole_windows(values, window):
    means = report.window_means(values, window)
    assert len(means) == max(len(values) // window, 1)
    for i, m in enumerate(means):
        part = values[i * window : (i + 1) * window]
        assert min(part) - 1e-9 <= m <= max(part) + 1e-9

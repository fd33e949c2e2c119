"""The demo pipeline: a miniature end-to-end run (--small) with four algorithms (PPO, GRPO, DPO, online DPO) and two
seeds, and its helpers."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

from lit_rlhf.demo import compare, curves, evaluate, pipeline, report, stages

REQUIRED_KEYS = (
    "rm_val_accuracy", "sft_gold_mean", "sft_gold_std", "ppo_gold_mean", "ppo_gold_std", "ppo_kl_ref",
    "sft_grammatical_rate", "ppo_grammatical_rate", "wall_s",
)  # fmt: skip
ALGORITHM_KEYS = {*compare.METRICS, "std", "min", "n_seeds", "seeds", "seeds_meeting_target",
                  "seeds_reaching_target_in_curve"}  # fmt: skip
ARGS = ["--small", "--algorithms", "ppo,grpo,dpo,online_dpo", "--seeds", "2", "--threads", "1", "--ensemble",
        "--kl-sweep", "0.1,0.01"]  # fmt: skip
# --ensemble: both ensembles' members and every reward source's run for every seed
ENSEMBLE = {"rm_weak_ensemble", "sft_seed1", "sft_seed2", "rm_weak_sft1", "rm_weak_sft2", "ppo_overoptimize_ensemble",
            "ppo_overoptimize_pretrain_ensemble", "ppo_overoptimize_seed1", "ppo_overoptimize_ensemble_seed1",
            "ppo_overoptimize_pretrain_ensemble_seed1", "rm_weak_disagreement_ensemble",
            "ppo_overoptimize_disagreement_ensemble", "ppo_overoptimize_disagreement_ensemble_seed1",
            "ppo_overoptimize_posterior", "ppo_overoptimize_posterior_seed1"}  # fmt: skip
SWEEP = {"ppo_overoptimize_kl0.1", "ppo_overoptimize_kl0.01", "ppo_overoptimize_kl0.1_seed1", "ppo_overoptimize_kl0.01_seed1"}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The miniature run, then the same command again with --reuse: (out, first summary, second summary)."""
    out = tmp_path_factory.mktemp("demo")
    first = pipeline.main(["--out", str(out), *ARGS])  # the over-optimisation run is on by default
    again = pipeline.main(["--out", str(out), *ARGS, "--reuse"])
    return out, first, again


def test_small_pipeline_writes_the_report(small_run):
    out, summary, again = small_run
    for name in ("report.md", "report.json", "samples.md", "ppo_reward_vs_kl.png", "rm_accuracy.png",
                 "ppo_overoptimize_reward_vs_kl.png", "algorithms_gold.png", "gold_vs_kl_frontier.png",
                 "ppo_overoptimize_ensemble_reward_vs_kl.png", "overoptimize_single_vs_ensemble.png",
                 "overoptimize_kl_sweep.png", "ppo_overoptimize_pretrain_ensemble_reward_vs_kl.png",
                 "ppo_overoptimize_disagreement_ensemble_reward_vs_kl.png",
                 "ppo_overoptimize_posterior_reward_vs_kl.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(again))  # the last run's
    for key in REQUIRED_KEYS:
        assert isinstance(summary[key], float) and math.isfinite(summary[key]), key
    runs = {"ppo", "ppo_seed1", "grpo", "grpo_seed1", "dpo", "dpo_seed1", "online_dpo", "online_dpo_seed1"}
    stages_run = summary["wall_s_per_stage"]
    over = {"rm_weak", "ppo_overoptimize", *ENSEMBLE}
    assert set(stages_run) == {"assets", "sft", "rm", "evaluate", "report"} | over | runs | SWEEP
    assert summary["wall_s"] >= sum(stages_run.values()) - 1e-6
    # The SFT policy is its own reference: its KL is exactly zero.
    assert summary["sft_kl_ref"] == 0.0
    assert 0.0 <= summary["rm_val_accuracy"] <= 1.0
    assert summary["max_new_tokens"] >= summary["max_response_tokens"]
    assert summary["ppo_kl_budget"] == report.KL_BUDGET == curves.KL_BUDGET
    assert summary["ppo_kl_target"] == stages.load_config("ppo", out, small=True)["model"]["init_args"]["kl"]["target"]
    assert summary["ppo_within_kl_budget"] == (summary["ppo_kl_ref"] <= report.KL_BUDGET)
    assert summary["n_seeds"] == 2 and summary["reused_stages"] == []
    assert summary["machine"]["threads"] == 1 and summary["machine"]["cpu"]  # the CPU the figures are from
    assert set(summary["machine"]["cpu_features"]) <= set(report.CPU_FEATURES)
    report_md = (out / "report.md").read_text()  # of the second, reusing run: same rows
    for name in ("ppo", "grpo", "dpo", "online_dpo"):
        assert f"| {name} | 0,1 |" in report_md, name
    assert "2 training seeds per algorithm" in report_md
    # the best-of-n frontier of the SFT policy: n = 1, 2, 4, 8 at the analytic KL, gold never below n = 1's
    points = summary["best_of_n_frontier"]
    assert [p["n"] for p in points] == [1, 2, 4, 8]
    assert [p["kl"] for p in points] == pytest.approx([math.log(n) - (n - 1) / n for n in (1, 2, 4, 8)])
    assert all(math.isfinite(p["gold_mean"]) for p in points)
    for entry in summary["algorithms"].values():
        for seed in entry["seeds"]:
            d = seed["frontier_distance"]
            assert d is None or math.isfinite(d)


def test_algorithms_entries_hold_per_seed_figures_and_their_spread(small_run):
    out, summary, _ = small_run
    assert list(summary["algorithms"]) == ["ppo", "grpo", "dpo", "online_dpo"]
    for name, entry in summary["algorithms"].items():
        assert set(entry) == ALGORITHM_KEYS, name
        assert [s["seed"] for s in entry["seeds"]] == [0, 1]
        assert [s["run"] for s in entry["seeds"]] == [name, f"{name}_seed1"]
        for seed in entry["seeds"]:
            for metric in ("gold_mean", "kl_ref", "grammatical_rate", "train_s", "wall_s", "peak_rss_mb"):
                assert isinstance(seed[metric], float) and math.isfinite(seed[metric]), (name, metric)
            assert seed["peak_rss_mb"] > 100  # a process that imported torch
            growth = seed["train_peak_rss_growth_mb"]  # PeakMemory's file of the run
            assert isinstance(growth, float) and 0.0 <= growth < seed["peak_rss_mb"], (name, growth)
            # The miniature SFT policy writes no grammatical review: gold has no spread, lift is undefined.
            assert summary["sft_gold_std"] == 0.0 and seed["gold_lift_sft_std"] is None
            assert seed["time_to_target_s"] is None and seed["steps_to_target"] is None
            assert seed["meets_target"] is False
            points = compare.read_curve(out / "curves" / f"{seed['run']}.json")
            assert [p["step"] for p in points] == [0, 1, 2]  # before training, after each of 2 rollouts
            assert points[0]["kl_ref"] == 0.0 and points[0]["seconds"] < points[-1]["seconds"]
        kl = [s["kl_ref"] for s in entry["seeds"]]
        assert entry["kl_ref"] == pytest.approx(sum(kl) / 2)
        assert entry["std"]["kl_ref"] == pytest.approx(abs(kl[0] - kl[1]) / math.sqrt(2))
        assert entry["min"]["kl_ref"] == min(kl)
        assert entry["time_to_target_s"] is None and entry["n_seeds"] == 2
    ppo = summary["algorithms"]["ppo"]["seeds"]
    assert ppo[0]["kl_ref"] != ppo[1]["kl_ref"]  # another training seed, another result


def test_reuse_skips_recorded_stages_and_gives_the_same_figures(small_run):
    _, first, again = small_run
    assert set(again["reused_stages"]) == {
        "sft", "rm", "ppo", "ppo_seed1", "grpo", "grpo_seed1", "dpo", "dpo_seed1",
        "online_dpo", "online_dpo_seed1", "rm_weak", "ppo_overoptimize", *ENSEMBLE, *SWEEP,
    }  # fmt: skip
    for name in ("ppo", "grpo", "dpo", "online_dpo"):
        assert again["algorithms"][name]["seeds"] == [
            {**seed, "reused": True} for seed in first["algorithms"][name]["seeds"]
        ]
    assert again["ppo_gold_mean"] == first["ppo_gold_mean"]
    # reused stages keep their recorded wall time, which this run's total does not include
    assert again["wall_s_per_stage"]["ppo"] == first["wall_s_per_stage"]["ppo"]
    assert again["wall_s"] < first["wall_s"]
    seconds = first["wall_s_per_stage"]["ppo"]
    assert f"| ppo | {seconds:.1f} (reused) |" in (Path(again["plots"]["ppo"]).parent / "report.md").read_text()


def test_small_pipeline_keeps_models_and_tensorboard_logs(small_run):
    out, _, _ = small_run
    for folder in ("sft", "rm", "ppo/actor", "ppo/critic", "ppo_seed1/actor", "grpo/actor", "dpo", "rm_weak",
                   "ppo_overoptimize/actor", "rm_weak_ensemble/member_2", "ppo_overoptimize_ensemble/actor", "sft_seed2", "rm_weak_sft2",
                   "ppo_overoptimize_pretrain_ensemble_seed1/actor"):  # fmt: skip
        assert (out / folder / "config.json").exists(), folder
    for stage in ("sft", "rm", "ppo", "ppo_seed1", "grpo", "dpo", "rm_weak", "ppo_overoptimize"):
        assert list((out / "tb" / stage).glob("events.out.tfevents.*")), stage
    ppo = report.read_scalars(out / "tb" / "ppo")
    # one point per rollout for the curves of the report; the gold curve's points beside them
    assert len(ppo["rollout/kl_ref"]) == len(ppo["rollout/monitor_score"]) == 2
    assert [step for step, _ in ppo["heldout/gold_mean"]] == [0, 1, 2]
    assert not (out / "grpo" / "critic").exists()  # critic-free


def test_ensemble_row_is_reported_beside_the_single_weak_model(small_run):
    out, summary, _ = small_run
    assert json.loads((out / "rm_weak_ensemble" / "ensemble.json").read_text())["members"] == [
        "member_0", "member_1", "member_2"]  # fmt: skip
    accuracies = summary["rm_weak_ensemble_member_accuracies"]
    assert len(accuracies) == 3 and all(0.0 <= a <= 1.0 for a in accuracies)
    for prefix in ("overoptimize", "overoptimize_ensemble"):
        assert math.isfinite(summary[f"{prefix}_gold_mean"]) and summary[f"{prefix}_kl_ref"] >= 0.0
        assert set(summary[f"{prefix}_curve"]) >= {"proxy_rise", "gold_peak", "gold_final", "peaks_and_falls"}
    # the ensemble run scored with the three members: their scores and spread are in its training log
    scalars = report.read_scalars(out / "tb" / "ppo_overoptimize_ensemble")
    assert {"rollout/ensemble_std", "rollout/reward/member_0", "rollout/reward/member_2"} <= set(scalars)
    report_md = (out / "report.md").read_text()
    assert "- ensemble of 3 weak RMs on one SFT backbone (mean - std) (members' accuracies" in report_md
    assert "| PPO OVEROPTIMIZE ENSEMBLE |" in report_md


def test_pretrain_ensemble_members_have_their_own_backbones_and_every_source_runs_per_seed(small_run):
    out, summary, _ = small_run
    manifest = json.loads((out / "rm_weak_pretrain_ensemble" / "ensemble.json").read_text())
    assert manifest["members"] == ["../rm_weak", "../rm_weak_sft1", "../rm_weak_sft2"]
    assert manifest["aggregation"] == "mean_minus_std" and manifest["kind"] == "pretrain"
    for k in (1, 2):  # every seed of member k is k: its SFT backbone from scratch and its weak RM on it
        sft = yaml.safe_load((out / "configs" / f"sft_seed{k}.yaml").read_text())
        assert sft["seed_everything"] == k and sft["model"]["init_args"]["model"]["seed"] == k
        rm = yaml.safe_load((out / "configs" / f"rm_weak_sft{k}.yaml").read_text())
        assert rm["model"]["init_args"]["model"] == {"name_or_path": str(out / f"sft_seed{k}"), "seed": k}
        assert rm["data"] == yaml.safe_load((out / "configs" / "rm_weak.yaml").read_text())["data"]  # same pairs
    assert len(summary["rm_weak_pretrain_ensemble_member_accuracies"]) == 3
    assert summary["rm_weak_pretrain_ensemble_member_accuracies"][0] == summary["rm_weak_val_accuracy"]
    scalars = report.read_scalars(out / "tb" / "ppo_overoptimize_pretrain_ensemble_seed1")
    assert {"rollout/ensemble_std", "rollout/reward/member_0", "rollout/reward/member_2"} <= set(scalars)
    sources = summary["overoptimize_sources"]
    assert list(sources) == ["single", "finetune_ensemble", "pretrain_ensemble", "disagreement_ensemble", "posterior"]
    base = {"single": "ppo_overoptimize", "finetune_ensemble": "ppo_overoptimize_ensemble",
            "pretrain_ensemble": "ppo_overoptimize_pretrain_ensemble",
            "disagreement_ensemble": "ppo_overoptimize_disagreement_ensemble",
            "posterior": "ppo_overoptimize_posterior"}  # fmt: skip
    for source, entry in sources.items():
        assert [(r["seed"], r["run"]) for r in entry["seeds"]] == [(0, base[source]), (1, f"{base[source]}_seed1")]
        config = yaml.safe_load((out / "configs" / f"{base[source]}_seed1.yaml").read_text())
        assert config["seed_everything"] == 1 and config["model"]["init_args"]["rng_seed"] == 1
        assert config["model"]["init_args"]["kl"] == {"coef": 0.001}  # the weak KL of every source
        for row in entry["seeds"]:  # the miniature SFT has no gold spread: no lift, nothing holds
            assert row["gold_lift"] is None and row["holds"] is False
            assert row["collapsed"] == (row["gold_mean"] <= -5.0)
        assert entry["collapsed"] == sum(r["collapsed"] for r in entry["seeds"])
    assert "- Final policies, pretrain_ensemble: seed 0: gold" in (out / "report.md").read_text()


def test_the_disagreement_ensemble_trains_on_the_sft_policys_unlabelled_texts(small_run):
    from lit_rlhf.demo import ensemble_runs

    out, summary, _ = small_run
    texts = evaluate.read_jsonl(out / ensemble_runs.DISAGREEMENT_TEXTS)
    assert len(texts) == ensemble_runs.SMALL_TEXTS and all(r["text"].strip() for r in texts)
    config = yaml.safe_load((out / "configs" / "rm_weak_disagreement_ensemble.yaml").read_text())
    init = config["model"]["init_args"]
    assert init["disagreement"]["texts"] == str(out / ensemble_runs.DISAGREEMENT_TEXTS)
    assert init["seeds"] == [0, 1, 2] and init["bootstrap"] is True  # the fine-tune ensemble's members
    assert config["data"] == yaml.safe_load((out / "configs" / "rm_weak_ensemble.yaml").read_text())["data"]
    manifest = json.loads((out / "rm_weak_disagreement_ensemble" / "ensemble.json").read_text())
    assert manifest["disagreement"]["target"] == 1.0
    assert len(summary["rm_weak_disagreement_ensemble_member_accuracies"]) == 3
    scalars = report.read_scalars(out / "tb" / "rm_weak_disagreement_ensemble")
    assert {"train/disagreement", "train/unlabelled_std"} <= set(scalars)
    ppo = yaml.safe_load((out / "configs" / "ppo_overoptimize_disagreement_ensemble_seed1.yaml").read_text())
    assert ppo["model"]["init_args"]["reward_model"]["ensemble"] == str(out / "rm_weak_disagreement_ensemble")


def test_ensemble_without_the_overoptimisation_run_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--out", str(tmp_path / "demo"), "--no-overoptimize", "--ensemble"])
    assert exit_info.value.code == 2
    assert "--ensemble adds to the over-optimisation demo" in capsys.readouterr().err


def test_held_out_sampling_leaves_the_global_random_state_alone(small_run):
    from transformers import AutoModelForCausalLM

    from lit_rlhf.demo.evaluate import sample_responses
    from lit_rlhf.models import load_tokenizer
    from lit_rlhf.rollout import GenerationSettings

    out, _, _ = small_run
    policy = AutoModelForCausalLM.from_pretrained(out / "ppo" / "actor").eval()
    reference = AutoModelForCausalLM.from_pretrained(out / "sft").eval()
    tokenizer = load_tokenizer(str(out / "sft"), padding_side="left")
    prompts = ["the movie was", "the food felt", "the plot"]
    state = torch.get_rng_state()
    args = (policy, reference, tokenizer, prompts, GenerationSettings(max_new_tokens=8, temperature=0.8))
    first, second = sample_responses(*args, seed=3), sample_responses(*args, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == second and all(row["proxy"] is None for row in first)


def test_stage_configs_move_every_demo_path_under_out(tmp_path):
    for stage in ("sft", "rm", "ppo", "rm_weak", "ppo_overoptimize"):
        text = yaml.safe_dump(stages.load_config(stage, tmp_path, small=False))
        assert "runs/demo" not in text, stage
        assert yaml.safe_load(text)["trainer"]["logger"]["init_args"]["save_dir"] == str(tmp_path / "tb")


def test_algorithm_config_names_runs_by_seed_and_adds_the_gold_curve(tmp_path):
    run, config = pipeline.algorithm_config("ppo", 2, tmp_path, small=False)
    assert run == "ppo_seed2"
    assert config["seed_everything"] == 2 and config["model"]["init_args"]["rng_seed"] == 2
    assert config["trainer"]["logger"]["init_args"]["name"] == "ppo_seed2"
    assert stages.export_dir(config) == str(tmp_path / "ppo_seed2")
    *_, curve, memory = config["trainer"]["callbacks"]  # PeakMemory after GoldCurve (its models excluded)
    assert memory == {
        "class_path": "lit_rlhf.callbacks.PeakMemory",
        "init_args": {"output": str(tmp_path / "memory" / "ppo_seed2.json")},
    }
    assert curve["class_path"] == "lit_rlhf.demo.curves.GoldCurve"
    assert curve["init_args"]["output"] == str(tmp_path / "curves" / "ppo_seed2.json")
    assert curve["init_args"]["reference"] == str(tmp_path / "sft")
    assert pipeline.algorithm_config("ppo", 0, tmp_path, small=False)[0] == "ppo"


def test_online_configs_must_sample_alike(tmp_path):
    ppo = stages.load_config("ppo", tmp_path, small=False)
    pipeline.check_online_configs({"ppo": ppo}, max_response_tokens=23)
    fewer = stages.merge(ppo, {"model": {"init_args": {"max_rollouts": 10}}})
    with pytest.raises(ValueError, match="as many responses"):
        pipeline.check_online_configs({"ppo": ppo, "other": fewer}, max_response_tokens=23)
    hotter = stages.merge(ppo, {"model": {"init_args": {"generation": {"temperature": 1.0}}}})
    with pytest.raises(ValueError, match=r"configs/demo/other.yaml: generation.temperature=1.0"):
        pipeline.check_online_configs({"other": hotter}, max_response_tokens=23)
    with pytest.raises(ValueError, match="max_new_tokens=24 is below"):
        pipeline.check_online_configs({"ppo": ppo}, max_response_tokens=30)
    unbounded = stages.merge(ppo, {"model": {"init_args": {"max_rollouts": None}}})
    with pytest.raises(ValueError, match=r"configs/demo/other.yaml: .* sets model.init_args.max_rollouts"):
        pipeline.check_online_configs({"other": unbounded}, max_response_tokens=23)


def test_seeds_and_algorithms_arguments():
    assert pipeline.parse_seeds("3") == [0, 1, 2]
    assert pipeline.parse_seeds("0,5,7") == [0, 5, 7]
    assert pipeline.parse_seeds("4,") == [4]
    for bad in ("0", "x", "1,1", "-1,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            pipeline.parse_seeds(bad)
    assert pipeline.parse_algorithms("ppo, ppo") == ["ppo"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown \['nope'\]; registered: ppo"):
        pipeline.parse_algorithms("ppo,nope")


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_threads_below_one_is_a_usage_error_naming_the_option(value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--out", str(tmp_path / "demo"), "--threads", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --threads: --threads:" in err and "Traceback" not in err, err
    assert not (tmp_path / "demo").exists(), "nothing ran"


def test_out_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "demo").write_text("a file")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main(["--out", str(tmp_path / "demo"), "--threads", "1"])
    assert exit_info.value.code == 2
    assert f"error: --out: {tmp_path / 'demo'} is an existing file, not a folder" in capsys.readouterr().err


def _point(step, seconds, gold_mean, kl, gold_std=2.0):
    return {"step": step, "seconds": seconds, "gold_mean": gold_mean, "gold_std": gold_std, "kl_ref": kl, "n_prompts": 8}


def test_time_to_target_by_hand():
    # first point: gold 1.0, std 2.0 -> lifts (g - 1) / 2: 0, 1.5, 2.5 (KL 4.5 over budget), 2.0, 3.0
    points = [_point(0, 0.0, 1.0, 0.0), _point(4, 3.0, 4.0, 2.0), _point(8, 6.0, 6.0, 4.5),
              _point(12, 9.5, 5.0, 4.0), _point(16, 12.0, 7.0, 3.0)]  # fmt: skip
    assert curves.lift(points) == [0.0, 1.5, 2.5, 2.0, 3.0]
    assert curves.time_to_target(points) == 9.5  # lift 2.0 exactly at KL 4.0 exactly: reached
    assert curves.target_point(points) is points[3]
    assert curves.time_to_target(points, kl_budget=5.0) == 6.0
    assert curves.time_to_target(points, target_lift=3.5) is None
    assert curves.lift([_point(0, 0.0, 1.0, 0.0, gold_std=0.0)]) == [None]
    assert curves.time_to_target([_point(0, 0.0, 1.0, 0.0, gold_std=0.0), _point(1, 1.0, 9.0, 0.1)]) is None


def test_overoptimization_shape_by_hand():
    # proxy 1, 2, 1.5, 3 -> +0, +1, +0.5, +2 (largest fall 0.5); gold 0, 2, 3, -1 peaks at window 2 (KL 4)
    shape = curves.overoptimization_shape(
        {"kl": [0.0, 1.0, 4.0, 9.0], "proxy": [1.0, 2.0, 1.5, 3.0], "gold": [0.0, 2.0, 3.0, -1.0]}
    )
    assert shape == {"proxy_rise": 2.0, "proxy_largest_drop": 0.5, "gold_peak": 3.0, "gold_peak_kl": 4.0,
                     "gold_final": -1.0, "gold_drop_from_peak": 4.0, "peaks_and_falls": True}  # fmt: skip
    # gold still rising at the end, or a proxy that ends below its start: no over-optimisation picture
    rising = {"kl": [0.0, 1.0, 2.0], "proxy": [0.0, 1.0, 2.0], "gold": [0.0, 1.0, 2.0]}
    assert curves.overoptimization_shape(rising)["peaks_and_falls"] is False
    assert curves.overoptimization_shape(rising)["proxy_largest_drop"] == 0.0
    falling_proxy = {"kl": [0.0, 1.0, 2.0], "proxy": [0.0, 1.0, -0.5], "gold": [0.0, 1.0, 0.5]}
    assert curves.overoptimization_shape(falling_proxy)["peaks_and_falls"] is False


def test_spread_by_hand():
    # values 1, 2, 6: mean 3, sample variance ((-2)^2 + (-1)^2 + 3^2) / 2 = 7
    assert compare.spread([1.0, 2.0, 6.0]) == {"mean": 3.0, "std": math.sqrt(7.0), "min": 1.0}
    assert compare.spread([5.0]) == {"mean": 5.0, "std": None, "min": 5.0}
    # a seed that never reached the target: no mean, the spread of those that did
    assert compare.spread([None, 2.0, 4.0]) == {"mean": None, "std": math.sqrt(2.0), "min": 2.0}
    assert compare.spread([None]) == {"mean": None, "std": None, "min": None}


def test_seed_figures_meet_the_target_only_with_lift_kl_and_grammar():
    class Record:
        wall_s, peak_rss_mb, reused = 10.0, 500.0, False

    sft = {"gold_mean": 0.0, "gold_std": 2.0}
    points = [_point(0, 0.0, 0.0, 0.0), _point(4, 5.0, 4.4, 3.0)]
    final = {"gold_mean": 4.2, "kl_ref": 3.9, "grammatical_rate": 0.96}
    figures = compare.seed_figures("ppo", 0, final, sft, points, Record())
    assert figures["gold_lift_sft_std"] == pytest.approx(2.1) and figures["meets_target"]
    assert figures["time_to_target_s"] == 5.0 and figures["steps_to_target"] == 4 and figures["train_s"] == 5.0
    for change in ({"kl_ref": 4.1}, {"grammatical_rate": 0.94}, {"gold_mean": 3.9}):
        assert not compare.seed_figures("ppo", 0, {**final, **change}, sft, points, Record())["meets_target"]


def test_small_online_configs_use_the_settings_groups(tmp_path):
    # the miniature's overrides merge into the configs' groups (keeping their other keys) and set no flat
    # argument of the earlier layout (the module would refuse it)
    from lit_rlhf.modules.online_migration import MOVED

    flat = set(MOVED["PPOModule"]) | set(MOVED["CriticFreeModule"])
    for stage in ("ppo", "ppo_overoptimize", "grpo", "rloo", "reinforce_pp"):
        full = stages.load_config(stage, tmp_path, small=False)["model"]["init_args"]
        init = stages.load_config(stage, tmp_path, small=True)["model"]["init_args"]
        assert not flat & set(init), stage
        assert init["update"] == {**full.get("update", {}), "epochs": 1}, stage
        assert init["scoring"] == {**full.get("scoring", {}), "forward_batch_size": 8}, stage
        assert init["max_rollouts"] == 2 and init.get("kl") == full.get("kl"), stage


def test_kl_target_is_read_from_the_kl_group():
    assert report.kl_target({"kl": {"coef": 0.2, "target": 3.5}}) == 3.5
    assert report.kl_target({"kl": {"coef": 0.2}}) is None
    assert report.kl_target({}) is None


def test_small_overrides_merge_into_nested_config():
    base = {"model": {"init_args": {"lr": 1, "model": {"config": {"n_embd": 128}, "seed": 0}}}}
    merged = stages.merge(base, {"model": {"init_args": {"model": {"config": {"n_embd": 32}}}}})
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


def test_kl_sweep_reports_a_point_per_coefficient_and_seed(small_run):
    out, summary, _ = small_run
    sweep = summary["overoptimize_sweep"]
    assert sorted((p["coef"], p["seed"]) for p in sweep["points"]) == [(0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]
    assert sweep["sft"]["kl_ref"] == 0.0 and set(sweep["shape"]) == {"0", "1"}
    for run in SWEEP:  # each run trained with its own fixed coefficient against the weak RM
        config = yaml.safe_load((out / "configs" / f"{run}.yaml").read_text())
        assert config["model"]["init_args"]["kl"] == {"coef": 0.1 if "kl0.1" in run else 0.01}
        assert config["model"]["init_args"]["reward_model"]["name_or_path"] == str(out / "rm_weak")
        assert (out / run / "actor" / "config.json").exists()
    points = {p["run"]: p for p in sweep["points"]}
    assert points["ppo_overoptimize_kl0.1"]["kl_ref"] != points["ppo_overoptimize_kl0.01"]["kl_ref"]
    assert "Over-optimisation sweep" in (out / "report.md").read_text()


def test_sources_summary_by_hand():
    """Lift in SFT std, holds (lift >= 1) and the floor (gold within 1 of -6), per source and seed."""
    from lit_rlhf.demo import overoptimization
    from lit_rlhf.demo.stages import StageRecord

    def record(run, seed):
        return StageRecord(run, "k", {"seed_everything": seed}, "", 0.0)

    golds = {"ppo_overoptimize": -5.5, "ppo_overoptimize_seed1": 1.0, "ppo_overoptimize_ensemble": 3.0,
             "ppo_overoptimize_ensemble_seed1": -4.9}  # fmt: skip
    runs = {run: record(run, int(run.endswith("seed1"))) for run in golds}
    runs["ppo_overoptimize_kl0.01_seed1"] = record("ppo_overoptimize_kl0.01_seed1", 1)  # a sweep run: no source
    results = {"sft": {"summary": {"gold_mean": 0.0, "gold_std": 2.0}}}
    for run, gold in golds.items():
        results[run] = {"summary": {"gold_mean": gold, "kl_ref": 10.0, "grammatical_rate": 0.5}}
    sources = overoptimization.sources_summary(results, runs)["overoptimize_sources"]
    assert list(sources) == ["single", "finetune_ensemble"]
    single, ensemble = sources["single"], sources["finetune_ensemble"]
    assert [r["gold_lift"] for r in single["seeds"]] == [-2.75, 0.5]
    assert [r["collapsed"] for r in single["seeds"]] == [True, False] and single["holds"] == 0
    assert [r["gold_lift"] for r in ensemble["seeds"]] == [1.5, -2.45]
    assert [r["holds"] for r in ensemble["seeds"]] == [True, False] and ensemble["collapsed"] == 0  # -4.9 > -5
    assert ensemble["mean_gold_lift"] == pytest.approx(-0.475) and ensemble["min_gold_lift"] == -2.45
    assert overoptimization.sources_summary(results, {"ppo_overoptimize": runs["ppo_overoptimize"]}) == {}


def test_aggregation_study_reruns_the_ensemble_run_per_source(small_run, capsys):
    """Each source's run is the pipeline's own where they coincide (same config, seed, threads: same policy)."""
    from lit_rlhf.demo import aggregation_study

    out, summary, _ = small_run
    argv = ["--out", str(out), "--small", "--threads", "1", "--seeds", "1",
            "--sources", "single,finetune:mean_minus_std,union:min"]  # fmt: skip
    study = aggregation_study.main(argv)
    assert list(study) == ["single", "finetune_mean_minus_std_1", "union_min"]
    assert study["single"]["seeds"][0]["gold_mean"] == summary["overoptimize_gold_mean"]
    assert study["finetune_mean_minus_std_1"]["seeds"][0]["gold_mean"] == summary["overoptimize_ensemble_gold_mean"]
    union = json.loads((out / "aggregation_study" / "union" / "ensemble.json").read_text())
    assert len(union["members"]) == 6 and all(Path(m).is_dir() for m in union["members"])
    config = yaml.safe_load((out / "aggregation_study" / "configs" / "union_min_t1_seed0.yaml").read_text())
    init = config["model"]["init_args"]
    assert init["reward_model"] == {"ensemble": str(out / "aggregation_study" / "union"), "aggregation": "min"}
    assert init["kl"] == {"coef": 0.001} and config["seed_everything"] == 0
    scalars = report.read_scalars(out / "aggregation_study" / "tb" / "union_min_t1_seed0")
    assert {"rollout/ensemble_std", "rollout/reward/member_5"} <= set(scalars)
    # "-z": the fine-tune members with their statistics on the held-out pairs (not fitted here: as the others)
    folder = aggregation_study.write_standardised_manifest(out, "finetune").parent
    standardised = json.loads((folder / "ensemble.json").read_text())
    assert folder == out / "aggregation_study" / "finetune-z"
    assert len(standardised["member_stats"]) == 3 and all(s["std"] > 0 for s in standardised["member_stats"])
    assert aggregation_study.reward_model(out, "finetune-z", "mean", None) == {"ensemble": str(folder), "aggregation": "mean"}
    for entry in study.values():
        assert entry["collapsed"] == sum(r["collapsed"] for r in entry["seeds"])
    assert json.loads((out / "aggregation_study" / "study_t1.json").read_text()) == json.loads(json.dumps(study))
    capsys.readouterr()
    assert aggregation_study.main([*argv, "--reuse"]) == study  # nothing retrained, the same evaluations
    assert capsys.readouterr().out.count("reusing the run recorded") == 3


@pytest.mark.parametrize(
    ("sources", "message"),
    [("bogus", "members must be one of"), ("finetune", "MEMBERS:AGGREGATION"), ("union:median", "AGGREGATION one of"),
     ("pretrain:mean_minus_std:x", "COEF must be a number")],
)  # fmt: skip
def test_aggregation_study_bad_sources_are_usage_errors(sources, message, tmp_path, capsys):
    from lit_rlhf.demo import aggregation_study

    with pytest.raises(SystemExit) as exit_info:
        aggregation_study.main(["--out", str(tmp_path), "--threads", "1", "--sources", sources])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_aggregation_study_needs_an_ensemble_demo_folder(tmp_path, capsys):
    from lit_rlhf.demo import aggregation_study

    with pytest.raises(SystemExit) as exit_info:
        aggregation_study.main(["--out", str(tmp_path), "--threads", "1"])
    assert exit_info.value.code == 2
    assert "no report.json, rm_weak_ensemble, rm_weak_pretrain_ensemble" in capsys.readouterr().err


def test_a_cell_with_seeds_missing_says_how_many_and_spreads_the_others():
    def entry(values):
        spreads = compare.spread(values)
        seeds = [{"frontier_distance": v} for v in values]
        return {"frontier_distance": spreads["mean"], "std": {"frontier_distance": spreads["std"]},
                "min": {"frontier_distance": spreads["min"]}, "n_seeds": len(values), "seeds": seeds}  # fmt: skip

    assert compare._cell(entry([0.1, -0.3, 0.5]), "frontier_distance", "+.2f") == "+0.10 ± 0.40 (min -0.30)"
    assert compare._cell(entry([None, -0.3, 0.5]), "frontier_distance", "+.2f") == (
        "n/a on 1 of 3 seeds; the others ± 0.57 (min -0.30)"
    )
    assert compare._cell(entry([None, None]), "frontier_distance", "+.2f") == "n/a"
    assert compare._cell(entry([None]), "frontier_distance", "+.2f") == "n/a"


def test_the_cpu_features_line_names_what_the_cpu_has_and_lacks():
    assert report.cpu_features_text(["avx2", "avx512f", "avx512_bf16"]) == "avx2, avx512f, avx512_bf16; no amx_bf16"
    assert report.cpu_features_text(list(report.CPU_FEATURES)) == "avx2, avx512f, avx512_bf16, amx_bf16"
    assert report.cpu_features_text([]) == "no avx2, avx512f, avx512_bf16, amx_bf16"


def test_member_agreement_by_hand_and_on_the_small_run(small_run, tmp_path):
    from lit_rlhf.demo import member_agreement

    scores = torch.tensor([[1.0, 3.0], [3.0, 5.0]])  # 2 members x 2 texts: means 2, 4; spreads 1, 1
    assert member_agreement.agreement(scores) == {"mean": 3.0, "spread": 1.0, "mean_minus_spread": 2.0}
    out, *_ = small_run
    result = member_agreement.main(["--out", str(out), "--prompts", "4"])
    assert set(result) == {"sft", "single", "finetune_ensemble", "pretrain_ensemble", "disagreement_ensemble", "posterior"}
    for entry in result.values():
        assert entry["n_texts"] == 4 and 0.0 <= entry["grammatical"] <= 1.0
        for family in member_agreement.FAMILIES:
            e = entry[family]
            assert e["spread"] >= 0 and e["mean_minus_spread"] == pytest.approx(e["mean"] - e["spread"], abs=1e-5)
    assert json.loads((out / "member_agreement_seed0.json").read_text()) == json.loads(json.dumps(result))
    with pytest.raises(SystemExit):  # a folder without the ensembles: argparse's error names the members
        member_agreement.main(["--out", str(tmp_path)])


def test_prior_study_texts_and_ordering_by_hand():
    from lit_rlhf.demo import prior_study, world

    rng = random.Random(0)
    exploit = prior_study.exploit_reviews(rng, 10)
    for i, text in enumerate(exploit):  # 4, 5, ..., 8, 4, ... positive clauses: beyond the grammar's three
        assert text.count(" and ") == 4 + i % 5 and not world.is_grammatical(text)  # prompts have no "and"
        assert world.gold_reward(text) == world.UNGRAMMATICAL_REWARD
    good = prior_study.good_reviews(rng, 5)
    assert all(world.is_grammatical(t) and world.gold_reward(t) >= prior_study.GOOD_MIN_GOLD for t in good)
    # good scores 1, 3 against exploit scores 2, 3: only (3 > 2) of the four pairs is ordered
    assert prior_study.ordered_share(torch.tensor([1.0, 3.0]), torch.tensor([2.0, 3.0])) == 0.25


def test_prior_study_on_the_small_run(small_run, capsys):
    """Members with a prior score f + beta p: p frozen, unit std on the training texts; beta 0 is f alone."""
    from lit_rlhf.demo import prior_study
    from lit_rlhf.models import load_tokenizer, sequence_scores

    out, *_ = small_run
    tokenizer = load_tokenizer(str(out / "sft"))
    pairs = evaluate.read_jsonl(out / "assets" / "prefs_train.jsonl")[:64]
    member = prior_study.train_member(out, tokenizer, pairs, seed=0, beta=2.0, steps=2)
    enc = tokenizer(
        [p["prompt"] + p["chosen"] + tokenizer.eos_token for p in pairs[:8]],
        return_tensors="pt",
        padding=True,
    )
    f = sequence_scores(member.f, enc["input_ids"], enc["attention_mask"])
    p = sequence_scores(member.prior, enc["input_ids"], enc["attention_mask"])
    torch.testing.assert_close(member(enc["input_ids"], enc["attention_mask"]), f + 2.0 * p)
    assert not any(q.requires_grad for q in member.prior.parameters())
    texts = [r["prompt"] + r["chosen"] + tokenizer.eos_token for r in pairs]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    assert sequence_scores(
        member.prior, enc["input_ids"], enc["attention_mask"]
    ).std().item() == pytest.approx(1.0, abs=1e-4)
    argv = [
        "--out",
        str(out),
        "--betas",
        "0,1",
        "--draws",
        "0",
        "--steps",
        "2",
        "--texts",
        "4",
        "--pairs",
        "64",
        "--threads",
        "1",
    ]
    results = prior_study.main(argv)
    assert [(r["draw"], r["beta"]) for r in results] == [(0, 0.0), (0, 1.0)]
    for r in results:
        assert len(r["member_accuracy"]) == 3 and 0.0 <= r["p_good_over_exploit_1std"] <= 1.0
        assert r["good"]["mean_minus_spread"] == pytest.approx(
            r["good"]["mean"] - r["good"]["spread"], abs=1e-5
        )
    assert json.loads((out / "prior_study.json").read_text()) == json.loads(json.dumps(results))
    assert capsys.readouterr().out.count("\n| 0 |") == 2
    # exported, reloaded as a reward function: mean - 1 std of f + beta p over the members, EOS where one stopped
    results = prior_study.main([*argv[:2], "--betas", "1", "--draws", "0", "--steps", "2", "--texts", "4",
                                "--pairs", "64", "--threads", "1", "--small", "--ppo-seeds", "0"])  # fmt: skip
    folder = out / prior_study.STUDY / "beta1_draw0"
    members, _ = prior_study.load_ensemble(str(folder))
    assert [m.beta for m in members] == [1.0] * 3 and all(m.prior is not None for m in members)
    prompt, response = pairs[0]["prompt"], pairs[0]["chosen"]
    eos_id = tokenizer.eos_token_id
    got = prior_study.prior_ensemble_reward(prompts=[prompt] * 2, completions=[response] * 2, completion_ids=[[5, eos_id], [5]], folder=str(folder))
    for text, value in zip([prompt + response + tokenizer.eos_token, prompt + response], got):
        each = prior_study.scores(members, tokenizer, [text])  # (3, 1)
        assert value == pytest.approx((each.mean() - each.std(correction=0)).item(), abs=1e-5)
    assert got[0] != got[1]
    entry = results[0]["ppo"]
    assert [r["seed"] for r in entry["seeds"]] == [0] and entry["seeds"][0]["run"] == "beta1_draw0_t1_seed0"
    assert (out / prior_study.STUDY / "beta1_draw0_t1_seed0" / "actor").is_dir()
    assert "beta 1, draw 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--betas", "x"], "must be numbers"),
        (["--betas", "-1"], "must be >= 0"),
        ([], "run the demo pipeline first"),
    ],
)
def test_prior_study_bad_arguments_are_usage_errors(args, message, tmp_path, capsys):
    from lit_rlhf.demo import prior_study

    with pytest.raises(SystemExit) as exit_info:
        prior_study.main(["--out", str(tmp_path), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_disagreement_study_on_the_small_run(small_run, capsys):
    """Unlabelled SFT samples, the last share kept from ending early; members trained with and without the
    disagreement term differ; the study's figures and report."""
    from lit_rlhf.demo import disagreement_study, unlabelled
    from lit_rlhf.models import load_tokenizer

    out, *_ = small_run
    tokenizer = load_tokenizer(str(out / "sft"))
    texts, stats = unlabelled.unlabelled_texts(out, 8, 1.5, forced_share=0.5, min_new_tokens=6)
    assert len(texts) == stats["n"] == 8 and 0.0 <= stats["grammatical"] <= 1.0
    prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_train.jsonl")][:8]
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        assert text.startswith(prompt)
        if i >= 4:  # forced: at least 6 response tokens, no EOS among them
            n_response = len(tokenizer(text)["input_ids"]) - len(tokenizer(prompt)["input_ids"])
            assert n_response >= 6, text
    pairs = evaluate.read_jsonl(out / "assets" / "prefs_train.jsonl")[:64]
    plain, diverse = (
        disagreement_study.train_ensemble(out, tokenizer, pairs, texts, 0, alpha, 1.0, steps=2) for alpha in (0.0, 1.0)
    )
    assert len(plain) == len(diverse) == 3
    assert any(not torch.equal(p, q) for p, q in zip(plain[0].f.parameters(), diverse[0].f.parameters()))
    argv = ["--out", str(out), "--coefs", "0,1", "--draws", "0", "--steps", "2", "--texts", "4", "--pairs", "64",
            "--unlabelled", "8", "--forced-share", "0.5", "--min-new-tokens", "4", "--threads", "1"]  # fmt: skip
    results = disagreement_study.main(argv)
    assert [(r["draw"], r["alpha"]) for r in results] == [(0, 0.0), (0, 1.0)]
    for r in results:
        assert len(r["member_accuracy"]) == 3 and 0.0 <= r["p_good_over_exploit_1std"] <= 1.0
        assert r["unlabelled"]["n"] == 8 and r["unlabelled"]["forced_share"] == 0.5
    assert json.loads((out / "disagreement_study.json").read_text()) == json.loads(json.dumps(results))
    assert "unlabelled texts:" in capsys.readouterr().out
    # the product's path: RewardEnsembleModule(disagreement=...) fitted by lit-rlhf, PPO against its export
    results = disagreement_study.main([*argv[:2], "--coefs", "1", "--draws", "0", "--unlabelled", "8", "--threads", "1",
                                       "--module", "--ppo-seeds", "0", "--small"])  # fmt: skip
    folder = out / "prior_study" / "module_disagree1_t1_draw0"
    manifest = json.loads((folder / "ensemble.json").read_text())
    assert manifest["seeds"] == [0, 1, 2] and manifest["disagreement"]["texts"].endswith("unlabelled.jsonl")
    assert len(evaluate.read_jsonl(out / "prior_study" / "unlabelled.jsonl")) == 8
    entry = results[0]["ppo"]
    assert results[0]["module"] and [r["run"] for r in entry["seeds"]] == ["module_disagree1_t1_draw0_t1_seed0"]
    assert "module, alpha 1, draw 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--coefs", "x"], "comma-separated numbers"),
        (["--forced-share", "1.5"], "--forced-share in [0, 1]"),
        (["--min-new-tokens", "99"], "at most the samples'"),
        ([], "run the demo pipeline first"),
    ],
)
def test_disagreement_study_bad_arguments_are_usage_errors(args, message, tmp_path, capsys):
    from lit_rlhf.demo import disagreement_study

    with pytest.raises(SystemExit) as exit_info:
        disagreement_study.main(["--out", str(tmp_path), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_posterior_source_scores_the_weak_rm_less_its_last_layer_spread(small_run):
    from lit_rlhf.data import PreferenceDataModule
    from lit_rlhf.demo import ensemble_runs

    out, summary, _ = small_run
    manifest = json.loads((out / ensemble_runs.POSTERIOR / "posterior.json").read_text())
    data = PreferenceDataModule(**yaml.safe_load((out / "configs" / "rm_weak.yaml").read_text())["data"]["init_args"])
    data.setup("fit")  # the pairs the weak RM trained on, read as it read them
    assert manifest["reward_model"] == "../rm_weak" and manifest["split"] == "train[:2400]"
    assert manifest["texts"] == 2 * len(data.train_dataset)
    config = yaml.safe_load((out / "configs" / "ppo_overoptimize_posterior_seed1.yaml").read_text())
    assert config["model"]["init_args"]["reward_model"] == {"posterior": str(out / "rm_weak_posterior"), "coef": 1.0}
    scalars = report.read_scalars(out / "tb" / "ppo_overoptimize_posterior")
    assert {"rollout/reward/score", "rollout/reward/uncertainty"} <= set(scalars)
    assert all(v > 0 for _, v in scalars["rollout/reward/uncertainty"])
    assert "- the weak RM less 1 x its last-layer posterior's spread (weak RM accuracy" in (out / "report.md").read_text()

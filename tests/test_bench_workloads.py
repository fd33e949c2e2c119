"""The benchmark harness's pure parts (scripts/bench): workload data and the summary a script reads.

No TRL here: the data generator and the 32,000-token tokenizer are checked against the issue's length
ranges, and the summary against hand-computed medians of made-up results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import peers  # noqa: E402
import report  # noqa: E402
import workloads  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    """The benchmark tokenizer (trained as build_workload_assets trains it) and the data of the workloads."""
    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    words = workloads.lexicon()
    tokenizer = train_bpe_tokenizer(workloads.training_texts(words), vocab_size=workloads.VOCAB_32K)
    word_ids = dict(zip(words, tokenizer([" " + w for w in words])["input_ids"]))
    rows = workloads.workload_rows(words, word_ids, tokenizer.eos_token_id)
    return tokenizer, rows


def test_tokenizer_has_32000_tokens_and_texts_tokenize_to_the_row_ids(vocab):
    tokenizer, rows = vocab
    assert len(tokenizer) == 32000
    for row in rows["grpo_prompts"][:5] + rows["ppo_prompts"][:5]:
        assert tokenizer(row["text"])["input_ids"] == row["ids"]
    eos = tokenizer.eos_token_id
    for pair in rows["pairs"][:5]:  # what TRL's DPOTrainer tokenises: prompt + response + EOS string
        for slot in ("chosen", "rejected"):
            text = pair["prompt"]["text"] + pair[slot]["text"] + tokenizer.eos_token
            assert tokenizer(text)["input_ids"] == pair["prompt"]["ids"] + pair[slot]["ids"]
            assert pair[slot]["ids"][-1] == eos and eos not in pair[slot]["ids"][:-1]


@pytest.mark.parametrize(
    "kind,lo,hi",
    [("grpo_prompts", 64, 256), ("ppo_prompts", 16, 256), ("pairs.prompt", 64, 512), ("pairs.chosen", 16, 128)],
)
def test_lengths_cover_the_issue_ranges(vocab, kind, lo, hi):
    _, rows = vocab
    if kind.startswith("pairs."):
        lengths = [len(p[kind[6:]]["ids"]) for p in rows["pairs"]]
    else:
        lengths = [len(r["ids"]) for r in rows[kind]]
    assert len(lengths) == workloads.N_ROWS
    assert lo <= min(lengths) and max(lengths) <= hi
    # varying over the range: both its lower and upper quarter are populated
    quarter = (hi - lo) / 4
    assert any(n < lo + quarter for n in lengths) and any(n > hi - quarter for n in lengths)


def test_bench_reward_scores_each_completion():
    assert workloads.bench_reward(["p", "q"], ["aab", ""]) == [2 / 4, 0.0]


def rollout_run(totals: list[float], tokens: list[int], rss: float) -> dict:
    rollouts = [dict(total=t, cpu_total=t) for t in totals]
    return dict(workload="W1_grpo", rollouts=rollouts, response_tokens=tokens, peak_rss_mb=rss)


def test_summary_is_the_median_of_per_pair_ratios():
    # W1: the warm-up rollout (first) is left out: tokens/s = 300 / 3 s = 100 vs 200 / 4 s = 50 -> 2.0
    w1 = [
        (rollout_run([9.0, 1.0, 2.0], [999, 100, 200], 500.0), rollout_run([9.0, 2.0, 2.0], [999, 100, 100], 1000.0)),
        (rollout_run([9.0, 1.0, 1.0], [1, 100, 100], 600.0), rollout_run([9.0, 2.0, 2.0], [1, 100, 100], 1000.0)),
        (rollout_run([9.0, 1.0, 1.0], [1, 100, 100], 700.0), rollout_run([9.0, 4.0, 4.0], [1, 100, 100], 1000.0)),
    ]  # ratios 2.0, 2.0, 4.0; RSS 0.5, 0.6, 0.7
    pair_runs = [
        (dict(pairs_per_s=3.0, peak_rss_mb=90.0), dict(pairs_per_s=2.0, peak_rss_mb=100.0)),
        (dict(pairs_per_s=1.0, peak_rss_mb=80.0), dict(pairs_per_s=2.0, peak_rss_mb=100.0)),
    ]  # ratios 1.5, 0.5 -> median 1.0; RSS 0.9, 0.8 -> 0.85
    runs = {name: [{"lit": a, "trl": b} for a, b in rows] for name, rows in (("W1_grpo", w1), ("W2_dpo", pair_runs))}
    summ = peers.summary(runs, "lit", {"W1_grpo": ["trl"], "W2_dpo": ["trl"]})
    assert summ["W1_grpo"]["throughput_ratio"] == pytest.approx(2.0)
    assert summ["W1_grpo"]["throughput_ratio_range"] == pytest.approx([2.0, 4.0])
    assert summ["W1_grpo"]["rss_ratio"] == pytest.approx(0.6)
    assert summ["W2_dpo"]["throughput_ratio"] == pytest.approx(1.0)
    assert summ["W2_dpo"]["rss_ratio"] == pytest.approx(0.85)
    assert summ["W2_dpo"]["throughput_unit"] == "pairs/s" and summ["W2_dpo"]["repeats"] == 2
    assert summ["W2_dpo"]["peer"] == "trl" and list(summ["W2_dpo"]["peers"]) == ["trl"]
    assert summ["W2_dpo"]["median_throughput"] == pytest.approx({"lit": 2.0, "trl": 2.0})
    table = peers.summary_table(summ, "lit")
    assert "| W1_grpo | trl | 2.00 [2.00-4.00] | 0.60 [0.50-0.70] | >= 2.5x / <= 0.7x | response tokens/s |" in table


def pair_run(pairs_per_s: float, rss: float) -> dict:
    return dict(pairs_per_s=pairs_per_s, peak_rss_mb=rss)


# One pair workload, three repeats of (lit, trl, trl-new); trl-new is the faster peer by median throughput
# (median 3.0 vs 2.0) though it is the slower one in the third repeat. Ratios lit/trl: 2, 3, 2.5 -> 2.5;
# lit/trl-new: 4/3, 9/7, 5/2 -> 4/3. RSS lit/trl 0.5 each; lit/trl-new 0.25 each.
THREE = [
    {"lit": pair_run(4.0, 100.0), "trl": pair_run(2.0, 200.0), "trl-new": pair_run(3.0, 400.0)},
    {"trl": pair_run(1.5, 200.0), "trl-new": pair_run(3.5, 400.0), "lit": pair_run(4.5, 100.0)},
    {"trl-new": pair_run(2.0, 400.0), "lit": pair_run(5.0, 100.0), "trl": pair_run(2.0, 200.0)},
]


def test_the_headline_is_against_the_faster_peer_by_median_throughput_and_both_are_kept():
    assert peers.median_throughput("W2_rm", THREE, "trl-new") == pytest.approx(3.0)
    assert peers.faster_peer("W2_rm", THREE, ["trl", "trl-new"]) == "trl-new"
    summ = peers.summary({"W2_rm": THREE}, "lit", {"W2_rm": ["trl", "trl-new"]})["W2_rm"]
    assert summ["peer"] == "trl-new"
    assert summ["throughput_ratio"] == pytest.approx(4 / 3) and summ["rss_ratio"] == pytest.approx(0.25)
    assert summ["throughput_ratio_range"] == pytest.approx([9 / 7, 2.5])
    assert summ["peers"]["trl"]["throughput_ratio"] == pytest.approx(2.5)
    assert summ["peers"]["trl"]["throughput_ratio_range"] == pytest.approx([2.0, 3.0])
    assert summ["peers"]["trl"]["rss_ratio"] == pytest.approx(0.5)
    assert summ["peers"]["trl-new"] == {k: v for k, v in summ.items() if k in summ["peers"]["trl-new"]}
    assert summ["median_throughput"] == pytest.approx({"lit": 4.5, "trl": 2.0, "trl-new": 3.0})
    # the faster peer of the same runs without trl-new is trl; a tie goes to the first listed
    assert peers.faster_peer("W2_rm", THREE, ["trl"]) == "trl"
    tied = [{"lit": pair_run(1.0, 1.0), "trl": pair_run(2.0, 1.0), "trl-new": pair_run(2.0, 1.0)}]
    assert peers.faster_peer("W2_rm", tied, ["trl", "trl-new"]) == "trl"
    assert peers.faster_peer("W2_rm", tied, ["trl-new", "trl"]) == "trl-new"


def test_summary_table_gives_the_headline_then_every_peer_with_its_release():
    summ = peers.summary(
        {"W2_rm": THREE, "W3_ppo": [{"lit": rollout_run([9.0, 1.0], [1, 100], 70.0),
                                     "trl": rollout_run([9.0, 2.0], [1, 100], 100.0)}]},
        "lit", {"W2_rm": ["trl", "trl-new"], "W3_ppo": ["trl"]},
    )  # fmt: skip
    labels = peers.impl_labels({"lit": {"lit-rlhf": "0.1"}, "trl": {"trl": "1.12.0"}, "trl-new": {"trl": "1.16.0"}})
    assert labels == {"lit": "lit", "trl": "trl (1.12.0)", "trl-new": "trl-new (1.16.0)"}
    table = peers.summary_table(summ, "lit", labels)
    assert "| W2_rm | trl-new (1.16.0) | 1.33 [1.29-2.50] | 0.25 [0.25-0.25] | >= 2.0x | pairs/s |" in table
    assert "| W3_ppo | trl (1.12.0) | 2.00 [2.00-2.00] | 0.70 [0.70-0.70] | >= 2.5x / <= 0.7x |" in table
    assert "| workload | lit/trl (1.12.0): throughput | peak RSS | lit/trl-new (1.16.0): throughput | peak RSS |" in table
    assert "| W2_rm | 2.50 [2.00-3.00] | 0.50 [0.50-0.50] | 1.33 [1.29-2.50] | 0.25 [0.25-0.25] |" in table
    assert "| W3_ppo | 2.00 [2.00-2.00] | 0.70 [0.70-0.70] | - | - |" in table
    assert "lit 4.5 / trl (1.12.0) 2 / trl-new (1.16.0) 3 pairs/s |" in table


def test_newest_trl_runs_grpo_dpo_and_rm_only_and_the_order_rotates_every_repeat():
    assert peers.workload_peers("W1_grpo", "trl", "trl-new") == ["trl", "trl-new"]
    assert peers.workload_peers("W1_grpo_bf16", "trl", "trl-new") == ["trl", "trl-new"]
    assert peers.workload_peers("W2_dpo", "trl", "trl-new") == ["trl", "trl-new"]
    for name in ("W3_ppo", "W3_ppo_bf16", "control_ppo", "control_rm"):
        assert peers.workload_peers(name, "trl", "trl-new") == ["trl"]
    assert peers.workload_peers("W2_rm", "lit", None) == ["lit"]
    impls = ["lit", "trl", "trl-new"]
    orders = [peers.run_order(impls, i) for i in range(4)]
    assert orders == [impls, ["trl", "trl-new", "lit"], ["trl-new", "lit", "trl"], impls]
    for position in range(3):  # over 3 repeats each implementation runs first, second and third once
        assert sorted(order[position] for order in orders[:3]) == sorted(impls)
    assert [peers.run_order(["lit", "trl"], i) for i in range(3)] == [["lit", "trl"], ["trl", "lit"], ["lit", "trl"]]


def test_third_implementation_and_the_check_for_missing_environments(tmp_path):
    import compare

    assert compare.third_impl("trl", "auto") == "trl-new"
    assert compare.third_impl("lit", "auto") is None  # lit@DIR vs lit: no TRL at all
    assert compare.third_impl("trl", "none") is None
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    args = compare.parse_args(["--trl-python", str(python), "--trl-new-python", str(tmp_path / "missing")])
    assert args.c == "trl-new"
    compare.check_pythons(args, ["W3_ppo", "control_rm", "flops"])  # trl 1.12 only: no error
    with pytest.raises(SystemExit, match="no TRL environment for trl-new at .*missing.*--c none"):
        compare.check_pythons(args, ["W3_ppo", "W2_dpo"])
    compare.check_pythons(compare.parse_args(["--trl-python", str(python), "--c", "none"]), ["W2_dpo"])
    with pytest.raises(SystemExit):  # argparse's error: the same implementation twice
        compare.parse_args(["--c", "trl"])  # B is trl too


def test_versions_table_names_each_environment():
    runs = {"W2_rm": [{"lit": {"versions": {"torch": "2.13.0", "transformers": "5.24.0", "lit-rlhf": "0.1"}},
                       "trl-new": {"versions": {"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0",
                                                "accelerate": "1.15.0"}}}]}  # fmt: skip
    versions = peers.versions_by_impl(runs)
    table = peers.versions_table(versions, {"lit": "/v/bin/python", "trl-new": "/n/bin/python"})
    assert "| lit | /v/bin/python | - | 5.24.0 | 2.13.0 | lit-rlhf 0.1 |" in table
    assert "| trl-new | /n/bin/python | 1.16.0 | 5.24.0 | 2.13.0 | accelerate 1.15.0 |" in table


def test_control_ppo_throughput_uses_the_fixed_tokens_and_the_median_rollout():
    run = dict(
        rollouts=[dict(total=t, cpu_total=t) for t in (9.0, 2.0, 4.0, 3.0)],
        tokens_per_rollout=512, peak_rss_mb=1.0,
    )  # fmt: skip
    assert report.throughput("control_ppo", run) == pytest.approx(512 / 3.0)


def test_lit_args_update_nested_settings_groups_field_by_field():
    import common

    from lit_rlhf.rollout import GenerationSettings

    kwargs = {
        "scoring": {"forward_batch_size": 16, "bucketing": {"token_budget": 512}},
        "generation": GenerationSettings(max_new_tokens=8),
        "max_rollouts": 3,
    }
    overrides = {"scoring": {"bucketing": {"split_cost": None}}, "generation": {"temperature": 0.5}, "max_rollouts": 1}
    out = common.with_overrides(kwargs, overrides)
    assert out["scoring"] == {"forward_batch_size": 16, "bucketing": {"token_budget": 512, "split_cost": None}}
    assert out["generation"] == GenerationSettings(max_new_tokens=8, temperature=0.5)
    assert out["max_rollouts"] == 1
    assert kwargs["scoring"]["bucketing"] == {"token_budget": 512}, "the defaults are not mutated"


def test_ablation_overrides_are_arguments_of_the_modules_settings_groups():
    # each ablation switches a technique off through the module's current arguments (a settings group or
    # the actor's ModelSpec), so a moved key fails here rather than in a 20-minute benchmark run
    import ablation

    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import CriticFreeModule, PPOModule

    modules = {"grpo_bench.py": CriticFreeModule, "ppo_bench.py": PPOModule}
    for name, ((script, _), overrides) in ablation.ABLATIONS.items():
        cls = modules[script]
        for key, value in overrides.items():
            if key in cls.settings_groups:
                cls.settings_groups[key].coerce(value, key)
            else:
                assert key == "actor", (name, key)
                ModelSpec.coerce({"name_or_path": "x", **value}, key)


PEAK = dict(
    threads=1, fp32_gflops=200.0, fp32_cpu_gflops=210.0, bf16_gflops=1400.0, bf16_cpu_gflops=1500.0,
    fp32_by_size={"512": 200.0}, bf16_by_size={"512": 1400.0},
)  # fmt: skip


def test_bf16_rows_run_where_the_bf16_peak_is_well_above_fp32():
    import compare

    assert compare.bf16_rows_wanted("auto", PEAK)  # 7x
    assert not compare.bf16_rows_wanted("auto", {**PEAK, "bf16_gflops": 399.0})  # 1.995x < 2x
    assert compare.bf16_rows_wanted("auto", {**PEAK, "bf16_gflops": 400.0})
    assert not compare.bf16_rows_wanted("auto", None)  # no peak measured
    assert compare.bf16_rows_wanted("on", {**PEAK, "bf16_gflops": 1.0})
    assert not compare.bf16_rows_wanted("off", PEAK)
    names = compare.with_bf16_rows(["W1_grpo", "W2_dpo", "W3_ppo", "flops"])
    assert names == ["W1_grpo", "W1_grpo_bf16", "W2_dpo", "W3_ppo", "W3_ppo_bf16", "flops", "flops_bf16"]
    jobs = compare.workload_jobs(compare.argparse.Namespace(size="smoke", rollouts=None, rm_steps=None, rm_warmup=5))
    assert jobs["W3_ppo_bf16"] == (jobs["W3_ppo"][0], (*jobs["W3_ppo"][1], "--precision", "bf16-mixed"))
    assert "--precision" not in jobs["W1_grpo"][1]
    assert "| bf16 | 1400.0 | 1500.0 | 512: 1400 |" in report.peak_table(PEAK, 2.0)
    assert "bf16 rows run (bf16/fp32 7.00x, threshold 2x)" in report.peak_table(PEAK, 2.0)


def test_bf16_rows_summary_and_what_bf16_buys():
    # lit: fp32 100 tokens/s, bf16 300 (3x); trl: fp32 50, bf16 75 (1.5x); trl-new: fp32 40, bf16 20 (0.5x)
    def run(tok_s):
        return rollout_run([9.0, 1.0], [1, tok_s], 1.0)

    runs = {
        "W1_grpo": [{"lit": run(100), "trl": run(50), "trl-new": run(40)}],
        "W1_grpo_bf16": [{"trl-new": run(20), "lit": run(300), "trl": run(75)}],
    }
    summ = peers.summary(runs, "lit", {name: ["trl", "trl-new"] for name in runs})
    assert summ["W1_grpo_bf16"]["throughput_ratio"] == pytest.approx(4.0) and summ["W1_grpo_bf16"]["peer"] == "trl"
    assert summ["W1_grpo_bf16"]["peers"]["trl-new"]["throughput_ratio"] == pytest.approx(15.0)
    assert summ["W1_grpo_bf16"]["throughput_unit"] == "response tokens/s"
    text = report.precision_speedups(runs)
    assert "- W1_grpo: bf16-mixed / float32 throughput, trl-new 0.50x, lit 3.00x, trl 1.50x" in text
    assert report.precision_speedups({"W1_grpo": runs["W1_grpo"]}) == ""


def test_flop_utilisation_is_against_the_peak_of_the_dtype_in_use():
    settings = dict(batch=1, prompt_len=1, response_len=1, ppo_epochs=1)
    rollouts = [dict(update=1.0, cpu_update=1.0, optimizer=0.0, cpu_optimizer=0.0, total=2.0, cpu_total=2.0)] * 2
    run = dict(impl="lit", actor_params=1, critic_params=1, update_flops=700e9, rollouts=rollouts,
               tokens_per_rollout=10, peak_rss_mb=1.0)  # fmt: skip
    # 700 GFLOP/s: 350% of the fp32 peak (a float32 run), 50% of the bf16 peak (a bf16-mixed run)
    assert "| fraction of the fp32 peak (target >= 60%) | 350% | 333% |" in report.flops_table(PEAK, run, settings)
    bf16 = report.flops_table(PEAK, {**run, "precision": "bf16-mixed"}, settings)
    assert "| fraction of the bf16 peak | 50% | 47% |" in bf16 and "bf16-mixed" in bf16

"""The tool world's pipeline: the calculator in the rollout loop, the evaluation, the config checks, the report
figures, and (slow) a miniature run end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lit_rlhf.demo import tool_assets, tool_evaluate, tool_pipeline, tool_report, tool_world
from lit_rlhf.demo.tool_env import Calculator
from lit_rlhf.engines import Responses
from lit_rlhf.environments import open_episodes, run_episodes
from lit_rlhf.models import load_tokenizer

PROBLEM = {"prompt": "tom has 37 boxes of 48 apples . how many apples ?", "answer": 1776, "kind": "product"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_assets")
    paths = tool_assets.build_tool_assets(out, **tool_assets.SMALL)
    return paths, load_tokenizer(str(paths["tokenizer"]), padding_side="left")


def scripted(tokenizer, turns: list[list[str]]):
    """A generate function whose call t answers turn t of each active episode with the given texts (+ EOS
    when the text does not end with the calculator's closing tag)."""
    calls = iter(turns)

    def generate(ids, mask, settings, greedy):
        texts = next(calls)
        assert len(texts) == ids.shape[0] and tool_world.CALL_CLOSE in settings.stop_strings
        rows = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        rows = [r if t.endswith(tool_world.CALL_CLOSE) else r + [tokenizer.eos_token_id] for r, t in zip(rows, texts)]
        T = max(map(len, rows))
        out = torch.full((len(rows), T), tokenizer.pad_token_id)
        keep = torch.zeros(len(rows), T, dtype=torch.bool)
        for i, r in enumerate(rows):
            out[i, : len(r)], keep[i, : len(r)] = torch.tensor(r), True
        return Responses(out, keep, torch.zeros(len(rows), dtype=torch.bool))

    return generate


def test_the_calculator_in_the_rollout_loop(assets):
    """Two episodes: one calls the calculator and copies its value, one answers at once; a third calls badly."""
    _, tokenizer = assets
    episode, turn = tool_evaluate.episode_settings(tool=True)
    problems = [PROBLEM, PROBLEM, PROBLEM]
    enc = tokenizer([p["prompt"] for p in problems], padding=True, return_tensors="pt")
    envs, prompts, mask = open_episodes(Calculator, episode, problems, tokenizer, enc.input_ids, enc.attention_mask)
    generate = scripted(tokenizer, [
        [" <calc> 37 * 48 </calc>", " answer : 1776 .", " <calc> 37 * </calc>"],
        [" answer : 1776 .", " answer : 1777 ."],  # the episodes still running: the first and the third
    ])  # fmt: skip
    out = run_episodes(generate, tokenizer, envs, prompts, mask, turn, episode)
    texts = [tokenizer.decode(ids[keep], skip_special_tokens=True) for ids, keep in zip(out.responses.ids, out.responses.mask)]
    assert texts == [" <calc> 37 * 48 </calc> = 1776 answer : 1776 .", " answer : 1776 .",
                     " <calc> 37 * </calc> = error answer : 1777 ."]  # fmt: skip
    assert tool_world.exact_match(["p"] * 3, texts, [1776] * 3) == [1.0, 1.0, 0.0]
    assert out.turns.tolist() == [2, 1, 2] and out.tool_calls.tolist() == [1, 0, 1] and out.tool_errors.tolist() == [0, 0, 1]
    observation = tokenizer(" = 1776", add_special_tokens=False).input_ids
    call = tokenizer(" <calc> 37 * 48 </calc>", add_special_tokens=False).input_ids
    span = slice(len(call), len(call) + len(observation))
    assert out.responses.ids[0, span].tolist() == observation  # appended once, as tokenised on its own
    assert not out.responses.loss_mask[0, span].any() and out.responses.loss_mask[0, : len(call)].all()


def test_evaluation_of_an_exported_policy(assets, tmp_path):
    paths, tokenizer = assets
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    problems = tool_evaluate.read_problems(paths["prompts_eval"])[:12]
    for setting in tool_evaluate.SETTINGS:
        rows = tool_evaluate.evaluate_policy(tmp_path, problems, tool=setting == "tool", batch_size=5)
        again = tool_evaluate.evaluate_policy(tmp_path, problems, tool=setting == "tool", batch_size=5)
        assert rows == again  # its own seeded stream
        assert [r["prompt"] for r in rows] == [p["prompt"] for p in problems]
        limit = 3 if setting == "tool" else 1
        assert all(1 <= r["turns"] <= limit and r["ended"] in ("done", "max_turns", "length") for r in rows)
        for r in rows:
            assert r["correct"] == (tool_world.final_answer(r["response"]) == r["answer"])
    summary = tool_evaluate.summarize(rows)
    assert summary["n"] == 12 and 0.0 <= summary["accuracy"] <= 1.0 and summary["turns"] == 1.0


def test_summary_figures():
    def row(kind, correct, calls=0, errors=0, turns=1, written=None):
        return {"kind": kind, "correct": correct, "tool_calls": calls, "tool_errors": errors, "turns": turns,
                "calls_written": calls > 0 if written is None else written}  # fmt: skip

    rows = [row("sum", True), row("product", True, 1, 0, 2), row("product", False, 1, 1, 2), row("product", False),
            row("product", False, written=True)]  # fmt: skip
    s = tool_evaluate.summarize(rows)
    assert (s["n"], s["accuracy"], s["tool_call_rate"], s["tool_calls"], s["tool_errors"]) == (5, 0.4, 0.6, 0.4, 0.2)
    assert s["turns"] == pytest.approx(7 / 5) and s["answered_call_accuracy"] == 1.0  # the failed call is left out
    assert s["sum"]["accuracy"] == 1.0 and s["sum"]["answered_call_accuracy"] is None
    assert s["product"]["accuracy"] == 0.25 and s["product"]["tool_call_rate"] == 0.75


def test_target_and_aggregation():
    def figures(accuracy):
        return {m: accuracy if m == "accuracy" else 0.0 for m in tool_report.METRICS}

    seeds = [{"run": f"r{i}", "tool": figures(a), "no_tool": figures(a / 4)} for i, a in enumerate((0.6, 0.8, 0.7))]
    entry = tool_report.aggregate(seeds)
    assert entry["tool"]["accuracy"] == pytest.approx(0.7) and entry["tool"]["std"]["accuracy"] == pytest.approx(0.1)
    assert entry["no_tool"]["accuracy"] == pytest.approx(0.175)
    sft = {"tool": figures(0.35), "no_tool": figures(0.2)}
    no_tool = tool_report.aggregate([{"run": "n", "tool": figures(0.3), "no_tool": figures(0.3)}])
    result = tool_report.target(sft, {"grpo_tool": entry, "grpo_no_tool": no_tool})
    assert result["met"] and result["ratio_to_sft"] == pytest.approx(2.0)  # 0.7 = 2 x 0.35, above 0.3
    assert not tool_report.target({**sft, "tool": figures(0.36)}, {"grpo_tool": entry, "grpo_no_tool": no_tool})["met"]
    better = tool_report.aggregate([{"run": "n", "tool": figures(0.1), "no_tool": figures(0.75)}])
    assert not tool_report.target(sft, {"grpo_tool": entry, "grpo_no_tool": better})["met"]  # 0.7 < 0.75


def test_the_configs_sample_as_the_evaluation(tmp_path):
    configs = {name: tool_pipeline.grpo_config(name, 0, tmp_path, small=False)[1] for name in tool_pipeline.ALGORITHMS}
    tool_pipeline.check_configs(configs)
    init = configs["grpo_tool"]["model"]["init_args"]
    assert init["environment"]["env"] == tool_evaluate.ENVIRONMENT and "environment" not in configs["grpo_no_tool"]["model"]["init_args"]
    assert init["actor"]["name_or_path"] == str(tmp_path / "sft")
    assert configs["grpo_tool"]["trainer"]["callbacks"][0]["init_args"] == {"dirpath": str(tmp_path / "grpo_tool"), "overwrite": True}
    run, seeded = tool_pipeline.grpo_config("grpo_no_tool", 2, tmp_path, small=True)
    assert run == "grpo_no_tool_seed2" and seeded["model"]["init_args"]["rng_seed"] == 2
    bad = json.loads(json.dumps(configs))
    bad["grpo_tool"]["model"]["init_args"]["generation"]["temperature"] = 0.8
    with pytest.raises(ValueError, match=r"tool_grpo.yaml: generation .* temperature 1.0"):
        tool_pipeline.check_configs(bad)
    bad = json.loads(json.dumps(configs))
    bad["grpo_tool"]["model"]["init_args"]["environment"]["max_turns"] = 2
    with pytest.raises(ValueError, match="environment .* differs from the evaluation's"):
        tool_pipeline.check_configs(bad)
    bad = json.loads(json.dumps(configs))
    bad["grpo_no_tool"]["model"]["init_args"]["max_rollouts"] = 7
    with pytest.raises(ValueError, match="as many prompts"):
        tool_pipeline.check_configs(bad)


@pytest.mark.slow
def test_small_pipeline_end_to_end(tmp_path):
    out = tmp_path / "tool"
    args = ["--out", str(out), "--small", "--seeds", "2", "--threads", "1"]
    summary = tool_pipeline.main(args)
    for name in ("report.json", "report.md", "samples.md", "tool_world.png"):
        assert (out / name).stat().st_size > 0, name
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(summary))
    assert set(summary["algorithms"]) == {"grpo_tool", "grpo_no_tool"} and summary["n_seeds"] == 2
    assert [s["run"] for s in summary["algorithms"]["grpo_tool"]["seeds"]] == ["grpo_tool", "grpo_tool_seed1"]
    for setting in tool_evaluate.SETTINGS:
        for key in ("accuracy", "tool_call_rate", "tool_errors", "turns"):
            assert math.isfinite(summary["sft"][setting][key])
    assert summary["sft"]["no_tool"]["turns"] == 1.0  # one turn without the tool
    assert len(summary["curves"]["grpo_tool"]["score"]) == 2  # one point per rollout (max_rollouts 2)
    assert isinstance(summary["target"]["met"], bool)
    again = tool_pipeline.main([*args, "--reuse"])
    assert set(again["reused_stages"]) == {"sft", "grpo_tool", "grpo_tool_seed1", "grpo_no_tool", "grpo_no_tool_seed1"}


@pytest.mark.slow
def test_the_demo_configuration_meets_the_target(tmp_path):
    """`make demo`'s tool world (seed 0, about 2.5 minutes on one thread): GRPO with the calculator at least
    doubles the SFT policy's accuracy and beats GRPO without it (measured: 0.793 vs 0.320 and 0.127)."""
    summary = tool_pipeline.main(["--out", str(tmp_path / "tool"), "--threads", "1"])
    target = summary["target"]
    assert target["met"], target
    assert target["grpo_tool_accuracy"] > 0.7 and target["grpo_no_tool_accuracy"] < 0.25
    sft, tool = summary["sft"]["tool"], summary["algorithms"]["grpo_tool"]["tool"]
    assert sft["sum"]["accuracy"] > 0.95 and sft["product"]["accuracy"] < 0.3  # SFT: sums by heart, a few calls
    assert sft["answered_call_accuracy"] > 0.7  # SFT copies the calculator's value when it calls
    assert tool["tool_call_rate"] > 0.6 and tool["turns"] > 1.5 and tool["tool_errors"] < 0.05

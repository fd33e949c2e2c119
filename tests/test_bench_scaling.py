"""The scaling harness (scripts/bench/scaling.py, scaling_plot.py) without timing anything: the points of
each sweep, the actors' sizes, the fixed-length data, and the figures read from made-up results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import scaling  # noqa: E402
import scaling_plot  # noqa: E402


def params(point: dict) -> int:
    """Parameters of the point's actor, built on the meta device (no memory, no init)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    special = dict(pad_token_id=1, eos_token_id=0, bos_token_id=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**scaling.model_fields(point, special)))
    return sum(p.numel() for p in model.parameters())


def test_full_sweep_points_vary_one_axis_from_the_base():
    base = scaling.SWEEPS["full"]["base"]
    grpo = scaling.points("full", tuple(scaling.ALGO_AXES["grpo"]), "grpo")
    dpo = scaling.points("full", tuple(scaling.ALGO_AXES["grpo"]), "dpo")
    assert len(grpo) == 1 + 2 + 3 + 2 + 2  # the base point once, then the other values of each axis
    assert len(dpo) == 1 + 2 + 2 + 2  # no K axis for pairs
    assert all(p["k"] == base["k"] for p in dpo)
    for point in grpo:
        assert sum(point[k] != v for k, v in base.items()) <= 1
    assert {p["prompt_len"] for p in grpo} == {64, 256, 1024}
    assert {p["k"] for p in grpo} == {2, 4, 8, 16}
    assert {p["vocab"] for p in grpo} == {8000, 32000, 128000}
    assert len({scaling.point_name(p) for p in grpo}) == len(grpo)


@pytest.mark.parametrize("model", ["5M", "20M", "100M"])
def test_model_axis_actors_are_near_their_nominal_size(model):
    n = params({**scaling.SWEEPS["full"]["base"], "model": model})
    assert abs(n / scaling.NOMINAL_PARAMS[model] - 1) < 0.05, n
    if model == "20M":
        assert n == 20_580_608  # W1's own actor (hidden 256, 4 layers, vocab 32k, untied)


@pytest.mark.parametrize("vocab", [8000, 128000])
def test_vocab_axis_changes_only_the_embedding_and_head(vocab):
    base = scaling.SWEEPS["full"]["base"]
    n, n32 = params({**base, "vocab": vocab}), params(base)
    assert n - n32 == 2 * (vocab - 32000) * 256  # embedding and untied head, hidden 256


def test_the_lexicon_is_w1s_up_to_32k():
    assert scaling.lexicon(32000) == __import__("workloads").lexicon()  # the base point is W1's tokenizer


def test_point_data_has_exact_lengths_and_tokenizes_to_its_ids():
    point = {**scaling.SWEEPS["smoke"]["base"], "prompt_len": 48, "vocab": 2000}
    words, tok, word_ids = scaling.vocabulary(point["vocab"])
    assert len(tok) == 2000
    data = scaling.point_data(point, "smoke", words, tok, word_ids)
    assert len(data["grpo_prompts"]) == scaling.SWEEPS["smoke"]["rollouts"] + 1
    for prompt in data["grpo_prompts"]:
        assert len(prompt["ids"]) == 48 and tok(prompt["text"])["input_ids"] == prompt["ids"]
    assert len(data["pairs"]) == 2 * (scaling.SWEEPS["smoke"]["dpo_steps"] + 1)
    for pair in data["pairs"]:
        assert len(pair["prompt"]["ids"]) == 48
        for slot in ("chosen", "rejected"):  # what DPOTrainer tokenises: prompt + response + EOS string
            assert (
                len(pair[slot]["ids"]) == scaling.PAIR_RESPONSE and pair[slot]["ids"][-1] == tok.eos_token_id
            )
            text = pair["prompt"]["text"] + pair[slot]["text"] + tok.eos_token
            assert tok(text)["input_ids"] == pair["prompt"]["ids"] + pair[slot]["ids"]


def grpo_run(totals: list[float], rss: float) -> dict:
    rollouts = [dict(total=t, cpu_total=t, generation=t / 2, scoring=0.0, update=t / 2) for t in totals]
    return dict(rollouts=rollouts, response_tokens=[10] * len(totals), peak_rss_mb=rss, actor_params=5)


def test_curves_take_medians_of_timed_rollouts_and_keep_failures():
    base = dict(prompt_len=256, k=8, model="20M", vocab=32000)
    entry = lambda point, lit, trl: dict(point=point, runs=[dict(lit=lit, trl=trl)])  # noqa: E731
    result = dict(
        sweep=dict(base=base, axes=dict(k=(2, 8, 16))),
        runs=dict(grpo={
            "a": entry({**base, "k": 16}, grpo_run([9, 4, 6], 300), dict(impl="trl", error="exit code -9")),
            "b": entry(base, grpo_run([9, 1, 3], 100), grpo_run([9, 4, 5, 9], 200)),
            "c": entry({**base, "vocab": 8000}, grpo_run([9, 1, 1], 1), grpo_run([9, 1, 1], 1)),  # other axis
        }),
    )  # fmt: skip
    points = scaling_plot.curve(result, "grpo", "k")
    assert [value for value, _ in points] == [8, 16]  # axis order; the vocab point is not on the K curve
    (_, at8), (_, at16) = points
    assert at8["lit"]["time"] == 2.0 and at8["trl"]["time"] == 5.0  # warm-up left out, medians
    assert at8["lit"]["rss"] == 100 and at16["lit"]["time"] == 5.0
    assert at16["trl"] == dict(error="exit code -9")
    table = scaling_plot.table(result)
    assert "| W1 GRPO, s / rollout | k | 8 |" in table and "**2.50**" in table  # 5.0 / 2.0
    assert "| 2 [1-3] | 5 [4-9] |" in table  # the medians with the min-max of the timed rollouts
    assert "1.00/0.00/1.00 vs 2.50/0.00/2.50" in table  # the phase split, medians
    assert "failed" in table and "exit code -9" in table

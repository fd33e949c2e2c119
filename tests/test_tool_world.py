"""The tool world: problems and their gold answers, the calculator, the Calculator environment, the exact-match
reward, the digit-splitting tokenizer and the assets."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lit_rlhf.demo import tool_assets, tool_world
from lit_rlhf.demo.tool_env import Calculator
from lit_rlhf.environments import StepResult, check_step
from lit_rlhf.models import load_tokenizer
from lit_rlhf.models.tokenizer import EOS_TOKEN, train_bpe_tokenizer


def test_problems_and_their_gold_answers():
    rng = random.Random(0)
    problems = [tool_world.sample_problem(rng) for _ in range(2_000)]
    for p in problems:
        a, b = (int(n) for n in re.findall(r"\d+", p["prompt"]))  # the two numbers of the text
        assert {a, b} == {p["a"], p["b"]}
        assert p["answer"] == (a + b if p["kind"] == "sum" else a * b)
        assert p["prompt"].endswith(" ?") and f"many {p['prompt'].split()[-2]} ?" in p["prompt"]
        if p["kind"] == "product":
            assert 1_000 <= p["answer"] <= 9_999  # always four digits
        else:
            assert 2 <= p["answer"] <= 18
    sums = sum(p["kind"] == "sum" for p in problems) / len(problems)
    assert abs(sums - tool_world.EASY_FRACTION) < 0.04
    assert len({p["prompt"] for p in problems}) > 1_500  # names, items, boxes and templates vary


def test_a_hand_written_problem():
    problem = {"prompt": "tom packs 48 apples in each of 37 boxes . how many apples ?", "answer": 1776,
               "kind": "product", "a": 37, "b": 48}  # fmt: skip
    assert tool_world.expression(problem) == "48 * 37"  # the numbers in the order of the text
    assert tool_world.tool_response(problem) == " <calc> 48 * 37 </calc> = 1776 answer : 1776 ."
    assert tool_world.direct_response(1776) == " answer : 1776 ."
    with pytest.raises(ValueError, match="kind must be"):
        tool_world.sample_problem(random.Random(0), "division")


@pytest.mark.parametrize(
    ("expr", "value"),
    [("37 * 48", 1776), (" 3 + 5 ", 8), ("2+3*4", 14), ("10 - 2 * 3 + 1", 5), ("7", 7), ("2 * 3 * 4 - 1", 23)],
)
def test_calculate(expr, value):
    assert tool_world.calculate(expr) == value


@pytest.mark.parametrize("expr", ["", "  ", "37 *", "* 3", "3 4", "3 ** 4", "3 / 4", "(3)", "x", "1234567890 * 2", "-3"])
def test_calculate_refuses_malformed_expressions(expr):
    with pytest.raises(ValueError):
        tool_world.calculate(expr)


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(["+", "-", "*"]))
def test_calculate_agrees_with_python(a, b, op):
    assert tool_world.calculate(f"{a} {op} {b}") == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_calculator_steps():
    env = Calculator()
    assert env.reset({"prompt": "tom has 37 boxes of 48 apples . how many apples ?", "answer": 1776}) is None
    call = env.step(" <calc> 37 * 48 </calc>")
    assert call == StepResult(" = 1776", tool_call=True) and check_step(call, "test") == call
    assert env.step(" <calc> 37 * 48 </calc>  " + EOS_TOKEN) == StepResult(" = 1776", tool_call=True)
    assert env.step(" <calc> 2 + </calc>") == StepResult(" = error", tool_call=True, tool_error=True)
    assert env.step(" 37 * 48 </calc>") == StepResult(" = error", tool_call=True, tool_error=True)  # no <calc>
    assert env.step(" <calc> 1 + 1 </calc> <calc> 6 * 7 </calc>").observation == " = 42"  # the last call
    assert env.calls == 5
    final = env.step(" answer : 1776 .")
    assert final == StepResult(None, done=True) and not final.tool_call
    assert env.step(" <calc> 37 * 48").done  # an unclosed call is a final (wrong) answer
    assert Calculator(error_observation=" = ?").step(" <calc> x </calc>").observation == " = ?"
    with pytest.raises(ValueError, match="error_observation"):
        Calculator(error_observation="")


def test_exact_match():
    prompts = ["p"] * 6
    responses = [
        " answer : 1776 .",
        " <calc> 37 * 48 </calc> = 1776 answer : 1776 .",
        " <calc> 37 * 48 </calc> = 1776 answer : 1777 .",
        " answer : 1776 . " + EOS_TOKEN + "answer : 5 .",  # what follows the EOS is not the response
        " answer : 1776",  # no full stop: not the answer format
        " = 1776",
    ]
    assert tool_world.exact_match(prompts, responses, answer=[1776] * 6, kind=["product"] * 6) == [
        1.0, 1.0, 0.0, 1.0, 0.0, 0.0,
    ]  # fmt: skip
    assert tool_world.exact_match(["p"], [" answer : 8 ."], answer=["8"]) == [1.0]  # a gold read as text
    assert tool_world.final_answer(" answer : 3 . answer : 4 .") == 4
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 answers"):
        tool_world.exact_match(["p", "q"], ["r"], answer=[1, 2])


def test_the_reward_reaches_the_answer_column():
    from lit_rlhf.reward_fns import reward_call

    call = reward_call(tool_world.exact_match, "reward_fn")
    assert call.form == "pairs" and call.keywords is None and call.required == ("answer",)


def test_digits_are_single_tokens(tmp_path):
    texts = [tool_world.sample_problem(random.Random(i))["prompt"] + " answer : 1776 ." for i in range(300)]
    train_bpe_tokenizer(texts, vocab_size=300, split_digits=True).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path))
    pieces = [tokenizer.decode([i]) for i in tokenizer(" <calc> 37 * 48 </calc> = 1776", add_special_tokens=False).input_ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == ["3", "7", "4", "8", "1", "7", "7", "6"]
    plain = train_bpe_tokenizer(texts, vocab_size=300)  # without split_digits numbers merge
    assert any(len(plain.decode([i]).strip()) > 1 and plain.decode([i]).strip().isdigit()
               for i in plain(" 1776 1776 1776", add_special_tokens=False).input_ids)  # fmt: skip


def test_a_transcript_tokenises_as_its_turns_and_observation(tmp_path):
    """Observations have no trailing space: the model's turns and the observation, tokenised one by one, give
    the tokens of the transcript's text (so SFT on transcripts trains the tokens the rollout produces)."""
    paths = tool_assets.build_tool_assets(tmp_path, **tool_assets.SMALL)
    tokenizer = load_tokenizer(str(paths["tokenizer"]))
    rows = [json.loads(line) for line in paths["sft_train"].read_text().splitlines()]
    tool_rows = [r for r in rows if tool_world.CALL_OPEN in r["completion"]]
    assert tool_rows
    for row in tool_rows:
        call, rest = row["completion"].split(tool_world.CALL_CLOSE)
        observation, answer = rest.split(" answer")
        parts = [call + tool_world.CALL_CLOSE, observation, " answer" + answer]
        pieces = [i for part in parts for i in tokenizer(part, add_special_tokens=False).input_ids]
        assert pieces == tokenizer(row["completion"], add_special_tokens=False).input_ids


def test_assets(tmp_path):
    sizes = dict(n_sft=4_000, n_prompts=64, n_eval_prompts=100, tool_fraction=0.2, copy_fraction=0.3, sft_sum_fraction=0.4)
    paths = tool_assets.build_tool_assets(tmp_path, **sizes)
    manifest = json.loads(paths["manifest"].read_text())
    assert manifest["rows"] == {"sft_train": 4_000, "sft_val": 200, "prompts_train": 64, "prompts_eval": 100}
    sft = [json.loads(line) for line in paths["sft_train"].read_text().splitlines()]
    products = [r for r in sft if " of " in r["prompt"]]  # both product templates have it, no sum template
    tool_rows = [r for r in sft if tool_world.CALL_OPEN in r["completion"]]
    copy_rows = [r for r in sft if tool_world.CALL_OPEN in r["prompt"]]
    assert all(r in products for r in tool_rows + copy_rows)  # sums are always answered directly
    assert abs(1 - len(products) / len(sft) - 0.4) < 0.03  # the SFT rows' own share of sums
    assert 0.17 < len(tool_rows) / len(products) < 0.23 and 0.27 < len(copy_rows) / len(products) < 0.33
    assert (manifest["sft_tool_rows"], manifest["sft_copy_rows"]) == (len(tool_rows), len(copy_rows))
    for row in sft:  # the answer is the gold of the problem's numbers; a continuation holds the observation
        question = row["prompt"].split(" ?")[0]
        a, b = (int(n) for n in re.findall(r"\d+", question))
        gold = a * b if row in products else a + b
        assert tool_world.final_answer(row["completion"]) == gold
        if row in copy_rows:
            assert row["prompt"].endswith(f"? <calc> {a} * {b} </calc> = {gold}")
            assert row["completion"] == tool_world.direct_response(gold)
    evaluation = [json.loads(line) for line in paths["prompts_eval"].read_text().splitlines()]
    train = [json.loads(line) for line in paths["prompts_train"].read_text().splitlines()]
    assert set(train[0]) == {"prompt", "answer", "kind"} and len({r["prompt"] for r in evaluation}) == 100
    sum_share = sum(r["kind"] == "sum" for r in train + evaluation) / len(train + evaluation)
    assert abs(sum_share - tool_world.EASY_FRACTION) < 0.1  # the world's share, not the SFT rows'
    parts = {"eval": evaluation, "rl": train, "sft": [{**r, "kind": "product" if r in products else "sum"} for r in sft]}
    for where, rows in parts.items():  # three disjoint parts of the problem space
        for row in rows:
            question = row["prompt"].split(" ?")[0] + " ?"
            a, b = (int(n) for n in re.findall(r"\d+", question))
            assert tool_assets.part({"prompt": question, "kind": row["kind"], "a": a, "b": b}) == where
    again = tool_assets.build_tool_assets(tmp_path / "again", **sizes)
    assert again["sft_train"].read_text() == paths["sft_train"].read_text()  # deterministic
    with pytest.raises(ValueError, match="tool_fraction and copy_fraction"):
        tool_assets.build_tool_assets(tmp_path / "bad", tool_fraction=0.6, copy_fraction=0.5)

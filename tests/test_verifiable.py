"""lit_rlhf.verifiable: math-verify accuracy on hand-picked answers, format, soft overlong punishment, repetition."""

from __future__ import annotations

import math

import pytest

from lit_rlhf.verifiable import accuracy, format_reward, repetition_penalty, soft_overlong_punishment


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        ("1/2", "0.5"),
        ("0.5", "1/2"),
        ("0.5", "\\frac{1}{2}"),
        ("The answer is $\\frac{1}{2}$.", "0.5"),
        ("so we get \\boxed{\\frac{1}{2}}", "1/2"),
        ("3.0", "3"),
        ("3", "3.0"),
        ("answer: 3", 3),  # a number in the gold column
        ("1000", "10^{3}"),  # a LaTeX gold without delimiters is read as LaTeX math
        ("x = \\boxed{\\sqrt{2}}", "$\\sqrt{2}$"),
    ],
)
def test_equivalent_answers_are_correct(completion, gold):
    assert accuracy([completion], answer=[gold]) == [1.0]


@pytest.mark.parametrize(
    ("completion", "gold"),
    [("1/3", "0.5"), ("0.51", "1/2"), ("4", "3"), ("\\boxed{2}", "\\frac{1}{2}"), ("-3", "3")],
)
def test_wrong_answers_score_zero(completion, gold):
    assert accuracy([completion], answer=[gold]) == [0.0]


@pytest.mark.parametrize("completion", ["", "I do not know.", "???", "\\frac{1}{"])
def test_an_unparseable_completion_scores_zero(completion):
    assert accuracy([completion], answer=["1/2"]) == [0.0]


@pytest.mark.parametrize("gold", ["???", "", "   ", None, "\\frac{1}{", ["1/2"]])
def test_an_unparseable_gold_answer_is_reported_not_scored_wrong(gold):
    with pytest.warns(UserWarning, match="math-verify cannot parse the gold answer"):
        scores = accuracy(["1/2", "0.5", "nothing"], answer=[gold, "1/2", gold])
    # NaN: a non-finite score for lit_rlhf's on_nonfinite policy, skipped by TRL's nansum (not None: in a
    # reward_fn list None means "not this function's row", and the other functions' sum would stand)
    assert math.isnan(scores[0]) and scores[1] == 1.0 and math.isnan(scores[2])


def test_answer_pattern_checks_the_last_match_and_a_missing_match_scores_zero():
    completions = ["<answer>3</answer> no, <answer>0.5</answer>", "<answer>3</answer>", "0.5 without tags"]
    tags = "<answer>(.*?)</answer>"
    assert accuracy(completions, answer=["1/2"] * 3, answer_pattern=tags) == [1.0, 0.0, 0.0]
    # without the pattern math-verify reads the whole text: a plain number, but not one glued to tags
    assert accuracy(["<answer>0.5</answer>", "0.5 without tags"], answer=["1/2"] * 2) == [0.0, 1.0]


TAGS = "<answer>(.*?)</answer>"


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("2\\sqrt{2}", "2", 0.0),  # read whole as LaTeX math, not its first number
        ("3\\pi", "3", 0.0),
        ("10^{3}", "10", 0.0),
        ("\\sqrt{2}", "\\sqrt{2}", 1.0),
        ("\\dfrac{3}{4}", "\\frac{3}{4}", 1.0),
        ("\\pi", "\\pi", 1.0),
        ("10^{3}", "1000", 1.0),
        ("x^2+1", "x^2+1", 1.0),
        ("1/2", "0.5", 1.0),
        ("x = 4", "4", 1.0),
    ],
)
def test_the_answer_a_pattern_picks_out_is_read_as_latex_math_like_the_gold(answer, gold, score):
    assert accuracy([f"so <answer>{answer}</answer>"], answer=[gold], answer_pattern=TAGS) == [score]


@pytest.mark.parametrize(
    ("answer", "gold", "score"),
    [
        ("It is 5", "5", 1.0),  # plain words: read as free text, as math-verify reads a whole completion
        ("**5**", "5", 1.0),  # markdown around the answer is dropped
        ("`5`", "5", 1.0),
        ("__\\frac{1}{2}__", "0.5", 1.0),
        ("The answer is *5*.", "5", 1.0),
        ("**2\\sqrt{2}**", "2", 0.0),  # still math once the markdown is gone
        ("2*3*4", "24", 1.0),  # a product, no emphasis
        ("x_1 + x_1", "2x_1", 1.0),  # subscripts, no emphasis
        ("It is 4", "5", 0.0),
    ],
)
def test_the_answer_a_pattern_picks_out_is_read_without_markdown_and_words_as_text(answer, gold, score):
    assert accuracy([f"<think>2+3=5</think><answer>{answer}</answer>"], answer=[gold], answer_pattern=TAGS) == [score]


def test_conversational_completions_are_read_by_their_last_message():
    chat = [[{"role": "assistant", "content": "so \\boxed{5}"}], [{"role": "assistant", "content": "<answer>4</answer>"}]]
    assert accuracy(chat, answer=["5", "4"]) == [1.0, 0.0]  # the second: digits glued to tags, as for strings
    assert format_reward(chat) == [1.0, 0.0]
    assert repetition_penalty([[{"role": "assistant", "content": "a b a b"}]], ngram_size=2) == pytest.approx([-1 / 3])


def test_number_golds_are_written_out_and_nan_is_a_missing_gold():
    import numpy as np

    # str(0.00001) is 1e-05, which math-verify reads as e - 5
    assert accuracy(["\\boxed{0.00001}", "\\boxed{e-5}"], answer=[0.00001] * 2) == [1.0, 0.0]
    assert accuracy(["\\boxed{10000000000000000}", "\\boxed{e+16}"], answer=[1e16] * 2) == [1.0, 0.0]
    assert accuracy(["\\boxed{3}"], answer=[np.int64(3)]) == [1.0]
    with pytest.warns(UserWarning, match="cannot parse the gold answer nan"):
        (score,) = accuracy(["\\boxed{nan}"], answer=[float("nan")])  # how pandas stores a missing number
    assert math.isnan(score)


def test_currency_and_matrix_golds_are_read_as_math():
    # an escaped \$ is a currency sign, not a math delimiter; a pmatrix needs math mode around it
    assert accuracy(["\\boxed{18.90}", "\\boxed{18.9}", "\\boxed{19}"], answer=["\\$18.90"] * 3) == [1.0, 1.0, 0.0]
    matrix = "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"
    assert accuracy([f"$${matrix}$$", "\\boxed{2}"], answer=[matrix] * 2) == [1.0, 0.0]


def test_accuracy_reads_the_gold_column_it_is_told():
    assert accuracy(["0.5"], solution=["1/2"], gold_column="solution", prompts=["p"]) == [1.0]
    with pytest.raises(ValueError, match=r"column 'answer', which the prompt rows lack .*\['prompts', 'solution'\]"):
        accuracy(["0.5"], solution=["1/2"], prompts=["p"])
    with pytest.raises(ValueError, match="answer_pattern '\\(' is not a valid regular expression"):
        accuracy(["0.5"], answer=["1/2"], answer_pattern="(")


def test_accuracy_runs_without_a_timeout_outside_the_main_thread():
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(accuracy(["0.5", "2"], answer=["1/2", "1/2"])))
    thread.start()
    thread.join()
    assert out == [[1.0, 0.0]]


def test_format_reward():
    completions = ["so \\boxed{2}", "2", "<answer>1</answer>", "think <answer>1</answer>"]
    assert format_reward(completions) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward(completions, pattern="<answer>.*?</answer>") == [0.0, 0.0, 1.0, 1.0]
    assert format_reward(completions, pattern="<answer>.*?</answer>", fullmatch=True) == [0.0, 0.0, 1.0, 0.0]
    assert format_reward(["<answer>\n1\n</answer>"], pattern="<answer>.*</answer>", fullmatch=True) == [1.0]
    with pytest.raises(ValueError, match="format_reward: pattern '\\[' is not a valid regular expression"):
        format_reward(completions, pattern="[")


def test_soft_overlong_punishment_of_token_lengths():
    # L_max = 10, L_cache = 4: 0 up to 6 tokens, -0.25 per token after, -1 from 10 on
    ids = [[7] * n for n in (3, 6, 7, 9, 10, 12)]
    assert soft_overlong_punishment(ids, max_length=10, cache_length=4, completions=["x"] * 6) == [
        0.0, 0.0, -0.25, -0.75, -1.0, -1.0
    ]  # fmt: skip


def test_repetition_penalty_by_hand():
    completions = [
        "a b a b a b",  # bigrams ab ba ab ba ab: 2 distinct of 5 -> -(1 - 2/5) = -0.6
        "a b c d",  # 3 distinct of 3 -> 0
        "a",  # fewer words than n -> 0
        "The the THE",  # lower-cased: (the, the) twice, 1 distinct of 2 -> -0.5
        "",
    ]
    assert repetition_penalty(completions, ngram_size=2) == pytest.approx([-0.6, 0.0, 0.0, -0.5, 0.0])
    # trigrams (default): "x y z x y z x": xyz yzx zxy xyz yzx -> 3 distinct of 5 -> -0.4
    assert repetition_penalty(["x y z x y z x"]) == pytest.approx([-0.4])
    assert repetition_penalty(["go go go go"], ngram_size=1) == pytest.approx([-0.75])
    with pytest.raises(ValueError, match="ngram_size must be an integer >= 1, got 0"):
        repetition_penalty(["a"], ngram_size=0)

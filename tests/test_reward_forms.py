"""Reward-function calling forms (this project's (prompts, responses) and TRL's (completions, **kwargs)),
weighted reward_fn lists and their per-function scores, through RewardSource."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from lit_rlhf.models import load_tokenizer
from lit_rlhf.reward_fns import call_reward_fn, reward_call
from lit_rlhf.rewards import RewardSource, reward_terms


def pairs(prompts, responses):
    return [1.0] * len(responses)


def pairs_with_column(prompts, responses, answer, scale=1.0):
    return [scale * (r == a) for r, a in zip(responses, answer)]


def pairs_with_kwargs(prompts, responses, **kwargs):
    return [float(len(kwargs))] * len(responses)


def trl(completions, **kwargs):
    return [float(len(c)) for c in completions]


def trl_ids_only(completion_ids, max_length):
    return [float(len(ids) > max_length) for ids in completion_ids]


def only_kwargs(**kwargs):
    return [0.0] * len(kwargs["completions"])


def trl_prompts(prompts, **kwargs):
    return [0.0] * len(prompts)


class Scorer:
    def __call__(self, completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize(
    ("fn", "form", "keywords", "required"),
    [
        (pairs, "pairs", frozenset(), ()),
        (lambda p, r: r, "pairs", frozenset(), ()),
        (pairs_with_column, "pairs", {"answer", "scale"}, ("answer",)),
        (pairs_with_kwargs, "pairs", None, ()),
        (max, "pairs", frozenset(), ()),  # no inspectable signature: called as fn(prompts, responses)
        (trl, "trl", None, ("completions",)),
        (trl_ids_only, "trl", {"completion_ids", "max_length"}, ("completion_ids", "max_length")),
        (only_kwargs, "trl", None, ()),
        (trl_prompts, "trl", None, ("prompts",)),
        (Scorer(), "trl", {"completions", "answer"}, ("completions", "answer")),
    ],
)
def test_the_form_is_read_from_the_signature(fn, form, keywords, required):
    call = reward_call(fn, "reward_fn x")
    assert call.form == form and call.required == required
    assert call.keywords == (None if keywords is None else frozenset(keywords))


def test_fixed_kwargs_are_no_longer_required():
    assert reward_call(trl_ids_only, "rf", {"max_length": 4}).required == ("completion_ids",)
    assert reward_call(functools.partial(trl_ids_only, max_length=4), "rf").form == "trl"


def one(texts):
    return texts


def none():
    return []


def three_positional(a, b, c, /):
    return c


@pytest.mark.parametrize(
    ("fn", "fixed", "message"),
    [
        (one, None, r"reward_fn\[1\] one: one\(texts\) fits neither this project's fn\(prompts, responses, \*\*columns\)"),
        (none, None, r"none: none\(\) fits neither"),
        (three_positional, None, r"positional-only parameter\(s\) \['c'\] cannot be passed"),
        (trl_ids_only, {"scale": 2}, r"kwargs \['scale'\] are not keywords it takes"),
        (trl, {"completions": ["x"]}, r"kwargs \['completions'\] are not keywords it takes \(lit_rlhf passes"),
    ],
)
def test_bad_signatures_and_kwargs_are_refused_naming_the_function(fn, fixed, message):
    with pytest.raises(TypeError, match=message):
        reward_call(fn, f"reward_fn[1] {fn.__name__}", fixed)


def test_call_passes_each_form_what_it_takes():
    seen = {}

    def trl_all(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [0.0]

    args = (["p"], ["r"], [[5, 6]], {"answer": ["a"], "level": [3]})
    call_reward_fn(trl_all, reward_call(trl_all, "rf"), "rf", *args, fixed={"k": 1})
    assert seen == {"prompts": ["p"], "completions": ["r"], "completion_ids": [[5, 6]], "answer": ["a"], "level": [3], "k": 1}
    # a function without **kwargs gets only what it names; the pairs form gets (prompts, responses) positionally
    assert call_reward_fn(Scorer(), reward_call(Scorer(), "rf"), "rf", *args) == [0.0]
    assert call_reward_fn(pairs_with_column, reward_call(pairs_with_column, "rf"), "rf", ["p"], ["a"], [[1]],
                          {"answer": ["a"], "level": [3]}, {"scale": 2.0}) == [2.0]  # fmt: skip
    assert call_reward_fn(pairs_with_kwargs, reward_call(pairs_with_kwargs, "rf"), "rf", *args) == [3.0]  # ids, answer, level
    assert call_reward_fn(pairs, reward_call(pairs, "rf"), "rf", *args) == [1.0]


def test_call_names_a_missing_column_and_a_column_that_clashes():
    call = reward_call(Scorer(), "reward_fn[0] scorer")
    with pytest.raises(ValueError, match=r"reward_fn\[0\] scorer needs \['answer'\]: neither in its kwargs nor a column "
                                         r"of the prompt rows \(their columns: \['solution'\]"):  # fmt: skip
        call_reward_fn(Scorer(), call, "reward_fn[0] scorer", ["p"], ["r"], [[1]], {"solution": ["s"]})
    with pytest.raises(ValueError, match=r"rf: the prompt rows' column\(s\) \['completion_ids'\] have the name"):
        call_reward_fn(trl, reward_call(trl, "rf"), "rf", ["p"], ["r"], [[1]], {"completion_ids": [1]})
    with pytest.raises(ValueError, match=r"column\(s\) \['scale'\]"):
        call_reward_fn(pairs_with_column, reward_call(pairs_with_column, "rf", {"scale": 2}), "rf", ["p"], ["r"], [[1]],
                       {"answer": ["a"], "scale": [1]}, {"scale": 2})  # fmt: skip
    # a clash with a keyword the function does not take is harmless
    assert call_reward_fn(pairs, reward_call(pairs, "rf"), "rf", ["p"], ["r"], [[1]], {"prompts": ["x"]}) == [1.0]


@pytest.mark.parametrize(
    ("value", "kind", "message"),
    [
        ("ppo_rewards:the_count", TypeError, "expected 'package.module:function' or a non-empty list"),
        ([], TypeError, "non-empty list"),
        ({"fn": "ppo_rewards:the_count"}, TypeError, "non-empty list of {fn, weight} entries"),
        ([{"weight": 1.0}], TypeError, r"reward_fn\[0\]: missing `fn`"),
        (["a:b", 3], TypeError, r"reward_fn\[1\]: expected RewardTerm, a dict of its fields or None, got int"),
        ([{"fn": "ppo_rewards:the_count", "weigth": 1.0}], TypeError, r"reward_fn\[0\]: unknown RewardTerm field\(s\) \['weigth'\]"),
        ([{"fn": "a:b"}, {"fn": "no_colon"}], ValueError, r"reward_fn\[1\].fn must be 'package.module:function'"),
        ([{"fn": "a:b", "weight": float("nan")}], ValueError, r"reward_fn\[0\].weight must be a finite number"),
        ([{"fn": "a:b", "weight": "1"}], ValueError, r"reward_fn\[0\].weight must be a number, got '1'"),
        ([{"fn": "a:b", "name": "my score"}], ValueError, r"reward_fn\[0\].name must be letters, digits"),
        ([{"fn": "a:b", "kwargs": [1]}], ValueError, r"reward_fn\[0\].kwargs must be a mapping"),
        ([{"fn": "x:f"}, {"fn": "y:f"}], ValueError, r"the names \['f'\] are used more than once; give each entry its own `name`"),
    ],
)
def test_reward_terms_errors_name_the_entry(value, kind, message):
    with pytest.raises(kind, match=message):
        reward_terms(value)


def test_reward_terms_defaults():
    (term, plain) = reward_terms([{"fn": "lit_rlhf.verifiable:accuracy", "weight": 2}, "ppo_rewards:the_count"])
    assert term.name == "accuracy" and term.weight == 2.0 and isinstance(term.weight, float) and term.kwargs is None
    assert (plain.fn, plain.weight, plain.name) == ("ppo_rewards:the_count", 1.0, "the_count")  # a string: weight 1


def rollout_rows(tok, prompts: list[str], responses: list[str]):
    """(B, P+T) ids and mask of left-padded prompts + right-padded responses, and T."""
    p = tok(prompts, return_tensors="pt", padding=True)
    tok.padding_side = "right"
    r = tok(responses, return_tensors="pt", padding=True)
    tok.padding_side = "left"
    ids = torch.cat([p["input_ids"], r["input_ids"]], dim=1)
    return ids, torch.cat([p["attention_mask"], r["attention_mask"]], dim=1), r["input_ids"].shape[1]


def test_a_weighted_list_scores_the_sum_and_returns_each_raw_score(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir, padding_side="left")
    ids, mask, T = rollout_rows(tok, ["the food was", "it was"], [" the the good", " bad"])
    terms = [
        {"fn": "ppo_rewards:target_count", "weight": 1.0},  # TRL form, reads the `target` column
        {"fn": "ppo_rewards:the_count", "weight": 0.5, "name": "the"},  # this project's form
        {"fn": "lit_rlhf.verifiable:soft_overlong_punishment", "weight": -2.0, "name": "overlong",
         "kwargs": {"max_length": 2, "cache_length": 1}},
    ]  # fmt: skip
    source = RewardSource(None, terms, tok)
    assert source.description == "reward_fn [target_count x 1, the x 0.5, overlong x -2]"
    total, parts = source.score_terms(ids, mask, T, 4, {"target": ["the", "x"]})
    response_lengths = mask[:, -T:].sum(1).tolist()  # the overlong term reads the token ids
    overlong = [0.0 if n <= 1 else -1.0 if n >= 2 else 0.0 for n in response_lengths]
    assert parts["target_count"].tolist() == [2.0, 0.0] and parts["the"].tolist() == [2.0, 0.0]
    assert parts["overlong"].tolist() == overlong
    expected = [1.0 * t + 0.5 * h - 2.0 * o for t, h, o in zip([2.0, 0.0], [2.0, 0.0], overlong)]
    assert total.dtype == torch.float32 and total.tolist() == expected
    assert torch.equal(source.score(ids, mask, T, 4, {"target": ["the", "x"]}), total)
    assert source.config_value == [
        {"fn": "ppo_rewards:target_count", "weight": 1.0, "name": "target_count", "kwargs": None},
        {"fn": "ppo_rewards:the_count", "weight": 0.5, "name": "the", "kwargs": None},
        {"fn": "lit_rlhf.verifiable:soft_overlong_punishment", "weight": -2.0, "name": "overlong",
         "kwargs": {"max_length": 2, "cache_length": 1}},
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"column 'target' has 1 values for 2 responses"):
        source.score(ids, mask, T, 4, {"target": ["the"]})


def test_one_trl_function_alone_and_none_as_nan(tokenizer_dir, monkeypatch):
    tok = load_tokenizer(tokenizer_dir, padding_side="left")
    ids, mask, T = rollout_rows(tok, ["the food was", "it was"], [" the good", " bad"])
    source = RewardSource(None, "lit_rlhf.verifiable:accuracy", tok)
    assert source.call.form == "trl" and source.terms == [] and source.config_value == "lit_rlhf.verifiable:accuracy"
    with pytest.warns(UserWarning, match="cannot parse the gold answer '\\?'"):
        total, parts = source.score_terms(ids, mask, T, 4, {"answer": ["1", "?"]})
    assert parts == {} and total[0] == 0.0 and math.isnan(total[1])  # TRL's None is NaN for on_nonfinite
    with pytest.raises(ValueError, match=r"accuracy: the gold answers are read from the column 'answer', which the "
                                         r"prompt rows lack \(their columns and keywords: \['completion_ids', 'prompts'\]\)"):  # fmt: skip
        source.score(ids, mask, T, 4)


def test_a_bad_signature_fails_when_the_module_is_built(tokenizer_dir, tmp_path, monkeypatch):
    from conftest import gpt2_config
    from ppo_helpers import tiny_critic_free

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text("def score(texts):\n    return [0.0] * len(texts)\n")
    with pytest.raises(TypeError, match=r"reward_fn\[1\] score \(my_rewards:score\): score\(texts\) fits neither"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=["ppo_rewards:the_count", "my_rewards:score"])

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


def pairs_ids_kwonly(prompts, responses, *, completion_ids):
    return [float(len(ids)) for ids in completion_ids]


def pairs_ids_default(prompts, responses, completion_ids=None):
    return [float(len(ids)) for ids in completion_ids]


def trl_prompts_ids(prompts, completion_ids):
    return [0.0] * len(prompts)


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
        # completion_ids after the pairs form's two positional parameters is its keyword, not TRL's marker
        (pairs_ids_kwonly, "pairs", {"completion_ids"}, ("completion_ids",)),
        (pairs_ids_default, "pairs", {"completion_ids"}, ()),
        (trl_prompts_ids, "trl", {"prompts", "completion_ids"}, ("prompts", "completion_ids")),
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


def test_the_pairs_form_takes_completion_ids_by_keyword():
    for fn in (pairs_ids_kwonly, pairs_ids_default):
        call = reward_call(fn, "rf")
        assert call_reward_fn(fn, call, "rf", ["p", "q"], ["r", "s"], [[1, 2, 3], [4]], {"answer": ["1", "2"]}) == [3.0, 1.0]


def test_a_column_named_like_a_positional_parameter_is_not_passed():
    # TRL's prompt-completion data has a `completion` column; fn(prompt, completion, **columns) gets the text
    seen = {}

    def ref_match(prompt, completion, **columns):
        seen.update(prompt=prompt, completion=completion, columns=sorted(columns))
        return [1.0] * len(completion)

    call = reward_call(ref_match, "rf")
    assert call.form == "pairs" and call.positional == ("prompt", "completion")
    out = call_reward_fn(ref_match, call, "rf", ["p"], ["r"], [[1]], {"completion": ["gold"], "reference": ["x"]})
    assert out == [1.0] and seen == {"prompt": ["p"], "completion": ["r"], "columns": ["completion_ids", "reference"]}


CHATS = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}], [{"role": "user", "content": "1+1?"}]]


def test_chat_prompts_reach_trl_functions_in_trl_conversational_format():
    seen = {}

    def trl_format(prompts, completions, **kwargs):  # TRL's documented conversational format reward
        seen.update(prompts=prompts, kwargs=sorted(kwargs))
        return [float(completion[0]["content"] == "5") for completion in completions]

    args = (["2+3?", "1+1?"], ["5", "3"], [[7], [8]])
    out = call_reward_fn(trl_format, reward_call(trl_format, "rf"), "rf", *args, {"prompt": CHATS, "answer": ["5", "2"]})
    assert out == [1.0, 0.0] and seen == {"prompts": CHATS, "kwargs": ["answer", "completion_ids"]}
    # the pairs form keeps its strings; a `prompt` column of strings is an ordinary column, as before
    assert call_reward_fn(pairs_with_kwargs, reward_call(pairs_with_kwargs, "rf"), "rf", *args, {"prompt": CHATS}) == [1.0] * 2
    def trl_spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, kwargs=sorted(kwargs))
        return [0.0] * len(completions)

    call_reward_fn(trl_spy, reward_call(trl_spy, "rf"), "rf", *args, {"prompt": ["a", "b"]})
    assert seen == {"prompts": ["2+3?", "1+1?"], "completions": ["5", "3"], "kwargs": ["completion_ids", "prompt"]}


def test_trl_none_is_a_row_the_function_does_not_score(tokenizer_dir):
    # TRL's multi-task pattern: each function scores its task's rows and gives None elsewhere; the total is
    # the weighted sum of what scored the row (TRL's nansum), NaN where nothing did or a real NaN came back
    tok = load_tokenizer(tokenizer_dir, padding_side="left")
    ids, mask, T = rollout_rows(tok, ["a", "b", "c", "d"], [" the", " bad", " it", " was"])
    source = RewardSource(None, ["ppo_rewards:math_task", {"fn": "ppo_rewards:code_task", "weight": 2.0}], tok)
    task = {"task": ["math", "code", "neither", "broken"]}
    total, parts, scored = source.score_terms(ids, mask, T, 4, task)
    assert total[0] == len(" the") and total[1] == 2.0 and math.isnan(total[2]) and math.isnan(total[3])
    assert scored["math_task"].tolist() == [True, False, False, False]
    assert scored["code_task"].tolist() == [False, True, False, True]  # a NaN is a score (non-finite), None is not
    assert math.isnan(parts["math_task"][1]) and parts["code_task"][1] == 1.0
    assert torch.equal(source.score(ids, mask, T, 4, task).nan_to_num(-1), total.nan_to_num(-1))


def test_a_multi_task_run_learns_from_every_row_and_counts_only_real_nonfinite_scores(tokenizer_dir, tmp_path):
    import csv

    from conftest import gpt2_config
    from ppo_helpers import prompt_loader, tiny_critic_free, trainer

    batch = next(iter(prompt_loader(tokenizer_dir, n=4, batch_size=4)))
    loader = torch.utils.data.DataLoader([{**batch, "columns": {"task": ["math", "code"] * 2}}], batch_size=None)
    terms = ["ppo_rewards:math_task", "ppo_rewards:code_task"]
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=terms, max_rollouts=1)  # on_nonfinite: raise
    trainer(tmp_path).fit(module, loader)
    (path,) = tmp_path.rglob("metrics.csv")
    (row,) = [r for r in csv.DictReader(path.open()) if r.get("rollout/score")]
    assert float(row["rollout/nonfinite_scores"]) == 0.0
    assert float(row["rollout/reward_nonfinite/math_task"]) == float(row["rollout/reward_nonfinite/code_task"]) == 0.0
    assert float(row["rollout/reward/code_task"]) == 1.0  # the mean over its own rows


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
    total, parts, _ = source.score_terms(ids, mask, T, 4, {"target": ["the", "x"]})
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
        total, parts, _ = source.score_terms(ids, mask, T, 4, {"answer": ["1", "?"]})
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

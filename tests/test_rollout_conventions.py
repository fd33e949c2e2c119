"""What a Hugging Face rollout takes from the model and how it ends (``lit_rlhf.engines.hf_generate``):

- a model file's ``generation_config`` processors (``repetition_penalty``, ``no_repeat_ngram_size``,
  ``min_new_tokens``, ``bad_words_ids``) do not reach the rollout: its tokens and behaviour log-probs are those
  of the same model without them, the lean loop still runs, and the model keeps its file;
- a response that a stop string ends on its last allowed token is not truncated
  (``lit_rlhf.engines.base.truncated_rows``), and a stop string is matched in the response alone.
"""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config

from lit_rlhf.engines.base import truncated_rows
from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, policy_forward
from lit_rlhf.rollout import GenerationSettings, generate_responses

# what Qwen2.5-Instruct's generation_config.json ships (repetition_penalty 1.05), stronger, and more processors
MODEL_FILE = dict(repetition_penalty=1.5, no_repeat_ngram_size=1, min_new_tokens=6, bad_words_ids=[[5], [9]])


def _prompts(tokenizer):
    tokenizer.padding_side = "left"
    enc = tokenizer(["the food was", "i loved it and the staff"] * 2, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _rollout(model, tokenizer, ids, mask, **settings):
    torch.manual_seed(0)
    return generate_responses(
        model, ids, mask, GenerationSettings(max_new_tokens=10, **settings),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


@pytest.mark.parametrize("decode_loop", ["lean", "generate"])
@pytest.mark.parametrize("sampler", ["multinomial", "inverse_cdf"])
def test_a_model_files_processors_do_not_reach_the_rollout(tokenizer_dir, decode_loop, sampler):
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0)
    plain, model = build_causal_lm(spec, tokenizer).eval(), build_causal_lm(spec, tokenizer).eval()
    model.generation_config.update(**MODEL_FILE)
    ids, mask = _prompts(tokenizer)
    # "lean" raised before ("generation_config sets [...]"): the loop now sees the token ids only
    out = _rollout(model, tokenizer, ids, mask, decode_loop=decode_loop, sampler=sampler)
    expected = _rollout(plain, tokenizer, ids, mask, decode_loop=decode_loop, sampler=sampler)
    assert torch.equal(out.ids, expected.ids) and torch.equal(out.logprobs, expected.logprobs)
    # on-policy: the behaviour log-prob of every token is the policy's (the penalised ones were off by ~1e-2)
    with torch.no_grad():
        full, attention = torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask.long()], 1)
        scored = policy_forward(model, full, attention, out.ids.shape[1], 1.0)[0]
    torch.testing.assert_close((out.logprobs + out.log_kept_mass)[out.mask], scored[out.mask], rtol=0, atol=1e-5)
    assert model.generation_config.repetition_penalty == 1.5  # the file is kept (evaluation, export)
    assert model.generation_config.bad_words_ids == [[5], [9]]


def test_a_lora_actors_rollout_ignores_its_base_models_file(tokenizer_dir):
    # peft's generate copies the base model's generation_config: the reduced one is what it copies
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0, lora={"r": 4, "lora_alpha": 8})
    model = build_causal_lm(spec, tokenizer).eval()
    model.generation_config.update(**MODEL_FILE)
    ids, mask = _prompts(tokenizer)
    out = _rollout(model, tokenizer, ids, mask, decode_loop="generate")
    with torch.no_grad():
        full, attention = torch.cat([ids, out.ids], 1), torch.cat([mask, out.mask.long()], 1)
        scored = policy_forward(model, full, attention, out.ids.shape[1], 1.0)[0]
    torch.testing.assert_close((out.logprobs + out.log_kept_mass)[out.mask], scored[out.mask], rtol=0, atol=1e-5)
    assert model.generation_config.repetition_penalty == 1.5


def test_greedy_rollouts_ignore_the_model_files_processors_too(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=0)
    plain, model = build_causal_lm(spec, tokenizer).eval(), build_causal_lm(spec, tokenizer).eval()
    model.generation_config.update(**MODEL_FILE)
    ids, mask = _prompts(tokenizer)
    for loop in ("lean", "generate"):
        settings = GenerationSettings(max_new_tokens=10, decode_loop=loop)
        kwargs = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, greedy=True)
        out = generate_responses(model, ids, mask, settings, **kwargs)
        assert torch.equal(out.ids, generate_responses(plain, ids, mask, settings, **kwargs).ids)


def test_rows_ended_by_a_stop_string_on_their_last_token_are_not_truncated(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = torch.tensor([tokenizer("the food was good")["input_ids"]] * 3)  # (3, n): three full-length rows
    n = ids.shape[1]
    assert [tokenizer.decode(t) for t in ids[0, -2:]] == [" g", "ood"]
    mask, has_stop = torch.ones_like(ids, dtype=torch.bool), torch.tensor([False, False, True])
    assert truncated_rows(ids, mask, has_stop, n).tolist() == [True, True, False]  # no stop strings
    # matches that overlap the last token "ood" (as transformers' StopStringCriteria matches them)
    for stop in ("ood", " good", "was good", "oo"):
        assert truncated_rows(ids, mask, has_stop, n, [stop], tokenizer).tolist() == [False, False, False], stop
    # a match that ends before the last token (or none at all) leaves a cut row truncated
    assert truncated_rows(ids, mask, has_stop, n, ["food", "bad"], tokenizer).tolist() == [True, True, False]
    # a row shorter than the limit is not truncated whatever it holds
    assert truncated_rows(ids, mask, has_stop, n + 1, ["bad"], tokenizer).tolist() == [False, False, False]


def test_a_rollout_ended_by_a_stop_string_at_the_limit_is_not_truncated(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=1), tokenizer).eval()
    ids = torch.tensor([tokenizer("the food was")["input_ids"]])
    mask = torch.ones_like(ids)

    def greedy(limit: int, stops: list[str]):
        settings = GenerationSettings(max_new_tokens=limit, stop_strings=stops)
        return generate_responses(
            model, ids, mask, settings, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer, greedy=True,
        )  # fmt: skip

    free = greedy(6, [])
    assert bool(free.mask.all()) and bool(free.truncated[0])  # 6 tokens, no EOS: cut by the limit
    stop = tokenizer.decode(free.ids[0])  # the whole response: only its 6th token completes it
    assert stop == "as" + "'" * 5  # this seed's greedy tokens: "the food was" + "as", then 5 quotes
    for limit in (6, 7):  # ended by the stop string, with or without room for one more token
        out = greedy(limit, [stop])
        assert int(out.mask.sum()) == 6 and torch.equal(out.ids[0, :6], free.ids[0])
        assert not bool(out.truncated[0])
    # a stop string that straddles the prompt's end ("was" + "as") is no match in the response: it ran on to
    # the limit (generate(stop_strings=...) matched it on the whole sequence and ended the response at "as")
    out = greedy(6, ["wasas", "food"])
    assert torch.equal(out.ids, free.ids) and bool(out.mask.all()) and bool(out.truncated[0])


@pytest.mark.parametrize(
    "field, value",
    [("stop_strings", "</answer>"), ("stop_strings", [""]), ("stop_strings", [3]), ("stop_token_ids", [2.5]),
     ("stop_token_ids", 7), ("stop_token_ids", [-1])],
)  # fmt: skip
def test_stop_settings_of_the_wrong_kind_are_refused(field, value):
    """A bare string was read character by character (every character a stop string), "" ended every
    response after one token."""
    from lit_rlhf.rollout import GenerationSettings

    with pytest.raises(ValueError, match=f"generation.{field} must be a list of"):
        GenerationSettings(**{field: value})

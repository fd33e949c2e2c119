"""Inverse-CDF token sampling (``lit_rlhf.models.sampling``): the distribution of the warped softmax, never a
zero-probability token, independent rows, seeded; through ``generate_responses`` as the online modules use it.

Distributions are compared by total variation over many draws under a fixed seed. With the numbers of
draws here the sampling noise is ~0.002-0.01 and a wrong sampler (ignored temperature, CDF off by one
token, one uniform shared by all rows) is off by 0.1 or more.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import replace

import pytest
import torch
from conftest import llama_config

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer
from lit_rlhf.models.sampling import (
    INVERSE_CDF_MIN_VOCAB,
    InverseCDFSampler,
    MultinomialRecorder,
    inverse_cdf_sample,
    resolve_sampler,
)
from lit_rlhf.rollout import GenerationSettings, generate_responses, generation_kwargs

INF = float("inf")
# 6 tokens; token 3 is -inf (as a suppressed pad token is when the sampler runs)
LOGITS = [2.0, 1.0, 0.0, -INF, 0.5, 1.5]


def _total_variation(tokens: torch.Tensor, expected: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    return 0.5 * (counts / counts.sum() - torch.tensor(expected, dtype=torch.float64)).abs().sum().item()


def _softmax_over(logits: list[float], kept: list[int], temperature: float) -> list[float]:
    """softmax(logits / temperature) restricted to the ``kept`` tokens (0 elsewhere), by hand."""
    weights = [math.exp(x / temperature) if i in kept else 0.0 for i, x in enumerate(logits)]
    return [w / sum(weights) for w in weights]


def _draw(sampler: InverseCDFSampler, logits: list[float], n: int, seed: int = 0) -> torch.Tensor:
    """(n,) tokens: one draw for each of n copies of the ``logits`` row."""
    scores = torch.tensor([logits]).expand(n, -1).contiguous()  # (n, V)
    torch.manual_seed(seed)
    out = sampler(torch.zeros(n, 1, dtype=torch.long), scores)  # (n, V): 0 at the token, -inf elsewhere
    assert ((out == 0).sum(dim=1) == 1).all() and (out[out != 0] == -INF).all()
    return out.argmax(dim=1)


# softmax of LOGITS / 0.5 = [0.636, 0.086, 0.012, 0, 0.032, 0.234]: top-k 3 keeps tokens 0, 5, 1; top-p 0.97
# drops the smallest tokens whose total is <= 0.03, i.e. token 2 (0.012; with token 4 it would be 0.044).
@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",
    [
        (1.0, 0, 1.0, [0, 1, 2, 4, 5]),
        (0.5, 0, 1.0, [0, 1, 2, 4, 5]),
        (0.5, 3, 1.0, [0, 1, 5]),
        (0.5, 0, 0.97, [0, 1, 4, 5]),
        (2.0, 4, 0.97, [0, 1, 4, 5]),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "all"],
)
def test_draws_follow_the_warped_softmax(temperature, top_k, top_p, kept):
    tokens = _draw(InverseCDFSampler(temperature, top_k, top_p), LOGITS, n=100_000)
    expected = _softmax_over(LOGITS, kept, temperature)
    assert _total_variation(tokens, expected) < 0.01
    assert set(tokens.unique().tolist()) == set(kept), "every kept token is drawn, no other one"


def test_zero_probability_tokens_are_never_drawn_even_at_the_ends_of_the_uniform(monkeypatch):
    # Zero probability at both ends of the vocabulary and in the middle; the uniform at its two extremes
    # (0 and the largest float32 below 1) must still pick the first and the last positive token.
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.7, 0.0]]).expand(2, -1)
    extremes = torch.tensor([[0.0], [1 - 2**-24]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: extremes.to(kwargs.get("dtype")))
    assert inverse_cdf_sample(probs).tolist() == [4, 1]
    monkeypatch.undo()
    torch.manual_seed(0)
    tokens = inverse_cdf_sample(torch.tensor([[0.0, 1e-30, 0.0, 0.0, 1.0, 0.0]]).expand(100_000, -1))
    assert set(tokens.unique().tolist()) == {4}, "a 1e-30 token has no draw in 100k, a zero one never"


def test_a_nan_distribution_is_refused_by_name(tokenizer_dir):
    """A policy with a NaN weight: the inverse-CDF draw found no token and failed on an index out of the
    vocabulary, naming nothing. It raises NonFiniteError naming the rows, in both decoding loops."""
    from lit_rlhf.guards import NonFiniteError

    probs = torch.tensor([[0.2, 0.8], [float("nan"), 0.5], [0.5, 0.5]])
    with pytest.raises(NonFiniteError, match=r"1 of 3 rows is not finite \(rows \[1\]\)"):
        inverse_cdf_sample(probs)
    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0), tok)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    enc = tok(["the food was", "we hated"], return_tensors="pt", padding=True, padding_side="left")
    for loop, sampler in (("lean", "inverse_cdf"), ("generate", "inverse_cdf"), ("lean", "multinomial"),
                          ("generate", "multinomial")):  # fmt: skip
        settings = GenerationSettings(max_new_tokens=3, sampler=sampler, decode_loop=loop)
        with pytest.raises(NonFiniteError, match="logits hold NaN or inf"):
            generate_responses(model, enc["input_ids"], enc["attention_mask"], settings,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip


def test_rows_are_independent():
    # 2N rows of one distribution: the (even row, odd row) pairs follow the product distribution.
    p = [0.4, 0.3, 0.2, 0.1]
    torch.manual_seed(0)
    tokens = inverse_cdf_sample(torch.tensor([p]).expand(2 * 50_000, -1)).view(-1, 2)  # (N, 2)
    joint = [p[a] * p[b] for a in range(4) for b in range(4)]
    assert _total_variation(tokens[:, 0] * 4 + tokens[:, 1], joint) < 0.02
    scores = torch.randn(64, 300)
    torch.manual_seed(1)
    first = InverseCDFSampler(0.7, 20)(None, scores).argmax(1)
    torch.manual_seed(1)
    assert torch.equal(InverseCDFSampler(0.7, 20)(None, scores).argmax(1), first), "seeded"
    assert not torch.equal(InverseCDFSampler(0.7, 20)(None, scores).argmax(1), first), "fresh draws"


def test_settings_and_resolution():
    assert GenerationSettings().sampler == "auto"
    assert resolve_sampler("auto", torch.device("cpu")) == "inverse_cdf"
    assert resolve_sampler("auto", torch.device("cpu"), vocab_size=INVERSE_CDF_MIN_VOCAB) == "inverse_cdf"
    assert resolve_sampler("auto", torch.device("cpu"), vocab_size=INVERSE_CDF_MIN_VOCAB - 1) == "multinomial"
    assert resolve_sampler("inverse_cdf", torch.device("cpu"), vocab_size=10) == "inverse_cdf"
    assert resolve_sampler("auto", torch.device("cuda")) == "multinomial"
    assert resolve_sampler("multinomial", torch.device("cpu")) == "multinomial"
    assert GenerationSettings.coerce({"sampler": "multinomial"}).sampler == "multinomial"
    with pytest.raises(ValueError, match=r"generation.sampler must be one of \['auto', 'inverse_cdf', 'multinomial'\]"):
        GenerationSettings(sampler="gumbel")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        InverseCDFSampler(temperature=0.0)


def _model(tokenizer_dir: str):
    tok = load_tokenizer(tokenizer_dir)
    return tok, build_causal_lm(ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0), tok).eval()


def _prompts(tok, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([tok("the food was")["input_ids"]]).expand(rows, -1)
    return ids, torch.ones_like(ids)


def test_generate_samples_the_warped_model_distribution(tokenizer_dir):
    # First response token of 4000 copies of one prompt vs softmax(logits / T) over the top-k tokens,
    # computed from the model's own forward with the pad token (made likely here) removed.
    tok, model = _model(tokenizer_dir)
    ids, mask = _prompts(tok, 4000)
    head = model.lm_head.weight  # (V, H), no bias
    with torch.no_grad():
        head.mul_(30.0)  # a random-init model's next-token distribution is near uniform: sharpen it
        top = model(input_ids=ids[:1], attention_mask=mask[:1]).logits[0, -1].argmax()
        head[tok.pad_token_id] = 1.5 * head[top]
        logits = model(input_ids=ids[:1], attention_mask=mask[:1]).logits[0, -1]  # (V,)
    assert logits.argmax() == tok.pad_token_id, "pad would be the likeliest token without suppression"
    logits[tok.pad_token_id] = -INF
    kept = logits.topk(5).indices.tolist()
    settings = GenerationSettings(max_new_tokens=1, temperature=0.7, top_k=5, sampler="inverse_cdf")
    torch.manual_seed(0)
    responses = generate_responses(
        model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).ids
    expected = _softmax_over(logits.tolist(), kept, 0.7)
    assert max(expected) < 0.9, "a distribution worth testing"
    assert set(responses[:, 0].unique().tolist()) <= set(kept)
    assert _total_variation(responses[:, 0], expected) < 0.04


def test_generate_responses_with_stops_and_no_warning(tokenizer_dir, caplog):
    tok, model = _model(tokenizer_dir)
    ids, mask = _prompts(tok, 16)
    settings = GenerationSettings(max_new_tokens=12, temperature=0.9, top_p=0.95, stop_strings=["e"])
    torch.manual_seed(0)
    probe, probe_mask, *_ = generate_responses(
        model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tokenizer=tok
    )
    settings = replace(settings, stop_token_ids=probe[probe_mask].bincount().topk(2).indices.tolist())
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        responses, response_mask, truncated, *_ = generate_responses(
            model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            tokenizer=tok,
        )  # fmt: skip
    assert not caught and not caplog.records, "generate warns about nothing"
    assert not (responses[response_mask] == tok.pad_token_id).any(), "pad is never sampled"
    assert (responses[~response_mask] == tok.pad_token_id).all()
    lengths = response_mask.sum(dim=1)
    stopped = torch.isin(responses, torch.tensor(settings.stop_token_ids)).any(dim=1)
    # a row whose 12th token holds the "e" was ended by the stop string, not cut by the limit
    last_has_e = torch.tensor(["e" in tok.decode(r[m][-1:]) for r, m in zip(responses, response_mask)])
    assert (~stopped & (lengths == 12) & last_has_e).any()
    assert stopped.any() and torch.equal(truncated, ~stopped & (lengths == 12) & ~last_has_e)
    by_string = ~stopped & (lengths < 12)  # ended by the stop string "e"
    texts = [tok.decode(r[m]) for r, m in zip(responses[by_string], response_mask[by_string])]
    assert texts and all("e" in text for text in texts)


def test_multinomial_reproduces_hugging_face_sampling(tokenizer_dir):
    tok, model = _model(tokenizer_dir)
    ids, mask = _prompts(tok, 8)
    settings = GenerationSettings(max_new_tokens=10, temperature=0.8, top_k=40, top_p=0.9, sampler="multinomial")
    kwargs = generation_kwargs(ids, mask, settings, [tok.eos_token_id], tok.pad_token_id)
    # generate's own warpers are off: the last processor applies them (and records the log-probs)
    assert kwargs["do_sample"] and kwargs["temperature"] is kwargs["top_k"] is kwargs["top_p"] is None
    assert [type(p) for p in kwargs["logits_processor"]] == [MultinomialRecorder]
    torch.manual_seed(3)
    ours = generate_responses(model, ids, mask, settings, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id).ids  # fmt: skip
    torch.manual_seed(3)
    hf = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=40, top_p=0.9,
        max_new_tokens=10, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
        suppress_tokens=[tok.pad_token_id],
    )  # fmt: skip
    assert torch.equal(ours, hf[:, ids.shape[1] :])


def test_greedy_stays_greedy(tokenizer_dir):
    tok, model = _model(tokenizer_dir)
    ids, mask = _prompts(tok, 2)
    settings = GenerationSettings(max_new_tokens=6, sampler="inverse_cdf")
    kwargs = generation_kwargs(ids, mask, settings, [tok.eos_token_id], tok.pad_token_id, greedy=True)
    assert not kwargs["do_sample"] and "logits_processor" not in kwargs
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        outs.append(generate_responses(model, ids, mask, settings, eos_token_id=tok.eos_token_id,
                                       pad_token_id=tok.pad_token_id, greedy=True)[0])  # fmt: skip
    assert torch.equal(*outs) and torch.equal(outs[0][0], outs[0][1])

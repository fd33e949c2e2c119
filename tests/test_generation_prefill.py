"""Generation with the prompt prefilled once per group: the responses of the unshared generation.

Every comparison runs the same seeded generation twice, ``group_prefill="never"`` vs ``"always"``, on
left-padded prompts of different lengths in groups of K = 3 copies, and asserts that the shared path was
really taken (the model saw one (G, P-1) prefill and never the (G*K, P) prompts). The other tests sample
with the default sampler ("auto": inverse CDF on CPU, ``lit_rlhf.models.sampling``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import gpt2_config, llama_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer
from test_ppo import read_metrics

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, position_ids_from_mask
from lit_rlhf.models.prefill import is_grouped, prefill_groups
from lit_rlhf.rollout import GROUP_PREFILL_MIN_PROMPT_TOKENS, GenerationSettings, generate_responses

K = 3
TEXTS = ["the food was really good and the staff", "we hated it", "i", "the movie plot was not very"]


def _prompts(tok, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(G*k, P) left-padded prompts of 4 different lengths (one of a single token), k copies each."""
    enc = [tok(text)["input_ids"] for text in TEXTS]
    assert len({len(e) for e in enc}) == len(enc) and min(map(len, enc)) == 1
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    return ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)


def _model(tokenizer_dir: str, config: dict, lora: dict | None = None):
    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0, lora=lora), tok).eval()
    return tok, model


def _record_forward_shapes(model) -> list[tuple[int, int]]:
    """(rows, columns) of the input ids of every forward of ``model`` (a peft model's base model)."""
    shapes = []
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes


def _generate_both(model, tok, ids, mask, settings, greedy=False, group_size=K):
    """The outputs (and the next random number) of the unshared and of the shared generation, same seed."""
    shapes = _record_forward_shapes(model)
    results = []
    for mode in ("never", "always"):
        shapes.clear()
        torch.manual_seed(7)
        out = generate_responses(
            model, ids, mask, replace(settings, group_prefill=mode), eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, tokenizer=tok, greedy=greedy, group_size=group_size,
        )  # fmt: skip
        results.append((out, torch.rand(3), list(shapes)))
    (unshared, rng_unshared, shapes_unshared), (shared, rng_shared, shapes_shared) = results
    rows, width = ids.shape
    assert shapes_unshared[0] == (rows, width)
    assert shapes_shared[:2] == [(rows // group_size, width - 1), (rows, 1)], "the prefill was not shared"
    return unshared, shared, (rng_unshared, rng_shared)


def _assert_same(unshared, shared, rngs) -> None:
    for a, b in zip(unshared[:3], shared[:3]):  # ids, mask, truncated
        assert torch.equal(a, b)
    for a, b in zip(unshared[3:], shared[3:]):  # logprobs, log_kept_mass: the same up to float rounding
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(*rngs, rtol=0, atol=0)  # the same random draws were consumed


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
@pytest.mark.parametrize(
    "greedy, sampler",
    [(False, "inverse_cdf"), (False, "multinomial"), (True, "inverse_cdf")],
    ids=["inverse_cdf", "multinomial", "greedy"],
)
def test_shared_prefill_generates_the_unshared_responses(tokenizer_dir, config, greedy, sampler):
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=12, temperature=0.9, num_samples=K, sampler=sampler)
    unshared, shared, rngs = _generate_both(model, tok, ids, mask, settings, greedy)
    _assert_same(unshared, shared, rngs)
    responses, response_mask, truncated = shared[:3]
    assert response_mask.any(dim=1).all() and responses.shape[1] >= 2
    if greedy:  # the K copies of a prompt decode to the same response
        assert torch.equal(responses[::K], responses[1::K]) and torch.equal(responses[::K], responses[2::K])
    else:  # the K copies are sampled independently
        assert not torch.equal(responses[::K], responses[1::K])


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_stop_token_ids_and_top_k_top_p(tokenizer_dir, config):
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    # the most frequent sampled tokens of an unconstrained run become stop ids, so some rows stop on them
    torch.manual_seed(0)
    settings = GenerationSettings(max_new_tokens=16, num_samples=K, top_k=50, top_p=0.95)
    probe, probe_mask, *_ = generate_responses(
        model, ids, mask, replace(settings, group_prefill="never"),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    stop_ids = probe[probe_mask].bincount().topk(2).indices.tolist()
    settings = replace(settings, stop_token_ids=stop_ids)
    unshared, shared, rngs = _generate_both(model, tok, ids, mask, settings)
    _assert_same(unshared, shared, rngs)
    responses, response_mask, truncated = shared[:3]
    stopped = torch.isin(responses, torch.tensor(stop_ids)).any(dim=1)
    assert stopped.any() and (~truncated).any()


def test_stop_strings(tokenizer_dir):
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=16, num_samples=K, stop_strings=["e"])
    unshared, shared, rngs = _generate_both(model, tok, ids, mask, settings)
    _assert_same(unshared, shared, rngs)
    assert (shared[1].sum(dim=1) < shared[0].shape[1]).any(), "some response ended at a stop string"


def test_lora_actor(tokenizer_dir):
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    tok, model = _model(tokenizer_dir, gpt2_config(), lora)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=10, num_samples=K)
    torch.manual_seed(0)
    with torch.no_grad():  # non-zero adapters, so the LoRA path changes the logits
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    unshared, shared, rngs = _generate_both(model, tok, ids, mask, settings)
    _assert_same(unshared, shared, rngs)
    with model.disable_adapter():  # the adapters were active in the shared prefill
        torch.manual_seed(7)
        plain = generate_responses(model, ids, mask, replace(settings, group_prefill="never"),
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    assert not torch.equal(plain[0], shared[0])


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_prefilled_cache_gives_the_full_forward_logits(tokenizer_dir, config):
    # The next-token logits after the shared prefill + the last prompt token equal those of the full
    # (G*K, P) forward of the unshared generation, on every row, padded ones included.
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        cache = prefill_groups(model, ids, mask, K)
        assert cache.get_seq_length() == ids.shape[1] - 1 and cache.layers[0].keys.shape[0] == ids.shape[0]
        step = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:], cache=cache)
    torch.testing.assert_close(step.logits[:, -1], full, atol=1e-5, rtol=1e-5)


def test_unsupported_cache_falls_back_to_the_unshared_generation(tokenizer_dir):
    # Mistral's sliding-window layers are not repeated by prefill_groups: generation runs unshared.
    config = {**llama_config(), "model_type": "mistral", "sliding_window": 4}
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    assert prefill_groups(model, ids, mask, K) is None
    settings = GenerationSettings(max_new_tokens=8, num_samples=K)
    outs = []
    for mode in ("never", "always"):
        torch.manual_seed(7)
        outs.append(generate_responses(model, ids, mask, replace(settings, group_prefill=mode),
                                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))  # fmt: skip
    for a, b in zip(*outs):  # both unshared: the same computation
        assert (a is None and b is None) or torch.equal(a, b)


def test_rows_that_are_not_groups_are_refused(tokenizer_dir):
    tok, model = _model(tokenizer_dir, gpt2_config())
    ids, mask = _prompts(tok)
    assert is_grouped(ids, mask, K) and not is_grouped(ids, mask, 2) and not is_grouped(ids[1:], mask[1:], K)
    settings = GenerationSettings(max_new_tokens=4, num_samples=2, group_prefill="always")
    with pytest.raises(ValueError, match="group_size=2, but the 12 prompt rows are not contiguous groups"):
        generate_responses(model, ids, mask, settings, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, group_size=2)  # fmt: skip


def test_settings_switch():
    auto = GenerationSettings(num_samples=4)
    long, short = GROUP_PREFILL_MIN_PROMPT_TOKENS, GROUP_PREFILL_MIN_PROMPT_TOKENS - 1
    assert auto.group_prefill == "auto"
    assert auto.shares_prefill(4, long) and not auto.shares_prefill(4, short)
    assert not auto.shares_prefill(1, long), "one sample per prompt: nothing to share"
    assert not auto.shares_prefill(4, long, synced_gpus=True), "multi-rank runs generate unshared"
    always = replace(auto, group_prefill="always")
    assert always.shares_prefill(2, 2) and not always.shares_prefill(2, 1)
    assert not always.shares_prefill(2, long, synced_gpus=True)
    assert not replace(auto, group_prefill="never").shares_prefill(8, 1000)
    assert GenerationSettings.coerce({"group_prefill": "never"}).group_prefill == "never"
    with pytest.raises(ValueError, match=r"generation.group_prefill must be one of \['auto', 'always', 'never'\]"):
        GenerationSettings(group_prefill="on")


def test_grpo_fit_logs_the_same_metrics(tokenizer_dir, tmp_path, monkeypatch):
    # A CriticFreeModule (GRPO, K = 4) fit with the shared prefill logs exactly what the unshared one does.
    import lit_rlhf.engines.hf_generate

    prefills = []
    counted = lambda *args: prefills.append(args[1].shape) or prefill_groups(*args)  # noqa: E731
    monkeypatch.setattr(lit_rlhf.engines.hf_generate, "prefill_groups", counted)
    rows = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        module = tiny_critic_free(
            tokenizer_dir, llama_config(), max_rollouts=4,
            generation={"max_new_tokens": 8, "num_samples": 4, "group_prefill": mode},
            scoring={"old_logprobs": "forward"},
        )  # fmt: skip
        trainer(tmp_path / mode).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
        rows[mode] = read_metrics(tmp_path / mode)
    assert len(rows["always"]) == 4 and len(prefills) == 4, "each rollout of the second fit was shared"
    # The same tokens and every metric of them; the engine-vs-trainer mismatch statistics compare the
    # behaviour log-probs of the shared prefill's logits, equal to float rounding only (on an Intel Xeon
    # with AMX they differ by ~1e-8, on an AMD EPYC they were equal). The old log-probs come from the
    # scoring forward: from the sampler's record (scoring.old_logprobs "auto") that rounding would enter
    # the KL-shaped scores and the ratio, and the updates would agree to rounding only (a clipped token more
    # or less on the AMX Xeon)
    rounding = ("rollout/logprob_diff_", "rollout/is_ratio_")
    for shared, unshared in zip(rows["always"], rows["never"]):
        assert set(shared) == set(unshared)
        for key, value in unshared.items():
            if key.startswith(rounding):
                assert shared[key] == pytest.approx(value, abs=1e-6), key
        differ = {k: (shared[k], v) for k, v in unshared.items() if not k.startswith(rounding) and shared[k] != v}
        assert not differ, (shared.get("step"), sorted(differ), differ)


@pytest.mark.parametrize("name", ["grpo", "rloo", "ppo"])
def test_the_demo_generates_unshared(name):
    # The demo's prompts are short (max_prompt_length 16): "auto" keeps its rollouts, and so its
    # figures, on the unshared path, where sharing would gain nothing.
    import yaml

    path = Path(__file__).resolve().parents[1] / f"configs/demo/{name}.yaml"
    config = yaml.safe_load(path.read_text())
    settings = GenerationSettings.coerce(config["model"]["init_args"].get("generation"))
    width = config["data"]["init_args"]["max_prompt_length"]
    assert settings.group_prefill == "auto"
    assert not settings.shares_prefill(settings.num_samples, width)

"""The transposed LM head of generation: same logits, same tokens, only where it applies, restored after."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer
from lit_rlhf.models.decoding import TRANSPOSED_HEAD_MIN_ELEMENTS, transposed_lm_head


def _model(tokenizer_dir, config, vocab=None, **fields):
    config = {**config, **({"vocab_size": vocab} if vocab else {}), **fields}
    tokenizer = load_tokenizer(tokenizer_dir, padding_side="left")
    return build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer).eval()


def _wide(config):
    # a head of >= TRANSPOSED_HEAD_MIN_ELEMENTS: hidden 64 x vocab 16,384 (token ids stay < the real vocab)
    hidden = config.get("n_embd", config.get("hidden_size"))
    return max(TRANSPOSED_HEAD_MIN_ELEMENTS // hidden, 1024) + 7


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_logits_and_sampled_tokens_equal_the_plain_head(tokenizer_dir, config):
    model = _model(tokenizer_dir, config, vocab=_wide(config))
    ids = torch.randint(5, 100, (3, 9))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with transposed_lm_head(model) as swapped:
            assert swapped
            fast = model(input_ids=ids).logits
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    assert "forward" not in model.get_output_embeddings().__dict__  # restored
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, pad_token_id=0)
    torch.manual_seed(3)
    expected = model.generate(**kwargs)
    torch.manual_seed(3)
    with transposed_lm_head(model):
        got = model.generate(**kwargs)
    assert torch.equal(got, expected)


def test_left_alone_where_it_does_not_apply(tokenizer_dir):
    small = _model(tokenizer_dir, gpt2_config())  # a head below the size threshold
    with transposed_lm_head(small) as swapped:
        assert not swapped
    wide = _model(tokenizer_dir, gpt2_config(), vocab=_wide(gpt2_config()))
    with transposed_lm_head(wide, enabled=False) as swapped:
        assert not swapped
    with transposed_lm_head(wide) as outer, transposed_lm_head(wide) as inner:
        assert outer and not inner  # nested: the swapped head is not swapped again
    assert "forward" not in wide.get_output_embeddings().__dict__


def test_restored_after_an_error(tokenizer_dir):
    model = _model(tokenizer_dir, gpt2_config(), vocab=_wide(gpt2_config()))
    with pytest.raises(RuntimeError, match="boom"), transposed_lm_head(model):
        raise RuntimeError("boom")
    assert "forward" not in model.get_output_embeddings().__dict__


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
def test_generate_responses_with_and_without_the_transposed_head(tokenizer_dir, sampler):
    from lit_rlhf.rollout import GenerationSettings, generate_responses

    model = _model(tokenizer_dir, llama_config(), vocab=_wide(llama_config()))
    ids = torch.randint(5, 100, (4, 7))
    out = {}
    for transposed in (True, False):
        settings = GenerationSettings(max_new_tokens=8, sampler=sampler, transposed_head=transposed)
        torch.manual_seed(5)
        out[transposed] = generate_responses(
            model, ids, torch.ones_like(ids), settings, eos_token_id=2, pad_token_id=0
        )
    for a, b in zip(out[True][:3], out[False][:3]):  # ids, mask, truncated
        assert torch.equal(a, b)
    for a, b in zip(out[True][3:5], out[False][3:5]):  # behaviour log-probs: logits equal to float rounding
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert "forward" not in model.get_output_embeddings().__dict__


class _WeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the casts to bfloat16 of tensors shaped like one of ``shapes`` (the model's Linear weights)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.count += tuple(args[0].shape) in self.shapes
        return func(*args, **kwargs)


@pytest.mark.parametrize("decode_loop", ["lean", "generate"])
def test_autocast_casts_each_weight_once_per_call_with_the_same_tokens(tokenizer_dir, monkeypatch, decode_loop):
    """Under an autocast region with its cache off (Lightning's bf16-mixed), generation casts each Linear weight
    once per call, not once per step, and draws the same tokens with the same log-probs, bit for bit."""
    import contextlib

    from lit_rlhf.engines import hf_generate
    from lit_rlhf.rollout import GenerationSettings, generate_responses

    model = _model(tokenizer_dir, llama_config())
    for p in model.parameters():  # trained weights: what autocast's cache keeps
        p.requires_grad_(True)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = {tuple(m.weight.shape) for m in linears}
    ids = torch.randint(5, 100, (4, 7))
    settings = GenerationSettings(max_new_tokens=8, decode_loop=decode_loop, transposed_head=False)
    out, casts = {}, {}
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(hf_generate, "cached_autocast_casts", lambda m: contextlib.nullcontext(False))
        torch.manual_seed(5)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), _WeightCasts(
            shapes
        ) as counter:
            out[cached] = generate_responses(model, ids, torch.ones_like(ids), settings, eos_token_id=2, pad_token_id=0)
            assert not torch.is_autocast_cache_enabled()  # the enclosing region's setting is back
        casts[cached] = counter.count
    steps = out[True].ids.shape[1]
    assert steps > 2
    for a, b in zip(out[True][:5], out[False][:5]):  # ids, mask, truncated, behaviour log-probs, kept mass
        assert (a is None and b is None) or torch.equal(a, b)
    assert casts[True] <= len(linears) < casts[False]
    assert casts[False] >= (steps - 1) * len(linears)


def test_cached_casts_are_cleared_when_the_block_ends(tokenizer_dir):
    """A weight changed after a cached block (an optimiser step) is cast anew by the next cached block."""
    from lit_rlhf.models.decoding import cached_autocast_casts

    model = _model(tokenizer_dir, llama_config())
    ids = torch.randint(5, 100, (2, 5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        with cached_autocast_casts(model) as cached:
            assert cached and torch.is_autocast_cache_enabled()
            model(input_ids=ids)
        for p in model.parameters():
            p.mul_(0.5)  # in place, as an optimiser changes a weight: same tensor, new values
        expected = model(input_ids=ids).logits  # cast afresh (the enclosing region has no cache)
        with cached_autocast_casts(model):
            got = model(input_ids=ids).logits
    assert torch.equal(got, expected)
    with cached_autocast_casts(model) as cached:  # no autocast region: nothing to cache
        assert not cached
    with torch.autocast("cpu", dtype=torch.bfloat16), cached_autocast_casts(model) as cached:
        assert not cached  # the enclosing region caches already

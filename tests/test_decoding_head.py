"""The LM head's decoding layouts (transposed, oneDNN-packed): the same logits to float rounding and the
same tokens, only where they apply, restored after."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer
from lit_rlhf.models.decoding import (
    PACKED_HEAD_MIN_ROWS,
    TRANSPOSED_HEAD_MIN_ELEMENTS,
    decoding_lm_head,
    onednn_packs,
)

_NO_ONEDNN = pytest.mark.skipif(not onednn_packs(torch.empty(1)), reason="oneDNN packs on x86-64 CPU builds only")
LAYOUTS = ["transposed", pytest.param("packed", marks=_NO_ONEDNN)]


def _model(tokenizer_dir, config, vocab=None, **fields):
    config = {**config, **({"vocab_size": vocab} if vocab else {}), **fields}
    tokenizer = load_tokenizer(tokenizer_dir, padding_side="left")
    return build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer).eval()


def _wide(config):
    # a head of >= TRANSPOSED_HEAD_MIN_ELEMENTS: hidden 64 x vocab 16,384 (token ids stay < the real vocab)
    hidden = config.get("n_embd", config.get("hidden_size"))
    return max(TRANSPOSED_HEAD_MIN_ELEMENTS // hidden, 1024) + 7


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
def test_logits_and_sampled_tokens_equal_the_plain_head(tokenizer_dir, config, layout):
    model = _model(tokenizer_dir, config, vocab=_wide(config))
    ids = torch.randint(5, 100, (3, 9))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with decoding_lm_head(model, layout) as used:
            assert used == layout
            fast = model(input_ids=ids).logits
            last = model(input_ids=ids, logits_to_keep=1).logits  # the head on a view of the hidden states
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, fast[:, -1:], rtol=1e-5, atol=1e-5)
    assert "forward" not in model.get_output_embeddings().__dict__  # restored
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=True, pad_token_id=0)
    torch.manual_seed(3)
    expected = model.generate(**kwargs)
    torch.manual_seed(3)
    with decoding_lm_head(model, layout):
        got = model.generate(**kwargs)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rows_logits_do_not_depend_on_the_batch_above_the_probed_rows(tokenizer_dir, layout):
    """What dropping finished rows relies on: from ``min_rows`` rows on (a probe of the head's own product),
    each row's logits are those of the 16-row batch."""
    from lit_rlhf.engines.lean_decode import min_rows

    model = _model(tokenizer_dir, llama_config(), vocab=_wide(llama_config()))
    hidden = torch.randn(16, 1, llama_config()["hidden_size"])
    head = model.get_output_embeddings()
    with torch.no_grad(), decoding_lm_head(model, layout):
        batch = head(hidden)  # (16, 1, V)
        rounded = [n for n in range(1, 16) if not torch.equal(head(hidden[:n].clone()), batch[:n])]
        fewest = min_rows(model, 16)
    assert all(n < fewest for n in rounded), (rounded, fewest)


def test_auto_packs_where_onednn_can_and_the_call_has_the_rows(tokenizer_dir):
    model = _model(tokenizer_dir, llama_config(), vocab=_wide(llama_config()))
    packs = onednn_packs(model.get_output_embeddings().weight)
    with decoding_lm_head(model, "auto", rows=PACKED_HEAD_MIN_ROWS) as used:
        assert used == ("packed" if packs else "transposed")
    with decoding_lm_head(model, "auto", rows=PACKED_HEAD_MIN_ROWS - 1) as used:
        assert used == "transposed"  # one or two rows: the transposed copy is faster
    with torch.autocast("cpu", dtype=torch.bfloat16), decoding_lm_head(model, "auto", rows=8) as used:
        assert used == "transposed"  # never packed under autocast
    with pytest.warns(UserWarning, match="cannot pack"), torch.autocast("cpu", dtype=torch.bfloat16):
        with decoding_lm_head(model, "packed", rows=8) as used:
            assert used == "transposed"
    with pytest.raises(ValueError, match="decoding head layout must be one of"), decoding_lm_head(model, "fast"):
        pass
    assert "forward" not in model.get_output_embeddings().__dict__


def test_left_alone_where_it_does_not_apply(tokenizer_dir):
    small = _model(tokenizer_dir, gpt2_config())  # a head below the size threshold
    with decoding_lm_head(small, "packed") as used:
        assert used is None
    wide = _model(tokenizer_dir, gpt2_config(), vocab=_wide(gpt2_config()))
    with decoding_lm_head(wide, "plain") as used:
        assert used is None
    with decoding_lm_head(wide) as outer, decoding_lm_head(wide) as inner:
        assert outer and inner is None  # nested: the swapped head is not swapped again
    assert "forward" not in wide.get_output_embeddings().__dict__


def test_restored_after_an_error(tokenizer_dir):
    model = _model(tokenizer_dir, gpt2_config(), vocab=_wide(gpt2_config()))
    with pytest.raises(RuntimeError, match="boom"), decoding_lm_head(model):
        raise RuntimeError("boom")
    assert "forward" not in model.get_output_embeddings().__dict__


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
def test_generate_responses_with_and_without_the_decoding_head(tokenizer_dir, sampler, layout):
    from lit_rlhf.rollout import GenerationSettings, generate_responses

    model = _model(tokenizer_dir, llama_config(), vocab=_wide(llama_config()))
    ids = torch.randint(5, 100, (4, 7))
    out = {}
    for head in (layout, "plain"):
        for loop in ("lean", "generate"):
            settings = GenerationSettings(max_new_tokens=8, sampler=sampler, decoding_head=head, decode_loop=loop)
            torch.manual_seed(5)
            out[head, loop] = generate_responses(
                model, ids, torch.ones_like(ids), settings, eos_token_id=2, pad_token_id=0
            )
    for loop in ("lean", "generate"):
        for a, b in zip(out[layout, loop][:3], out["plain", loop][:3]):  # ids, mask, truncated
            assert torch.equal(a, b)
        for a, b in zip(out[layout, loop][3:5], out["plain", loop][3:5]):  # behaviour log-probs: to rounding
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(out[layout, "lean"][:5], out[layout, "generate"][:5]):  # one layout: the loops agree
        assert torch.equal(a, b)
    assert "forward" not in model.get_output_embeddings().__dict__


def test_generation_settings_refuse_an_unknown_head_layout():
    from lit_rlhf.rollout import GenerationSettings

    with pytest.raises(ValueError, match="generation.decoding_head must be one of"):
        GenerationSettings(decoding_head="fast")


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
    settings = GenerationSettings(max_new_tokens=8, decode_loop=decode_loop, decoding_head="plain")
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


@_NO_ONEDNN
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9), depth=st.integers(1, 70), width=st.integers(1, 300), bias=st.booleans(),
    steps=st.integers(1, 3), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_packed_linear_is_nn_linear_to_rounding(rows, depth, width, bias, steps, seed):
    """Any shape, with or without a bias, 2-D or 3-D input, a non-contiguous view included."""
    from lit_rlhf.models.decoding import packed_linear

    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(width, depth, generator=generator)
    b = torch.randn(width, generator=generator) if bias else None
    x = torch.randn(rows, steps + 1, depth, generator=generator)[:, 1:]  # (rows, steps, depth), a view
    product = packed_linear(weight, b)
    expected = torch.nn.functional.linear(x, weight, b)
    torch.testing.assert_close(product(x), expected, rtol=1e-5, atol=1e-5 * depth**0.5)
    torch.testing.assert_close(product(x[:, -1]), expected[:, -1], rtol=1e-5, atol=1e-5 * depth**0.5)


def test_a_head_onednn_cannot_pack_falls_back_to_the_transposed_copy(tokenizer_dir, monkeypatch):
    from lit_rlhf.models import decoding

    def refuse(weight, bias=None):
        raise RuntimeError("no reorder here")

    model = _model(tokenizer_dir, llama_config(), vocab=_wide(llama_config()))
    monkeypatch.setattr(decoding, "onednn_packs", lambda weight: True)
    monkeypatch.setattr(decoding, "packed_linear", refuse)
    ids = torch.randint(5, 100, (3, 9))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with pytest.warns(UserWarning, match="could not be packed"), decoding_lm_head(model, "packed") as used:
            assert used == "transposed"
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

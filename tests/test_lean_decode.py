"""The lean decoding loop (``generation.decode_loop``) against Hugging Face ``generate``, same seed.

Each comparison runs one seeded generation with ``decode_loop="generate"`` and one with ``"lean"`` (where
``model.generate`` is made to fail, so the lean loop really ran), on left-padded prompts of 4 different
lengths in groups of K = 3 copies, and asserts the same tokens, masks and truncation flags, the same
behaviour log-probs and kept masses (to float rounding), and the same next random number (the same draws
were consumed).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import gpt2_config, llama_config
from test_generation_prefill import K, _model, _prompts, _record_forward_shapes

from lit_rlhf.engines import lean_decode
from lit_rlhf.engines.lean_decode import (
    MIN_ROWS,
    GrowingLayer,
    _keep_rows,
    _worth_dropping,
    lean_unsupported,
    min_rows,
)
from lit_rlhf.rollout import GenerationSettings, generate_responses, generation_kwargs


def _generate(model, tok, ids, mask, settings, greedy=False):
    torch.manual_seed(11)
    out = generate_responses(
        model, ids, mask, settings, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tokenizer=tok, greedy=greedy, group_size=settings.num_samples,
    )  # fmt: skip
    return out, torch.rand(3)


def _both(model, tok, ids, mask, settings, greedy=False, monkeypatch=None):
    """(generate's outputs, next random numbers), (the lean loop's, next random numbers)."""
    reference = _generate(model, tok, ids, mask, replace(settings, decode_loop="generate"), greedy)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model, "generate", lambda *a, **k: pytest.fail("the lean loop called generate"))
        lean = _generate(model, tok, ids, mask, replace(settings, decode_loop="lean"), greedy)
    return reference, lean


def _assert_same(reference, lean) -> None:
    (a, rng_a), (b, rng_b) = reference, lean
    for x, y in zip(a[:3], b[:3]):  # ids, mask, truncated
        assert torch.equal(x, y)
    for x, y in zip(a[3:5], b[3:5]):  # logprobs, log_kept_mass
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert torch.equal(rng_a, rng_b), "another number of random draws was consumed"


SAMPLING = {
    "inverse_cdf": (False, dict(sampler="inverse_cdf")),
    "multinomial": (False, dict(sampler="multinomial")),
    "inverse_cdf_top_k_top_p": (False, dict(sampler="inverse_cdf", top_k=40, top_p=0.9)),
    "multinomial_top_p": (False, dict(sampler="multinomial", top_p=0.8)),
    "greedy": (True, {}),
}


@pytest.mark.parametrize("config", [gpt2_config(), llama_config()], ids=["gpt2", "llama"])
@pytest.mark.parametrize("group_prefill", ["never", "always"])
@pytest.mark.parametrize("sampling", sorted(SAMPLING))
def test_lean_loop_gives_generates_tokens_and_logprobs(tokenizer_dir, config, group_prefill, sampling):
    greedy, fields = SAMPLING[sampling]
    tok, model = _model(tokenizer_dir, config)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(
        max_new_tokens=10, temperature=0.9, num_samples=K, group_prefill=group_prefill, **fields
    )
    reference, lean = _both(model, tok, ids, mask, settings, greedy)
    _assert_same(reference, lean)
    assert reference[0].mask.any(dim=1).all()


def _stopping_settings(model, tok, ids, mask, sampler, **fields):
    """Settings whose stop ids (the most sampled tokens) end the rows at different steps before the limit."""
    settings = GenerationSettings(max_new_tokens=24, num_samples=K, sampler=sampler, **fields)
    probe = _generate(model, tok, ids, mask, replace(settings, decode_loop="generate"))[0]
    frequent = torch.bincount(probe.ids[probe.mask]).topk(12).indices.tolist()  # the most sampled tokens
    return replace(settings, stop_token_ids=[t for t in frequent if t != tok.pad_token_id])


@pytest.mark.parametrize("group_prefill", ["never", "always"])
@pytest.mark.parametrize("drop_finished", ["always", "never"])
@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial", "greedy"])
def test_lean_loop_stops_rows_as_generate_does(tokenizer_dir, sampler, drop_finished, group_prefill):
    """Stop ids that end every row at a different step before the limit, so the loop ends early too; with
    ``drop_finished`` the finished rows leave the batch (greedy and inverse CDF) and nothing else changes."""
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    greedy = sampler == "greedy"
    settings = _stopping_settings(
        model, tok, ids, mask, "inverse_cdf" if greedy else sampler, top_k=20, drop_finished=drop_finished,
        group_prefill=group_prefill,
    )  # fmt: skip
    if greedy:  # a group's K greedy rows are one response: stop on tokens of the groups' at different steps
        unstopped = replace(settings, decode_loop="generate", stop_token_ids=[])
        probe = _generate(model, tok, ids, mask, unstopped, greedy=True)[0]
        rows = torch.arange(0, len(ids), K)
        settings = replace(settings, stop_token_ids=probe.ids[rows, torch.arange(len(rows)) * 3].tolist())
    shapes = _record_forward_shapes(model)
    reference, lean = _both(model, tok, ids, mask, settings, greedy)
    _assert_same(reference, lean)
    out = reference[0]
    lengths = out.mask.sum(dim=1)
    assert not out.truncated.any() and out.ids.shape[1] < settings.max_new_tokens
    assert (
        len(set(lengths.tolist())) >= (2 if greedy else 3) and (out.ids[~out.mask] == tok.pad_token_id).all()
    )
    lean_rows = [
        rows for rows, columns in shapes[len(shapes) // 2 :] if columns == 1
    ]  # the lean call's steps
    dropped = drop_finished == "always" and sampler != "multinomial"
    assert (min(lean_rows) < len(ids)) == dropped
    assert min(lean_rows) >= min(min_rows(model, len(ids)), len(ids)) and lean_rows == sorted(
        lean_rows, reverse=True
    )


def test_dropping_rows_keeps_the_batch_at_its_fewest_rows(tokenizer_dir):
    """All rows but one stop at their first token: the loop goes on with the running row and finished
    fillers up to ``min_rows`` (a one-row batch would take the BLAS's matrix-vector path), with generate's
    tokens."""
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    settings = GenerationSettings(
        max_new_tokens=12, num_samples=K, sampler="inverse_cdf", drop_finished="always"
    )
    probe = _generate(model, tok, ids, mask, replace(settings, decode_loop="generate"))[0]
    first = probe.ids[:, 0]
    stops = sorted(set(first[1:].tolist()) - {first[0].item(), tok.pad_token_id})
    settings = replace(settings, stop_token_ids=stops)
    shapes = _record_forward_shapes(model)
    reference, lean = _both(model, tok, ids, mask, settings)
    _assert_same(reference, lean)
    running = reference[0].mask.sum(dim=1) > 1
    assert running[0] and not running[1:][~torch.isin(first[1:], first[0])].any()
    assert min(rows for rows, columns in shapes if columns == 1) == min(min_rows(model, len(ids)), len(ids))


def test_which_rows_are_kept():
    assert _keep_rows(torch.tensor([True, False, True, False])).tolist() == [0, 2]
    assert _keep_rows(torch.tensor([False, False, True, False])).tolist() == [0, 2]  # a filler: 2 rows
    assert _keep_rows(torch.tensor([False, False, False, True])).tolist() == [0, 3]
    assert _keep_rows(torch.tensor([False, True, False, False, True]), fewest=4).tolist() == [0, 1, 2, 4]
    assert not _worth_dropping(MIN_ROWS, 1)  # cannot shrink
    assert not _worth_dropping(4, 1, fewest=4) and _worth_dropping(5, 4, fewest=4)
    assert _worth_dropping(8, 7) and not _worth_dropping(8, 8)
    assert not _worth_dropping(64, 57) and _worth_dropping(64, 56)  # an eighth of a large batch


def test_min_rows_finds_the_row_counts_a_blas_rounds_otherwise(tokenizer_dir, monkeypatch):
    """The probe against a stand-in BLAS that rounds batches of fewer than 5 rows otherwise: the batch
    keeps 5 rows; against the real one at least ``MIN_ROWS``, and each row count from there on gives the
    probe's rows bit-identical to the full batch's."""
    _, model = _model(tokenizer_dir, llama_config())
    linear = torch.nn.functional.linear

    def blas(x, weight, bias=None):
        out = linear(x, weight, bias)
        return out + 1e-3 if x.shape[0] < 5 else out

    lean_decode._rounding_rows.cache_clear()
    # a 3-row batch is all under the stand-in's 5 rows, so only the real BLAS can round its rows otherwise:
    # whether its 2 rows round as its 3 depends on the CPU (on an Intel Xeon with AMX the 64 -> 32 product
    # does not), so the stand-in's answer for 3 rows is the real one's
    real = {batch: min_rows(model, batch) for batch in (3, 8, 64)}  # batch -> the real BLAS's fewest rows
    lean_decode._rounding_rows.cache_clear()
    monkeypatch.setattr(torch.nn.functional, "linear", blas)
    assert min_rows(model, 8) == max(5, real[8]) and min_rows(model, 64) == max(5, real[64])
    assert min_rows(model, 3) == real[3]
    monkeypatch.undo()
    lean_decode._rounding_rows.cache_clear()
    shapes = {m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)}  # (out, in)
    for batch in (4, 8, 16):
        fewest = min_rows(model, batch)
        assert fewest >= MIN_ROWS
        for shape in shapes:  # every product of the model, in and out features as it multiplies them
            x, weight = torch.randn(batch, shape[1]), torch.randn(shape)
            whole = linear(x, weight)
            for n in range(fewest, batch):
                assert torch.equal(linear(x[:n].clone(), weight), whole[:n]), (shape, n, batch)


def test_drop_finished_setting():
    assert GenerationSettings().drops_finished("cpu")
    assert not GenerationSettings().drops_finished("meta")  # auto: CPU only
    assert GenerationSettings(drop_finished="always").drops_finished("meta")
    assert not GenerationSettings(drop_finished="never").drops_finished("cpu")
    with pytest.raises(ValueError, match="generation.drop_finished must be one of"):
        GenerationSettings(drop_finished="yes")


def test_lean_loop_with_a_lora_policy(tokenizer_dir):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    tok, model = _model(tokenizer_dir, llama_config(), lora=lora)
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=8, num_samples=K, group_prefill="always")
    _assert_same(*_both(model, tok, ids, mask, settings))


def test_growing_layer_holds_what_concatenation_holds():
    keys, values = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    layer = GrowingLayer(keys, values, capacity=6)
    new_k, new_v = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5)
    k, v = layer.update(new_k, new_v)
    assert torch.equal(k, torch.cat([keys, new_k], dim=-2)) and torch.equal(
        v, torch.cat([values, new_v], dim=-2)
    )
    assert layer.get_seq_length() == 5
    layer.update(new_k, new_v)
    with pytest.raises(RuntimeError, match="capacity 6"):
        layer.update(new_k, new_v)


def test_growing_layer_keeps_rows():
    keys, values = torch.randn(4, 3, 2, 5), torch.randn(4, 3, 2, 5)
    layer = GrowingLayer(keys, values, capacity=4)
    rows = torch.tensor([1, 3])
    layer.keep_rows(rows)
    assert torch.equal(layer.keys, keys[rows]) and torch.equal(layer.values, values[rows])
    new_k, new_v = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5)
    k, v = layer.update(new_k, new_v)  # grows in the new buffers, up to the same capacity
    assert torch.equal(k, torch.cat([keys[rows], new_k], dim=-2)) and torch.equal(
        v, torch.cat([values[rows], new_v], dim=-2)
    )
    layer.update(new_k, new_v)
    with pytest.raises(RuntimeError, match="capacity 4"):
        layer.update(new_k, new_v)


def _kwargs(tok, settings, greedy=False):
    ids = torch.tensor([[5, 6, 7]])
    return generation_kwargs(
        ids, torch.ones_like(ids), settings, [tok.eos_token_id], tok.pad_token_id, tok, greedy=greedy
    )


def test_unsupported_settings_fall_back_to_generate(tokenizer_dir):
    tok, model = _model(tokenizer_dir, gpt2_config())
    assert lean_unsupported(model, _kwargs(tok, GenerationSettings())) is None
    assert lean_unsupported(model, _kwargs(tok, GenerationSettings(), greedy=True)) is None
    assert "stop strings" in lean_unsupported(model, _kwargs(tok, GenerationSettings(stop_strings=["ab"])))
    assert "synced_gpus" in lean_unsupported(
        model, {**_kwargs(tok, GenerationSettings()), "synced_gpus": True}
    )
    model.generation_config.repetition_penalty = 1.3  # generate would add a processor the loop has not
    assert "repetition_penalty" in lean_unsupported(model, _kwargs(tok, GenerationSettings()))
    model.generation_config.repetition_penalty = None
    model.generation_config.suppress_tokens = [tok.pad_token_id]  # what the greedy loop suppresses itself
    assert lean_unsupported(model, _kwargs(tok, GenerationSettings(), greedy=True)) is None


def test_auto_falls_back_and_lean_says_why(tokenizer_dir):
    tok, model = _model(tokenizer_dir, gpt2_config())
    ids, mask = _prompts(tok, k=1)
    settings = GenerationSettings(max_new_tokens=6, stop_strings=["od"])
    with pytest.raises(ValueError, match="stop strings"):
        _generate(model, tok, ids, mask, replace(settings, decode_loop="lean"))
    reference = _generate(model, tok, ids, mask, replace(settings, decode_loop="generate"))
    auto = _generate(model, tok, ids, mask, settings)  # "auto" runs generate, which matches the stop string
    _assert_same(reference, auto)
    # a model file's processors (no_repeat_ngram_size) never reach a rollout: the lean loop runs
    model.generation_config.no_repeat_ngram_size = 2
    _assert_same(*_both(model, tok, ids, mask, replace(settings, stop_strings=[])))
    with pytest.raises(ValueError, match="decode_loop must be one of"):
        GenerationSettings(decode_loop="fast")


@pytest.mark.parametrize("sampler", ["inverse_cdf", "multinomial"])
def test_lean_loop_under_bf16_autocast(tokenizer_dir, sampler):
    """Lightning's ``bf16-mixed`` generates under CPU autocast: bfloat16 logits, cast to float32 as generate does."""
    tok, model = _model(tokenizer_dir, llama_config())
    ids, mask = _prompts(tok)
    settings = GenerationSettings(max_new_tokens=8, num_samples=K, sampler=sampler, group_prefill="always")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same(*_both(model, tok, ids, mask, settings))

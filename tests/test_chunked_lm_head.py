"""The chunked LM head (lit_rlhf.models.lm_head) equals the full-logits path: log-probs, entropy, argmax
and the gradients of every parameter, for a tied GPT-2, an untied Llama and a LoRA model, in the padded
and the shared-prompt layout; it falls back where it is not exact, "auto" chooses by gradient mode, and
it never keeps (tokens x vocabulary) logits for the backward nor creates them without gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, llama_config
from transformers import AutoConfig, AutoModelForCausalLM

from lit_rlhf.models import (
    LOGITS_CHUNKING_THRESHOLD,
    NO_GRAD_CHUNKING_VOCAB,
    ModelSpec,
    ValueHead,
    build_causal_lm,
    chunkable_head,
    final_hidden_states,
    head_token_scores,
    load_tokenizer,
    next_token_logprobs,
    packed_policy_forward,
    packed_response_logprobs,
    policy_forward,
    reference_logits_context,
    response_logprobs,
    set_logits_chunking,
    set_scored_last_layer,
    shared_prefix_layout,
)
from lit_rlhf.models import lm_head as lm_head_module
from lit_rlhf.models.lm_head import auto_chunks, chunk_tokens
from lit_rlhf.models.scoring import _forward_kwargs

VOCAB = 300
B, P, T = 3, 6, 7


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """5 tokens per chunk, so every test runs several chunks (and a ragged last one)."""
    monkeypatch.setattr(lm_head_module, "_CHUNK_ELEMENTS", 5 * VOCAB)
    monkeypatch.setattr(lm_head_module, "_NO_GRAD_CHUNK_ELEMENTS", 5 * VOCAB)
    monkeypatch.setattr(lm_head_module, "_MIN_CHUNK_TOKENS", 1)


def _model(kind: str, dtype: torch.dtype = torch.float32, vocab: int = VOCAB) -> torch.nn.Module:
    fields = gpt2_config(vocab) if kind == "gpt2" else llama_config(vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    # the head route against the full logits bit for bit: the whole last layer on both sides (the last layer
    # at the kept positions only, a float-rounding change, is tested in test_last_layer.py)
    set_scored_last_layer(model, False)
    return model.to(dtype).eval()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    target = ["c_attn", "lm_head"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj", "lm_head"]
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target))
    with torch.no_grad():  # LoRA's B starts at 0: make the adapters change the outputs
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return peft_model


def _rollout_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P+T) left-padded prompts and right-padded responses."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, P + T), generator=gen)
    mask = torch.ones(B, P + T, dtype=torch.long)
    mask[0, :2] = 0  # a shorter prompt
    mask[1, -3:] = 0  # a response that stopped early
    return ids, mask


def _grads(model: torch.nn.Module, *extra: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = [*model.named_parameters(), *(p for m in extra for p in m.named_parameters(prefix="extra"))]
    return {name: p.grad.clone() for name, p in params if p.grad is not None}


def _run_both(model, fn):
    """fn() under "off" then "on": (outputs, grads) of each; gradients zeroed in between."""
    results = []
    for mode in ("off", "on"):
        set_logits_chunking(model, mode)
        model.zero_grad(set_to_none=True)
        results.append(fn())
    return results


def _assert_grads_equal(plain: dict, chunked: dict) -> None:
    """Equal up to the order of float sums (chunks accumulate the head's gradient one at a time):
    relative 1e-5, absolute 1e-6 of the tensor's largest entry in float32 (1e-13 in float64)."""
    assert plain.keys() == chunked.keys() and plain
    for name, want in plain.items():
        tol = 1e-6 if want.dtype == torch.float32 else 1e-13
        scale = want.abs().max().item()
        torch.testing.assert_close(
            chunked[name], want, rtol=10 * tol, atol=tol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize(("lora", "dtype"), [(False, torch.float32), (True, torch.float32), (False, torch.float64)])
def test_policy_forward_equals_full_logits(kind, lora, dtype):
    model = _model(kind, dtype)
    if lora:
        model = _lora(model)
    assert chunkable_head(model, 1, mode="on") is not None
    value_head = ValueHead(model.config.hidden_size).to(dtype)
    torch.nn.init.normal_(value_head.linear.weight)
    ids, mask = _rollout_batch()
    real = mask[:, -T:].bool()  # the head route scores real response tokens only (padding reads 0)

    def step():
        value_head.zero_grad(set_to_none=True)
        logprobs, entropy, values = policy_forward(model, ids, mask, T, temperature=0.7, value_head=value_head)
        ((logprobs * real).sum() - 0.1 * (entropy * real).sum() + values.square().sum()).backward()
        return (logprobs, entropy, values), _grads(model, value_head)

    (plain, plain_grads), (chunked, chunked_grads) = _run_both(model, step)
    for got, want in zip(chunked, plain):
        assert got.shape == want.shape == (B, T) and got.dtype == want.dtype
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-13)
    for padded in chunked[:2]:
        assert not padded[~real].any()
    _assert_grads_equal(plain_grads, chunked_grads)
    if kind == "gpt2" and not lora:  # the tied embedding/head received both gradients
        assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_policy_forward_entropy_without_graph(kind):
    model = _model(kind)
    ids, mask = _rollout_batch()

    real = mask[:, -T:].bool()

    def step():
        logprobs, entropy, _ = policy_forward(model, ids, mask, T, temperature=1.3, entropy_grad=False)
        assert not entropy.requires_grad
        (logprobs * real).sum().backward()
        return (logprobs, entropy), _grads(model)

    (plain, plain_grads), (chunked, chunked_grads) = _run_both(model, step)
    for got, want in zip(chunked, plain):
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-6)
    _assert_grads_equal(plain_grads, chunked_grads)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("lora", [False, True])
def test_response_logprobs_equal_full_logits(kind, lora):
    model = _model(kind)
    if lora:
        model = _lora(model)
    ids, mask = _rollout_batch()
    response_mask = torch.zeros_like(mask)
    response_mask[:, P:] = 1

    def step():
        logps, n_tokens = response_logprobs(model, ids, mask, response_mask)
        (logps * torch.tensor([1.0, -2.0, 0.5])).sum().backward()
        return (logps, n_tokens), _grads(model)

    (plain, plain_grads), (chunked, chunked_grads) = _run_both(model, step)
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-5)  # sums of T log-probs
    assert torch.equal(chunked[1], plain[1]) and chunked[1].tolist() == [T, T - 3, T]
    _assert_grads_equal(plain_grads, chunked_grads)
    if lora:  # the reference (adapters off) differs from the policy, identically on both paths
        with torch.no_grad(), reference_logits_context(model):
            set_logits_chunking(model, "off")
            off = response_logprobs(model, ids, mask, response_mask)[0]
            set_logits_chunking(model, "on")
            on = response_logprobs(model, ids, mask, response_mask)[0]
        torch.testing.assert_close(on, off, rtol=0, atol=1e-5)
        assert not torch.allclose(on, plain[0], atol=1e-3)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_next_token_logprobs_and_argmax_equal_full_logits(kind):
    """SFT's loss and token accuracy: scored positions only, zeros/-1 elsewhere on both paths."""
    model = _model(kind)
    ids, mask = _rollout_batch()
    score_mask = torch.zeros(B, P + T - 1, dtype=torch.bool)
    score_mask[:, P - 1 :] = mask[:, P:].bool()

    def step():
        logprobs, predicted = next_token_logprobs(model, ids, mask, score_mask, argmax=True)
        logprobs.sum().backward()
        return (logprobs, predicted), _grads(model)

    (plain, plain_grads), (chunked, chunked_grads) = _run_both(model, step)
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-6)
    assert torch.equal(chunked[1], plain[1])
    assert (plain[0][~score_mask] == 0).all() and (plain[1][~score_mask] == -1).all()
    assert (plain[1][score_mask] >= 0).all()
    _assert_grads_equal(plain_grads, chunked_grads)


def test_head_token_scores_by_hand():
    """A 2-token vocabulary: logits (0, log 3) give p = (1/4, 3/4); at temperature 2, z = (0, log 3 / 2)."""
    head = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [torch.log(torch.tensor(3.0))]]))
    hidden, labels = torch.ones(3, 1), torch.tensor([0, 1, 1])
    scores = head_token_scores(head, hidden, labels, entropy=True, argmax=True, chunk_elements=2)
    expected = torch.tensor([0.25, 0.75, 0.75]).log()
    torch.testing.assert_close(scores.logprobs, expected)
    entropy = -(0.25 * torch.tensor(0.25).log() + 0.75 * torch.tensor(0.75).log())
    torch.testing.assert_close(scores.entropy, entropy.expand(3))
    assert scores.argmax.tolist() == [1, 1, 1]
    p1 = 3**0.5 / (1 + 3**0.5)  # softmax((0, log 3) / 2)[1]
    warm = head_token_scores(head, hidden, labels, temperature=2.0)
    torch.testing.assert_close(warm.logprobs, torch.tensor([1 - p1, p1, p1]).log())
    assert warm.entropy is None and warm.argmax is None


def test_final_hidden_states_are_the_heads_input_and_skip_its_matmul():
    model = _model("llama")
    ids, mask = _rollout_batch()
    head = model.get_output_embeddings()
    outputs = []
    handle = head.register_forward_hook(lambda _m, _a, out: outputs.append(out))
    hidden = final_hidden_states(model, head, _forward_kwargs(ids, mask), logits_to_keep=T + 1)
    handle.remove()
    assert outputs[0].shape == (B, 0, VOCAB)  # the head saw no positions
    reference = model(**_forward_kwargs(ids, mask), output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(hidden, reference[:, -T - 1 :], rtol=0, atol=0)


def test_fallback_where_chunking_is_not_exact_or_not_asked_for():
    llama = _model("llama")
    assert chunkable_head(llama, 1, mode="on") is llama.lm_head
    assert chunkable_head(llama, 1, mode="off") is None
    assert chunkable_head(llama, 1) is None  # auto: far below the threshold
    assert chunkable_head(llama, -(-LOGITS_CHUNKING_THRESHOLD // VOCAB)) is llama.lm_head
    assert chunkable_head(llama, LOGITS_CHUNKING_THRESHOLD // VOCAB - 1) is None
    set_logits_chunking(llama, "off")
    assert chunkable_head(llama, 10**9) is None
    with pytest.raises(ValueError, match="logits_chunking"):
        set_logits_chunking(llama, "always")
    # models that change the logits after the head
    scaled = _model("llama")
    scaled.config.logit_scale = 0.5
    assert chunkable_head(scaled, 10**9, mode="on") is None
    gemma2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(
            "gemma2",
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=30.0,
        )
    )
    assert chunkable_head(gemma2, 10**9, mode="on") is None
    ids, mask = _rollout_batch()
    set_logits_chunking(gemma2, "on")
    logits = gemma2(**_forward_kwargs(ids, mask)).logits[:, -T - 1 : -1]  # softcapped
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, -T:, None]).squeeze(-1)
    logprobs, _, _ = policy_forward(gemma2, ids, mask, T, temperature=1.0)
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-6)


def _largest_saved_activation(model: torch.nn.Module, fn) -> int:
    """Elements of the largest storage autograd saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    largest = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal largest
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            largest = max(largest, storage.nbytes() // tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return largest


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_no_logits_of_all_tokens_are_kept_for_backward(kind):
    vocab = 10 * VOCAB  # logits well above the model's own activations (B x L x 4H)
    model = _model(kind, vocab=vocab)
    ids, mask = _rollout_batch()
    response_mask = torch.zeros_like(mask)
    response_mask[:, P:] = 1
    forwards = {
        "policy": (lambda: policy_forward(model, ids, mask, T, temperature=0.7)[0].sum(), B * T),
        "response": (lambda: response_logprobs(model, ids, mask, response_mask)[0].sum(), B * T),
    }
    for name, (forward, n_tokens) in forwards.items():
        set_logits_chunking(model, "off")
        assert _largest_saved_activation(model, forward) >= n_tokens * vocab, name  # the check can fail
        set_logits_chunking(model, "on")
        assert _largest_saved_activation(model, forward) < n_tokens * vocab / 4, name


def test_model_spec_switch(tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    with pytest.raises(ValueError, match="ModelSpec.logits_chunking"):
        ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, logits_chunking="yes")
    for mode in ("auto", "on", "off"):
        spec = ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0, logits_chunking=mode)
        model = build_causal_lm(spec, tokenizer)
        assert (chunkable_head(model, 1) is not None) == (mode == "on")
    lora = ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, lora={"r": 2}, logits_chunking="on")
    assert chunkable_head(build_causal_lm(lora, tokenizer), 1) is not None


def test_sft_step_equal_with_and_without_chunking(tokenizer_dir):
    """SFTModule's loss, token accuracy and gradients with ModelSpec.logits_chunking on and off."""
    from lit_rlhf.modules import SFTModule

    ids, mask = _rollout_batch()
    response_mask = torch.zeros_like(mask)
    response_mask[:, P:] = mask[:, P:]
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": response_mask}
    results = []
    for mode in ("off", "on"):
        spec = {"config": llama_config(VOCAB), "tokenizer": tokenizer_dir, "seed": 0, "logits_chunking": mode}
        module = SFTModule(spec)
        assert (chunkable_head(module.model, 1) is not None) == (mode == "on")
        loss, accuracy, n_tokens = module._step(batch)
        loss.backward()
        results.append(((loss, accuracy, n_tokens), _grads(module.model)))
    (plain, plain_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=1e-6)
    assert torch.equal(chunked[1], plain[1]) and torch.equal(chunked[2], plain[2])
    _assert_grads_equal(plain_grads, chunked_grads)


# -- the shared-prompt layout (models/shared_prefix.py) with the chunked head --------------------------
K = 3  # responses per prompt


def _group_rows(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(2K, P+T) rows: two prompts (4 and 6 real tokens, left-padded) with K EOS-stopped responses of
    1-7 tokens each, right-padded; returns ids, attention mask and the (2K, P+T) response mask."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (2 * K, P + T), generator=gen)
    ids[1:K, :P], ids[K + 1 :, :P] = ids[0, :P], ids[K, :P]
    mask = torch.ones(2 * K, P + T, dtype=torch.long)
    mask[:K, : P - 4] = 0
    for row, length in enumerate([7, 3, 1, 5, 7, 2]):
        mask[row, P + length :] = 0
    response_mask = mask.clone()
    response_mask[:, :P] = 0
    return ids, mask, response_mask


def _packed(model: torch.nn.Module, ids, mask, response_mask):
    layout = shared_prefix_layout(model, "on", ids, mask * (1 - response_mask), response_mask, 0, 0, response_width=T)
    assert layout.input_ids.shape[0] == 2  # one row per prompt
    return layout


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [False, True])
def test_packed_chunked_equals_padded_plain(kind, attn, lora):
    """Log-probs, entropy (with and without its graph) and gradients of the packed rows with the chunked
    head equal the padded layout's full-logits path; summed response log-probs (DPO's) too."""
    model = _model(kind)
    model.config._attn_implementation = attn
    if lora:
        model = _lora(model)
    ids, mask, response_mask = _group_rows()
    real = response_mask[:, P:].bool()  # (2K, T)
    layout = _packed(model, ids, mask, response_mask)
    for entropy_grad in (True, False):
        outputs = []
        for packed, mode in ((False, "off"), (True, "on")):
            set_logits_chunking(model, mode)
            model.zero_grad(set_to_none=True)
            if packed:
                logprobs, entropy = packed_policy_forward(model, layout, 0.7, entropy_grad)
                summed, n_tokens = packed_response_logprobs(model, layout)
            else:
                logprobs, entropy, _ = policy_forward(model, ids, mask, T, 0.7, entropy_grad=entropy_grad)
                summed, n_tokens = response_logprobs(model, ids, mask, response_mask)
            assert entropy.requires_grad == entropy_grad
            loss = (logprobs * real).sum() - (0.1 * entropy * real).sum() + (summed * torch.arange(6.0)).sum()
            loss.backward()
            outputs.append(((logprobs[real], entropy[real], summed, n_tokens), _grads(model)))
        (plain, plain_grads), (chunked, chunked_grads) = outputs
        for got, want in zip(chunked, plain):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        _assert_grads_equal(plain_grads, chunked_grads)


def _largest_created(fn) -> int:
    """Elements of the largest tensor any operation of ``fn`` creates (outputs that alias an input, such
    as a transposed weight, excluded)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                    Largest.largest = max(Largest.largest, tensor.numel())
            return out

    with Largest():
        fn()
    return Largest.largest


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_packed_path_keeps_and_creates_no_logits_of_all_tokens(kind):
    """With the chunked head the packed forward saves no (N, T, V) logits for the backward, and without
    gradients no operation creates a tensor of that size (the check can fail: the plain path does both)."""
    vocab = 10 * VOCAB  # logits well above the model's own activations
    model = _model(kind, vocab=vocab)
    ids, mask, response_mask = _group_rows(vocab)
    layout = _packed(model, ids, mask, response_mask)
    n_logits = 2 * K * T * vocab  # (N, T, V)

    def forward():
        return packed_policy_forward(model, layout, temperature=0.7)[0].sum()

    for mode in ("off", "on"):
        set_logits_chunking(model, mode)
        saved = _largest_saved_activation(model, forward)
        with torch.no_grad():
            created = _largest_created(forward)
        if mode == "off":
            assert saved >= n_logits and created >= n_logits
        else:
            assert saved < n_logits / 4 and created < n_logits / 4


def test_auto_chunks_by_vocabulary_and_gradient_mode():
    """"auto": a vocabulary of >= NO_GRAD_CHUNKING_VOCAB always takes the head route (the head on the scored
    tokens only); a smaller one with gradients by the size of the logits, without gradients never. With
    gradients the route splits into recomputed chunks only from LOGITS_CHUNKING_THRESHOLD logits on."""
    assert auto_chunks(1, NO_GRAD_CHUNKING_VOCAB, grad=False)
    assert auto_chunks(1, NO_GRAD_CHUNKING_VOCAB, grad=True)
    assert not auto_chunks(10**9, NO_GRAD_CHUNKING_VOCAB - 1, grad=False)
    assert auto_chunks(LOGITS_CHUNKING_THRESHOLD // 640 + 1, 640, grad=True)
    assert not auto_chunks(LOGITS_CHUNKING_THRESHOLD // 640, 640, grad=True)
    big = _model("llama", vocab=NO_GRAD_CHUNKING_VOCAB)
    demo = _model("llama", vocab=640)  # the demo's vocabulary stays on the plain path
    assert chunkable_head(big, 1) is big.lm_head and chunkable_head(demo, 1) is None
    with torch.no_grad():
        assert chunkable_head(big, 1) is big.lm_head
        assert chunkable_head(demo, 10**6) is None
        assert chunkable_head(big, 1, mode="off") is None
    # through policy_forward: the head sees zero positions of the model's forward, then the real response
    # tokens: in chunks without gradients, at once (nothing recomputed) with gradients below the threshold
    ids, mask = _rollout_batch()
    n_real = int(mask[:, -T:].sum())
    seen = []
    handle = big.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        policy_forward(big, ids, mask, T, temperature=1.0)
    assert seen[0] == (B, 0, 32) and seen[1:] == [(1, 32)] * n_real  # the fixture's chunks: 1 token at V = 8192
    seen.clear()
    policy_forward(big, ids, mask, T, temperature=1.0)
    handle.remove()
    assert seen == [(B, 0, 32), (n_real, 32)]


def test_chunk_tokens_have_a_floor_at_large_vocabularies(monkeypatch):
    """The module's own defaults: 2**21 logits per chunk without gradients (65 tokens at V = 32,000),
    2**22 with, and never fewer than 64 tokens (a chunk of 16 at V = 128,000 would re-read the head weight
    32 times for 512 tokens); an explicit chunk_elements is taken as given."""
    monkeypatch.undo()  # the real constants, not the fixture's
    assert chunk_tokens(32000, grad=False) == 65 and chunk_tokens(32000, grad=True) == 131
    assert chunk_tokens(128000, grad=False) == 64 and chunk_tokens(128000, grad=True) == 64
    assert chunk_tokens(128000, grad=False, chunk_elements=2 * 128000) == 2
    assert chunk_tokens(10, grad=False, chunk_elements=3) == 1


def test_floor_chunks_equal_full_logits_and_bound_the_chunk(monkeypatch):
    """At V = 40,000 (2**21 // V = 52 < 64) the scoring forward's head sees chunks of 64 tokens and a ragged
    last one, and its log-probs equal the full-logits path's to float rounding."""
    monkeypatch.undo()
    vocab, rows, t = 40000, 2, 40
    model = _model("llama", vocab=vocab)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (rows, P + t), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # 75 real response tokens: one chunk of 64, one of 11
    seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    with torch.no_grad():
        set_logits_chunking(model, "auto")
        chunked, _, _ = policy_forward(model, ids, mask, t, temperature=0.7, entropy=False)
        handle.remove()
        set_logits_chunking(model, "off")
        plain, _, _ = policy_forward(model, ids, mask, t, temperature=0.7, entropy=False)
    assert seen[1:] == [64, 11]
    real = mask[:, -t:].bool()
    torch.testing.assert_close(chunked[real], plain[real], rtol=1e-5, atol=1e-5)
    assert (chunked[~real] == 0).all()

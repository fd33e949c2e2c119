"""The fused LM head (lit_rlhf.models.fused_head): its hand-written backward is the gradient of the plain
path (gradcheck in float64; against autograd for random shapes, chunk sizes and temperatures; in
bfloat16 too), the pure gradient function matches a hand computation, the route is taken only where it
applies, and the kept logits serve exactly one backward."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_rlhf.functional import label_logprobs_and_entropy, label_logprobs_and_entropy_grad_
from lit_rlhf.models import fused_head as fused_head_module
from lit_rlhf.models.fused_head import fusable_head, fused_head_token_scores
from lit_rlhf.models.lm_head import head_token_scores

H, V = 5, 11


def _inputs(n=7, dtype=torch.float64, bias=True, seed=0, vocab=V):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    hidden = torch.randn(n, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    return hidden, labels, weight, b


def test_gradient_of_logprob_and_entropy_by_hand():
    """V = 2, z = (0, log 3): p = (1/4, 3/4), E_p[z] = 3/4 log 3. Label 1, g = 2, h = -1:
    dL/dz = g (onehot - p) - h p (z - E_p[z])."""
    z = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)
    lse = torch.logsumexp(z, -1)
    entropy = lse - (torch.softmax(z, -1) * z).sum(-1)
    e_z = 0.75 * math.log(3.0)
    want = [2 * (0 - 0.25) + 0.25 * (0 - e_z), 2 * (1 - 0.75) + 0.75 * (math.log(3.0) - e_z)]
    g, h = torch.tensor([2.0], dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64)
    got = label_logprobs_and_entropy_grad_(z.clone(), torch.tensor([1]), lse, g, h, entropy)
    torch.testing.assert_close(got, torch.tensor([want], dtype=torch.float64))
    # temperature 2 halves the gradient with respect to the unscaled logits
    halved = label_logprobs_and_entropy_grad_(z.clone(), torch.tensor([1]), lse, g, temperature=2.0)
    torch.testing.assert_close(halved, torch.tensor([[-0.25, 0.25]], dtype=torch.float64))
    with pytest.raises(ValueError, match="entropy"):
        label_logprobs_and_entropy_grad_(z.clone(), torch.tensor([1]), lse, g, grad_entropy=h)


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize(("temperature", "bias", "chunk"), [(1.0, True, 3), (0.7, False, 1), (1.3, True, 64)])
def test_gradcheck_float64(entropy_grad, temperature, bias, chunk):
    """Recomputed logits (gradcheck runs several backwards through one graph; kept logits serve one,
    and are compared with autograd below)."""
    hidden, labels, weight, b = _inputs(bias=bias)

    def scores(hidden, weight, *maybe_bias):
        logp, ent, _ = fused_head_token_scores(
            hidden, labels, weight, maybe_bias[0] if maybe_bias else None, temperature=temperature,
            tokens_per_chunk=chunk, entropy=True, entropy_grad=entropy_grad,
        )  # fmt: skip
        return (logp, ent) if entropy_grad else logp

    assert torch.autograd.gradcheck(scores, (hidden, weight, *((b,) if bias else ())))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 9),
    chunk=st.integers(1, 10),
    temperature=st.sampled_from([0.5, 1.0, 1.7]),
    keep_logits=st.booleans(),
    entropy=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_equals_autograd_of_the_plain_path(n, chunk, temperature, keep_logits, entropy, seed):
    """Outputs equal; gradients of any weighting of log-probs and entropies equal autograd's (float64)."""
    gen = torch.Generator().manual_seed(seed)
    g, h = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    results = []
    for fused in (False, True):
        hidden, labels, weight, b = _inputs(n, seed=seed)
        if fused:
            logp, ent, top = fused_head_token_scores(
                hidden, labels, weight, b, temperature=temperature, tokens_per_chunk=chunk, entropy=entropy,
                argmax=True, keep_logits=keep_logits,
            )  # fmt: skip
        else:
            logits = torch.nn.functional.linear(hidden, weight, b)
            logp, ent = label_logprobs_and_entropy(logits, labels, temperature, entropy=entropy)
            top = logits.argmax(-1)
        loss = (g * logp).sum() + ((h * ent).sum() if entropy else 0.0)
        loss.backward()
        results.append((logp, ent, top, hidden.grad, weight.grad, b.grad))
    plain, fused = results
    assert torch.equal(fused[2], plain[2])
    for got, want in zip(fused, plain):
        if want is not None and want.dtype == torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bfloat16_weights_match_autograd():
    """Low-precision heads: logits in bfloat16 as the plain path, the weight gradient summed in float32."""
    results = []
    for fused in (False, True):
        hidden, labels, weight, b = _inputs(40, dtype=torch.bfloat16, vocab=64)
        if fused:
            logp, _, _ = fused_head_token_scores(hidden, labels, weight, b, tokens_per_chunk=7)
        else:
            logp = label_logprobs_and_entropy(torch.nn.functional.linear(hidden, weight, b), labels)[0]
        logp.sum().backward()
        assert logp.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
        results.append((logp, hidden.grad.float(), weight.grad.float(), b.grad.float()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for got, want in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_frozen_inputs_get_no_gradient_and_kept_logits_serve_one_backward():
    hidden, labels, weight, b = _inputs()
    weight.requires_grad_(False)
    logp, _, _ = fused_head_token_scores(hidden, labels, weight, b, tokens_per_chunk=2, keep_logits=True)
    logp.sum().backward(retain_graph=True)
    assert weight.grad is None and hidden.grad is not None and b.grad is not None
    with pytest.raises(RuntimeError, match="inplace"):  # the kept logits became their gradient
        logp.sum().backward()
    recomputed, _, _ = fused_head_token_scores(hidden, labels, weight, b, tokens_per_chunk=2)
    recomputed.sum().backward(retain_graph=True)
    recomputed.sum().backward()  # recomputing keeps nothing to overwrite: a second backward is fine
    with pytest.raises(ValueError, match="tokens_per_chunk"):
        fused_head_token_scores(hidden, labels, weight, b, tokens_per_chunk=0)


def test_route_only_for_plain_linear_heads_with_gradients(monkeypatch):
    calls = []
    real = fused_head_module.fused_head_token_scores
    monkeypatch.setattr(
        "lit_rlhf.models.lm_head.fused_head_token_scores", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    head = torch.nn.Linear(H, V, bias=False)
    hidden, labels = torch.randn(4, H), torch.randint(0, V, (4,))
    assert fusable_head(head, hidden)
    head_token_scores(head, hidden, labels)
    assert calls == [1]
    with torch.no_grad():
        head_token_scores(head, hidden, labels)  # no gradients: the chunked loop, nothing to fuse
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fusable_head(head, hidden)
        head_token_scores(head, hidden, labels)
    handle = head.register_forward_hook(lambda *a: None)
    assert not fusable_head(head, hidden)  # a hook must see the head's call
    handle.remove()

    class Quantised(torch.nn.Linear):
        pass

    assert not fusable_head(Quantised(H, V), hidden)
    assert calls == [1]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("chunking", ["auto", "on"])
def test_policy_forward_fused_equals_autograd_graph_and_off(kind, chunking, tokenizer_dir):
    """A real vocabulary (auto takes the head route, kept logits) and forced chunks (recomputed): log-probs,
    entropy and every parameter's gradient equal the fused_lm_head=False route and the full logits."""
    from conftest import gpt2_config, llama_config

    from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer, policy_forward

    vocab = 8192  # NO_GRAD_CHUNKING_VOCAB: "auto" takes the head route
    config = (gpt2_config if kind == "gpt2" else llama_config)(vocab)
    tokenizer = load_tokenizer(tokenizer_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (3, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[2, -3:] = 0
    real = mask[:, -5:].bool()
    results = {}
    for name, fields in {
        "fused": dict(logits_chunking=chunking),
        "graph": dict(logits_chunking=chunking, fused_lm_head=False),
        "full": dict(logits_chunking="off"),
    }.items():
        spec = ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0, **fields)
        model = build_causal_lm(spec, tokenizer).eval()
        logprobs, entropy, _ = policy_forward(model, ids, mask, 5, temperature=0.8)
        ((logprobs * real).sum() - 0.3 * (entropy * real).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (logprobs[real], entropy[real], grads)
    for name in ("graph", "full"):
        for got, want in zip(results["fused"][:2], results[name][:2]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert results["fused"][2].keys() == results[name][2].keys()
        for key, want in results[name][2].items():
            scale = want.abs().max().item()
            torch.testing.assert_close(results["fused"][2][key], want, rtol=1e-5, atol=1e-6 * scale, msg=key)


def test_model_spec_switch(tokenizer_dir):
    from conftest import llama_config

    from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer
    from lit_rlhf.models.lm_head import head_settings, set_logits_chunking

    with pytest.raises(ValueError, match="ModelSpec.fused_lm_head"):
        ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, fused_lm_head="no")
    tokenizer = load_tokenizer(tokenizer_dir)
    for fused in (True, False):
        spec = ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0, fused_lm_head=fused)
        assert head_settings(build_causal_lm(spec, tokenizer)) == {"force_chunks": False, "fused": fused}
    with pytest.raises(TypeError, match="fused_lm_head"):
        set_logits_chunking(torch.nn.Linear(2, 2), "auto", fused="yes")


def _micro_batch_grads(in_place: bool, hooked: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Three micro-batches' backwards into one weight; returns weight.grad and the ids of the (V, H) tensors
    autograd handed to AccumulateGrad (through a post-accumulate hook's view of ``.grad``)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(V, H, generator=gen, dtype=torch.float64))
    seen: list[int] = []
    if hooked:
        weight.register_post_accumulate_grad_hook(lambda p: seen.append(id(p.grad)))
    with fused_head_module.head_grads_in_place(in_place):
        for n, chunk in [(4, 3), (7, 2), (1, 5)]:
            hidden = torch.randn(n, H, generator=gen, dtype=torch.float64)
            labels = torch.randint(0, V, (n,), generator=gen)
            logp, ent, _ = fused_head_token_scores(
                hidden, labels, weight, temperature=0.9, tokens_per_chunk=chunk, entropy=True
            )
            accumulate = logp.grad_fn.next_functions[2][0]  # the weight's AccumulateGrad node
            handed: list[bool] = []
            handle = accumulate.register_prehook(lambda grads, handed=handed: handed.append(grads[0] is not None))
            buffer = weight.grad
            (logp.sum() + 0.3 * ent.sum()).backward()
            handle.remove()
            # in place from the second micro-batch on: autograd gets no (V, H) gradient to add
            assert handed == [buffer is None or not in_place or hooked]
            assert buffer is None or weight.grad is buffer
    return weight.grad, seen


def test_head_grads_in_place_accumulate_into_the_existing_gradient():
    plain, _ = _micro_batch_grads(in_place=False)
    in_place, _ = _micro_batch_grads(in_place=True)
    torch.testing.assert_close(in_place, plain, rtol=1e-12, atol=1e-12)
    # a gradient hook on the weight (DDP, FSDP, optimiser-in-backward) must see every micro-batch: no in place
    hooked, seen = _micro_batch_grads(in_place=True, hooked=True)
    assert len(seen) == 3
    torch.testing.assert_close(hooked, plain, rtol=1e-12, atol=1e-12)
    # torch.autograd.grad returns the gradient and leaves .grad alone, in the block too
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(V, H, generator=gen, dtype=torch.float64))
    weight.grad = torch.ones_like(weight)
    hidden = torch.randn(4, H, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (4,), generator=gen)
    want = torch.autograd.grad(fused_head_token_scores(hidden, labels, weight, tokens_per_chunk=3)[0].sum(), weight)
    with fused_head_module.head_grads_in_place():
        logp = fused_head_token_scores(hidden, labels, weight, tokens_per_chunk=3)[0].sum()
        got = torch.autograd.grad(logp, weight)
        logp = fused_head_token_scores(hidden, labels, weight, tokens_per_chunk=3)[0].sum()
        (only_hidden,) = torch.autograd.grad(logp, hidden)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert only_hidden.shape == hidden.shape
    assert torch.equal(weight.grad, torch.ones_like(weight))  # untouched by either call
    # outside the block (or a non-parameter weight) nothing changes
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    assert fused_head_module._in_place_target(weight) is None
    with fused_head_module.head_grads_in_place():
        assert fused_head_module._in_place_target(weight) is None
        parameter = torch.nn.Parameter(weight.detach().clone())
        assert fused_head_module._in_place_target(parameter) is parameter
        assert fused_head_module._in_place_target(torch.nn.Parameter(weight.detach().bfloat16())) is None
    assert fused_head_module._in_place_target(parameter) is None

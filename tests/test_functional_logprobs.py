"""logprobs_from_logits / entropy_from_logits: hand values, float32 math on bf16 input, temperature,
chunking (same numbers, no float32 copy kept for backward)."""

import math

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import lit_rlhf.functional.logprobs as logprobs_module
from lit_rlhf.functional import entropy_from_logits, logprobs_from_logits

# float32 results against float64 references
F32 = {"atol": 1e-5, "rtol": 1e-5}


def _reference_logprobs(logits, labels, temperature=1.0):
    z = logits.double() / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_logprob_hand_computed():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])
    labels = torch.tensor([[2, 0]])
    # label 2: 3 - logsumexp(1, 2, 3) = 3 - (3 + log(1 + e^-1 + e^-2)) = -log(1.503214724) = -0.407605964
    # label 0: 1 - 3.407605964 = -2.407605964
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels), torch.tensor([[-0.407605964, -2.407605964]])
    )
    # temperature 2: z = (0.5, 1, 1.5); label 2: 1.5 - (1.5 + log(1 + e^-0.5 + e^-1)) = -log(1.974410) = -0.680269
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels, temperature=2.0)[0, 0],
        torch.tensor(-0.680269),
        atol=1e-6,
        rtol=0,
    )


def test_entropy_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    # uniform over 2: log 2 = 0.693147; p = (1/4, 3/4): 0.25 * log 4 + 0.75 * log(4/3) = 0.346574 + 0.215762 = 0.562335
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([[0.693147, 0.562335]]), atol=1e-6, rtol=0
    )
    # temperature 1e6 flattens (0, log 3) to uniform: log 2
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature=1e6)[0, 1], torch.tensor(math.log(2.0)), atol=1e-6, rtol=0
    )


def test_bf16_logits_computed_in_float32():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 1000, generator=gen) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 1000, (3, 5), generator=gen)
    lp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    assert lp.dtype == ent.dtype == torch.float32
    # bf16 inputs are exact in float32, so float32 math must match the float64 reference to float32 rounding
    # (|logp| ~ 10: ~1e-6). A bf16 log_softmax is off by ~1e-2 (8 mantissa bits), which this tolerance rejects:
    ref_lp, ref_ent = _reference_logprobs(logits, labels), _reference_entropy(logits)
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=0)
    naive = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert (naive.double() - ref_lp).abs().max() > 2e-5


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_matches_scaled_softmax(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    torch.testing.assert_close(
        logprobs_from_logits(logits, labels, temperature).double(),
        _reference_logprobs(logits, labels, temperature),
        **F32,
    )
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature).double(), _reference_entropy(logits, temperature), **F32
    )


def test_entropy_grows_with_temperature():
    logits = torch.randn(1, 3, 20, generator=torch.Generator().manual_seed(2))
    ents = [entropy_from_logits(logits, t) for t in (0.25, 1.0, 4.0)]
    assert (ents[0] < ents[1]).all() and (ents[1] < ents[2]).all()
    assert (ents[2] < math.log(20)).all()


@pytest.mark.parametrize("chunk_elements", [1, 7 * 13, 3 * 7 * 13, 1 << 24])
def test_chunking_gives_same_values_and_grads(monkeypatch, chunk_elements):
    # 1 and 7*13 slice each sequence along time, 3*7*13 slices whole sequences, 2**24 is one slice.
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(4, 9, 13, generator=gen, requires_grad=True)
    logits = full[:, 1:-1]  # non-contiguous (B, 7, V) slice, as the PPO module takes response logits
    labels = torch.randint(0, 13, (4, 7), generator=gen)
    weights = torch.randn(4, 7, generator=gen)
    lp = logprobs_from_logits(logits, labels, 0.8)
    ent = entropy_from_logits(logits, 0.8)
    ((lp + ent) * weights).sum().backward()
    ref_full = full.detach().double().requires_grad_()
    ref_logits = ref_full[:, 1:-1]
    ref = _reference_logprobs(ref_logits, labels, 0.8) + _reference_entropy(ref_logits, 0.8)
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close((lp + ent).double(), ref.detach(), **F32)
    torch.testing.assert_close(full.grad.double(), ref_full.grad, **F32)


def test_no_float32_copy_kept_for_backward(monkeypatch):
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 4 * 50)
    logits = torch.randn(2, 8, 50).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 50, (2, 8))

    def float32_elements_saved():
        saved = []
        with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            logprobs_from_logits(logits, labels).sum() + entropy_from_logits(logits).sum()
        return sum(t.numel() for t in saved if t.dtype == torch.float32)

    # With checkpointing autograd keeps only the bf16 input views.
    assert float32_elements_saved() == 0
    # Without it, every slice's float32 copy would be kept: the check above is not vacuous.
    monkeypatch.setattr(logprobs_module, "checkpoint", lambda fn, *args, use_reentrant: fn(*args))
    assert float32_elements_saved() >= logits.numel()


def test_padding_positions_are_independent():
    # A NaN logit row at a padded position must not touch the other positions.
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 6, generator=gen)
    labels = torch.randint(0, 6, (2, 3), generator=gen)
    garbage = torch.cat([logits, torch.full((2, 2, 6), float("nan"))], dim=1)
    garbage_labels = torch.cat([labels, torch.zeros(2, 2, dtype=torch.long)], dim=1)
    torch.testing.assert_close(
        logprobs_from_logits(garbage, garbage_labels)[:, :3], logprobs_from_logits(logits, labels)
    )
    torch.testing.assert_close(entropy_from_logits(garbage)[:, :3], entropy_from_logits(logits))


def test_bad_inputs():
    logits = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(logits, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        logprobs_from_logits(logits, torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.zeros(1, 2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        entropy_from_logits(torch.zeros(2, 5))
    assert logprobs_from_logits(torch.zeros(0, 3, 5), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)

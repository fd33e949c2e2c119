"""The unsharded export copy of an FSDP model (lit_rlhf.modules.distributed): a model rebuilt on the meta
device and materialised with ``to_empty`` gets its weights from the gathered state dict and its
non-persistent buffers (RoPE's ``inv_freq``, which no state dict carries) from the live model, so the
export's finiteness check never reads uninitialised memory."""

from __future__ import annotations

import torch
from conftest import llama_config
from transformers import AutoConfig, AutoModelForCausalLM

from lit_rlhf.guards import check_finite_weights
from lit_rlhf.modules.distributed import _empty_like, copy_unloaded_buffers


def test_unloaded_buffers_come_from_the_live_model():
    fields = llama_config()
    torch.manual_seed(0)
    live = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    state = live.state_dict()
    fresh = _empty_like(live, torch.float32)
    fresh.load_state_dict(state)
    unloaded = [name for name, _ in fresh.named_buffers() if name not in state]
    assert unloaded, "the check needs a non-persistent buffer (RoPE's inv_freq)"
    with torch.no_grad():
        for name, buffer in fresh.named_buffers():
            if name in unloaded:
                buffer.fill_(float("nan"))  # what uninitialised memory may hold
    copy_unloaded_buffers(fresh, live, state.keys())
    live_buffers = dict(live.named_buffers())
    for name, buffer in fresh.named_buffers():
        assert torch.equal(buffer, live_buffers[name]), name
    check_finite_weights(fresh, "export")  # raises on a non-finite parameter or buffer
    ids = torch.randint(0, 300, (2, 7))
    torch.testing.assert_close(fresh(ids).logits, live(ids).logits, rtol=0, atol=0)


def test_a_tied_lora_model_stays_tied_in_the_export_copy(tokenizer_dir):
    """GPT-2's tied embeddings under LoRA: ``to_empty`` gave the input and output embeddings separate
    tensors, so the FSDP export merged an untied model (an lm_head of its own, tie_word_embeddings false)."""
    from conftest import gpt2_config

    from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer

    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
    live = build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=0, lora=lora),
                           load_tokenizer(tokenizer_dir))  # fmt: skip
    fresh = _empty_like(live, torch.float32)
    fresh.load_state_dict(live.state_dict())
    base = fresh.get_base_model()
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
    merged = fresh.merge_and_unload()
    assert merged.config.tie_word_embeddings
    assert merged.get_output_embeddings().weight is merged.get_input_embeddings().weight

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

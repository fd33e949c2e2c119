"""The parts of the vLLM engine that need no vLLM (run in the main environment): its arguments, the weights
it would load (LoRA merged on copies), the manifest check and the timeout around a sync."""

from __future__ import annotations

import copy
import importlib.util
import time

import pytest
import torch
from conftest import llama_config

from lit_rlhf.engines import build_engine, engine_hparams
from lit_rlhf.engines.vllm import VLLMEngine
from lit_rlhf.engines.vllm_weights import call_with_timeout, check_manifest, hf_weights
from lit_rlhf.models import ModelSpec, build_causal_lm, load_tokenizer


@pytest.fixture
def model(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    return build_causal_lm(ModelSpec(config=llama_config(len(tok)), tokenizer=tokenizer_dir, seed=0), tok)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dtype="fp8"), "dtype must be one of"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in"),
        (dict(kv_cache_gib=0), "kv_cache_gib must be a whole number of GiB >= 1"),
        (dict(kv_cache_gib=1.5), "kv_cache_gib must be a whole number"),
        (dict(max_model_len=1), "max_model_len must be >= 2"),
        (dict(sleep_level=2), "sleep_level must be 0 or 1"),
        (dict(sync_timeout_s=0), "sync_timeout_s must be > 0"),
        (dict(lora_sync="both"), "lora_sync must be .merged. or .adapter."),
        (dict(engine_kwargs={"seed": 3, "max_num_seqs": 4}), r"engine_kwargs may not set \[.seed.\]"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=f"VLLMEngine: {message}"):
        VLLMEngine(**kwargs)


def test_the_engine_is_named_vllm_and_round_trips_through_hparams():
    engine = build_engine({"class_path": "vllm", "init_args": {"dtype": "bfloat16", "kv_cache_gib": 2}})
    assert isinstance(engine, VLLMEngine) and not engine.uses_policy
    again = build_engine(engine_hparams(engine))
    assert isinstance(again, VLLMEngine) and again.init_args() == engine.init_args()
    assert isinstance(build_engine("vllm"), VLLMEngine)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_missing_vllm_is_named(model, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ImportError, match=r"VLLMEngine needs vLLM \(pip install 'lit-rlhf\[vllm\]'"):
            VLLMEngine().setup(model, tok)


def test_plain_weights_are_the_state_dict(model):
    weights = dict(hf_weights(model))
    state = model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)


def test_lora_weights_are_merged_on_copies_in_the_base_models_names(model):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    weights = dict(hf_weights(lora))
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()  # peft's own merge, as the reference
    assert weights.keys() == merged.keys() == model.state_dict().keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(weights[q], model.state_dict()[q]), "the adapter's delta is in"
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items()), "the actor is untouched"


def test_the_manifest_names_what_differs(model):
    weights = hf_weights(model)
    manifest = check_manifest(weights, None)
    assert check_manifest(weights, manifest) == manifest
    name, tensor = weights[0]
    with pytest.raises(ValueError, match=rf"missing \['{name}'\].*nothing was loaded"):
        check_manifest(weights[1:], manifest)
    with pytest.raises(ValueError, match=r"extra \['bonus'\]"):
        check_manifest([*weights, ("bonus", tensor)], manifest)
    with pytest.raises(ValueError, match=rf"changed \['{name}: \(1,"):
        check_manifest([(name, tensor[:1]), *weights[1:]], manifest)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        check_manifest([(name, tensor.bfloat16()), *weights[1:]], manifest)


def test_a_call_that_hangs_times_out_and_an_error_names_the_call():
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"the reload did not finish within 0.2 s"):
        call_with_timeout(lambda: time.sleep(3), 0.2, "the reload")
    assert time.perf_counter() - start < 2

    def refuse():
        raise KeyError("lm_head.weight")

    with pytest.raises(RuntimeError, match=r"the reload failed after .* s: KeyError: 'lm_head.weight'") as info:
        call_with_timeout(refuse, 5, "the reload")
    assert isinstance(info.value.__cause__, KeyError)
    value, seconds = call_with_timeout(lambda: 42, 5, "the reload")
    assert value == 42 and seconds >= 0

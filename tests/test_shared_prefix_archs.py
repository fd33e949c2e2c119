"""Which architectures the shared-prompt layout runs on (models/shared_prefix.py ``SHARED_PREFIX_MODEL_TYPES``):
every vouched-for one gives the padded layout's log-probs and scores; the others (ALiBi, GPT-Neo's local
attention, Falcon's sequence classifier) are refused with a reason, so ``auto`` keeps the padded layout."""

from __future__ import annotations

import pytest
import torch

from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    build_score_model,
    load_tokenizer,
    packed_response_logprobs,
    packed_sequence_scores,
    response_logprobs,
    sequence_scores,
    shared_prefix_layout,
)
from lit_rlhf.models.shared_prefix import SHARED_PREFIX_MODEL_TYPES, refuse_unsupported_shared_prefix

PAD = 0
DECODER = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128,
)  # fmt: skip
NO_KV = {k: v for k, v in DECODER.items() if k != "num_key_value_heads"}
GPT = dict(n_embd=32, n_layer=2, n_head=4, n_positions=128)
NEO = dict(hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128)
FALCON = dict(model_type="falcon", hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
# one tiny config per vouched-for model type; sliding windows off (a window is refused on its own)
VOUCHED = {
    "codegen": dict(rotary_dim=4, **GPT),
    "cohere": dict(logit_scale=0.5, **DECODER),
    "gemma": dict(head_dim=8, **DECODER),
    "gpt2": GPT,
    "gpt_bigcode": GPT,
    "gpt_neo": dict(attention_types=[[["global"], 2]], **NEO),
    "gpt_neox": NO_KV,
    "gptj": dict(rotary_dim=4, **GPT),
    "granite": dict(logits_scaling=4.0, **DECODER),
    "llama": DECODER,
    "mistral": dict(sliding_window=None, **DECODER),
    "mixtral": dict(sliding_window=None, num_local_experts=2, num_experts_per_tok=1, **DECODER),
    "olmo": DECODER,
    "olmo2": DECODER,
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128),
    "persimmon": NO_KV,
    "phi": NO_KV,
    "phi3": DECODER,
    "qwen2": DECODER,
    "qwen2_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, **DECODER),
    "qwen3": dict(head_dim=8, **DECODER),
    "stablelm": DECODER,
    "starcoder2": dict(sliding_window=None, **DECODER),
}  # fmt: skip
NO_SCORE_MODEL = {"codegen", "cohere", "granite"}  # transformers has no ...ForSequenceClassification


def _group(vocab: int):
    """One prompt of 12 tokens and its K = 3 responses of 2, 4 and 3 tokens: (3, 16) right-padded rows."""
    g = torch.Generator().manual_seed(0)
    prompt, lengths = torch.randint(3, vocab, (12,), generator=g), (2, 4, 3)
    ids = torch.full((3, 16), PAD)
    attention_mask, prompt_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, : 12 + n] = torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)])
        attention_mask[i, : 12 + n], prompt_mask[i, :12] = 1, 1
    return ids, attention_mask, prompt_mask, attention_mask - prompt_mask


def test_every_vouched_for_model_type_has_a_measured_config():
    assert set(VOUCHED) == SHARED_PREFIX_MODEL_TYPES


@pytest.mark.parametrize("model_type", sorted(VOUCHED))
def test_vouched_for_architectures_pack_exactly(tokenizer_dir, model_type):
    tokenizer = load_tokenizer(tokenizer_dir)
    spec = ModelSpec(config={"model_type": model_type, **VOUCHED[model_type]}, tokenizer=tokenizer_dir, seed=0)
    ids, attention_mask, prompt_mask, response_mask = _group(len(tokenizer))
    builders = [build_causal_lm] + ([] if model_type in NO_SCORE_MODEL else [build_score_model])
    for build in builders:
        model = build(spec, tokenizer).eval()
        layout = shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, PAD, ids.numel())
        with torch.no_grad():
            if build is build_causal_lm:
                padded = response_logprobs(model, ids, attention_mask, response_mask)[0]
                packed = packed_response_logprobs(model, layout)[0]
            else:
                padded, packed = sequence_scores(model, ids, attention_mask), packed_sequence_scores(model, layout)
        torch.testing.assert_close(packed, padded, rtol=0, atol=2e-5)


REFUSED = {
    "gpt_neo local": ("lm", dict(model_type="gpt_neo", attention_types=[[["global", "local"], 1]], window_size=4, **NEO),
                      r"GPT-Neo local attention layers \(window 4"),
    "mpt": ("lm", dict(model_type="mpt", d_model=32, n_layers=2, n_heads=4, max_seq_len=128), "model_type 'mpt'"),
    "bloom": ("lm", dict(model_type="bloom", hidden_size=32, n_layer=2, n_head=4), "model_type 'bloom'"),
    "falcon alibi": ("lm", dict(alibi=True, **FALCON), "model_type 'falcon'"),
    "falcon score model": ("rm", FALCON, "model_type 'falcon'"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_other_architectures_keep_the_padded_layout(tokenizer_dir, case):
    # packed, these gave other log-probs / scores (GPT-Neo local 3e-2, MPT 7e-2, Falcon's classifier 2e-4) or
    # crashed (BLOOM, Falcon with ALiBi: "too many values to unpack")
    kind, config, reason = REFUSED[case]
    tokenizer = load_tokenizer(tokenizer_dir)
    build = build_causal_lm if kind == "lm" else build_score_model
    model = build(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer)
    ids, _, prompt_mask, response_mask = _group(len(tokenizer))
    assert shared_prefix_layout(model, "auto", ids, prompt_mask, response_mask, PAD, ids.numel()) is None
    with pytest.raises(ValueError, match=f"shared_prefix='on' cannot run with {reason}"):
        shared_prefix_layout(model, "on", ids, prompt_mask, response_mask, PAD, ids.numel())
    with pytest.raises(ValueError, match=f"scoring.shared_prefix='on' cannot run the actor with {reason}"):
        refuse_unsupported_shared_prefix("scoring.shared_prefix", "on", actor=model)

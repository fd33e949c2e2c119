"""Model building, the pad-token policy, save/load round trips, LoRA as its own reference, freezing."""

from __future__ import annotations

import pytest
import torch
from conftest import gpt2_config, make_corpus
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    build_score_model,
    causal_lm_logits,
    causal_lm_logits_and_hidden,
    export_pretrained,
    frozen_copy,
    load_tokenizer,
    position_ids_from_mask,
    reference_logits_context,
    token_values,
)

LORA = {"r": 4, "lora_alpha": 8}
BUILDERS = {"policy": build_causal_lm, "score": build_score_model}
AUTO = {"policy": AutoModelForCausalLM, "score": AutoModelForSequenceClassification}
IDS = torch.tensor([[1, 1, 7, 8, 9, 10], [7, 8, 9, 10, 11, 0]])  # pad id 1 (left), EOS id 0 (right row)
MASK = (IDS != 1).long()


def outputs(model, role: str) -> torch.Tensor:
    """Logits (policy) or per-token values (score) in eval mode (GPT-2 has dropout; from_config trains)."""
    model.eval()
    with torch.no_grad():
        if role == "policy":
            return causal_lm_logits(model, IDS, MASK)
        return token_values(model, IDS, MASK)


def perturb(model, seed: int = 0) -> None:
    """Add seeded noise to every trainable parameter (LoRA B starts at zero, so the adapters matter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype))


@pytest.mark.parametrize("role", ["policy", "score"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_inline_build_is_reproducible_with_its_seed(tiny_config, tokenizer, tokenizer_dir, role, lora):
    def build(seed):
        return BUILDERS[role](
            ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=seed, lora=lora), tokenizer
        )

    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = build(5).state_dict()
    assert torch.equal(torch.rand(3), expected_draw)  # the global RNG stream is left as it was
    second, other = build(5).state_dict(), build(6).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_inline_config_takes_sizes_and_special_ids_from_the_tokenizer(tiny_config, tokenizer, tokenizer_dir):
    config = {k: v for k, v in tiny_config.items() if k != "vocab_size"}
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir), tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert (model.config.pad_token_id, model.config.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
    )
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id


@pytest.mark.parametrize("pad", [None, "<|endoftext|>"], ids=["no_pad", "pad_is_eos"])
def test_pad_policy_adds_a_dedicated_pad_and_resizes_embeddings(tiny_config, tmp_path, pad):
    # pad = EOS (Qwen2.5's base tokenizers) would hide every real EOS from masks and block EOS when sampling
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(make_corpus(), trainer)
    raw = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token=pad)
    assert raw.pad_token == pad
    raw.save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == len(raw) + 1

    fields = {**tiny_config, "vocab_size": len(raw)}
    pretrained = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    pretrained.save_pretrained(tmp_path / "model")
    spec = ModelSpec(name_or_path=str(tmp_path / "model"), tokenizer=str(tmp_path / "tok"), seed=0)
    for model in (build_causal_lm(spec, tokenizer), build_score_model(spec, tokenizer)):
        embeddings = model.get_input_embeddings().weight
        assert embeddings.shape[0] == len(tokenizer) == model.config.vocab_size
        assert torch.equal(embeddings[: len(raw)], pretrained.get_input_embeddings().weight)
        assert model.config.pad_token_id == tokenizer.pad_token_id
    assert build_causal_lm(spec, tokenizer).get_output_embeddings().weight.shape[0] == len(tokenizer)


def test_larger_embeddings_are_not_shrunk(tiny_config, tokenizer, tokenizer_dir):
    spec = ModelSpec(config={**tiny_config, "vocab_size": 400}, tokenizer=tokenizer_dir)
    assert build_causal_lm(spec, tokenizer).get_input_embeddings().weight.shape[0] == 400


@pytest.mark.parametrize("role", ["policy", "score"])
@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_export_round_trip_gives_identical_outputs(
    tiny_config, tokenizer, tokenizer_dir, tmp_path, role, lora
):
    model = BUILDERS[role](
        ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=0, lora=lora), tokenizer
    )
    model.eval()
    perturb(model)
    before = outputs(model, role)

    folder = export_pretrained(model, tokenizer, tmp_path / "export")
    assert not (folder / "adapter_config.json").exists()  # merged: plain weights, no peft needed
    # Merging happened on a copy: the original keeps its (unmerged) adapters and its outputs.
    torch.testing.assert_close(outputs(model, role), before, atol=0, rtol=0)
    assert isinstance(model, PeftModel) == (lora is not None)

    plain = AUTO[role].from_pretrained(folder).eval()
    torch.testing.assert_close(outputs(plain, role), before, atol=1e-5, rtol=0)
    # The hub loading path, offline: ModelSpec(name_or_path=folder) with the exported tokenizer.
    spec = ModelSpec(name_or_path=str(folder))
    reloaded_tokenizer = load_tokenizer(spec.tokenizer_name_or_path)
    assert reloaded_tokenizer.pad_token_id == tokenizer.pad_token_id
    rebuilt = BUILDERS[role](spec, reloaded_tokenizer).eval()
    torch.testing.assert_close(outputs(rebuilt, role), before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("role", ["policy", "score"])
@pytest.mark.parametrize("lora", [None, LORA])
def test_models_loaded_from_a_folder_train_with_their_dropout(tokenizer, tokenizer_dir, tmp_path, role, lora):
    # from_pretrained gives eval mode; an SFT or reward model loaded that way must still train with the
    # dropout of its config (GPT-2's default dropout is 0.1).
    config = gpt2_config(len(tokenizer))
    source = BUILDERS[role](ModelSpec(config=config, tokenizer=tokenizer_dir), tokenizer)
    export_pretrained(source, tokenizer, tmp_path / "m")
    model = BUILDERS[role](ModelSpec(name_or_path=str(tmp_path / "m"), lora=lora), tokenizer)
    assert all(module.training for module in model.modules())
    with torch.no_grad():
        assert not torch.equal(outputs_in_current_mode(model, role), outputs_in_current_mode(model, role))


def outputs_in_current_mode(model, role: str) -> torch.Tensor:
    if role == "policy":
        return model(input_ids=IDS, attention_mask=MASK).logits
    return token_values(model, IDS, MASK)


def test_critic_from_a_policy_export_keeps_the_backbone_and_adds_a_seeded_head(
    tiny_config, tokenizer, tokenizer_dir, tmp_path
):
    policy = build_causal_lm(ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=0), tokenizer).eval()
    perturb(policy)
    export_pretrained(policy, tokenizer, tmp_path / "sft")
    spec = ModelSpec(name_or_path=str(tmp_path / "sft"), seed=1)
    critic = build_score_model(spec, tokenizer).eval()
    with torch.no_grad():
        _, policy_hidden = causal_lm_logits_and_hidden(policy, IDS, MASK)
        backbone = getattr(critic, critic.base_model_prefix)
        critic_hidden = backbone(
            input_ids=IDS, attention_mask=MASK, position_ids=position_ids_from_mask(MASK)
        )
        torch.testing.assert_close(critic_hidden.last_hidden_state, policy_hidden, atol=1e-5, rtol=0)
        torch.testing.assert_close(token_values(critic, IDS, MASK), critic.score(policy_hidden).squeeze(-1))
    assert critic.config.num_labels == 1
    assert torch.equal(build_score_model(spec, tokenizer).score.weight, critic.score.weight)


def test_lora_actor_with_adapters_disabled_is_the_reference(tiny_config, tokenizer, tokenizer_dir):
    plain = build_causal_lm(ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=3), tokenizer)
    actor = build_causal_lm(
        ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=3, lora=LORA), tokenizer
    )
    reference = frozen_copy(plain)
    perturb(actor)
    adapted = outputs(actor, "policy")
    with reference_logits_context(actor):
        disabled = outputs(actor, "policy")
    torch.testing.assert_close(disabled, outputs(reference, "policy"), atol=1e-6, rtol=0)
    assert (adapted - disabled).abs().max() > 1e-3  # the perturbed adapters do change the policy
    assert torch.equal(outputs(actor, "policy"), adapted)  # adapters are back on after the block

    # One copy of the base weights: the actor holds the base parameters plus the LoRA matrices only.
    lora_numel = sum(p.numel() for name, p in actor.named_parameters() if "lora_" in name)
    assert lora_numel > 0
    assert (
        sum(p.numel() for p in actor.parameters()) == sum(p.numel() for p in plain.parameters()) + lora_numel
    )
    assert all(("lora_" in name) == p.requires_grad for name, p in actor.named_parameters())


def test_reference_context_is_a_no_op_for_a_plain_model(tiny_config, tokenizer, tokenizer_dir):
    model = build_causal_lm(ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=0), tokenizer)
    with reference_logits_context(model):
        inside = outputs(model, "policy")
    assert torch.equal(inside, outputs(model, "policy"))


def test_lora_score_model_trains_its_head(tiny_config, tokenizer, tokenizer_dir):
    spec = ModelSpec(
        config=tiny_config, tokenizer=tokenizer_dir, seed=0, lora={**LORA, "modules_to_save": []}
    )
    model = build_score_model(spec, tokenizer)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("score" in name for name in trainable)
    assert all("lora_" in name or "score" in name for name in trainable)
    assert spec.lora["modules_to_save"] == []  # peft extends the list in place: the spec must not see it


def test_frozen_copy_is_independent_and_frozen(tiny_config, tokenizer, tokenizer_dir):
    model = build_causal_lm(ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=0), tokenizer).train()
    frozen = frozen_copy(model)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert model.training and all(p.requires_grad for p in model.parameters())
    frozen.train()  # a frozen copy put back in train mode stays frozen
    assert not any(p.requires_grad for p in frozen.parameters())
    assert not {p.data_ptr() for p in model.parameters()} & {p.data_ptr() for p in frozen.parameters()}
    before = outputs(frozen, "policy")
    perturb(model)
    assert torch.equal(outputs(frozen, "policy"), before)


def test_gradient_checkpointing_recomputes_and_keeps_lora_gradients(tiny_config, tokenizer, tokenizer_dir):
    config = {**tiny_config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}  # GPT-2 dropout off
    config = config if tiny_config["model_type"] == "gpt2" else tiny_config

    def lora_grads(checkpointing: bool):
        spec = ModelSpec(
            config=config, tokenizer=tokenizer_dir, seed=0, lora=LORA, gradient_checkpointing=checkpointing
        )
        model = build_causal_lm(spec, tokenizer).train()
        perturb(model)
        layer = next(m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        calls = []
        # transformers checkpoints the layer's forward (not __call__), so watch a submodule inside it.
        next(layer.children()).register_forward_hook(lambda *_: calls.append(1))
        causal_lm_logits(model, IDS, MASK).float().pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, len(calls), model

    plain, plain_calls, _ = lora_grads(False)
    checkpointed, checkpointed_calls, model = lora_grads(True)
    assert (plain_calls, checkpointed_calls) == (1, 2)  # forward, then the recompute in backward
    assert model.config.use_cache is False
    for name, grad in plain.items():
        assert grad.abs().sum() > 0
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)


def test_dtype_applies_to_parameters_and_values_stay_float32(tiny_config, tokenizer, tokenizer_dir):
    spec = ModelSpec(config=tiny_config, tokenizer=tokenizer_dir, seed=0, dtype="bfloat16")
    model = build_score_model(spec, tokenizer)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert outputs(model, "score").dtype == torch.float32


@pytest.mark.parametrize(
    "lora",
    [
        {"target_modules": ["c_attn", "lm_head"]},
        {"target_modules": ["c_attn"], "modules_to_save": ["wte"]},
        {"target_modules": r".*(c_attn|lm_head)"},
    ],
)
def test_lora_on_an_embedding_tied_to_the_other_is_refused(tokenizer, tokenizer_dir, lora):
    # one adapter on the shared matrix's two uses cannot be merged: the export would not be the trained model
    spec = ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, lora={"r": 2, **lora})
    with pytest.raises(ValueError, match=r"lora\.(target_modules|modules_to_save) includes .*tie_word_embeddings"):
        build_causal_lm(spec, tokenizer)
    untied = ModelSpec(config={**gpt2_config(), "tie_word_embeddings": False}, tokenizer=tokenizer_dir, lora={"r": 2, **lora})
    assert build_causal_lm(untied, tokenizer) is not None
    assert build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, lora={"r": 2, "target_modules": ["c_attn"]}), tokenizer)


def test_the_models_further_stop_tokens_are_kept_and_end_rollouts(tokenizer, tokenizer_dir, tmp_path):
    # an instruct model's generation config stops at its end of turn besides EOS (Gemma's <end_of_turn>)
    from lit_rlhf.models import export_pretrained, generation_stop_ids
    from lit_rlhf.modules.online_generation import with_model_stops
    from lit_rlhf.rollout import GenerationSettings

    end_of_turn = 7
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model(**gpt2_config(len(tokenizer))))
    source.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn, tokenizer.pad_token_id]
    source.save_pretrained(tmp_path / "instruct")
    model = build_causal_lm(ModelSpec(name_or_path=str(tmp_path / "instruct"), tokenizer=tokenizer_dir), tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id  # the tokenizer's, first
    assert generation_stop_ids(model) == [tokenizer.eos_token_id, end_of_turn]  # the pad (never sampled) left out
    export_pretrained(model, tokenizer, tmp_path / "export")
    assert generation_stop_ids(AutoModelForCausalLM.from_pretrained(tmp_path / "export")) == [tokenizer.eos_token_id, end_of_turn]
    settings = with_model_stops(GenerationSettings(stop_token_ids=[9]), model, tokenizer)
    assert settings.stop_token_ids == [9, end_of_turn]  # every engine ends a response there
    plain = build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir), tokenizer)
    assert generation_stop_ids(plain) == [tokenizer.eos_token_id]
    assert with_model_stops(GenerationSettings(), plain, tokenizer) == GenerationSettings()

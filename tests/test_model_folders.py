"""Building models from what users point them at (``lit_rlhf.models.loading``, ``lit_rlhf.models.folders``):
dropout off everywhere, a saved peft adapter folder as the starting policy, a classifier with several
labels as a reward model, and a tokenizer that ships as remote code."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import llama_config
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    build_score_model,
    disable_dropout,
    export_pretrained,
    load_tokenizer,
    reference_logits_context,
)

IDS = torch.tensor([[7, 8, 9, 10, 11, 12, 13, 14]])
OPT = dict(model_type="opt", vocab_size=322, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=128, word_embed_proj_dim=32)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [OPT, {**llama_config(), "attention_dropout": 0.1}],  # OPT's config default dropout=0.1 (facebook/opt-*)
    ids=["opt dropout", "llama attention_dropout"],
)
def test_disable_dropout_zeroes_the_probabilities_modules_copied_from_the_config(tokenizer, tokenizer_dir, config):
    # OPT's decoder layers and Llama's attention keep their probability as a float, not an nn.Dropout
    model = build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer)
    disable_dropout(model)
    model.train()  # the update forwards run in train mode
    logits = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        logits.append(model(input_ids=IDS).logits)
    assert torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[0], model.eval()(input_ids=IDS).logits, rtol=0, atol=1e-6)
    assert not [name for name, m in model.named_modules() for k, v in vars(m).items()
                if isinstance(v, float) and "dropout" in k and v > 0]  # fmt: skip


@pytest.fixture
def adapter_folder(tokenizer, tokenizer_dir, tmp_path):
    """(folder, logits of IDS): a LoRA adapter saved with peft's ``save_pretrained`` (its adapter_config.json
    names the base folder), its B matrices random so that it is not the base's policy."""
    config = {**llama_config(len(tokenizer)), "tie_word_embeddings": False}
    export_pretrained(build_causal_lm(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=0), tokenizer), tokenizer,
                      tmp_path / "base")  # fmt: skip
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p))
        lora.save_pretrained(tmp_path / "adapter")
        tokenizer.save_pretrained(tmp_path / "adapter")
        base_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(input_ids=IDS).logits
        logits = lora.eval()(input_ids=IDS).logits
    assert (logits - base_logits).abs().max() > 0.1
    return str(tmp_path / "adapter"), logits


def test_an_adapter_folder_starts_from_the_adapters_policy_fully_trainable(tokenizer, adapter_folder, tmp_path):
    folder, expected = adapter_folder
    model = build_causal_lm(ModelSpec(name_or_path=folder), tokenizer)
    assert not isinstance(model, PeftModel) and all(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
    export_pretrained(model, tokenizer, tmp_path / "export")  # was a misleading peft-version error
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)


def test_new_lora_on_an_adapter_folder_trains_on_top_of_the_adapters_policy(tokenizer, adapter_folder):
    # was: the saved adapter replaced by the new one, i.e. training (and the reference) from the base model
    folder, expected = adapter_folder
    model = build_causal_lm(ModelSpec(name_or_path=folder, lora={"r": 4, "lora_alpha": 8}), tokenizer).eval()
    assert isinstance(model, PeftModel)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
        with reference_logits_context(model):  # the LoRA actor's reference: the adapter's policy too
            torch.testing.assert_close(model(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)


def test_a_classifier_with_several_labels_is_refused_as_a_reward_model(tokenizer, tmp_path):
    config = AutoConfig.for_model(**{**llama_config(len(tokenizer)), "num_labels": 2})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two_labels")
    message = rf"one-label score head \(num_labels=1\); {tmp_path / 'two_labels'} has 2 labels"
    with pytest.raises(ValueError, match=message):
        build_score_model(ModelSpec(name_or_path=str(tmp_path / "two_labels")), tokenizer)


def test_a_remote_code_tokenizer_loads_with_trust_remote_code(tokenizer, tokenizer_dir, tmp_path):
    from lit_rlhf.modules import SFTModule

    folder = tmp_path / "custom"
    export_pretrained(build_causal_lm(ModelSpec(config=llama_config(), tokenizer=tokenizer_dir, seed=0), tokenizer),
                      tokenizer, folder)  # fmt: skip
    # the folder's tokenizer class is its own code (as InternLM's, ChatGLM's or Qwen-1's are)
    (folder / "tokenization_custom.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    fields = json.loads((folder / "tokenizer_config.json").read_text())
    auto_map = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    fields |= {"tokenizer_class": "CustomTokenizer", "auto_map": auto_map}
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))
    with pytest.raises(OSError, match="custom code"):
        SFTModule(ModelSpec(name_or_path=str(folder)))
    single = SFTModule(ModelSpec(name_or_path=str(folder), trust_remote_code=True))
    assert type(single.tokenizer).__name__ == "CustomTokenizer"
    module = _critic_free(folder)
    assert type(module.tokenizer).__name__ == "CustomTokenizer"
    assert load_tokenizer(str(folder), trust_remote_code=True).get_vocab() == module.tokenizer.get_vocab()


def _critic_free(folder):
    from lit_rlhf.modules import CriticFreeModule

    return CriticFreeModule(
        actor=ModelSpec(name_or_path=str(folder), trust_remote_code=True), reward_fn="ppo_rewards:the_count",
        generation={"max_new_tokens": 4, "num_samples": 2},
    )  # fmt: skip


def test_the_cli_says_so_in_one_error_line(tokenizer, tokenizer_dir, tmp_path):
    from test_cli_errors import ROOT, error_line, lit_rlhf

    config = AutoConfig.for_model(**{**llama_config(len(tokenizer)), "num_labels": 2})
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two_labels")
    run = {
        "trainer": {"max_steps": 1, "logger": False, "enable_checkpointing": False},
        "model": {"class_path": "lit_rlhf.modules.RewardModelModule",
                  "init_args": {"model": {"name_or_path": str(tmp_path / "two_labels"), "tokenizer": tokenizer_dir}}},
        "data": {"class_path": "lit_rlhf.data.PreferenceDataModule",
                 "init_args": {"tokenizer": tokenizer_dir, "train_path": str(ROOT / "data/tiny/prefs.jsonl")}},
    }  # fmt: skip
    (tmp_path / "rm.yaml").write_text(json.dumps(run))
    line = error_line(lit_rlhf(tmp_path, "fit", "--config", str(tmp_path / "rm.yaml")))
    assert "needs a one-label score head (num_labels=1)" in line and "has 2 labels" in line


@pytest.mark.parametrize("task, refused", [("CAUSAL_LM", True), ("SEQ_CLS", False)])
def test_a_causal_lm_adapter_as_a_reward_model_is_refused(tmp_path, task, refused):
    """A peft adapter folder is checked by its task: a causal LM's adapter would get a new, random score head."""
    import json

    from lit_rlhf.models import ModelSpec
    from lit_rlhf.rewards import check_trained_head

    (tmp_path / "adapter_config.json").write_text(json.dumps({"task_type": task, "base_model_name_or_path": "x"}))
    spec = ModelSpec(name_or_path=str(tmp_path))
    if refused:
        with pytest.raises(ValueError, match="peft adapter of task CAUSAL_LM, not a reward model's"):
            check_trained_head(spec, "reward_model")
    else:
        check_trained_head(spec, "reward_model")

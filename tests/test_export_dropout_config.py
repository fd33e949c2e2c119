"""An export of a model trained with its dropout off (DPO, PPO, GRPO, online DPO: ``disable_dropout``) carries
its source's dropout probabilities in ``config.json``: a later stage that trains from it (a reward model or
critic on a DPO export) trains with the source's dropout. The live model keeps training without dropout,
its config's probabilities included (GPT-Neo and Persimmon read them at forward time)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import gpt2_config

from lit_rlhf.models import ModelSpec, build_causal_lm, build_score_model, disable_dropout, export_pretrained

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}
GPT2_DROPOUT = {"attn_pdrop": 0.1, "embd_pdrop": 0.2, "resid_pdrop": 0.3, "summary_first_dropout": 0.4}


def dropouts(config: dict) -> dict:
    return {k: v for k, v in config.items() if k in GPT2_DROPOUT}


@pytest.mark.parametrize("lora", [None, LORA])
@pytest.mark.parametrize("build", [build_causal_lm, build_score_model])
def test_export_writes_the_source_dropout_and_the_live_model_keeps_none(tokenizer, tokenizer_dir, tmp_path, lora, build):
    model = build(ModelSpec(config={**gpt2_config(), **GPT2_DROPOUT}, tokenizer=tokenizer_dir, seed=0, lora=lora), tokenizer)
    disable_dropout(model)
    disable_dropout(model)  # twice (e.g. a frozen copy of a module's actor): the source values stay recorded
    export_pretrained(model, tokenizer, tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert dropouts(written) == GPT2_DROPOUT
    assert not [k for k in written if k.startswith("lit_rlhf")]
    assert dropouts(model.config.to_dict()) == dict.fromkeys(GPT2_DROPOUT, 0.0), "the live config changed"
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    # the next stage trains from the export with the source's dropout
    reloaded = build_score_model(ModelSpec(name_or_path=str(tmp_path / "export")), tokenizer)
    assert {m.p for m in reloaded.modules() if isinstance(m, torch.nn.Dropout)} == {0.1, 0.2, 0.3}


def test_a_model_without_disabled_dropout_exports_its_config_unchanged(tokenizer, tokenizer_dir, tmp_path):
    model = build_causal_lm(ModelSpec(config={**gpt2_config(), **GPT2_DROPOUT}, tokenizer=tokenizer_dir), tokenizer)
    export_pretrained(model, tokenizer, tmp_path / "export")
    assert dropouts(json.loads((tmp_path / "export" / "config.json").read_text())) == GPT2_DROPOUT


def test_an_online_modules_export_carries_the_actors_source_dropout(tokenizer_dir, tmp_path):
    from ppo_helpers import tiny_critic_free

    module = tiny_critic_free(tokenizer_dir, {**gpt2_config(), **GPT2_DROPOUT})
    assert {m.p for m in module.actor.modules() if isinstance(m, torch.nn.Dropout)} == {0.0}
    module.export_pretrained(str(tmp_path / "export"))
    assert dropouts(json.loads((tmp_path / "export" / "actor" / "config.json").read_text())) == GPT2_DROPOUT

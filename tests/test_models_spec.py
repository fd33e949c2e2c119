"""ModelSpec: validation messages and use as a jsonargparse (LightningCLI) type from YAML."""

from __future__ import annotations

import pytest
import torch
from jsonargparse import ArgumentParser

from lit_rlhf.models import ModelSpec


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "exactly one of `name_or_path`"),
        (
            dict(name_or_path="a", config={"model_type": "gpt2"}, tokenizer="t"),
            "exactly one of `name_or_path`",
        ),
        (dict(config={"n_layer": 2}, tokenizer="t"), "needs a `model_type` key"),
        (dict(config={"model_type": "gpt2"}), "ModelSpec.tokenizer: required"),
        (dict(name_or_path="a", dtype="float64"), "ModelSpec.dtype"),
        (
            dict(name_or_path="a", lora={"rank": 4, "alpha": 8, "r": 4}),
            r"unknown LoraConfig field\(s\) \['alpha', 'rank'\]",
        ),
        (dict(name_or_path="a", lora={"task_type": "CAUSAL_LM"}), "do not set `task_type`"),
        (
            dict(name_or_path="a", lora={"r": 0}),
            "ModelSpec.lora.r: the LoRA rank must be a positive integer, got 0",
        ),
        # peft's own check, re-raised with the field name: a regex target cannot be combined with layer indices.
        (
            dict(name_or_path="a", lora={"target_modules": ".*q_proj", "layers_to_transform": [0]}),
            "ModelSpec.lora: invalid",
        ),
    ],
)
def test_invalid_specs_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec(**kwargs)


def test_valid_specs_and_defaults():
    hub = ModelSpec(name_or_path="org/model")
    assert hub.tokenizer_name_or_path == "org/model"
    assert hub.torch_dtype == torch.float32
    assert (hub.lora, hub.seed, hub.gradient_checkpointing, hub.trust_remote_code) == (
        None,
        None,
        False,
        False,
    )
    inline = ModelSpec(config={"model_type": "llama"}, tokenizer="tok", dtype="bfloat16", lora={"r": 4})
    assert inline.tokenizer_name_or_path == "tok"
    assert inline.torch_dtype == torch.bfloat16


@pytest.fixture
def parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--model", type=ModelSpec)
    return parser


def test_parsed_from_yaml(parser):
    yaml = """
model:
  config: {model_type: gpt2, n_layer: 2}
  tokenizer: tok_dir
  dtype: bfloat16
  lora: {r: 4, lora_alpha: 8, target_modules: [c_attn]}
  seed: 3
"""
    spec = parser.instantiate(parser.parse_string(yaml)).model
    assert spec == ModelSpec(
        config={"model_type": "gpt2", "n_layer": 2},
        tokenizer="tok_dir",
        dtype="bfloat16",
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]},
        seed=3,
    )


def test_yaml_errors_reach_the_user(parser):
    with pytest.raises(Exception, match="model.dtype"):
        parser.parse_string("model:\n  name_or_path: a\n  dtype: float64\n")
    with pytest.raises(ValueError, match=r"unknown LoraConfig field\(s\) \['rank'\]"):
        parser.instantiate(parser.parse_string("model:\n  name_or_path: a\n  lora: {rank: 4}\n"))


def test_field_docs_show_in_help(parser, capsys):
    parser.print_help()
    help_text = " ".join(capsys.readouterr().out.split())
    assert "hub id or local folder" in help_text
    assert "seed of every random initialisation" in help_text


def test_coerce_accepts_what_a_python_user_passes():
    spec = ModelSpec(name_or_path="a")
    assert ModelSpec.coerce(spec) is spec
    assert ModelSpec.coerce("runs/x") == ModelSpec(name_or_path="runs/x")
    assert ModelSpec.coerce({"name_or_path": "b", "dtype": "bfloat16"}) == ModelSpec(name_or_path="b", dtype="bfloat16")
    with pytest.raises(TypeError, match=r"actor: unknown ModelSpec field\(s\) \['path'\]"):
        ModelSpec.coerce({"path": "b"}, "actor")
    with pytest.raises(TypeError, match="reward_model: expected a ModelSpec"):
        ModelSpec.coerce(3, "reward_model")
    with pytest.raises(ValueError, match="exactly one of"):
        ModelSpec.coerce({}, "actor")

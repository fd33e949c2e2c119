"""configs/real/*.yaml parse with the CLI's types, and their models build config-only (meta device).

Nothing is downloaded: each hub name is mapped to its published architecture below, the model is
built on the meta device from ``AutoConfig.for_model``, LoRA targets are applied to it, and the FSDP
wrapping units (transformer blocks) are found. Fast, so not marked ``distributed``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import lit_rlhf.data  # noqa: F401  (class_path short names)
import lit_rlhf.modules  # noqa: F401
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules.distributed import block_classes

CONFIGS = sorted((Path(__file__).parents[1] / "configs" / "real").glob("*.yaml"))

QWEN25_1_5B = dict(
    model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
)  # fmt: skip
LLAMA31_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
)  # fmt: skip
LLAMA32_1B = dict(
    model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
)  # fmt: skip
# The published config.json of each model the configs name (and the RM export of rm_qwen2.5_1.5b).
ARCHITECTURES = {
    "Qwen/Qwen2.5-1.5B-Instruct": QWEN25_1_5B,
    "runs/real/rm_qwen2.5_1.5b/export": QWEN25_1_5B,
    "meta-llama/Llama-3.1-8B-Instruct": LLAMA31_8B,
    "Skywork/Skywork-Reward-Llama-3.1-8B-v0.2": LLAMA31_8B,
    "meta-llama/Llama-3.2-1B-Instruct": LLAMA32_1B,
}
SPEC_ROLES = {"model": "score", "actor": "causal", "reward_model": "score", "critic": "score", "reference": "causal"}


def cli_parser() -> ArgumentParser:
    """The parser LightningCLI builds for ``lit-rlhf fit`` (subclass mode), without instantiating."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--seed_everything", type=int | bool, default=True)
    parser.add_class_arguments(Trainer, "trainer", fail_untyped=False)
    parser.add_subclass_arguments(LightningModule, "model")
    parser.add_subclass_arguments(LightningDataModule, "data")
    return parser


def instantiate(ns: Namespace):
    module_name, _, cls_name = ns.class_path.rpartition(".")
    cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
    return cls(**vars(ns.get("init_args", Namespace())))


def build_meta(spec: ModelSpec, role: str) -> torch.nn.Module:
    config = AutoConfig.for_model(**ARCHITECTURES[spec.name_or_path], num_labels=1)
    auto = AutoModelForCausalLM if role == "causal" else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = auto.from_config(config, dtype=spec.torch_dtype)
    if spec.lora is not None:
        from peft import LoraConfig, get_peft_model

        task = "CAUSAL_LM" if role == "causal" else "SEQ_CLS"
        model = get_peft_model(model, LoraConfig(task_type=task, **spec.lora))
    return model


def test_there_are_real_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_real_config_parses_and_builds_on_meta(path):
    cfg = cli_parser().parse_args(["--config", str(path)])
    # the strategy is one the modules recognise, with FSDP2 sizes given explicitly
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ in ("ModelParallelStrategy", "FSDPStrategy")
    if type(strategy).__name__ == "ModelParallelStrategy":
        devices = cfg.trainer.devices * cfg.trainer.num_nodes
        assert strategy._data_parallel_size == devices and strategy._tensor_parallel_size == 1
    specs = {k: v for k, v in vars(cfg.model.init_args).items() if k in SPEC_ROLES and v is not None}
    assert specs, f"{path.name}: no model spec"
    for key, ns in specs.items():
        spec = ModelSpec(**vars(ns))
        assert spec.name_or_path in ARCHITECTURES, f"{path.name}: {key} {spec.name_or_path} not in the table"
        model = build_meta(spec, SPEC_ROLES[key])
        n_params = sum(p.numel() for p in model.parameters())
        assert 1e9 < n_params < 9e9, (key, n_params)
        if spec.lora is not None:
            # LoRA targets exist in the architecture and only adapters (and the score head) train
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            assert 0 < trainable < 0.05 * n_params, (key, trainable)
        # FSDP finds the decoder layers to wrap as units (one per layer)
        blocks = block_classes(model)
        assert len(blocks) == 1
        assert sum(isinstance(m, tuple(blocks)) for m in model.modules()) == model.config.num_hidden_layers

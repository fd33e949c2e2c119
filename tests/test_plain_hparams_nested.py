"""Hyper-parameters are stored as plain values at any depth: an online module's reward-model ensemble given
as a list of ``ModelSpec`` objects writes no ``!!python/object`` tag into ``hparams.yaml`` and its checkpoint
loads weights-only; ``plain_hparams`` (SFT, RM, DPO) converts nested dataclasses the same way."""

from __future__ import annotations

import dataclasses

import torch
import yaml
from conftest import gpt2_config
from lightning.pytorch import LightningModule
from lightning.pytorch.core.saving import load_hparams_from_yaml, save_hparams_to_yaml
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import CriticFreeModule
from lit_rlhf.modules.base import plain_hparams


def contains_dataclass(value) -> bool:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return True
    if isinstance(value, dict):
        return any(contains_dataclass(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(contains_dataclass(v) for v in value)


def test_an_ensemble_of_spec_objects_is_stored_as_plain_dicts(tokenizer_dir, tmp_path):
    members = [ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=k) for k in (1, 2)]
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), reward_fn=None, reward_model={"ensemble": members, "aggregation": "mean"},
        max_rollouts=1, update={"epochs": 1},
    )  # fmt: skip
    for store in (module.hparams, module.hparams_initial):
        assert not contains_dataclass(dict(store))
    assert module.hparams["reward_model"]["ensemble"][1]["seed"] == 2
    path = tmp_path / "hparams.yaml"
    save_hparams_to_yaml(path, module.hparams_initial)
    assert "!!python" not in path.read_text()
    assert load_hparams_from_yaml(path)["reward_model"]["ensemble"][0]["seed"] == 1
    fit = trainer(tmp_path, enable_checkpointing=True, default_root_dir=str(tmp_path))
    fit.fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    fit.save_checkpoint(tmp_path / "last.ckpt")
    torch.load(tmp_path / "last.ckpt", weights_only=True)  # no library class to unpickle
    reloaded = CriticFreeModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert reloaded.rewards.members is not None and len(reloaded.rewards.members) == 2


def test_plain_hparams_converts_dataclasses_inside_containers():
    class Module(LightningModule):
        def __init__(self, models, pair) -> None:
            super().__init__()
            self.save_hyperparameters()

    spec = ModelSpec(name_or_path="a")
    module = Module({"members": [spec, {"inner": spec}]}, (spec, 1))
    plain_hparams(module, extra=[spec])
    for store in (module.hparams, module.hparams_initial):
        assert not contains_dataclass(dict(store))
        assert store["models"]["members"][1]["inner"]["name_or_path"] == "a"
        assert store["pair"] == (dataclasses.asdict(spec), 1) and store["extra"][0]["name_or_path"] == "a"
    yaml.safe_dump({k: v for k, v in module.hparams.items() if k != "pair"})

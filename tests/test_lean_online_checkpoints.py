"""Online checkpoints hold each weight once, and a LoRA model's trained weights only: the rollout engine's
model is a plain reference (not a second ``_engine_model.*`` copy of the actor), the frozen base weights of
a LoRA actor and of a LoRA critic are rebuilt from their specs on resume, and checkpoints of earlier
versions that still hold ``_engine_model.*`` keys load and resume."""

from __future__ import annotations

import warnings

import torch
from conftest import gpt2_config
from lightning.pytorch import Callback
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer

from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import CriticFreeModule, PPOModule

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"], "fan_in_fan_out": True}


class SaveAfterRollout(Callback):
    """Save a checkpoint after the first rollout, while the engine holds the actor (teardown drops it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if module.rollouts_done == 1:
            trainer.save_checkpoint(self.path)


def lora_spec(tokenizer_dir: str, seed: int = 0) -> ModelSpec:
    return ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=seed, lora=LORA)


def fit_and_save(module, tokenizer_dir: str, tmp_path, max_rollouts: int = 1) -> str:
    path = str(tmp_path / "mid.ckpt")
    module.max_rollouts = max_rollouts
    trainer(tmp_path, callbacks=[SaveAfterRollout(path)]).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    return path


def test_a_lora_actors_checkpoint_holds_no_engine_copy_and_no_frozen_base(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), actor=lora_spec(tokenizer_dir), update={"epochs": 1})
    state = torch.load(fit_and_save(module, tokenizer_dir, tmp_path), weights_only=False)["state_dict"]
    assert not [k for k in state if k.startswith("_engine_model.")]
    frozen = {f"actor.{n}" for n, p in module.actor.named_parameters() if not p.requires_grad}
    trainable = {f"actor.{n}" for n, p in module.actor.named_parameters() if p.requires_grad}
    assert frozen and not frozen & set(state), "the actor's frozen LoRA base weights were checkpointed"
    assert trainable <= set(state)
    assert "_engine_model" not in dict(module.named_children())


def test_a_lora_critics_frozen_base_is_left_out_and_rebuilt_on_load(tokenizer_dir, tmp_path):
    module = tiny_ppo(
        tokenizer_dir, gpt2_config(), actor=lora_spec(tokenizer_dir), critic=lora_spec(tokenizer_dir, seed=1),
        update={"epochs": 1, "num_minibatches": 1},
    )  # fmt: skip
    path = fit_and_save(module, tokenizer_dir, tmp_path)
    state = torch.load(path, weights_only=False)["state_dict"]
    frozen = {f"critic.{n}" for n, p in module.critic.named_parameters() if not p.requires_grad}
    assert frozen and not frozen & set(state), "the critic's frozen LoRA base weights were checkpointed"
    assert any(k.startswith("critic.") and "lora_" in k for k in state)
    reloaded = PPOModule.load_from_checkpoint(path)
    for name, weight in reloaded.critic.state_dict().items():
        torch.testing.assert_close(weight, module.critic.state_dict()[name], msg=name)


def test_an_old_checkpoint_with_engine_model_keys_loads_and_resumes(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), update={"epochs": 1})
    path = fit_and_save(module, tokenizer_dir, tmp_path / "run")
    checkpoint = torch.load(path, weights_only=False)
    actor = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("actor.")}
    checkpoint["state_dict"].update({"_engine_model." + k[len("actor.") :]: v for k, v in actor.items()})
    old = str(tmp_path / "old.ckpt")
    torch.save(checkpoint, old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = CriticFreeModule.load_from_checkpoint(old)
    assert not [w for w in caught if "_engine_model" in str(w.message)]
    assert "_engine_model" not in dict(loaded.named_children())
    for name, weight in module.actor.state_dict().items():
        torch.testing.assert_close(loaded.actor.state_dict()[name], weight, msg=name)
    resumed = tiny_critic_free(tokenizer_dir, gpt2_config(), update={"epochs": 1}, max_rollouts=2)
    trainer(tmp_path / "resumed").fit(resumed, prompt_loader(tokenizer_dir, n=8, batch_size=2), ckpt_path=old)
    assert resumed.rollouts_done == 2

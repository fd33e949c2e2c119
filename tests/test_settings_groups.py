"""The settings groups' generic checks and defaults: field types from the annotations (Python dicts and YAML
read by ``yaml.safe_load`` included), each module's default K where ``generation.num_samples`` is not given
(Python, CLI and checkpoints), the adaptive KL controller's horizon against a rollout's rows, and the options
PPO-Penalty does not read."""

from __future__ import annotations

import pickle

import pytest
import yaml
from conftest import gpt2_config
from ppo_helpers import adamw, prompt_loader, tiny_critic_free, tiny_ppo, trainer

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing
from lit_rlhf.data import PromptDataModule
from lit_rlhf.modules import CriticFreeModule, OnlineDPOModule, PPOModule
from lit_rlhf.modules import online_settings as S
from lit_rlhf.modules.online_dpo import PreferenceSettings
from lit_rlhf.rollout import GenerationSettings

# -- field types -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (S.KLSettings, {"coef": "0.1"}, "kl.coef must be a number, got '0.1'"),
        (S.KLSettings, {"coef": 0.1, "target": "6"}, "kl.target must be a number or None, got '6'"),
        (S.KLSettings, {"horizon": 2.5}, "kl.horizon must be an integer, got 2.5"),
        (S.KLSettings, {"estimator": 3}, "kl.estimator must be one of ['k1', 'abs', 'k2', 'k3'], got 3"),
        (S.GAESettings, {"whiten": "false"}, "advantage.whiten must be a bool (true or false), got 'false'"),
        (S.GAESettings, {"whiten_rewards": 1}, "advantage.whiten_rewards must be a bool (true or false), got 1"),
        (S.AdvantageSettings, {"gamma": "0.9"}, "advantage.gamma must be a number, got '0.9'"),
        (S.UpdateSettings, {"epochs": 2.0}, "update.epochs must be an integer, got 2.0"),
        (S.UpdateSettings, {"num_minibatches": True}, "update.num_minibatches must be an integer, got True"),
        (S.UpdateSettings, {"max_grad_norm": "1"}, "update.max_grad_norm must be a number or None, got '1'"),
        (S.UpdateSettings, {"is_correction": {"cap": "2"}}, "update.is_correction.cap must be a number, got '2'"),
        (S.CriticFreeUpdate, {"old_logprobs_from_update": "no"}, "update.old_logprobs_from_update must be a bool"),
        (S.PPOUpdate, {"vf_coef": None}, "update.vf_coef must be a number, got None"),
        (S.ScoringSettings, {"forward_batch_size": 4.0}, "scoring.forward_batch_size must be an integer, got 4.0"),
        (S.ScoringSettings, {"bucketing": {"enabled": "no"}}, "scoring.bucketing.enabled must be a bool (true or false), got 'no'"),
        (S.ScoringSettings, {"bucketing": {"token_budget": "8"}}, "scoring.bucketing.token_budget must be an integer or None"),
        (S.SampleSettings, {"every": 1.5}, "samples.every must be an integer, got 1.5"),
        (S.EvaluationSettings, {"greedy": "yes"}, "evaluation.greedy must be a bool (true or false), got 'yes'"),
        (Bucketing, {"split_cost": 1.5}, "bucketing.split_cost must be an integer, a string or None, got 1.5"),
        (PreferenceSettings, {"beta": "0.1"}, "preference.beta must be a number, got '0.1'"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(cls, values, message):
    with pytest.raises(TypeError) as err:
        cls.coerce(values)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)  # as the earlier checks of the generation group raised


def test_types_are_checked_as_annotated_ints_pass_for_floats_and_the_choices_stay_the_groups():
    kl = S.KLSettings.coerce({"coef": 1, "target": 3, "horizon": 100})  # an int where a float is expected
    assert (kl.coef, kl.target, kl.horizon) == (1, 3, 100)
    assert S.ScoringSettings.coerce({"bucketing": False}).bucketing.enabled is False  # the bool form of bucketing
    assert S.ScoringSettings.coerce({"bucketing": {"split_cost": None}}).bucketing.split_cost is None
    with pytest.raises(ValueError, match="needs a critic"):  # a string not among the choices: the group's message
        S.AdvantageSettings.coerce({"estimator": "gae"})
    assert GenerationSettings.coerce({"top_p": 1}).top_p == 1
    with pytest.raises(TypeError, match=r"^generation.max_new_tokens must be an integer, got 4.0$"):
        GenerationSettings.coerce({"max_new_tokens": 4.0})


def test_yaml_safe_load_strings_are_refused_by_the_module_naming_the_key(tokenizer_dir):
    config = yaml.safe_load("kl: {coef: 5e-2}\nupdate: {ent_coef: 1e-3}")  # PyYAML reads both as strings
    with pytest.raises(TypeError, match=r"^CriticFreeModule: kl.coef must be a number, got '5e-2'$"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), kl=config["kl"])
    with pytest.raises(TypeError, match=r"^CriticFreeModule: update.ent_coef must be a number, got .1e-3.$"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), update=config["update"])
    with pytest.raises(TypeError, match=r"^PPOModule: advantage.whiten must be a bool \(true or false\), got 'false'$"):
        tiny_ppo(tokenizer_dir, gpt2_config(), advantage={"whiten": "false"})


# -- the default K -----------------------------------------------------------------------------------------


def test_each_module_puts_its_default_k_where_num_samples_is_not_given(tokenizer_dir):
    actor = {"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0}
    common = dict(actor=actor, reward_fn="ppo_rewards:the_count", samples={"every": 0})
    unset = ({"max_new_tokens": 8}, {"max_new_tokens": 8, "num_samples": None}, GenerationSettings(max_new_tokens=8))
    for generation in (None, *unset):
        for advantage in ({"estimator": "grpo"}, {"estimator": "reinforce_pp"}):
            module = CriticFreeModule(**common, advantage=advantage, generation=generation)
            assert module.num_samples == 4, (generation, advantage)
            assert module.hparams["generation"]["num_samples"] == 4
        assert OnlineDPOModule(**common, generation=generation, scoring={"forward_batch_size": 8}).num_samples == 2
        assert PPOModule(**common, generation=generation).num_samples == 1
    assert unset[2].num_samples == 1 and unset[2].num_samples_unset  # outside a module it reads 1
    # a K given is kept, an explicit 1 included (REINFORCE++ needs no group)
    for generation in ({"num_samples": 1}, GenerationSettings(num_samples=1)):
        module = CriticFreeModule(**common, advantage={"estimator": "reinforce_pp"}, generation=generation)
        assert module.num_samples == 1
        with pytest.raises(ValueError, match="needs generation.num_samples >= 2 .* got num_samples=1"):
            CriticFreeModule(**common, generation=generation)
    assert CriticFreeModule(**common, generation={"num_samples": 6}, scoring={"forward_batch_size": 6}).num_samples == 6
    # an unset K survives pickling (a checkpoint that stored the group itself)
    assert pickle.loads(pickle.dumps(GenerationSettings())).num_samples_unset


def test_the_cli_gives_the_modules_default_k_to_a_generation_group_without_num_samples(tokenizer_dir, prompt_file, tmp_path):
    from lightning.pytorch import LightningDataModule, LightningModule

    from lit_rlhf.cli import LitRLHFCLI

    def config(**init_args):
        return {
            "trainer": {"logger": False, "enable_checkpointing": False},
            "model": {"class_path": "lit_rlhf.modules.CriticFreeModule", "init_args": {
                "actor": {"config": gpt2_config(), "tokenizer": tokenizer_dir},
                "reward_fn": "ppo_rewards:the_count", **init_args,
            }},
            "data": {"class_path": "lit_rlhf.data.PromptDataModule",
                     "init_args": {"tokenizer": tokenizer_dir, "train_path": str(prompt_file)}},
        }  # fmt: skip

    cases = [
        (config(generation={"max_new_tokens": 8, "temperature": 1.0}), [], 4),
        (config(), ["--model.init_args.generation.max_new_tokens=8"], 4),
        (config(generation={"max_new_tokens": 8, "num_samples": 2}), [], 2),
        (config(generation={"max_new_tokens": 8}), ["--model.init_args.generation.num_samples=3"], 3),
    ]
    for i, (values, extra, k) in enumerate(cases):
        path = tmp_path / f"grpo_{i}.yaml"
        path.write_text(yaml.safe_dump(values))
        cli = LitRLHFCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         run=False, auto_configure_optimizers=False, args=["--config", str(path), *extra])  # fmt: skip
        assert cli.model.num_samples == k, (values, extra)
        assert cli.model.hparams["generation"]["num_samples"] == k


def test_a_checkpoint_keeps_the_default_k_it_was_trained_with(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), generation={"max_new_tokens": 4}, max_rollouts=1,
                              update={"epochs": 1, "num_minibatches": 1})  # fmt: skip
    assert module.num_samples == 4
    fit = trainer(tmp_path, logger=False)
    fit.fit(module, prompt_loader(tokenizer_dir, n=2, batch_size=2))
    fit.save_checkpoint(tmp_path / "k.ckpt")
    loaded = CriticFreeModule.load_from_checkpoint(tmp_path / "k.ckpt", actor_optimizer=adamw(1e-2))
    assert loaded.num_samples == 4 and loaded.generation == module.generation


# -- the adaptive KL controller's horizon ------------------------------------------------------------------


def test_a_kl_horizon_a_rollout_would_overrun_is_refused_before_the_first_rollout(tokenizer_dir, prompt_file, tmp_path):
    # 4 prompts x K = 4 = 16 rows: the controller's factor 1 - 0.2 x 16 / horizon must stay > 0, horizon >= 4
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), kl={"coef": 0.05, "target": 6.0, "horizon": 3})
    message = (r"CriticFreeModule: kl.horizon=3 is too small for a rollout of 16 rows \(the data's batch_size 4 x "
               r"generation.num_samples 4 x 1 process\(es\)\).* use kl.horizon >= 4")  # fmt: skip
    with pytest.raises(ValueError, match=message):  # a plain DataLoader: checked when training starts
        trainer(tmp_path, logger=False).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert module.rollouts_done == 0
    data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=4)
    with pytest.raises(ValueError, match=message):  # a data module: checked when the fit sets up
        trainer(tmp_path, logger=False).fit(module, data)
    dpo = OnlineDPOModule(actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0},
                          reward_fn="ppo_rewards:the_count", generation={"max_new_tokens": 4}, samples={"every": 0},
                          kl={"target": 6.0, "horizon": 1})  # fmt: skip
    with pytest.raises(ValueError, match=r"OnlineDPOModule: kl.horizon=1 is too small for a rollout of 8 rows"):
        trainer(tmp_path, logger=False).fit(dpo, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    # the smallest horizon the message names runs: the controller's largest step keeps its coefficient > 0
    controller = F.AdaptiveKLController(0.05, target=6.0, horizon=4)
    controller.update(0.0, n_steps=16)
    assert controller.value == pytest.approx(0.05 * (1 - 0.2 * 16 / 4))


# -- PPO-Penalty -------------------------------------------------------------------------------------------


def test_kl_penalty_refuses_the_clip_it_does_not_apply():
    with pytest.raises(ValueError, match=r"update.clip_coef_high must be None with policy_loss='kl_penalty'"):
        S.PPOUpdate.coerce({"policy_loss": "kl_penalty", "clip_coef_high": 0.28})
    assert S.PPOUpdate.coerce({"policy_loss": "clip", "clip_coef_high": 0.28}).clip_coef_high == 0.28
    assert S.PPOUpdate.coerce({"policy_loss": "kl_penalty"}).clip_coef_high is None

"""The online modules' settings groups: self-checking dataclasses, plain dicts, one registry of names, the
earlier flat arguments named with their new place (Python, CLI, checkpoints)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from conftest import gpt2_config
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf import functional as F
from lit_rlhf.cli_errors import moved_keys_message
from lit_rlhf.modules import CriticFreeModule, OnlineRLModule, PPOModule
from lit_rlhf.modules import online_migration as M
from lit_rlhf.modules import online_settings as S
from lit_rlhf.rollout import GenerationSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "cls, values, message",
    [
        (S.UpdateSettings, {"epochs": 0}, "update.epochs must be > 0, got 0"),
        (S.UpdateSettings, {"clip_coef": float("nan")}, "update.clip_coef must be a finite number"),
        (S.UpdateSettings, {"clip_coef_high": -0.1}, "update.clip_coef_high must be > 0 or None"),
        (S.UpdateSettings, {"loss_aggregation": "sum"}, "update.loss_aggregation must be one of"),
        (S.PPOUpdate, {"policy_loss": "dpo"}, "update.policy_loss must be one of ['clip', 'kl_penalty']"),
        (S.PPOUpdate, {"clip_coef_value": 0.0}, "update.clip_coef_value must be > 0"),
        (S.PPOUpdate, {"policy_loss": "kl_penalty", "importance_sampling_level": "sequence"}, "'token' with policy_loss"),
        (S.KLSettings, {"coef": -1.0}, "kl.coef must be >= 0, got -1.0"),
        (S.KLSettings, {"coef": 0.0, "target": 3.0}, "kl.coef must be > 0 with an adaptive target"),
        (S.KLSettings, {"estimator": "k4"}, "kl.estimator must be one of ['k1', 'abs', 'k2', 'k3']"),
        (S.ScoringSettings, {"forward_batch_size": 0}, "scoring.forward_batch_size must be > 0"),
        (S.ScoringSettings, {"on_nonfinite": "ignore"}, "scoring.on_nonfinite must be one of"),
        (S.ScoringSettings, {"bucketing": {"min_saving": 1.5}}, "bucketing.min_saving must be in [0, 1)"),
        (S.GAESettings, {"gae_lambda": 1.5}, "advantage.gae_lambda must be in [0, 1]"),
        (S.AdvantageSettings, {"estimator": "gae"}, "needs a critic; use lit_rlhf.modules.PPOModule"),
        (S.AdvantageSettings, {"estimator": "ppo"}, "advantage.estimator must be one of"),
        (S.SampleSettings, {"every": -1}, "samples.every must be >= 0"),
        (S.EvaluationSettings, {"generation": {"beams": 2}}, "evaluation.generation: unknown GenerationSettings field"),
        (S.EvaluationSettings, {"generation": {"max_new_tokens": 0}}, "generation.max_new_tokens must be >= 1"),
        (S.ScoringSettings, {"missing_eos_penalty": -1.0}, "scoring.missing_eos_penalty must be >= 0 or None"),
        (GenerationSettings, {"temperature": float("nan")}, "generation.temperature must be a finite number"),
        (GenerationSettings, {"temperature": float("inf")}, "generation.temperature must be a finite number"),
        (GenerationSettings, {"max_new_tokens": 4.0}, "generation.max_new_tokens must be an integer, got 4.0"),
        (GenerationSettings, {"num_samples": 2.5}, "generation.num_samples must be an integer"),
        (GenerationSettings, {"top_k": True}, "generation.top_k must be an integer"),
        (GenerationSettings, {"top_p": "0.9"}, "generation.top_p must be a number"),
    ],
)
def test_each_group_checks_itself_naming_the_key(cls, values, message):
    with pytest.raises((ValueError, TypeError)) as err:
        cls.coerce(values)
    assert message in str(err.value)


def test_groups_take_dicts_instances_and_none_and_name_renamed_fields():
    assert S.UpdateSettings.coerce(None) == S.UpdateSettings()
    assert S.UpdateSettings.coerce({"epochs": 2}).epochs == 2
    given = S.KLSettings(coef=0.1)
    assert S.KLSettings.coerce(given) is given
    with pytest.raises(TypeError, match=r"unknown UpdateSettings field\(s\) \['ppo_epochs'\] \('ppo_epochs' is now 'epochs'\)"):
        S.UpdateSettings.coerce({"ppo_epochs": 2})
    with pytest.raises(TypeError, match="expected KLSettings, a dict of its fields or None, got float"):
        S.KLSettings.coerce(0.1)
    scoring = S.ScoringSettings(bucketing={"enabled": False})
    assert scoring.as_dict()["bucketing"]["enabled"] is False  # nested groups as plain dicts
    evaluation = S.EvaluationSettings(generation={"max_new_tokens": 4}, greedy=True)
    resolved = evaluation.resolve(GenerationSettings(max_new_tokens=16, num_samples=4, temperature=0.7))
    assert (resolved.max_new_tokens, resolved.num_samples, resolved.temperature) == (4, 1, 0.7)


def test_a_module_prefixes_the_groups_messages(tokenizer_dir):
    with pytest.raises(ValueError, match=r"^CriticFreeModule: update.clip_coef must be > 0, got -1.0$"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), update={"clip_coef": -1.0})
    with pytest.raises(ValueError, match="needs generation.num_samples >= 2"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), generation={"num_samples": 1})
    with pytest.raises(ValueError, match=r"PPOModule: scoring.shared_prefix='on' needs forwards with a shared-prompt"):
        PPOModule(actor={"config": gpt2_config(), "tokenizer": tokenizer_dir}, reward_fn="ppo_rewards:the_count",
                  scoring={"shared_prefix": "on"})  # fmt: skip


def test_one_registry_is_the_source_of_every_name():
    assert get_args(S.AdvantageEstimator) == F.SEQUENCE_ESTIMATORS == tuple(
        k for k, v in F.ADVANTAGE_ESTIMATORS.items() if v.module == "CriticFreeModule"
    )
    assert F.GROUP_ESTIMATORS == tuple(k for k, v in F.ADVANTAGE_ESTIMATORS.items() if v.needs_group)
    assert get_args(S.LossAggregation) == F.LOSS_AGGREGATIONS
    assert get_args(S.KLEstimator) == F.KL_ESTIMATORS
    hints = {f.name: f.type for f in S.PPOUpdate.__dataclass_fields__.values()}
    assert "Literal['clip', 'kl_penalty']" in str(hints["policy_loss"]) and F.POLICY_LOSSES == ("clip", "kl_penalty")
    readme = (ROOT / "README.md").read_text()
    for name in F.ADVANTAGE_ESTIMATORS:
        assert f"| `{name}` |" in readme, f"README's estimator table lacks {name}"


def top_level_arguments(cls: type) -> set[str]:
    """The constructor arguments a user sees (the CLI resolves ``**kwargs`` into the base's)."""
    names = set()
    for klass in (cls, OnlineRLModule):
        names |= {p.name for p in inspect.signature(klass.__init__).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}  # fmt: skip
    return names


def test_the_online_modules_take_about_twenty_top_level_arguments():
    # (the last one added: the `environment` group of multi-turn rollouts)
    assert len(top_level_arguments(PPOModule)) <= 22, sorted(top_level_arguments(PPOModule))
    assert len(top_level_arguments(CriticFreeModule)) <= 18
    moved = set(M.MOVED["PPOModule"]) | set(M.MOVED["CriticFreeModule"])
    assert not moved & (top_level_arguments(PPOModule) | top_level_arguments(CriticFreeModule))


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_rlhf.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_cli_shows_the_groups_and_names_the_new_place_of_an_old_key(tmp_path):
    out = run_cli("fit", "--model.help", "lit_rlhf.modules.PPOModule")
    assert out.returncode == 0, out.stderr
    for group in ("update", "kl", "scoring", "advantage", "samples", "evaluation", "generation", "environment"):
        assert f"--model.{group}.help" in out.stdout, group
    assert "Show the help for PPOUpdate" in out.stdout and out.stdout.count("\n  --model.actor ACTOR") == 1
    out = run_cli("fit", "--config", "configs/ppo_tiny.yaml", "--model.init_args.ppo_epochs", "2", "--print_config")
    assert out.returncode == 2
    assert "'ppo_epochs' is now 'update.epochs'" in out.stderr.splitlines()[-1]
    old = (ROOT / "configs/ppo_tiny.yaml").read_text().replace("update: {epochs: 4, num_minibatches: 2}", "ppo_epochs: 4")
    old = old.replace("kl: {coef: 0.05, target: 4.0}", "kl_coef: 0.05\n    kl_target: 4.0")
    (tmp_path / "old.yaml").write_text(old)
    out = run_cli("fit", "--config", str(tmp_path / "old.yaml"), "--print_config")
    assert out.returncode == 2
    last = out.stderr.splitlines()[-1]
    assert "'ppo_epochs' is now 'update.epochs'" in last and "'kl_target' is now 'kl.target'" in last, last


def test_moved_keys_message_ignores_other_errors():
    assert moved_keys_message("Parser key 'model': Option 'clip_coef' is not accepted") is not None
    assert moved_keys_message("update.clip_coef must be > 0, got -1.0") is None


def flat_hparams(hparams: dict, module: str) -> dict:
    """The earlier flat layout of grouped hyper-parameters (the inverse of ``MOVED``)."""
    out = {k: v for k, v in hparams.items() if k not in ("update", "kl", "scoring", "samples", "evaluation", "advantage")}
    for old, new in M.MOVED[module].items():
        group, name = new.split(".")
        if group in hparams and name in (hparams[group] or {}):
            out[old] = hparams[group][name]
    out.pop("engine", None)
    return out


def test_a_checkpoint_of_the_flat_layout_loads_mapped(tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1, kl={"coef": 0.02},
                              advantage={"estimator": "rloo"}, update={"epochs": 1, "clip_coef": 0.3})  # fmt: skip
    fit = trainer(tmp_path, enable_checkpointing=True, default_root_dir=tmp_path)
    fit.fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    path = tmp_path / "model.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"] = flat_hparams(dict(checkpoint["hyper_parameters"]), "CriticFreeModule")
    assert "ppo_epochs" in checkpoint["hyper_parameters"] and "update" not in checkpoint["hyper_parameters"]
    torch.save(checkpoint, path)
    with pytest.warns(UserWarning, match="flat hyper-parameters were mapped into settings groups"):
        loaded = CriticFreeModule.load_from_checkpoint(path)
    assert (loaded.update, loaded.kl, loaded.advantage) == (module.update, module.kl, module.advantage)
    assert loaded.scoring == module.scoring and loaded.samples == module.samples
    assert all(torch.equal(a, b) for a, b in zip(loaded.actor.parameters(), module.actor.parameters()))
    migrated = M.migrate_checkpoint_hparams("CriticFreeModule", checkpoint["hyper_parameters"])
    assert migrated["update"]["epochs"] == 1 and migrated["advantage"] == {"estimator": "rloo", "gamma": 1.0}


def test_generation_transposed_head_of_earlier_versions_maps_to_decoding_head(tokenizer_dir, tmp_path):
    """``generation.transposed_head`` (a bool, replaced by ``decoding_head``) in a config, an evaluation
    override, a pickled group and a checkpoint's hyper-parameters: the layout it multiplied by then."""
    import pickle

    assert GenerationSettings.coerce({"transposed_head": True}).decoding_head == "transposed"
    assert GenerationSettings.coerce({"transposed_head": False}).decoding_head == "plain"
    assert GenerationSettings.coerce({"transposed_head": False, "decoding_head": "packed"}).decoding_head == "packed"
    evaluation = S.EvaluationSettings(generation={"transposed_head": False})
    assert evaluation.resolve(GenerationSettings()).decoding_head == "plain"
    old = GenerationSettings(top_k=3)  # as an earlier version pickled it: no decoding_head, no record_entropy
    del old.__dict__["decoding_head"], old.__dict__["record_entropy"]
    old.__dict__["transposed_head"] = False
    assert pickle.loads(pickle.dumps(old)) == GenerationSettings(top_k=3, decoding_head="plain")

    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1)
    fit = trainer(tmp_path, enable_checkpointing=True, default_root_dir=tmp_path)
    fit.fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    path = tmp_path / "model.ckpt"
    fit.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    generation = checkpoint["hyper_parameters"]["generation"]
    generation = dict(generation if isinstance(generation, dict) else generation.as_dict())
    del generation["decoding_head"]
    checkpoint["hyper_parameters"]["generation"] = {**generation, "transposed_head": True}
    torch.save(checkpoint, path)
    loaded = CriticFreeModule.load_from_checkpoint(path)
    assert loaded.generation == GenerationSettings(**{**module.generation.as_dict(), "decoding_head": "transposed"})


def test_the_package_cites_only_what_a_reader_can_open():
    """No citation of the background notes or the design file: neither is in the repository."""
    offenders = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in sorted((ROOT / "lit_rlhf").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if "seeds/" in line or "DESIGN.md" in line
    ]
    assert not offenders, offenders
    assert not (ROOT / "config.yaml").exists(), "a stray root config.yaml"


def test_the_cli_resumes_a_checkpoint_of_the_flat_layout(tokenizer_dir, prompt_file, tmp_path, monkeypatch):
    """``--ckpt_path`` with a checkpoint whose hyper-parameters are flat: mapped into the groups, it validates
    with the checkpoint's settings (over the config file's)."""
    import json

    from lit_rlhf.cli import run_cli

    monkeypatch.chdir(tmp_path)
    actor = {"config": gpt2_config(), "tokenizer": tokenizer_dir}
    args = [
        f"--config={ROOT / 'configs/grpo_tiny.yaml'}", "--model.init_args.actor=null",
        f"--model.init_args.actor={json.dumps(actor)}",
        "--model.init_args.reward_model=null", "--model.init_args.reward_fn=ppo_rewards:the_count",
        "--model.init_args.max_rollouts=1", "--model.init_args.generation.max_new_tokens=4",
        f"--data.init_args.tokenizer={tokenizer_dir}", f"--data.init_args.train_path={prompt_file}",
        f"--data.init_args.val_path={prompt_file}", "--data.init_args.test_path=null",
        "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=1",
    ]  # fmt: skip
    cli = run_cli(["fit", *args, "--model.init_args.update.epochs=1", "--model.init_args.kl.loss_coef=0.02"])
    path = tmp_path / "flat.ckpt"
    cli.trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    hparams = dict(checkpoint["hyper_parameters"])
    checkpoint["hyper_parameters"] = {**flat_hparams(hparams, "CriticFreeModule"), "_class_path": hparams["_class_path"]}
    assert checkpoint["hyper_parameters"]["kl_loss_coef"] == 0.02 and "kl" not in checkpoint["hyper_parameters"]
    torch.save(checkpoint, path)
    resumed = run_cli(["validate", *args, f"--ckpt_path={path}"])
    assert (resumed.model.update.epochs, resumed.model.kl.loss_coef) == (1, 0.02), "the checkpoint's settings"
    assert resumed.model.advantage.estimator == "grpo" and resumed.trainer.callback_metrics["val/score"] >= 0


# -- models that read the actor's token ids -----------------------------------------------------------------
def test_a_reference_or_critic_with_another_vocabulary_is_refused(tokenizer_dir, tmp_path):
    from conftest import make_corpus
    from ppo_helpers import tiny_ppo

    from lit_rlhf.models.tokenizer import load_tokenizer, train_bpe_tokenizer

    other = tmp_path / "other_tok"
    train_bpe_tokenizer(make_corpus(seed=1), vocab_size=300).save_pretrained(other)
    config = gpt2_config()
    spec = {"config": config, "tokenizer": str(other), "seed": 1}
    with pytest.raises(ValueError, match=r"^CriticFreeModule: reference: its tokenizer .*300 tokens.* is not the actor's"):
        tiny_critic_free(tokenizer_dir, config, reference=spec)
    with pytest.raises(ValueError, match=r"^PPOModule: critic: its tokenizer .* is not the actor's"):
        tiny_ppo(tokenizer_dir, config, critic=spec)
    # the same vocabulary from another folder (as an export saves it, with its pad token) is the actor's
    load_tokenizer(tokenizer_dir).save_pretrained(tmp_path / "export")
    same = {"config": config, "tokenizer": str(tmp_path / "export"), "seed": 1}
    assert tiny_ppo(tokenizer_dir, config, reference=same, critic=same).reference is not None


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_run_length_schedule_under_max_steps_counts_rollouts(tokenizer_dir, tmp_path, algorithm):
    # trainer.max_steps counts optimiser steps (update.epochs x num_minibatches per optimiser per rollout: PPO
    # steps actor and critic); the schedule steps once a rollout, so max_steps=16 is max_rollouts=4 for GRPO
    # (4 steps a rollout) and 2 for PPO (8): the same learning rates, decayed to 0 at the run's end
    from functools import partial

    from ppo_helpers import tiny_ppo
    from test_online_contract import read_metrics

    from lit_rlhf.modules import WarmupCosineLR

    build, prefix, rollouts = (tiny_critic_free, "policy", 4) if algorithm == "grpo" else (tiny_ppo, "ppo", 2)
    schedule = partial(WarmupCosineLR, min_lr_ratio=0.0)

    def lrs(root, **limits):
        kwargs = dict(update={"epochs": 2, "num_minibatches": 2}, actor_scheduler=schedule)
        if "max_rollouts" in limits:
            kwargs["max_rollouts"] = limits.pop("max_rollouts")
        module = build(tokenizer_dir, gpt2_config(), **kwargs)
        fit = trainer(root, **limits)
        fit.fit(module, prompt_loader(tokenizer_dir, n=32, batch_size=4))
        assert module.rollouts_done == rollouts
        final = module.optimizers()[0] if isinstance(module.optimizers(), list) else module.optimizers()
        # each row logs the learning rate its rollout used; the schedule has decayed to 0 after the last
        return [row[f"{prefix}/lr_actor"] for row in read_metrics(root)] + [final.param_groups[0]["lr"]]

    by_steps = lrs(tmp_path / "steps", max_steps=16)
    assert by_steps == lrs(tmp_path / "rollouts", max_rollouts=rollouts)
    assert by_steps[-1] == 0.0 and by_steps[-2] > 0.0


@pytest.mark.parametrize("algorithm", ["ppo", "reinforce_pp"])
def test_a_rollout_of_one_learned_token_trains(tokenizer_dir, tmp_path, algorithm):
    # one prompt, K = 1, one-token responses: no spread to whiten advantages by (whitened: 0), a std metric of 0
    from ppo_helpers import tiny_ppo
    from test_online_contract import read_metrics

    settings = dict(generation={"max_new_tokens": 1, "num_samples": 1}, update={"epochs": 1, "num_minibatches": 1})
    if algorithm == "ppo":
        module, prefix = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=2, **settings), "ppo"
    else:
        module, prefix = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=2,
                                          advantage={"estimator": "reinforce_pp"}, **settings), "policy"  # fmt: skip
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=2, batch_size=1))
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 and all(r[f"{prefix}/advantages_std"] == 0.0 for r in rows)
    assert all(r[f"{prefix}/policy_loss"] == 0.0 for r in rows)  # a whitened single advantage is 0


def test_a_rollout_past_a_learned_position_table_is_refused_naming_its_settings(tokenizer_dir, tmp_path):
    # GPT-2's table of n_positions rows: an index past it fails inside the forward (a device assert on a GPU)
    config = {**gpt2_config(), "n_positions": 12}
    module = tiny_critic_free(tokenizer_dir, config, max_rollouts=1, generation={"max_new_tokens": 16, "num_samples": 4})
    with pytest.raises(ValueError, match=r"^CriticFreeModule: the longest prompt .* and generation.max_new_tokens=16 make \d+ positions, past the 12"):
        trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    from conftest import llama_config

    llama = {**llama_config(), "max_position_embeddings": 12}  # rotary: runs past it
    module = tiny_critic_free(tokenizer_dir, llama, max_rollouts=1, generation={"max_new_tokens": 16, "num_samples": 4})
    trainer(tmp_path / "llama").fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    assert module.rollouts_done == 1


@pytest.mark.parametrize("algorithm", ["grpo", "online_dpo"])
def test_more_minibatches_than_a_rollout_holds_is_refused_when_the_fit_sets_up(tokenizer_dir, prompt_file, tmp_path, algorithm):
    from test_online_dpo import tiny_online_dpo

    from lit_rlhf.data import PromptDataModule

    data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=2)
    if algorithm == "grpo":  # rows: 2 prompts x K = 4
        module, message = tiny_critic_free(tokenizer_dir, gpt2_config(), update={"num_minibatches": 9}), "8 rows"
    else:  # whole prompts (a pair's rows together)
        module, message = tiny_online_dpo(tokenizer_dir, update={"num_minibatches": 3}), "2 prompts"
    with pytest.raises(ValueError, match=rf"update.num_minibatches=\d is more than a rollout's {message} \(the data's batch_size 2"):
        trainer(tmp_path).fit(module, data)
    assert module.rollouts_done == 0


def test_fp16_mixed_precision_with_a_gradient_scaler_is_refused_when_the_fit_sets_up(tokenizer_dir, tmp_path):
    # manual optimisation clips and screens the gradients before the scaler unscales them inside step
    from lightning.pytorch.plugins.precision import MixedPrecision

    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1)
    fit = trainer(tmp_path, plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(ValueError, match=r"precision 16-mixed \(fp16 with a gradient scaler\) is not supported .* use bf16-mixed"):
        fit.fit(module, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    assert module.rollouts_done == 0


def test_a_causal_lm_checkpoint_as_the_reward_model_is_refused(tokenizer_dir, tmp_path):
    # its score head would be new and random: every reward noise (a critic may start so)
    from ppo_helpers import tiny_ppo

    from lit_rlhf.models import ModelSpec, build_causal_lm, export_pretrained, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    export_pretrained(build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir), tokenizer), tokenizer, tmp_path / "sft")
    with pytest.raises(ValueError, match=r"reward_model '.*sft' is a GPT2LMHeadModel, not a reward model"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=None, reward_model={"name_or_path": str(tmp_path / "sft")})
    assert tiny_ppo(tokenizer_dir, gpt2_config(), critic={"name_or_path": str(tmp_path / "sft")}).critic is not None


def test_greedy_evaluation_with_several_samples_is_refused():
    from lit_rlhf.modules.online_settings import EvaluationSettings

    with pytest.raises(ValueError, match="num_samples=2 with evaluation.greedy"):
        EvaluationSettings(generation={"num_samples": 2}, greedy=True)
    assert EvaluationSettings(generation={"num_samples": 2}).greedy is False

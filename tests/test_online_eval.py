"""validate/test of the online modules (evaluation rollouts), the prompt batch contract before generation,
rng_seed following seed_everything, and the optimiser defaults for pretrained models."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import gpt2_config
from lightning.pytorch import seed_everything
from ppo_helpers import prompt_loader, tiny_critic_free, tiny_ppo, trainer

from lit_rlhf.data.contract import BatchContractError
from lit_rlhf.modules import CriticFreeModule, PPOModule
from lit_rlhf.modules.online_settings import EvaluationSettings
from lit_rlhf.rollout import GenerationSettings

ROOT = Path(__file__).resolve().parents[1]
EVAL_KEYS = {"score", "monitor_score", "kl_ref", "response_length", "eos_rate", "entropy"}


def rows_of(run) -> list[dict[str, str]]:
    with (Path(run.logger.log_dir) / "metrics.csv").open() as f:
        return [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def fit_with_val(module, tmp_path, tokenizer_dir, every: int | None = 2):
    """4 rollouts of 4 prompts; with ``every``, an evaluation rollout on 8 prompts every that many rollouts."""
    val = {} if every is None else dict(check_val_every_n_epoch=None, val_check_interval=every)
    run = trainer(tmp_path, **val)
    loaders = dict(val_dataloaders=prompt_loader(tokenizer_dir, n=8, batch_size=4)) if every else {}
    run.fit(module, train_dataloaders=prompt_loader(tokenizer_dir, n=16, batch_size=4), **loaders)
    return run


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_validation_every_n_rollouts_logs_val_metrics_and_samples_at_the_rollout_step(kind, tokenizer_dir, tmp_path):
    build = tiny_ppo if kind == "ppo" else tiny_critic_free
    extra = {"monitor_reward_fn": "ppo_rewards:the_count"} if kind == "grpo" else {}
    module = build(tokenizer_dir, gpt2_config(), max_rollouts=4, samples={"rows": 2}, **extra)
    run = fit_with_val(module, tmp_path, tokenizer_dir)
    rows = rows_of(run)
    rollout_steps = [int(r["step"]) for r in rows if "rollout/score" in r]
    val_rows = [r for r in rows if "val/score" in r]
    assert rollout_steps == [0, 1, 2, 3]
    # after rollouts 2 and 4, at the step of those rollouts' scalars
    assert [int(r["step"]) for r in val_rows] == [1, 3]
    assert {f"val/{k}" for k in EVAL_KEYS} <= set(val_rows[0])
    assert float(val_rows[0]["val/response_length"]) > 0
    samples = [json.loads(line) for line in (Path(run.logger.log_dir) / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples if s["tag"] == "val/samples"] == [1, 1, 3, 3]
    assert set(samples[0]) == {"step", "tag", "prompt", "response", "score"}
    # test: the same evaluation on the test loader, logged as test/*
    (results,) = run.test(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert {f"test/{k}" for k in EVAL_KEYS} == set(results)


def test_evaluation_leaves_training_unchanged_and_is_repeatable(tokenizer_dir, tmp_path):
    # The same run with and without evaluations samples the same rollouts (the training RNG stream is
    # held aside around the validation loop); evaluating the same policy twice gives the same numbers.
    torch.manual_seed(0)
    with_val = fit_with_val(tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=4), tmp_path / "a", tokenizer_dir)
    torch.manual_seed(0)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=4)
    without = fit_with_val(module, tmp_path / "b", tokenizer_dir, every=None)
    a = [r for r in rows_of(with_val) if "rollout/score" in r]
    b = [r for r in rows_of(without) if "rollout/score" in r]
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b):
        for key in ("rollout/kl_ref", "rollout/entropy", "ppo/policy_loss", "ppo/value_loss"):
            assert float(ra[key]) == pytest.approx(float(rb[key]), rel=1e-6, abs=1e-7), key
    val = prompt_loader(tokenizer_dir, n=8, batch_size=4)
    first, second = without.validate(module, val), without.validate(module, val)
    assert first == second and set(first[0]) == {f"val/{k}" for k in EVAL_KEYS}


def test_greedy_evaluation_and_evaluation_generation_overrides(tokenizer_dir, tmp_path):
    evaluation = {"generation": {"max_new_tokens": 4}, "greedy": True}
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), evaluation=evaluation, rng_seed=1)
    assert module.eval_generation == GenerationSettings(max_new_tokens=4, num_samples=1)
    run = trainer(tmp_path)
    (greedy,) = run.validate(module, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    other_seed = tiny_critic_free(tokenizer_dir, gpt2_config(), evaluation=evaluation, rng_seed=2)
    other_seed.load_state_dict(module.state_dict(), strict=False)
    (again,) = run.validate(other_seed, prompt_loader(tokenizer_dir, n=8, batch_size=4))
    assert greedy == again  # argmax decoding does not depend on the evaluation seed
    assert greedy["val/response_length"] <= 4
    with pytest.raises(TypeError, match=r"evaluation.generation: unknown GenerationSettings field\(s\) \['beams'\]"):
        EvaluationSettings(generation={"beams": 2}).resolve(GenerationSettings())
    with pytest.raises(ValueError, match="generation.max_new_tokens must be >= 1"):
        EvaluationSettings(generation={"max_new_tokens": 0}).resolve(GenerationSettings())
    # the module refuses them at construction, naming itself and the group
    with pytest.raises(TypeError, match=r"CriticFreeModule: evaluation.generation: unknown GenerationSettings"):
        tiny_critic_free(tokenizer_dir, gpt2_config(), evaluation={"generation": {"beams": 2}})
    # the resolved settings start from the training generation, with one sample per prompt
    resolved = EvaluationSettings(generation={"max_new_tokens": 4}).resolve(GenerationSettings(num_samples=4))
    assert resolved == GenerationSettings(max_new_tokens=4, num_samples=1)


class RecordingPPO(PPOModule):
    def ppo_loss(self, part):
        loss, stats = super().ppo_loss(part)
        self.recorded = [*getattr(self, "recorded", []), stats]
        return loss, stats


def right_padded_loader(tokenizer_dir: str) -> torch.utils.data.DataLoader:
    """The prompt loader's rows with their padding moved to the right (as a naive collator makes them)."""
    rows = []
    for batch in prompt_loader(tokenizer_dir, n=8, batch_size=8):
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            order = torch.argsort(1 - mask, stable=True)  # real tokens first
            rows.append({"input_ids": ids[order], "attention_mask": mask[order]})
    assert any(r["attention_mask"][-1] == 0 for r in rows)
    return torch.utils.data.DataLoader(rows, batch_size=8)


def test_right_padded_prompts_are_left_padded_so_the_first_ratio_is_one(tokenizer_dir, tmp_path):
    module = tiny_ppo(tokenizer_dir, gpt2_config(), cls=RecordingPPO, max_rollouts=1)
    trainer(tmp_path).fit(module, right_padded_loader(tokenizer_dir))
    first = module.recorded[0]
    assert first["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert first["ratio_max"].item() == pytest.approx(1.0, abs=1e-5)


def test_prompt_batches_are_checked_before_generation(tokenizer_dir):
    module = tiny_critic_free(tokenizer_dir, gpt2_config())
    trl = {"prompt_input_ids": [[1, 2]], "prompt": ["hi"]}
    with pytest.raises(BatchContractError, match="CriticFreeModule expects a 'prompt' batch.*PromptDataModule"):
        module.expand_prompts(trl)
    ids = torch.tensor([[5, 6, 0], [7, 8, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out_ids, out_mask = module.expand_prompts({"input_ids": ids, "attention_mask": mask}, num_samples=2)
    pad = module.tokenizer.pad_token_id
    assert out_ids.tolist() == [[pad, 5, 6], [pad, 5, 6], [7, 8, 9], [7, 8, 9]]
    assert out_mask.tolist() == [[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]


def test_rng_seed_follows_seed_everything_unless_given_and_is_checkpointed(tokenizer_dir, tmp_path):
    def head(global_seed: int, rng_seed: int | None = None) -> tuple[PPOModule, torch.Tensor]:
        seed_everything(global_seed)
        # an actor spec without its own seed is initialised from the module's seeded stream
        actor = {"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": None}
        module = tiny_ppo(tokenizer_dir, gpt2_config(), actor=actor, rng_seed=rng_seed)
        return module, module.actor.transformer.wte.weight.detach().clone()

    (m1, w1), (_, w1b), (m2, w2) = head(1), head(1), head(2)
    assert (m1.hparams.rng_seed, m2.hparams.rng_seed) == (1, 2)
    assert torch.equal(w1, w1b) and not torch.equal(w1, w2)
    (m7, w7), (_, w7b) = head(1, rng_seed=7), head(2, rng_seed=7)
    assert m7.hparams.rng_seed == 7 and torch.equal(w7, w7b)
    # the resolved seed is in the checkpoint (and in the hyper-parameters a reload is built from)
    module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=1, rng_seed=None)
    run = trainer(tmp_path, enable_checkpointing=True, default_root_dir=str(tmp_path))
    run.fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=8))
    (ckpt,) = tmp_path.rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert saved["online_state"]["rng_seed"] == module.rng_seed == saved["hyper_parameters"]["rng_seed"] == 2


def test_online_default_optimisers_use_pretrained_lm_learning_rates(tokenizer_dir):
    actor = {"config": gpt2_config(), "tokenizer": tokenizer_dir}
    ppo = PPOModule(actor=actor, reward_fn="ppo_rewards:the_count")
    actor_opt, critic_opt = ppo.configure_optimizers()[0]
    assert (actor_opt.param_groups[0]["lr"], critic_opt.param_groups[0]["lr"]) == (1e-6, 9e-6)
    grpo = CriticFreeModule(actor=actor, reward_fn="ppo_rewards:the_count")
    assert grpo.configure_optimizers().param_groups[0]["lr"] == 1e-6


ONLINE_CONFIGS = sorted(
    p for p in (ROOT / "configs").rglob("*.yaml") if any(m in p.read_text() for m in ("PPOModule", "CriticFreeModule"))
)


def test_online_configs_are_found():
    names = {p.name for p in ONLINE_CONFIGS}
    assert {"ppo_tiny.yaml", "grpo_tiny.yaml", "ppo.yaml", "ppo_overoptimize.yaml"} <= names


@pytest.mark.parametrize("path", ONLINE_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_online_configs_set_their_own_learning_rates(path):
    # the library defaults (1e-6 / 9e-6, for pretrained LMs) must not change what the shipped runs do
    model = yaml.safe_load(path.read_text())["model"]
    names = ["actor_optimizer"] + (["critic_optimizer"] if model["class_path"].endswith("PPOModule") else [])
    for name in names:
        assert float(model["init_args"][name]["init_args"]["lr"]) > 0, name


def test_resume_from_a_checkpoint_written_at_a_validation_is_exact(tokenizer_dir, tmp_path):
    # ModelCheckpoint saves at the end of each validation, while the global RNG holds the validation
    # loader's draws: the checkpoint must hold the training stream, so rollouts 3..4 of the resumed run
    # equal those of the uninterrupted one (and so do the validations).
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root, ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=4, kl={"target": 1.0})
        saver = ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1, filename="{step}")
        fit = trainer(root, check_val_every_n_epoch=None, val_check_interval=2, enable_checkpointing=True,
                      callbacks=[saver], default_root_dir=str(root))  # fmt: skip
        fit.fit(module, train_dataloaders=prompt_loader(tokenizer_dir, n=16, batch_size=4),
                val_dataloaders=prompt_loader(tokenizer_dir, n=8, batch_size=4), ckpt_path=ckpt_path)  # fmt: skip
        return rows_of(fit)

    full = run(tmp_path / "full")
    (first_ckpt, _) = sorted((tmp_path / "full" / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    resumed = run(tmp_path / "resumed", ckpt_path=str(first_ckpt))
    full_rollouts = [r for r in full if "rollout/score" in r][2:]
    resumed_rollouts = [r for r in resumed if "rollout/score" in r]
    assert len(full_rollouts) == len(resumed_rollouts) == 2
    for a, b in zip(full_rollouts, resumed_rollouts):
        for key in ("rollout/kl_ref", "rollout/entropy", "ppo/policy_loss", "ppo/value_loss", "ppo/kl_coef"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
    last_val = [r for r in full if "val/kl_ref" in r][-1]
    assert float(last_val["val/kl_ref"]) == pytest.approx(float([r for r in resumed if "val/kl_ref" in r][-1]["val/kl_ref"]))


@pytest.mark.parametrize("val_every", [2, None], ids=["validation_every_2", "no_validation"])
def test_an_end_of_run_checkpoint_extended_continues_the_run(tokenizer_dir, tmp_path, val_every, prompt_file):
    """3 rollouts, then the end-of-run checkpoint resumed to 5, against 5 uninterrupted: the same prompts
    (the cut epoch is continued, not restarted) and the same logging steps (with validation every 2 the
    checkpoint is written inside the validation max_rollouts triggers, after which Lightning's step trailed)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root, rollouts, ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_ppo(tokenizer_dir, gpt2_config(), max_rollouts=rollouts)
        saver = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
        val = {} if val_every is None else dict(check_val_every_n_epoch=None, val_check_interval=val_every)
        fit = trainer(root, enable_checkpointing=True, callbacks=[saver], default_root_dir=str(root), **val)
        from lit_rlhf.data import PromptDataModule  # its sampler's position is checkpointed

        val = 0.0 if val_every is None else 0.2
        data = PromptDataModule(tokenizer_dir, str(prompt_file), batch_size=4, val_fraction=val, seed=0)
        fit.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return [(int(r["step"]), float(r["rollout/score"]), float(r["rollout/kl_ref"])) for r in rows_of(fit) if "rollout/score" in r]

    full = run(tmp_path / "full", 5)
    run(tmp_path / "part", 3)
    extended = run(tmp_path / "part", 5, ckpt_path=str(tmp_path / "part" / "ckpt" / "last.ckpt"))
    assert [s for s, *_ in extended] == [s for s, *_ in full[3:]] == [3, 4]
    for (_, *values), (_, *expected) in zip(extended, full[3:]):
        assert values == pytest.approx(expected, rel=1e-5, abs=1e-6)

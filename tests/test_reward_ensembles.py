"""Reward-model ensembles: K members trained in one fit, exported with ensemble.json, reloaded as one reward
source that scores as its members do; PPO, GRPO and online DPO optimise it and log its spread; exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import gpt2_config, make_corpus
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from ppo_helpers import adamw, prompt_loader, tiny_critic_free, tiny_ppo, trainer
from test_ppo import StopAfter, read_metrics

from lit_rlhf import functional as F
from lit_rlhf.callbacks import HFExport
from lit_rlhf.data import PreferenceDataModule
from lit_rlhf.ensembles import (
    ENSEMBLE_MANIFEST,
    RewardEnsemble,
    coerce_reward_model,
    read_ensemble_manifest,
    reference_stats,
    write_ensemble_manifest,
)
from lit_rlhf.models import ModelSpec, load_tokenizer
from lit_rlhf.modules import OnlineDPOModule, RewardEnsembleModule, RewardModelModule
from lit_rlhf.rewards import RewardSource

# no dropout: a member trained in the ensemble and one trained alone draw no random numbers
TINY = {
    "model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 128,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def ensemble_dir(tokenizer_dir, tmp_path_factory) -> Path:
    """Three randomly initialised reward models on the test tokenizer, exported as one ensemble (mean)."""
    folder = tmp_path_factory.mktemp("ensemble")
    module = RewardEnsembleModule({"config": gpt2_config(), "tokenizer": tokenizer_dir}, num_members=3, seeds=[3, 4, 5],
                                  aggregation="mean")  # fmt: skip
    module.export_pretrained(str(folder))
    return folder


def preference_data(tiny: Path, **kw) -> PreferenceDataModule:
    return PreferenceDataModule(f"{tiny}/tokenizer", f"{tiny}/prefs.jsonl", max_length=64, max_prompt_length=16,
                                batch_size=16, split="train[:64]", val_fraction=0.25, seed=0, **kw)  # fmt: skip


def fit(
    module: LightningModule, data: LightningDataModule, root: Path, export: Path | None = None, **kw
) -> Trainer:
    run = Trainer(
        default_root_dir=root, max_steps=3, logger=CSVLogger(root, name="rm"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1, num_sanity_val_steps=0,
        callbacks=[HFExport(str(export))] if export else [], deterministic=True, **kw,
    )  # fmt: skip
    run.fit(module, data)
    return run


def test_three_members_train_export_and_reload_to_score_as_the_members_do(tiny_data_dir, tokenizer_dir, tmp_path):
    tok = f"{tiny_data_dir}/tokenizer"
    module = RewardEnsembleModule({"config": TINY, "tokenizer": tok}, num_members=3, aggregation="mean_minus_std",
                                  coef=0.5, optimizer=adamw(1e-3), scheduler=None)  # fmt: skip
    initial = [{k: v.clone() for k, v in m.state_dict().items()} for m in module.model]
    data = preference_data(tiny_data_dir)
    run = fit(module, data, tmp_path / "ensemble", export=tmp_path / "export")
    # 1. Trained: every member moved, apart from the others (seeds 0, 1, 2); metrics of each and of the ensemble.
    assert module.seeds == [0, 1, 2] and module.hparams.seeds == [0, 1, 2]
    for member, before in zip(module.model, initial):
        assert not torch.equal(member.score.weight, before["score.weight"])
    assert not torch.equal(module.model[0].score.weight, module.model[1].score.weight)
    logged = set(run.callback_metrics)
    assert {"train/loss", "val/loss", "val/accuracy", "val/ensemble_std", "train/accuracy"} <= logged
    assert {f"val/member_{k}/accuracy" for k in range(3)} <= logged
    # 2. Exported: three reward-model folders and the manifest.
    manifest = json.loads((tmp_path / "export" / ENSEMBLE_MANIFEST).read_text())
    assert manifest["members"] == ["member_0", "member_1", "member_2"]
    assert (manifest["aggregation"], manifest["coef"], manifest["seeds"], manifest["bootstrap"]) == (
        "mean_minus_std",
        0.5,
        [0, 1, 2],
        False,
    )
    # 3. Reloaded: the folder is one reward source whose member scores are exactly each member's alone.
    tokenizer = load_tokenizer(tok)
    source = RewardSource(coerce_reward_model(str(tmp_path / "export")), None, tokenizer)
    assert (
        len(source.members) == 3
        and source.ensemble.aggregation == "mean_minus_std"
        and source.ensemble.coef == 0.5
    )
    batch = next(iter(data.val_dataloader()))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    total, parts, _ = source.score_terms(ids, mask, 8, 7)
    alone = torch.stack([
        RewardSource(ModelSpec(name_or_path=str(tmp_path / "export" / f"member_{k}")), None, tokenizer).score(ids, mask, 8, 7)
        for k in range(3)
    ])  # fmt: skip
    assert list(parts) == ["member_0", "member_1", "member_2"]
    assert torch.equal(torch.stack(list(parts.values())), alone)
    assert torch.equal(total, F.aggregate_ensemble(alone, "mean_minus_std", 0.5))
    with torch.no_grad():  # the in-memory members, to float rounding
        torch.testing.assert_close(module.eval()(ids, mask), alone)
    # an actor with another vocabulary: the text is re-tokenised once for all members, as for one reward model
    actor_tokenizer = load_tokenizer(tokenizer_dir)
    other = RewardSource(coerce_reward_model(str(tmp_path / "export")), None, actor_tokenizer)
    assert other.model_tokenizer is not None
    actor_ids = actor_tokenizer(["review 3: great food", "review 4: awful staff"], return_tensors="pt", padding=True)
    texts = (actor_ids["input_ids"], actor_ids["attention_mask"], 3, 4)
    each = [
        RewardSource(ModelSpec(name_or_path=str(tmp_path / "export" / f"member_{k}")), None, actor_tokenizer).score(*texts)
        for k in range(3)
    ]  # fmt: skip
    assert torch.equal(torch.stack(list(other.score_terms(*texts)[1].values())), torch.stack(each))
    # 4. A member trains as it would alone: RewardModelModule with member 1's seed on the same batches.
    single = RewardModelModule(
        {"config": TINY, "tokenizer": tok, "seed": 1}, optimizer=adamw(1e-3), scheduler=None
    )
    fit(single, preference_data(tiny_data_dir), tmp_path / "single")
    for (name, a), b in zip(single.model.state_dict().items(), module.model[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_clips_each_member_as_it_would_be_alone(tiny_data_dir, tmp_path, algorithm):
    # a clip small enough to bind every step: the members' joint norm would clip each member by another factor
    tok = f"{tiny_data_dir}/tokenizer"
    clip = {"gradient_clip_val": 0.01, "gradient_clip_algorithm": algorithm}
    module = RewardEnsembleModule({"config": TINY, "tokenizer": tok}, num_members=2, optimizer=adamw(1e-3),
                                  scheduler=None)  # fmt: skip
    fit(module, preference_data(tiny_data_dir), tmp_path / "ensemble", **clip)
    for k in range(2):
        single = RewardModelModule(
            {"config": TINY, "tokenizer": tok, "seed": k}, optimizer=adamw(1e-3), scheduler=None
        )
        fit(single, preference_data(tiny_data_dir), tmp_path / f"single{k}", **clip)
        for (name, a), b in zip(single.model.state_dict().items(), module.model[k].state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"member {k}: {name}")


def test_bootstrap_weights_each_members_loss(tiny_data_dir):
    # the training loss is the sum of the members' Bradley-Terry losses, each weighted by its own counts
    tok = f"{tiny_data_dir}/tokenizer"
    module = RewardEnsembleModule(
        {"config": TINY, "tokenizer": tok}, num_members=2, seeds=[7, 9], bootstrap=True
    )
    data = preference_data(tiny_data_dir)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        loss = module._step(batch, "train")
        chosen, rejected = module(batch["input_ids"], batch["attention_mask"]).chunk(2, dim=1)  # (2, B) each
    weights = F.poisson_bootstrap_weights(batch["row_index"], [7, 9])  # (2, B)
    assert not torch.equal(weights[0], weights[1])
    expected = sum(F.pairwise_reward_loss(chosen[k], rejected[k], weights=weights[k])[0] for k in range(2))
    torch.testing.assert_close(loss, expected)
    no_index = {k: v for k, v in batch.items() if k != "row_index"}
    with pytest.raises(KeyError, match="bootstrap=True.*row_index"):
        module._step(no_index, "train")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_members": 1}, "num_members must be an integer >= 2"),
        ({"seeds": [1, 1, 2]}, "seeds must be 3 distinct integers"),
        ({"seeds": [1, 2]}, "seeds must be 3 distinct integers"),
        ({"aggregation": "median"}, "aggregation must be one of"),
        ({"coef": -0.5}, "coef must be a finite number >= 0"),
    ],
)
def test_ensemble_module_arguments_are_checked(tokenizer_dir, kwargs, message):
    with pytest.raises(ValueError, match=f"RewardEnsembleModule: {message}"):
        RewardEnsembleModule({"config": gpt2_config(), "tokenizer": tokenizer_dir}, **kwargs)


def test_reward_model_forms_of_an_ensemble(ensemble_dir):
    folder = str(ensemble_dir)
    assert isinstance(coerce_reward_model(folder), RewardEnsemble)
    from_spec = coerce_reward_model({"name_or_path": folder, "dtype": "bfloat16"})
    members = from_spec.resolve().members
    assert [m.dtype for m in members] == ["bfloat16"] * 3 and members[2].name_or_path.endswith("member_2")
    given = coerce_reward_model({"ensemble": folder, "aggregation": "min"})
    resolved = given.resolve()
    assert (resolved.aggregation, resolved.coef) == ("min", 1.0)  # the manifest's coef, the given aggregation
    listed = coerce_reward_model({"ensemble": [f"{folder}/member_0", {"name_or_path": f"{folder}/member_1"}]})
    assert [m.name_or_path for m in listed.resolve().members] == [f"{folder}/member_0", f"{folder}/member_1"]
    assert listed.resolve().aggregation == "mean"
    assert isinstance(coerce_reward_model(f"{folder}/member_0"), ModelSpec)  # one reward model
    assert coerce_reward_model(None) is None
    plain = RewardEnsemble(ensemble=folder, aggregation="mean_minus_var", coef=2).as_dict()
    assert plain == {
        "ensemble": folder, "aggregation": "mean_minus_var", "coef": 2.0, "member_stats": None, "normalize": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ({"ensemble": "x", "aggregation": "median"}, ValueError, "reward_model.aggregation must be one of"),
        ({"ensemble": "x", "coef": -1}, ValueError, "reward_model.coef must be a finite number >= 0"),
        ({"ensemble": ["only/one"]}, ValueError, "reward_model.ensemble must be at least 2 members"),
        ({"ensemble": 3}, ValueError, "reward_model.ensemble must be a folder or a list of member specs"),
        (
            {"ensemble": ["a", {"layers": 2}]},
            TypeError,
            r"reward_model.ensemble\[1\]: unknown ModelSpec field",
        ),
        (
            {"ensemble": "x", "weights": [1, 2]},
            TypeError,
            r"reward_model: unknown RewardEnsemble field\(s\) \['weights'\]",
        ),
        # a command-line override of one field that jsonargparse could not merge arrives alone
        ({"aggregation": "median"}, ValueError, r"reward_model.aggregation must be one of \['mean', "),
        ({"coef": 2.0}, ValueError, "settings of an ensemble, which needs `ensemble`"),
    ],
)
def test_ensemble_settings_are_checked(value, error, message):
    with pytest.raises(error, match=message):
        coerce_reward_model(value)


def test_ensemble_folders_are_checked(ensemble_dir, tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="reward_model.ensemble: .*: no such folder"):
        RewardEnsemble(ensemble=str(tmp_path / "nowhere")).resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no ensemble.json"):
        RewardEnsemble(ensemble=str(tmp_path / "empty")).resolve()
    write_ensemble_manifest(tmp_path / "partial", [str(ensemble_dir / "member_0"), "member_9"])
    with pytest.raises(FileNotFoundError, match="member 'member_9' is not a folder"):
        read_ensemble_manifest(tmp_path / "partial")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ENSEMBLE_MANIFEST).write_text('{"members": ["a", "b"]}')
    with pytest.raises(ValueError, match="expected {format: 'lit_rlhf.reward_ensemble'"):
        read_ensemble_manifest(tmp_path / "bad")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        write_ensemble_manifest(tmp_path / "x", ["a", "b"], aggregation="median")
    # members with another tokenizer: refused, naming the member
    other_tok = tmp_path / "other_tok"
    from lit_rlhf.models.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(make_corpus(seed=1), vocab_size=300).save_pretrained(other_tok)
    other = {"config": gpt2_config(300), "tokenizer": str(other_tok), "seed": 0}
    mixed = RewardEnsemble(ensemble=[str(ensemble_dir / "member_0"), other])
    with pytest.raises(
        ValueError, match=r"reward_model.ensemble\[1\] .*differs from member 0's.*share one tokenizer"
    ):
        RewardSource(mixed, None, load_tokenizer(tokenizer_dir))


def test_grpo_with_an_ensemble_logs_its_spread_and_optimises_the_mean(tokenizer_dir, ensemble_dir, tmp_path):
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), reward_fn=None, reward_model=str(ensemble_dir), max_rollouts=2
    )
    assert module.rewards.description.startswith("reward_model ensemble of 3 (mean)")
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        members = [row[f"rollout/reward/member_{k}"] for k in range(3)]
        assert row["rollout/ensemble_std"] > 0 and len(set(members)) == 3
        assert row["rollout/score"] == pytest.approx(sum(members) / 3, rel=1e-5)  # the mean of the members
        assert all(row[f"rollout/reward_nonfinite/member_{k}"] == 0 for k in range(3))


def test_ppo_and_online_dpo_take_an_ensemble(tokenizer_dir, ensemble_dir, tmp_path):
    reward_model = {"ensemble": str(ensemble_dir), "aggregation": "min"}
    ppo = tiny_ppo(tokenizer_dir, gpt2_config(), reward_fn=None, reward_model=reward_model, max_rollouts=1)
    # the critic starts from the first member (its backbone and head)
    member = RewardSource(ModelSpec(name_or_path=str(ensemble_dir / "member_0")), None, ppo.tokenizer).model
    for (name, a), b in zip(member.state_dict().items(), ppo.critic.state_dict().values()):
        assert torch.equal(a, b), name
    trainer(tmp_path / "ppo").fit(ppo, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    dpo = OnlineDPOModule(
        actor={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0}, reward_model=reward_model,
        generation={"max_new_tokens": 6, "num_samples": 2}, scoring={"forward_batch_size": 4}, samples={"every": 0},
        max_rollouts=1, rng_seed=0,
    )  # fmt: skip
    trainer(tmp_path / "dpo").fit(dpo, prompt_loader(tokenizer_dir, n=4, batch_size=4))
    for root in ("ppo", "dpo"):
        (row,) = read_metrics(tmp_path / root)
        members = [row[f"rollout/reward/member_{k}"] for k in range(3)]
        assert row["rollout/ensemble_std"] > 0, root
        assert row["rollout/score"] <= min(members) + 1e-6, root  # the worst member of each response


STATS = [{"mean": 0.5, "std": 2.0}, {"mean": -1.0, "std": 0.5}, {"mean": 0.0, "std": 1.0}]


def test_member_statistics_of_a_manifest_standardise_the_members(ensemble_dir, tmp_path):
    members = [str(ensemble_dir / f"member_{k}") for k in range(3)]
    write_ensemble_manifest(tmp_path / "z", members, "mean", member_stats=STATS)
    assert RewardEnsemble(ensemble=str(tmp_path / "z")).resolve().stats == [(0.5, 2.0), (-1.0, 0.5), (0.0, 1.0)]
    assert RewardEnsemble(ensemble=str(tmp_path / "z"), normalize=False).resolve().stats is None
    assert RewardEnsemble(ensemble=str(ensemble_dir)).resolve().stats is None  # no statistics: raw scores
    listed = RewardEnsemble(ensemble=members, member_stats=STATS).resolve()
    assert listed.stats == [(0.5, 2.0), (-1.0, 0.5), (0.0, 1.0)]
    with pytest.raises(ValueError, match=r"reward_model.normalize: true needs each member's reference statistics"):
        RewardEnsemble(ensemble=str(ensemble_dir), normalize=True).resolve()
    with pytest.raises(ValueError, match=r"member_stats\[1\] must be \{mean: finite, std: finite > 0\}"):
        RewardEnsemble(ensemble=members, member_stats=[STATS[0], {"mean": 0.0, "std": 0.0}, STATS[2]])
    with pytest.raises(ValueError, match="member_stats must be a list of 3"):
        RewardEnsemble(ensemble=members, member_stats=STATS[:2])
    write_ensemble_manifest(tmp_path / "bad", members, "mean", member_stats=[{"mean": 1.0}] * 3)
    with pytest.raises(ValueError, match=r"bad/ensemble.json: member_stats\[0\]"):
        RewardEnsemble(ensemble=str(tmp_path / "bad")).resolve()
    with pytest.raises(ValueError, match="reward_model.normalize must be true, false or None"):
        RewardEnsemble(ensemble=members, normalize="yes")


def test_a_standardised_ensemble_scores_and_logs_its_members_on_one_scale(tokenizer_dir, ensemble_dir, tmp_path):
    members = [str(ensemble_dir / f"member_{k}") for k in range(3)]
    write_ensemble_manifest(tmp_path / "z", members, "mean", member_stats=STATS)
    module = tiny_critic_free(
        tokenizer_dir, gpt2_config(), reward_fn=None, reward_model=str(tmp_path / "z"), max_rollouts=2
    )
    assert "standardised members" in module.rewards.description
    trainer(tmp_path / "fit").fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    means, stds = torch.tensor([0.5, -1.0, 0.0]), torch.tensor([2.0, 0.5, 1.0])
    for row in read_metrics(tmp_path / "fit"):
        raw = torch.tensor([row[f"rollout/reward/member_{k}"] for k in range(3)])  # batch means, raw
        # the mean of standardised members is affine in each member's batch mean: mean mu + mean sigma * mean z
        expected = means.mean() + stds.mean() * ((raw - means) / stds).mean()
        assert row["rollout/score"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-5)
        assert row["rollout/ensemble_std"] > 0


def test_reference_statistics_are_each_members_scores(ensemble_dir, tokenizer_dir):
    members = [ensemble_dir / f"member_{k}" for k in range(2)]
    texts = ["the food was good", "a room", "the plot was bad and dull", "we hated it"]
    stats = reference_stats(members, texts, batch_size=3)
    tok = load_tokenizer(tokenizer_dir)
    for member, got in zip(members, stats):
        scores = torch.tensor([RewardSource(ModelSpec(name_or_path=str(member)), None, tok).model(
            **tok([t], return_tensors="pt")).logits.item() for t in texts])  # fmt: skip
        assert got["mean"] == pytest.approx(scores.mean().item(), abs=1e-5)
        assert got["std"] == pytest.approx(scores.std(correction=0).item(), abs=1e-5)
    with pytest.raises(ValueError, match="reference_stats: needs at least 2 texts"):
        reference_stats(members, ["one"])


def test_resume_with_an_ensemble_reproduces_the_uninterrupted_run(
    tokenizer_dir, ensemble_dir, tmp_path, prompt_file
):
    from lit_rlhf.data import PromptDataModule

    def run(root, callbacks=(), ckpt_path=None):
        torch.manual_seed(0)
        module = tiny_critic_free(
            tokenizer_dir, gpt2_config(), reward_fn=None, max_rollouts=4, update={"epochs": 2},
            reward_model={"ensemble": str(ensemble_dir), "aggregation": "mean_minus_std", "coef": 0.5},
        )  # fmt: skip
        data = PromptDataModule(tokenizer_dir, str(prompt_file), max_prompt_length=16, batch_size=2, seed=3)
        trainer(root, callbacks=list(callbacks), default_root_dir=str(root)).fit(
            module, data, ckpt_path=ckpt_path
        )
        return read_metrics(root)

    full = run(tmp_path / "full")
    run(tmp_path / "part", callbacks=[StopAfter(2)])
    state = torch.load(tmp_path / "part" / "mid.ckpt", weights_only=False)
    assert not any(k.startswith("rewards.") for k in state["state_dict"])  # the frozen members are rebuilt
    resumed = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "part" / "mid.ckpt"))
    assert len(full) == 4 and len(resumed) == 2
    for a, b in zip(full[2:], resumed):
        assert set(a) == set(b) and "rollout/ensemble_std" in a
        for key in a:
            if key not in ("epoch", "step"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_the_cli_builds_an_ensemble_reward_model_from_yaml(
    tokenizer_dir, ensemble_dir, tmp_path, prompt_file
):
    import yaml

    from lit_rlhf.cli import LitRLHFCLI

    config = {
        "trainer": {"logger": False, "enable_checkpointing": False},
        "model": {"class_path": "lit_rlhf.modules.CriticFreeModule", "init_args": {
            "actor": {"config": gpt2_config(), "tokenizer": tokenizer_dir},
            "reward_model": {"ensemble": str(ensemble_dir), "aggregation": "mean_minus_var", "coef": 0.25},
        }},
        "data": {"class_path": "lit_rlhf.data.PromptDataModule",
                 "init_args": {"tokenizer": tokenizer_dir, "train_path": str(prompt_file)}},
    }  # fmt: skip
    path = tmp_path / "grpo_ensemble.yaml"
    path.write_text(yaml.safe_dump(config))
    for reward_model in (None, str(ensemble_dir)):  # the dict form, then the folder itself
        args = ["--config", str(path)] + (
            [f"--model.init_args.reward_model={reward_model}"] if reward_model else []
        )
        cli = LitRLHFCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         run=False, auto_configure_optimizers=False, args=args)  # fmt: skip
        ensemble = cli.model.rewards.ensemble
        expected = ("mean_minus_var", 0.25) if reward_model is None else ("mean", 1.0)
        assert len(cli.model.rewards.members) == 3 and (ensemble.aggregation, ensemble.coef) == expected


def test_members_from_one_reward_model_checkpoint_need_the_bootstrap(ensemble_dir):
    # a checkpoint keeps its trained head: the seeds change nothing, and on the same pairs the K would stay one
    checkpoint = str(ensemble_dir / "member_0")
    with pytest.raises(ValueError, match=r"the 2 members start from the same weights .* Set bootstrap: true"):
        RewardEnsembleModule(checkpoint, num_members=2)
    module = RewardEnsembleModule(checkpoint, num_members=2, bootstrap=True)  # each its own resample
    assert len(module.model) == 2

"""A reward model's last-layer posterior: the elliptical width by hand, the features it is read from, the
folder lit_rlhf.posterior writes, and the reward source an online module takes it as."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import gpt2_config
from hypothesis import given
from hypothesis import strategies as st
from ppo_helpers import prompt_loader, tiny_critic_free, trainer
from test_ppo import read_metrics

from lit_rlhf import functional as F
from lit_rlhf.data import PreferenceDataModule
from lit_rlhf.ensembles import coerce_reward_model
from lit_rlhf.models import (
    ModelSpec,
    build_score_model,
    load_tokenizer,
    sequence_scores,
    sequence_scores_and_features,
)
from lit_rlhf.posterior import PosteriorReward, fit_posterior, main, read_posterior
from lit_rlhf.rewards import RewardSource


def test_feature_precision_and_elliptical_width_by_hand():
    phi = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    precision = F.feature_precision(phi, ridge=1.0)  # [[1 + 1, 0], [0, 4 + 1]]
    torch.testing.assert_close(precision, torch.tensor([[2.0, 0.0], [0.0, 5.0]], dtype=torch.float64))
    covariance = torch.linalg.inv(precision)  # diag(0.5, 0.2)
    widths = F.elliptical_width(torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, -1.0]]), covariance)
    torch.testing.assert_close(widths, torch.tensor([0.7**0.5, 0.0, 2.0**0.5, 0.2**0.5]))
    assert widths.dtype == torch.float32


def test_a_direction_no_training_feature_took_is_the_widest():
    phi = torch.tensor([[1.0, 0.0, 0.0]] * 10 + [[0.0, 1.0, 0.0]] * 10)  # nothing along the third axis
    covariance = torch.linalg.inv(F.feature_precision(phi, ridge=1e-2))
    seen, unseen = F.elliptical_width(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), covariance)
    assert unseen == pytest.approx(10.0, rel=1e-5) and seen == pytest.approx((2 / 10.01) ** 0.5, rel=1e-5)


@given(st.integers(0, 2**16), st.floats(-3, 3))
def test_more_training_features_never_widen_and_the_width_scales_with_the_feature(seed, scale):
    g = torch.Generator().manual_seed(seed)
    phi, extra, x = torch.randn(6, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
    before = F.elliptical_width(x, torch.linalg.inv(F.feature_precision(phi, 0.1)))  # (5,)
    after = F.elliptical_width(x, torch.linalg.inv(F.feature_precision(torch.cat([phi, extra]), 0.1)))  # (5,)
    assert bool((after <= before + 1e-5).all())
    scaled = F.elliptical_width(scale * x, torch.linalg.inv(F.feature_precision(phi, 0.1)))
    torch.testing.assert_close(scaled, abs(scale) * before, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: F.feature_precision(torch.zeros(0, 3), 1.0), "must be \\(N, H\\) with N >= 1"),
        (lambda: F.feature_precision(torch.zeros(2, 3), 0.0), "`ridge` must be > 0.0"),
        (lambda: F.elliptical_width(torch.zeros(2, 3), torch.eye(2)), "must agree"),
    ],
)
def test_functional_arguments_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture(scope="module")
def reward_model_dir(tokenizer_dir, tmp_path_factory) -> Path:
    """A randomly initialised reward model (its head seeded) exported with the test tokenizer."""
    folder = tmp_path_factory.mktemp("rm")
    tokenizer = load_tokenizer(tokenizer_dir)
    build_score_model(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=7), tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def posterior_dir(reward_model_dir, tiny_data_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("posterior")
    fit_posterior(str(reward_model_dir), pairs_module(reward_model_dir, tiny_data_dir), folder, ridge=1e-2)
    return folder


def pairs_module(reward_model_dir: Path, tiny_data_dir: Path, batch_size: int = 16) -> PreferenceDataModule:
    """The first 40 pairs of the tiny data, read as a reward model's config would read them."""
    return PreferenceDataModule(str(reward_model_dir), str(tiny_data_dir / "prefs.jsonl"), val_fraction=0.0,
                                split="train[:40]", max_length=64, max_prompt_length=16, batch_size=batch_size)  # fmt: skip


def test_features_are_the_score_heads_input_at_the_scored_token(reward_model_dir):
    tokenizer = load_tokenizer(str(reward_model_dir))
    model = build_score_model(ModelSpec(name_or_path=str(reward_model_dir)), tokenizer).eval()
    enc = tokenizer(["the food was good", "a b"], return_tensors="pt", padding=True)
    with torch.no_grad():
        scores, features = sequence_scores_and_features(model, enc["input_ids"], enc["attention_mask"])
        torch.testing.assert_close(scores, sequence_scores(model, enc["input_ids"], enc["attention_mask"]))
        torch.testing.assert_close(model.score(features).squeeze(-1), scores)
    assert features.shape == (2, 32)


def test_the_posterior_folder_holds_the_training_texts_statistics(posterior_dir, reward_model_dir, tiny_data_dir):
    manifest = json.loads((posterior_dir / "posterior.json").read_text())
    assert manifest["texts"] == 80 and manifest["ridge"] == 0.01
    assert (posterior_dir / manifest["reward_model"]).resolve() == reward_model_dir.resolve()  # relative
    posterior = read_posterior(posterior_dir)
    assert posterior.reward_model.name_or_path == str(reward_model_dir.resolve())
    tokenizer = load_tokenizer(str(reward_model_dir))
    model = build_score_model(posterior.reward_model, tokenizer).eval()
    data = pairs_module(reward_model_dir, tiny_data_dir)
    data.setup("fit")
    enc = data.collator([data.train_dataset[i] for i in range(len(data.train_dataset))])  # all 40 pairs at once
    with torch.no_grad():
        scores, phi = sequence_scores_and_features(model, enc["input_ids"], enc["attention_mask"])
    assert manifest["score_std"] == pytest.approx(scores.std().item(), rel=1e-4)
    expected = torch.linalg.inv(phi.double().T @ phi.double() + 0.01 * torch.eye(32, dtype=torch.float64))
    torch.testing.assert_close(posterior.covariance, expected, rtol=1e-3, atol=1e-4)  # batches of 16 against one of 40
    # the spread is in score units: the training texts' mean spread is the scores' standard deviation
    assert posterior.spread(phi).mean().item() == pytest.approx(manifest["score_std"], rel=1e-4)


def test_the_reward_source_takes_coef_spreads_off_the_score(posterior_dir, reward_model_dir, tokenizer_dir):
    tokenizer = load_tokenizer(tokenizer_dir)
    plain = RewardSource(ModelSpec(name_or_path=str(reward_model_dir)), None, tokenizer)
    source = RewardSource(coerce_reward_model({"posterior": str(posterior_dir), "coef": 2.5}), None, tokenizer)
    assert source.model_spec.name_or_path == str(reward_model_dir.resolve())  # PPO's critic starts from it
    assert source.part_names == ["score", "uncertainty"]
    enc = tokenizer(["the food was good and the food", "b c d"], return_tensors="pt", padding=True)
    total, parts, scored = source.score_terms(enc["input_ids"], enc["attention_mask"], 3, 1)
    torch.testing.assert_close(parts["score"], plain.score(enc["input_ids"], enc["attention_mask"], 3, 2))
    torch.testing.assert_close(total, parts["score"] - 2.5 * parts["uncertainty"])
    assert bool((parts["uncertainty"] > 0).all()) and all(bool(m.all()) for m in scored.values())


def test_grpo_optimises_the_posteriors_score_and_logs_its_parts(posterior_dir, tokenizer_dir, tmp_path):
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), reward_fn=None, max_rollouts=2,
                              reward_model={"posterior": str(posterior_dir), "coef": 1.0})  # fmt: skip
    assert "less 1 x its last-layer spread" in module.rewards.description
    trainer(tmp_path).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/reward/uncertainty"] > 0
        expected = row["rollout/reward/score"] - row["rollout/reward/uncertainty"]
        assert row["rollout/score"] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"posterior": "x", "coef": -1}, "reward_model.coef must be a finite number >= 0"),
        ({"posterior": " "}, "reward_model.posterior must be a folder written by lit_rlhf.posterior"),
        ({"posterior": "x", "aggregation": "min"}, "aggregation"),
    ],
)
def test_posterior_settings_are_checked(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        coerce_reward_model(value)
    assert isinstance(coerce_reward_model({"posterior": "x"}), PosteriorReward)


def test_posterior_folders_are_checked(posterior_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no posterior.json"):
        read_posterior(tmp_path)
    (tmp_path / "posterior.json").write_text(json.dumps({"format": "lit_rlhf.last_layer_posterior", "score_std": 0}))
    with pytest.raises(ValueError, match="score_std must be a number > 0"):
        read_posterior(tmp_path)
    moved = tmp_path / "moved"  # a posterior folder copied without its reward model
    moved.mkdir()
    for name in ("posterior.json", "covariance.safetensors"):
        (moved / name).write_bytes((posterior_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match="its reward model .* is not there"):
        read_posterior(moved)
    # the manifest's own path (what fit_posterior returns) names the same posterior as its folder
    by_file, by_folder = read_posterior(posterior_dir / "posterior.json"), read_posterior(posterior_dir)
    assert by_file.reward_model == by_folder.reward_model and torch.equal(by_file.covariance, by_folder.covariance)


def _copy(posterior_dir: Path, to: Path, reward_model: str | None = None) -> Path:
    """A copy of the posterior folder (its reward model another, where given)."""
    to.mkdir()
    manifest = json.loads((posterior_dir / "posterior.json").read_text())
    manifest["reward_model"] = reward_model or str((posterior_dir / manifest["reward_model"]).resolve())
    (to / "posterior.json").write_text(json.dumps(manifest))
    (to / "covariance.safetensors").write_bytes((posterior_dir / "covariance.safetensors").read_bytes())
    return to


def test_a_damaged_covariance_is_named_with_its_folder(posterior_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(posterior_dir / "covariance.safetensors"))
    cases = {
        "truncated": (lambda f: f.write_bytes(f.read_bytes()[:100]), "covariance.safetensors cannot be read"),
        "no key": (lambda f: save_file({"other": tensors["covariance"]}, str(f)), "covariance.safetensors must hold an \\(H, H\\) `covariance`, got None"),
        "not square": (lambda f: save_file({"covariance": tensors["covariance"][:3]}, str(f)), "covariance.safetensors must hold an .* got \\(3, 32\\)"),
        "nan": (lambda f: save_file({"covariance": tensors["covariance"] * float("nan")}, str(f)), "covariance.safetensors.s covariance has non-finite values"),
    }  # fmt: skip
    for name, (damage, message) in cases.items():
        folder = _copy(posterior_dir, tmp_path / name.replace(" ", "_"))
        damage(folder / "covariance.safetensors")
        with pytest.raises(ValueError, match=f"reward_model.posterior: {folder}: {message}"):
            read_posterior(folder)


def test_a_reward_model_the_posterior_was_not_fit_on_is_refused(posterior_dir, reward_model_dir, tokenizer_dir, tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir)
    wider = tmp_path / "wider"  # another hidden size than the covariance's (before: a shape error at the first rollout)
    config = {**gpt2_config(), "n_embd": 48}
    build_score_model(ModelSpec(config=config, tokenizer=tokenizer_dir, seed=7), tokenizer).save_pretrained(wider)
    tokenizer.save_pretrained(wider)
    folder = _copy(posterior_dir, tmp_path / "wide_posterior", str(wider))
    with pytest.raises(ValueError, match="does not take the covariance's 32 features"):
        RewardSource(PosteriorReward(posterior=str(folder)), None, tokenizer)
    retrained = tmp_path / "retrained"  # the same architecture retrained in place (before: silently stale spreads)
    build_score_model(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir, seed=8), tokenizer).save_pretrained(retrained)
    tokenizer.save_pretrained(retrained)
    folder = _copy(posterior_dir, tmp_path / "stale_posterior", str(retrained))
    with pytest.raises(ValueError, match="another score head than the one the posterior was fit with"):
        RewardSource(PosteriorReward(posterior=str(folder)), None, tokenizer)
    RewardSource(PosteriorReward(posterior=str(posterior_dir)), None, tokenizer)  # its own reward model: accepted


def test_the_command_line_reads_the_reward_models_fit_config(reward_model_dir, tiny_data_dir, tmp_path, capsys):
    import yaml

    data = {"tokenizer": str(reward_model_dir), "train_path": str(tiny_data_dir / "prefs.jsonl"), "split": "train[:20]",
            "val_fraction": 0.25, "max_length": 64, "max_prompt_length": 16, "batch_size": 8}  # fmt: skip
    config = {"trainer": {"callbacks": [{"class_path": "lit_rlhf.callbacks.HFExport",
                                         "init_args": {"dirpath": str(reward_model_dir)}}]},
              "data": {"class_path": "lit_rlhf.data.PreferenceDataModule", "init_args": data}}  # fmt: skip
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(config))
    path = main(["--config", str(tmp_path / "rm.yaml"), "--out", str(tmp_path / "p")])
    manifest = json.loads(path.read_text())
    assert manifest["texts"] == 2 * 15  # its training split: 20 pairs less the 25% hold-out, chosen and rejected
    assert (path.parent / manifest["reward_model"]).resolve() == reward_model_dir.resolve()  # its HFExport folder
    bad = {"pairs given too": ["--pairs", "x.jsonl"], "no data": "{trainer: {}}", "not preference data": (
        "{data: {class_path: lit_rlhf.data.PromptDataModule, init_args: {}}}"), "unknown field": (
        "{data: {class_path: lit_rlhf.data.PreferenceDataModule, init_args: {nope: 1}}}")}  # fmt: skip
    messages = {"pairs given too": "--config reads the pairs as its data module does: drop --pairs",
                "no data": "no `data` with a class_path", "not preference data": "not a PreferenceDataModule",
                "unknown field": "data.init_args"}  # fmt: skip
    for name, extra in bad.items():
        argv = ["--config", str(tmp_path / "rm.yaml"), "--out", str(tmp_path / "q")]
        if isinstance(extra, str):
            (tmp_path / "bad.yaml").write_text(extra)
            argv[1] = str(tmp_path / "bad.yaml")
        else:
            argv += extra
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and messages[name] in err, (name, err)
        assert argv[1] in err or name == "pairs given too", (name, err)


def test_the_command_line_refuses_a_model_that_is_no_reward_model(tokenizer_dir, tiny_data_dir, tmp_path, capsys):
    from lit_rlhf.models import build_causal_lm

    tokenizer = load_tokenizer(tokenizer_dir)
    build_causal_lm(ModelSpec(config=gpt2_config(), tokenizer=tokenizer_dir), tokenizer).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    with pytest.raises(SystemExit) as exit_info:  # before: a posterior of a random head, written with exit 0
        main(["--reward_model", str(tmp_path / "policy"), "--pairs", str(tiny_data_dir / "prefs.jsonl"),
              "--out", str(tmp_path / "p")])  # fmt: skip
    assert exit_info.value.code == 2 and "not a reward model" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_the_command_line_writes_the_folder_and_refuses_bad_arguments(reward_model_dir, tiny_data_dir, tmp_path, capsys):
    path = main(["--reward_model", str(reward_model_dir), "--pairs", str(tiny_data_dir / "prefs.jsonl"),
                 "--split", "train[:8]", "--max_length", "64", "--max_prompt_length", "16", "--out", str(tmp_path / "p")])  # fmt: skip
    assert json.loads(path.read_text())["texts"] == 16
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": 3}\n')
    for argv, message in ((["--ridge", "0"], "--ridge must be"), (["--pairs", str(tmp_path / "none.jsonl")], "none.jsonl"),
                          (["--pairs", str(tmp_path / "bad.jsonl")], "bad.jsonl, row 1 (0-based), field 'chosen'")):  # fmt: skip
        base = {"--reward_model": str(reward_model_dir), "--pairs": str(tiny_data_dir / "prefs.jsonl"),
                "--out": str(tmp_path / "q")}  # fmt: skip
        base.update(dict(zip(argv[::2], argv[1::2])))
        with pytest.raises(SystemExit) as exit_info:
            main([part for item in base.items() for part in item])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err, err

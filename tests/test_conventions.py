"""Lightning conventions of SFT/RM: test/validate, sample tables in every logger at the scalars' step,
plain hparams.yaml, ModelSpec from plain values, top-level exports, seeds that follow seed_everything."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.core.saving import load_hparams_from_yaml
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

from lit_rlhf.data import PreferenceDataModule, SFTDataModule
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import RewardModelModule, SFTModule

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_conv") / "data" / "tiny"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_tiny_data.py"), "--out", str(out), "--rows", "96"], check=True
    )
    return out


def _sft_data(tiny: Path, **kw) -> SFTDataModule:
    return SFTDataModule(
        f"{tiny}/tokenizer", f"{tiny}/sft.jsonl", test_path=f"{tiny}/sft_test.jsonl",
        max_length=48, max_prompt_length=8, batch_size=16, **kw,
    )  # fmt: skip


def test_sft_samples_in_every_logger_at_the_step_of_the_val_scalars(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 gates the offline file store
    seed_everything(0)
    module = SFTModule({"config": TINY_GPT2, "tokenizer": f"{tiny_data}/tokenizer"}, num_samples=2,
                       sample_max_new_tokens=4)  # fmt: skip
    loggers = [
        CSVLogger(tmp_path, name="csv"),
        MLFlowLogger(experiment_name="conv", tracking_uri=f"file:{tmp_path}/mlruns"),
        TensorBoardLogger(tmp_path, name="tb"),
    ]
    trainer = Trainer(
        default_root_dir=tmp_path, logger=loggers, max_steps=6, val_check_interval=3, log_every_n_steps=1,
        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _sft_data(tiny_data))

    # CSV: samples.jsonl beside metrics.csv, at the steps where val/loss was logged (mid-epoch: 2 and 5,
    # while global_step was 3 and 6)
    log_dir = Path(loggers[0].log_dir)
    with (log_dir / "metrics.csv").open() as f:
        val_steps = sorted({int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")})
    samples = [json.loads(line) for line in (log_dir / "samples.jsonl").read_text().splitlines()]
    assert val_steps == [2, 5]
    assert sorted({s["step"] for s in samples}) == val_steps
    assert len(samples) == 4 and {s["tag"] for s in samples} == {"val/samples"}
    assert set(samples[0]) == {"step", "tag", "prompt", "completion"} and samples[0]["prompt"].startswith("review")

    # MLflow: one table artifact per validation, named by the same step
    client, run_id = loggers[1].experiment, loggers[1].run_id
    names = sorted(a.path for a in client.list_artifacts(run_id, "val/samples"))
    assert names == ["val/samples/step_0000002.json", "val/samples/step_0000005.json"]
    table = json.loads(Path(client.download_artifacts(run_id, names[0], str(tmp_path / "dl"))).read_text())
    assert table["columns"] == ["prompt", "completion"] and len(table["data"]) == 2
    val_history = [m.step for m in client.get_metric_history(run_id, "val/loss")]
    assert sorted(val_history) == val_steps

    # TensorBoard: text at the same steps
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(loggers[2].log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("val/samples/text_summary")] == val_steps
    assert [e.step for e in acc.Scalars("val/loss")] == val_steps

    # hparams.yaml: plain values Lightning's own reader understands; the checkpoint reloads from them
    hparams = load_hparams_from_yaml(str(log_dir / "hparams.yaml"))
    assert hparams["model"]["config"] == TINY_GPT2 and hparams["model"]["seed"] is None
    assert "!!python" not in (log_dir / "hparams.yaml").read_text()
    ckpt = next(Path(tmp_path).rglob("*.ckpt"))
    again = SFTModule.load_from_checkpoint(ckpt)
    torch.testing.assert_close(again.model.state_dict(), module.model.state_dict())

    # test: test/* metrics and test/samples on the held-out test_path
    results = trainer.test(module, _sft_data(tiny_data))
    assert {"test/loss", "test/perplexity", "test/token_accuracy"} <= set(results[0])
    tags = {json.loads(line)["tag"] for line in (log_dir / "samples.jsonl").read_text().splitlines()}
    assert "test/samples" in tags


def test_model_spec_from_plain_values(tiny_data, tmp_path):
    tok = f"{tiny_data}/tokenizer"
    module = RewardModelModule({"config": TINY_GPT2, "tokenizer": tok, "seed": 3})
    assert module.spec == ModelSpec(config=TINY_GPT2, tokenizer=tok, seed=3)
    SFTModule({"config": TINY_GPT2, "tokenizer": tok, "seed": 3}).export_pretrained(str(tmp_path / "sft"))
    from_path = SFTModule(str(tmp_path / "sft"))
    assert from_path.spec.name_or_path == str(tmp_path / "sft") and from_path.hparams.model["name_or_path"]
    with pytest.raises(TypeError, match=r"model: unknown ModelSpec field\(s\) \['layers'\]"):
        SFTModule({"config": TINY_GPT2, "tokenizer": tok, "layers": 2})
    with pytest.raises(TypeError, match="model: expected a ModelSpec"):
        RewardModelModule(3)


def test_reward_model_test_and_missing_test_path(tiny_data, tmp_path):
    module = RewardModelModule(ModelSpec(config=TINY_GPT2, tokenizer=f"{tiny_data}/tokenizer", seed=0))
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    common = dict(max_length=48, max_prompt_length=8, batch_size=16)
    data = PreferenceDataModule(f"{tiny_data}/tokenizer", f"{tiny_data}/prefs.jsonl",
                                test_path=f"{tiny_data}/prefs_test.jsonl", **common)  # fmt: skip
    (results,) = trainer.test(module, data)
    assert {"test/loss", "test/accuracy", "test/margin", "test/chosen_score_std"} <= set(results)
    assert data.stats["test"]["rows"] == 24
    no_test = PreferenceDataModule(f"{tiny_data}/tokenizer", f"{tiny_data}/prefs.jsonl", **common)
    with pytest.raises(ValueError, match="set `test_path`"):
        trainer.test(module, no_test)


def test_top_level_exports():
    import lit_rlhf

    assert lit_rlhf.SFTModule is SFTModule and lit_rlhf.PreferenceDataModule is PreferenceDataModule
    from lit_rlhf import CriticFreeModule, DPOModule, PPOModule
    from lit_rlhf.modules import critic_free, dpo, ppo

    assert (CriticFreeModule, DPOModule, PPOModule) == (critic_free.CriticFreeModule, dpo.DPOModule, ppo.PPOModule)
    for name in lit_rlhf.__all__:
        assert getattr(lit_rlhf, name) is not None
    code = "import sys, lit_rlhf; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False", "import lit_rlhf must stay cheap (exports load on first use)"


def test_data_and_model_seeds_follow_seed_everything_unless_given(tiny_data):
    def order(global_seed: int, **kw) -> list[int]:
        seed_everything(global_seed)
        data = _sft_data(tiny_data, val_fraction=0.2, **kw)
        data.setup("fit")
        return list(iter(data.train_dataloader().sampler))

    assert order(1) == order(1) and order(1) != order(2)
    assert order(1, seed=7) == order(2, seed=7)

    def weights(global_seed: int, spec_seed: int | None) -> torch.Tensor:
        seed_everything(global_seed)
        spec = {"config": TINY_GPT2, "tokenizer": f"{tiny_data}/tokenizer", "seed": spec_seed}
        return SFTModule(spec).model.transformer.wte.weight.detach().clone()

    assert torch.equal(weights(1, None), weights(1, None)) and not torch.equal(weights(1, None), weights(2, None))
    assert torch.equal(weights(1, 5), weights(2, 5))


def test_modules_check_the_batch_layout(tiny_data):
    from lit_rlhf.data.contract import BatchContractError

    spec = {"config": TINY_GPT2, "tokenizer": f"{tiny_data}/tokenizer"}
    trl_pairs = {"input_ids_chosen": torch.ones(2, 4, dtype=torch.long), "attention_mask_chosen": torch.ones(2, 4)}
    with pytest.raises(BatchContractError, match="RewardModelModule expects a 'preference' batch.*TRL RewardTrainer"):
        RewardModelModule(spec).training_step(trl_pairs, 0)
    with pytest.raises(BatchContractError, match="SFTModule expects an? 'sft' batch.*SFTDataModule"):
        SFTModule(spec).validation_step({"input_ids": torch.ones(2, 4, dtype=torch.long)}, 0)


def test_wandb_offline_gets_the_sample_table(tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    from lit_rlhf.modules.samples import log_text_table

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="lit_rlhf_test")
    module = LightningModule()  # log_text_table only reads the module's trainer
    module.trainer = Trainer(logger=logger, default_root_dir=tmp_path, enable_progress_bar=False)
    log_text_table(module, "val/samples", ["prompt", "completion"], [["review 1:", " the food was good."]], step=3)
    logger.experiment.finish()
    (table,) = Path(logger.experiment.dir).parent.glob("files/media/table/val/samples_*.table.json")
    content = json.loads(table.read_text())
    assert content["columns"] == ["prompt", "completion"] and content["data"] == [["review 1:", " the food was good."]]

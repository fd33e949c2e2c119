"""SFTModule and RewardModelModule: CLI fit with TensorBoard + export, plain-Trainer use, exact resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf.data import PreferenceDataModule, SFTDataModule
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import RewardModelModule, SFTModule

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128}
# dropout off: Lightning does not checkpoint the global RNG, so dropout masks would differ after resume
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_data")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/make_tiny_data.py"), "--out", str(out), "--rows", "160"], check=True
    )
    return out


def tb_scalars(log_dir: Path) -> dict[str, list[float]]:
    """All scalar series written to TensorBoard event files under ``log_dir``, read back by tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, list[float]] = {}
    for events in log_dir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            series.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return series


def test_reward_model_cli_fit_learns_logs_and_exports(tiny_data, tmp_path):
    run = tmp_path / "rm"
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(ROOT / "configs/rm_tiny.yaml"),
        f"--data.init_args.tokenizer={tiny_data}/tokenizer",
        f"--data.init_args.train_path={tiny_data}/prefs.jsonl",
        f"--model.init_args.model.tokenizer={tiny_data}/tokenizer",
        f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.default_root_dir={run}",
        "--trainer.callbacks+=lit_rlhf.callbacks.HFExport", f"--trainer.callbacks.dirpath={run}/export",
        "--trainer.max_epochs=3", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    scalars = tb_scalars(run)
    for tag in ("train/loss", "train/accuracy", "val/loss", "val/accuracy", "val/margin", "val/chosen_score_mean"):
        assert tag in scalars, f"{tag} missing from TensorBoard; have {sorted(scalars)}"
    losses = scalars["train/loss"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, "training loss must fall"
    # held-out pairs (the 10% validation carve-out): chance is 0.5, the toy preference is separable
    assert scalars["val/accuracy"][-1] >= 0.85

    # the export loads with plain transformers and reproduces the module's scores
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lit_rlhf.models import sequence_scores

    model = AutoModelForSequenceClassification.from_pretrained(run / "export").eval()
    tok = AutoTokenizer.from_pretrained(run / "export")
    batch = tok([" the food was great.", " the room was awful and the plot was dull."], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
        theirs = model(**batch).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert ours[0] > ours[1], "the positive review must score higher"


def _rm(tiny_data: Path) -> RewardModelModule:
    return RewardModelModule(
        ModelSpec(config={**TINY_GPT2, **NO_DROPOUT}, tokenizer=f"{tiny_data}/tokenizer", seed=0),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )


def _pref_data(tiny_data: Path) -> PreferenceDataModule:
    return PreferenceDataModule(
        f"{tiny_data}/tokenizer", f"{tiny_data}/prefs.jsonl", max_length=64, max_prompt_length=16, batch_size=16
    )


def _trainer(root: Path, **kwargs) -> Trainer:
    defaults = dict(
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, num_sanity_val_steps=0,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


class StopAt(Callback):
    """Stop fitting after ``step`` optimiser steps, as a crash or a pre-emption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_reward_model_resume_continues_exactly(tiny_data, tmp_path):
    # Uninterrupted: 6 steps. Interrupted: 3 steps with a checkpoint, then a new Trainer resumes to 6.
    # Same data order, optimiser (AdamW moments) and scheduler state => identical final weights.
    torch.manual_seed(0)
    full = _rm(tiny_data)
    _trainer(tmp_path / "a", max_steps=6, enable_checkpointing=False, limit_val_batches=0).fit(full, _pref_data(tiny_data))

    first = _rm(tiny_data)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=3)
    # same max_steps (so the LR schedule has the same length), interrupted after step 3
    interrupted = _trainer(tmp_path / "b", max_steps=6, callbacks=[ckpt, StopAt(3)], limit_val_batches=0)
    interrupted.fit(first, _pref_data(tiny_data))
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 3

    resumed = _rm(tiny_data)
    trainer = _trainer(tmp_path / "c", max_steps=6, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(resumed, _pref_data(tiny_data), ckpt_path=path)
    assert trainer.global_step == 6
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")
    opt_full = trainer.optimizers[0].state_dict()["state"]
    assert opt_full, "optimiser state restored and advanced"


def test_sft_plain_trainer_learns_and_exports(tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = SFTModule(
        ModelSpec(config=TINY_GPT2, tokenizer=f"{tiny_data}/tokenizer", seed=0),
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
        num_samples=1,
        sample_max_new_tokens=8,
    )
    data = SFTDataModule(f"{tiny_data}/tokenizer", f"{tiny_data}/sft.jsonl", max_length=64, max_prompt_length=16, batch_size=16)
    initial = _trainer(tmp_path, inference_mode=False).validate(module, data, verbose=False)[0]["val/perplexity"]
    trainer = _trainer(tmp_path, max_epochs=3, enable_checkpointing=False)
    before = [p.detach().clone() for p in module.model.parameters()]
    trainer.fit(module, data)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.model.parameters())), "weights changed"
    metrics = trainer.logged_metrics
    # a random model's perplexity is about the vocabulary size (400)
    assert initial > 200 and metrics["val/perplexity"] < initial / 4, (initial, metrics)
    assert 0 < metrics["val/token_accuracy"] <= 1
    module.export_pretrained(str(tmp_path / "export"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    batch = next(iter(data.val_dataloader()))
    module.model.eval()
    with torch.no_grad():
        from lit_rlhf.models import causal_lm_logits

        ours = causal_lm_logits(module.model, batch["input_ids"], batch["attention_mask"])
        theirs = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(ours, theirs)


def test_reward_model_plain_trainer_with_margin_and_centering(tiny_data, tmp_path):
    module = RewardModelModule(
        ModelSpec(config=TINY_GPT2, tokenizer=f"{tiny_data}/tokenizer", seed=0),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        center_rewards_coef=0.01,
    )
    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(module, _pref_data(tiny_data))
    for key in ("val/accuracy", "val/margin", "val/chosen_score_std", "val/rejected_score_mean", "train/loss"):
        assert torch.isfinite(trainer.logged_metrics[key]), key

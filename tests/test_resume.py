"""Exact resume of SFT, RM and a reward-model ensemble from every kind of checkpoint, against the uninterrupted run.

Constant learning rate and no dropout: the schedule's length then does not depend on the limit (so a
resume with a larger limit can be compared), and no RNG state outside the checkpoint matters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf.data import PreferenceDataModule, SFTDataModule
from lit_rlhf.models import ModelSpec
from lit_rlhf.modules import RewardEnsembleModule, RewardModelModule, SFTModule

TINY = {
    "model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
}  # fmt: skip
STEPS_PER_EPOCH = 5  # 80 rows / batch_size 16


def make(kind: str, tiny: Path, batch_size: int = 16):
    spec = ModelSpec(config=TINY, tokenizer=f"{tiny}/tokenizer", seed=0)
    opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    kw = dict(max_length=64, max_prompt_length=16, batch_size=batch_size, split="train[:80]", val_fraction=0.0)
    if kind == "sft":
        return (
            SFTModule(spec, optimizer=opt, scheduler=None, num_samples=0),
            SFTDataModule(f"{tiny}/tokenizer", f"{tiny}/sft.jsonl", **kw),
        )
    data = PreferenceDataModule(f"{tiny}/tokenizer", f"{tiny}/prefs.jsonl", **kw)
    if kind == "ensemble":  # three members, each on its own bootstrap resample of the pairs
        return RewardEnsembleModule(spec, num_members=3, bootstrap=True, optimizer=opt, scheduler=None), data
    return RewardModelModule(spec, optimizer=opt, scheduler=None), data


def fit(kind, tiny, root: Path, max_epochs: int, ckpt_path=None, max_steps: int = -1, batch_size: int = 16, **kwargs):
    """Checkpoints: ``ckpt/steps`` every 2 steps (+ last.ckpt), ``ckpt/epochs`` at each epoch's end."""
    module, data = make(kind, tiny, batch_size)
    steps = ModelCheckpoint(root / "ckpt/steps", "{epoch}-{step}", save_top_k=-1, every_n_train_steps=2, save_last=True)
    epochs = ModelCheckpoint(root / "ckpt/epochs", "{epoch}-{step}", save_top_k=-1, every_n_epochs=1)
    trainer = Trainer(
        default_root_dir=root, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[steps, epochs], deterministic=True,
        max_steps=max_steps, **kwargs,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module


def data_state(path: Path) -> dict:
    (state,) = [v for k, v in torch.load(path, weights_only=False).items() if k.endswith("DataModule")]
    return state


def assert_same_weights(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, msg=f"{name} differs after resume")


@pytest.fixture(scope="module", params=["sft", "rm"])
def uninterrupted(request, tiny_data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"full_{request.param}")
    trainer, module = fit(request.param, tiny_data_dir, root, 3)
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    return request.param, root, module


def test_end_of_epoch_checkpoint_state_starts_the_next_epoch(uninterrupted):
    _, root, _ = uninterrupted
    state = data_state(root / "ckpt/epochs" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
    assert state == {"epoch": 1, "consumed": 0, "offset": 0, "batches": 0}


@pytest.mark.parametrize(
    "name", ["steps/epoch=0-step=4.ckpt", "epochs/epoch=0-step=5.ckpt", "epochs/epoch=1-step=10.ckpt", "steps/last.ckpt"]
)
def test_resume_from_checkpoint_matches_uninterrupted(name, uninterrupted, tiny_data_dir, tmp_path):
    # step 4: mid-epoch; steps 5 and 10: saved at the end of an epoch; last: the end of the run
    kind, root, full = uninterrupted
    trainer, resumed = fit(kind, tiny_data_dir, tmp_path, 3, ckpt_path=root / "ckpt" / name)
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    assert_same_weights(full, resumed)


def test_end_of_run_resume_with_a_larger_limit_continues(uninterrupted, tiny_data_dir, tmp_path):
    kind, root, full = uninterrupted
    fit(kind, tiny_data_dir, tmp_path / "short", 2)
    (end,) = (tmp_path / "short" / "ckpt/epochs").glob(f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt")
    trainer, resumed = fit(kind, tiny_data_dir, tmp_path / "more", 3, ckpt_path=end)
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    assert_same_weights(full, resumed)


def test_a_run_cut_mid_epoch_by_max_steps_continues_that_epoch_when_extended(uninterrupted, tiny_data_dir, tmp_path):
    """``max_steps`` ends the epoch early and Lightning counts it finished; the extension's next epoch
    continues the cut one's order (before, it started a new order and never saw the rest)."""
    kind, _, full = uninterrupted
    fit(kind, tiny_data_dir, tmp_path / "short", 3, max_steps=STEPS_PER_EPOCH + 2)
    end = tmp_path / "short/ckpt/epochs" / f"epoch=1-step={STEPS_PER_EPOCH + 2}.ckpt"
    assert data_state(end) == {"epoch": 1, "consumed": 32, "offset": 1, "batches": 0}
    trainer, resumed = fit(kind, tiny_data_dir, tmp_path / "more", 4, ckpt_path=end)
    # Lightning's epochs are one ahead of the order's from there: the 3 batches left of order 1 make its
    # epoch 2, order 2 its epoch 3
    assert trainer.global_step == 3 * STEPS_PER_EPOCH
    assert_same_weights(full, resumed)


def test_epochs_shortened_by_limit_train_batches_resume_with_a_new_order(tiny_data_dir, tmp_path):
    """``limit_train_batches`` ends every epoch early by design: each epoch is a new order's first batches,
    resumed alike (not the continuation of a run cut short)."""
    _, full = fit("sft", tiny_data_dir, tmp_path / "full", 3, limit_train_batches=2)
    end = tmp_path / "full/ckpt/epochs/epoch=0-step=2.ckpt"
    assert data_state(end) == {"epoch": 1, "consumed": 0, "offset": 0, "batches": 0}
    _, resumed = fit("sft", tiny_data_dir, tmp_path / "resumed", 3, ckpt_path=end, limit_train_batches=2)
    assert_same_weights(full, resumed)


def test_a_batch_size_changed_on_resume_keeps_the_data_position(tiny_data_dir, tmp_path):
    """The position counts the batches before the resume at their own size (before, all at the new one)."""
    fit("sft", tiny_data_dir, tmp_path / "a", 1, max_steps=2)  # 2 batches of 16: 32 rows of order 0
    trainer, _ = fit("sft", tiny_data_dir, tmp_path / "b", 1, ckpt_path=tmp_path / "a/ckpt/steps/last.ckpt",
                     max_steps=4, batch_size=8)  # fmt: skip
    assert data_state(tmp_path / "b/ckpt/steps/last.ckpt")["consumed"] == 32 + 2 * 8


def test_checkpoint_without_metric_states_still_resumes(uninterrupted, tiny_data_dir, tmp_path):
    # checkpoints written before the epoch-metric states were kept: those metrics start empty
    kind, root, _ = uninterrupted
    state = torch.load(root / "ckpt/steps/epoch=0-step=4.ckpt", weights_only=False)
    metric_keys = [k for k in state["state_dict"] if k.startswith(("train_metrics.", "train_nll.", "train_acc."))]
    assert metric_keys
    for key in metric_keys:
        del state["state_dict"][key]
    torch.save(state, tmp_path / "old.ckpt")
    trainer, _ = fit(kind, tiny_data_dir, tmp_path, 3, ckpt_path=tmp_path / "old.ckpt")
    assert trainer.global_step == 3 * STEPS_PER_EPOCH


@pytest.mark.parametrize("name", ["steps/epoch=0-step=4.ckpt", "epochs/epoch=0-step=5.ckpt"])
def test_reward_ensemble_resume_matches_uninterrupted(name, tiny_data_dir, tmp_path):
    # mid-epoch and end-of-epoch checkpoints of 2 epochs; the members' bootstrap counts depend on the pair only
    trainer, full = fit("ensemble", tiny_data_dir, tmp_path / "full", 2)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    _, resumed = fit("ensemble", tiny_data_dir, tmp_path / "resumed", 2, ckpt_path=tmp_path / "full" / "ckpt" / name)
    assert_same_weights(full, resumed)
    assert not torch.equal(full.model[0].score.weight, full.model[1].score.weight)

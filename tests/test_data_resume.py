"""Exact mid-epoch resume of the prompt order through a real Lightning checkpoint."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf.data import PromptDataModule

datasets.disable_progress_bars()


class RecordBatches(LightningModule):
    """Trains nothing useful; remembers every batch of prompts (unpadded token ids) it is given, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[tuple] = []

    def training_step(self, batch, batch_idx):
        rows = zip(batch["input_ids"], batch["attention_mask"].bool())
        self.seen.append(tuple(tuple(ids[mask].tolist()) for ids, mask in rows))
        return (self.weight**2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(path, tokenizer_dir, ckpt_dir, ckpt_path=None) -> list[tuple]:
    model = RecordBatches()
    dm = PromptDataModule(tokenizer_dir, path, batch_size=2, seed=3)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)]
    trainer = Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


@pytest.fixture(scope="module")
def uninterrupted(tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(20)))
    return str(path), fit(str(path), tokenizer_dir, folder / "ckpt"), folder / "ckpt"


def test_uninterrupted_epochs_differ_and_cover_the_data(uninterrupted):
    _, seen, _ = uninterrupted
    assert len(seen) == 20  # 20 prompts / batch_size 2 = 10 batches per epoch, 2 epochs
    epoch0 = sorted(row for batch in seen[:10] for row in batch)
    assert epoch0 == sorted(row for batch in seen[10:] for row in batch) and len(set(epoch0)) == 20
    assert seen[:10] != seen[10:]  # reshuffled per epoch


@pytest.mark.parametrize("step", [4, 10, 13])  # mid epoch 0, end of epoch 0, mid epoch 1
def test_resume_continues_with_the_next_batch(step, uninterrupted, tokenizer_dir, tmp_path):
    path, seen, ckpt_dir = uninterrupted
    resumed = fit(path, tokenizer_dir, tmp_path, ckpt_path=str(ckpt_dir / f"step={step}.ckpt"))
    assert resumed == seen[step:]


def test_resume_on_fewer_rows_than_the_checkpoint_consumed_is_refused(uninterrupted, tokenizer_dir, tmp_path):
    """The saved position (8 of 20 rows consumed at step 4) is past a 4-row file's epoch: only changed training
    data gives that. Before, the rest of the epoch was silently skipped (a CLI run trained nothing and exited 0)."""
    _, _, ckpt_dir = uninterrupted
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(4)))
    with pytest.raises(ValueError, match=r"training position \(8 rows of its epoch consumed\).*small.jsonl"):
        fit(str(small), tokenizer_dir, tmp_path / "ckpt", ckpt_path=str(ckpt_dir / "step=4.ckpt"))

"""Output folders that cannot be written are refused when fit starts, not after training."""

from __future__ import annotations

import os

import pytest
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_rlhf.callbacks import (
    CheckpointFolderCheck,
    HFExport,
    PeakMemory,
    SigtermCheckpoint,
    check_output_folder,
)


class CountSteps(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args) -> None:
        self.steps += 1


def fit(tmp_path, *callbacks) -> CountSteps:
    counter = CountSteps()
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, counter],
    )  # fmt: skip
    trainer.fit(BoringModel())
    return counter


def test_hf_export_into_an_existing_file_is_refused_before_the_first_step(tmp_path):
    target = tmp_path / "export"
    target.write_text("not a folder")
    counter = CountSteps()
    with pytest.raises(FileExistsError, match=rf"HFExport dirpath: {target} is an existing file, not a folder"):
        fit(tmp_path, HFExport(str(target)), counter)
    assert counter.steps == 0


def test_hf_export_under_a_file_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "blocker").write_text("")
    target = tmp_path / "blocker" / "export"
    with pytest.raises(NotADirectoryError, match=rf"HFExport dirpath: {target} cannot be created: .*blocker is a file"):
        fit(tmp_path, HFExport(str(target)))


def test_checkpoint_folder_that_cannot_be_created_is_refused_before_the_first_step(tmp_path):
    (tmp_path / "blocker").write_text("")
    folder = tmp_path / "blocker" / "checkpoints"
    counter = CountSteps()
    with pytest.raises(NotADirectoryError, match=rf"ModelCheckpoint dirpath: {folder} cannot be created"):
        fit(tmp_path, ModelCheckpoint(dirpath=folder), CheckpointFolderCheck(), counter)
    assert counter.steps == 0
    # a good folder passes (and is created by ModelCheckpoint itself, as before)
    fit(tmp_path, ModelCheckpoint(dirpath=tmp_path / "ok" / "checkpoints"), CheckpointFolderCheck())
    assert any((tmp_path / "ok" / "checkpoints").iterdir())


def test_sigterm_and_peak_memory_destinations_are_checked_before_the_first_step(tmp_path):
    (tmp_path / "blocker").write_text("")
    counter = CountSteps()
    with pytest.raises(NotADirectoryError, match="SigtermCheckpoint dirpath: .*blocker is a file"):
        fit(tmp_path, SigtermCheckpoint(dirpath=str(tmp_path / "blocker" / "sig")), CheckpointFolderCheck(), counter)
    with pytest.raises(FileExistsError, match="PeakMemory output: .*blocker is an existing file, not a folder"):
        fit(tmp_path, PeakMemory(output=str(tmp_path / "blocker" / "peak.json")), counter)
    with pytest.raises(IsADirectoryError, match="PeakMemory output: .* is a folder"):
        fit(tmp_path, PeakMemory(output=str(tmp_path)), counter)
    assert counter.steps == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_is_refused(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="x: .* cannot be created"):
            check_output_folder(parent / "out", "x")
    finally:
        parent.chmod(0o700)


def test_missing_nested_folders_and_remote_paths_pass(tmp_path):
    check_output_folder(tmp_path / "a" / "b" / "c", "x")
    check_output_folder("s3://bucket/prefix", "x")
    assert not (tmp_path / "a").exists(), "nothing is created"


# -- the data's tokenizer is the model's --------------------------------------------------------------------
@pytest.mark.parametrize("module", ["sft", "grpo"])
def test_a_data_module_with_another_tokenizer_is_refused_before_the_first_step(tokenizer_dir, tmp_path, module):
    import json

    from conftest import gpt2_config, make_corpus
    from ppo_helpers import tiny_critic_free

    from lit_rlhf.data import PromptDataModule, SFTDataModule
    from lit_rlhf.models.tokenizer import train_bpe_tokenizer
    from lit_rlhf.modules import SFTModule

    other = tmp_path / "other_tok"
    train_bpe_tokenizer(make_corpus(seed=1), vocab_size=300).save_pretrained(other)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "the food", "completion": " was good"}) + "\n" for _ in range(8)))
    if module == "sft":
        model = SFTModule(model={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0})
        data = SFTDataModule(str(other), str(rows), batch_size=4)
    else:
        model = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1)
        data = PromptDataModule(str(other), str(rows), batch_size=4)
    counter = CountSteps()
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[counter])  # fmt: skip
    with pytest.raises(ValueError, match=r"the data module's tokenizer .*other_tok.* is not the model's .*another vocabulary"):
        trainer.fit(model, data)
    assert counter.steps == 0


def test_sft_rows_past_a_learned_position_table_are_refused(tokenizer_dir, tmp_path):
    import json

    from conftest import gpt2_config

    from lit_rlhf.data import SFTDataModule
    from lit_rlhf.modules import SFTModule

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": "the food " * 6, "completion": " was good" * 6}) + "\n" for _ in range(4)))
    model = SFTModule(model={"config": {**gpt2_config(), "n_positions": 16}, "tokenizer": tokenizer_dir, "seed": 0}, num_samples=0)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"^SFTModule: the batch's longest row .* make \d+ positions, past the 16 the model's learned position table holds"):
        trainer.fit(model, SFTDataModule(tokenizer_dir, str(rows), batch_size=4))


def test_a_fast_dev_run_exports_nothing_and_barebones_gets_no_progress_callbacks(tokenizer_dir, tmp_path):
    from conftest import gpt2_config

    from lit_rlhf.modules import SFTModule
    from lit_rlhf.progress import default_callbacks

    model = SFTModule(model={"config": gpt2_config(), "tokenizer": tokenizer_dir, "seed": 0}, num_samples=0)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "the food", "completion": " was good"}\n' * 4)
    from lit_rlhf.data import SFTDataModule

    trainer = Trainer(default_root_dir=tmp_path, fast_dev_run=True, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[HFExport(str(tmp_path / "export"))])  # fmt: skip
    trainer.fit(model, SFTDataModule(tokenizer_dir, str(rows), batch_size=2))
    assert not (tmp_path / "export").exists(), "a dev run writes no artifacts, so it blocks no real fit"
    assert default_callbacks(model, {"barebones": True}) == []  # Lightning refuses a bar or summary there
    assert len(default_callbacks(model, {})) == 2

"""``HFExport(overwrite=True)`` replaces what its folder held: another run's sub-folders (a PPO export's
``critic/``, an ensemble's ``member_<k>/``) do not stay beside the new export under the new run's marker;
what this fit writes there itself (checkpoints, logs) and the working directory are never deleted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from conftest import gpt2_config
from lightning.pytorch.callbacks import ModelCheckpoint
from ppo_helpers import prompt_loader, tiny_critic_free, trainer

from lit_rlhf.callbacks import EXPORT_MARKER, HFExport


def earlier_export(folder, run_id: str = "earlier") -> None:
    """A folder as another run's PPO export of 3 ensemble members left it."""
    for name in ("actor", "critic", "member_2"):
        (folder / name).mkdir(parents=True)
        (folder / name / "config.json").write_text("{}")
    (folder / EXPORT_MARKER).write_text(json.dumps({"run_id": run_id}) + "\n")


def test_overwrite_removes_another_runs_subfolders(tokenizer_dir, tmp_path):
    folder = tmp_path / "export"
    earlier_export(folder)
    module = tiny_critic_free(tokenizer_dir, gpt2_config(), max_rollouts=1, update={"epochs": 1})
    callback = HFExport(str(folder), overwrite=True)
    trainer(tmp_path, callbacks=[callback]).fit(module, prompt_loader(tokenizer_dir, n=8, batch_size=2))
    assert sorted(p.name for p in folder.iterdir()) == ["actor", EXPORT_MARKER]
    assert json.loads((folder / EXPORT_MARKER).read_text())["run_id"] == callback.run_id != "earlier"
    assert (folder / "actor" / "config.json").read_text() != "{}"


def fake_trainer(*callbacks, loggers=()) -> SimpleNamespace:
    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    return SimpleNamespace(checkpoint_callbacks=checkpoints, callbacks=list(callbacks), loggers=list(loggers))


def test_the_runs_own_export_and_a_folder_without_overwrite_are_not_cleared(tmp_path):
    earlier_export(tmp_path / "own", run_id="this-run")
    callback = HFExport(str(tmp_path / "own"), overwrite=True)
    callback.run_id = "this-run"  # a resumed run: it replaces its own files
    callback.clear_destination(fake_trainer())
    assert (tmp_path / "own" / "critic").is_dir()
    earlier_export(tmp_path / "kept")
    HFExport(str(tmp_path / "kept")).clear_destination(fake_trainer())
    assert (tmp_path / "kept" / "critic").is_dir()


def test_the_fits_checkpoints_and_logs_inside_the_folder_are_kept(tmp_path):
    folder = tmp_path / "export"
    earlier_export(folder)
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_text("x")
    (folder / "logs" / "version_0").mkdir(parents=True)
    logger = SimpleNamespace(log_dir=str(folder / "logs" / "version_0"))
    checkpoint = ModelCheckpoint(dirpath=str(folder / "checkpoints"))
    HFExport(str(folder), overwrite=True).clear_destination(fake_trainer(checkpoint, loggers=[logger]))
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "logs"]
    assert (folder / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("where", ["cwd", "parent of cwd", "checkpoint folder"])
def test_the_working_directory_and_the_checkpoint_folder_are_never_emptied(tmp_path, monkeypatch, where):
    folder = tmp_path / "export"
    earlier_export(folder)
    (folder / "actor" / "sub").mkdir()
    monkeypatch.chdir({"cwd": folder, "parent of cwd": folder / "actor" / "sub"}.get(where, tmp_path))
    callbacks = [ModelCheckpoint(dirpath=str(folder))] if where == "checkpoint folder" else []
    with pytest.warns(UserWarning, match="left in place"):
        HFExport(str(folder), overwrite=True).clear_destination(fake_trainer(*callbacks))
    assert (folder / "critic").is_dir() and (folder / "member_2").is_dir()

"""``HFExport(overwrite=True)`` replaces another run's export: its sub-folders (a PPO export's ``critic/``, an
ensemble's ``member_<k>/``) and files do not stay beside the new export under the new run's marker. Only a
folder marked by another run's HFExport is touched, and in it only what an export writes: other sub-folders
(checkpoints, logs, a user's), a folder without a marker, the working directory and the home folder stay."""

from __future__ import annotations

import json

import pytest
from conftest import gpt2_config
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


def test_only_what_an_export_writes_is_removed(tmp_path):
    folder = tmp_path / "export"
    earlier_export(folder)
    (folder / "model.safetensors").write_text("stale weights")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_text("x")
    (folder / "logs" / "version_0").mkdir(parents=True)
    HFExport(str(folder), overwrite=True).clear_destination()
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", EXPORT_MARKER, "logs"]
    assert (folder / "checkpoints" / "last.ckpt").is_file()


def test_the_runs_own_export_a_folder_without_overwrite_or_without_a_marker_are_not_cleared(tmp_path):
    earlier_export(tmp_path / "own", run_id="this-run")
    callback = HFExport(str(tmp_path / "own"), overwrite=True)
    callback.run_id = "this-run"  # a resumed run: it replaces its own files
    callback.clear_destination()
    assert (tmp_path / "own" / "critic").is_dir()
    earlier_export(tmp_path / "kept")
    HFExport(str(tmp_path / "kept")).clear_destination()
    assert (tmp_path / "kept" / "critic").is_dir()
    earlier_export(tmp_path / "unmarked")
    (tmp_path / "unmarked" / EXPORT_MARKER).unlink()  # not an HFExport folder: written over, nothing deleted
    HFExport(str(tmp_path / "unmarked"), overwrite=True).clear_destination()
    assert (tmp_path / "unmarked" / "critic").is_dir()


@pytest.mark.parametrize("marker", ["", "[1, 2]", '{"other": 1}'])
def test_an_unreadable_marker_is_another_runs(tmp_path, marker):
    # a marker cut short by a crash: the export at the end of the fit neither fails nor keeps the stale folders
    folder = tmp_path / "export"
    earlier_export(folder)
    (folder / EXPORT_MARKER).write_text(marker)
    HFExport(str(folder), overwrite=True).clear_destination()
    assert not (folder / "critic").exists()


@pytest.mark.parametrize("where", ["cwd", "parent of cwd", "home", "parent of home"])
def test_the_working_directory_and_the_home_folder_are_never_cleared(tmp_path, monkeypatch, where):
    folder = tmp_path / "export"
    earlier_export(folder)
    (folder / "actor" / "sub").mkdir()
    monkeypatch.chdir({"cwd": folder, "parent of cwd": folder / "actor" / "sub"}.get(where, tmp_path))
    home = {"home": folder, "parent of home": folder / "user"}.get(where, tmp_path / "elsewhere")
    monkeypatch.setenv("HOME", str(home))
    with pytest.warns(UserWarning, match="nothing removed"):
        HFExport(str(folder), overwrite=True).clear_destination()
    assert (folder / "critic").is_dir() and (folder / "member_2").is_dir()

"""Every YAML in configs/ parses with the lit-rlhf LightningCLI and survives a --print_config round trip."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from lit_rlhf.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.joinpath("configs").rglob("*.yaml"))


def print_config(path: Path) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    return out.getvalue()


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"sft_tiny.yaml", "rm_tiny.yaml", "ppo_tiny.yaml", "grpo_tiny.yaml", "rloo_tiny.yaml"} <= names
    assert "reinforce_pp_tiny.yaml" in names
    assert {"online_dpo_tiny.yaml", "rm_ensemble_tiny.yaml", "ppo_ensemble_tiny.yaml", "ppo_posterior_tiny.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_config_print_config_round_trip(path, tmp_path):
    first = print_config(path)
    assert "class_path" in first
    again = tmp_path / "printed.yaml"
    again.write_text(first)
    assert print_config(again) == first


def test_the_readmes_checkpoint_paths_are_where_their_configs_write_checkpoints():
    """The Quick start's `lit-rlhf test --config X --ckpt_path P` commands name a folder X's ModelCheckpoint writes
    to (the RM command named runs/rm_tiny/version_0/checkpoints, which no config writes)."""
    import re

    import yaml

    commands = re.findall(r"--config (configs/\S+\.yaml)\s*\\?\s*--ckpt_path (\S+)", (ROOT / "README.md").read_text())
    assert commands
    for config, ckpt in commands:
        callbacks = yaml.safe_load((ROOT / config).read_text())["trainer"]["callbacks"]
        folders = [c["init_args"]["dirpath"] for c in callbacks if c["class_path"].endswith("ModelCheckpoint")]
        assert folders == [str(Path(ckpt).parent)], f"README: {config} writes checkpoints to {folders}, not {ckpt}"

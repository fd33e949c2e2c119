"""Every YAML in configs/ parses with the lit-rlhf LightningCLI and survives a --print_config round trip."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from lit_rlhf.cli import run_cli

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").rglob("*.yaml"))


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
    assert {"online_dpo_tiny.yaml", "rm_ensemble_tiny.yaml", "ppo_ensemble_tiny.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(p.parents[1])) for p in CONFIGS])
def test_config_print_config_round_trip(path, tmp_path):
    first = print_config(path)
    assert "class_path" in first
    again = tmp_path / "printed.yaml"
    again.write_text(first)
    assert print_config(again) == first

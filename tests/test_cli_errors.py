"""Through ``lit-rlhf``, errors with the project's own messages end in one ``error:`` line (exit status 2):
bad argument values of every module and DataModule, a missing export named with the config that writes
it, data/setup errors and output folders that cannot be written, all before any training step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A fresh clone after `make_tiny_data.py --out data/tiny`: no runs/ yet (no SFT or RM export)."""
    work = tmp_path_factory.mktemp("cli_errors")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_data.py"), "--out", str(work / "data/tiny"),
                    "--rows", "48"], check=True, capture_output=True)  # fmt: skip
    return work


def lit_rlhf(workdir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "LIT_RLHF_DEBUG"}
    environ.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **env)
    return subprocess.run([sys.executable, "-m", "lit_rlhf.cli", *args], cwd=workdir, env=environ,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def error_line(proc: subprocess.CompletedProcess, max_lines: int | None = 8) -> str:
    """The one ``error:`` line of a failed command (asserting that it is one line, without a traceback)."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    # before the Trainer runs: "Seed set to 0", Lightning's device lines, the error and the hint
    assert max_lines is None or len(out.splitlines()) <= max_lines, out
    return errors[0]


def with_value(config: str, key: str, value, tmp_path: Path) -> str:
    """A copy of a shipped config with ``key`` set to ``value`` wherever the file has it under ``model`` (the
    module's arguments may be flat or grouped)."""
    data = yaml.safe_load((ROOT / config).read_text())

    def visit(node) -> bool:
        if isinstance(node, dict):
            if key in node:
                node[key] = value
                return True
            return any(visit(v) for v in node.values())
        return False

    if not visit(data["model"]):  # not in the file: the module's default, set where the flat arguments are
        data["model"]["init_args"][key] = value
    path = tmp_path / Path(config).name
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "config, key, value, expected",
    [
        ("configs/sft_tiny.yaml", "num_samples", -1, "num_samples must be >= 0, got -1"),
        ("configs/rm_tiny.yaml", "center_rewards_coef", -1.0, "center_rewards_coef must be >= 0, got -1.0"),
        ("configs/dpo_tiny.yaml", "beta", 0.0, "DPOModule: beta must be > 0, got 0.0"),
        ("configs/ppo_tiny.yaml", "epochs", 0, "error: update.epochs must be > 0, got 0"),
        ("configs/grpo_tiny.yaml", "num_minibatches", 0, "error: update.num_minibatches must be > 0, got 0"),
    ],
    ids=["sft", "rm", "dpo", "ppo", "grpo"],
)
def test_a_bad_module_argument_is_one_error_line(workdir, tmp_path, config, key, value, expected):
    proc = lit_rlhf(workdir, "fit", "--config", with_value(config, key, value, tmp_path))
    assert expected in error_line(proc)


def test_a_bad_command_line_option_is_one_error_line_and_debug_shows_the_traceback(workdir):
    args = ("fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--data.init_args.val_fraction=1.5")
    line = error_line(lit_rlhf(workdir, *args))
    assert line == "error: SFTDataModule: val_fraction must be in [0, 1), got 1.5"
    debug = lit_rlhf(workdir, *args, LIT_RLHF_DEBUG="1")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "val_fraction must be in [0, 1)" in debug.stderr


@pytest.mark.parametrize("name", ["grpo", pytest.param("dpo", marks=pytest.mark.slow)])
def test_a_missing_export_names_the_config_that_writes_it(workdir, name):
    line = error_line(lit_rlhf(workdir, "fit", "--config", str(ROOT / f"configs/{name}_tiny.yaml")))
    assert "could not load a tokenizer from 'runs/sft_tiny/export': no such folder" in line
    assert "runs/sft_tiny/export is written by the HFExport of" in line and "configs/sft_tiny.yaml" in line
    assert "Does not validate against any of the Union subtypes" not in line


def test_a_missing_data_file_at_setup_is_one_error_line(workdir):
    proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/sft_tiny.yaml"),
                    "--data.init_args.train_path=data/tiny/nope.jsonl")  # fmt: skip
    line = error_line(proc)
    assert "data/tiny/nope.jsonl" in line and "not found" in line
    assert "FaultCheckpoint" not in proc.stderr, "nothing had run: nothing to say about saving"


def test_validate_without_a_validation_split_is_one_error_line(workdir):
    line = error_line(lit_rlhf(workdir, "validate", "--config", str(ROOT / "configs/sft_tiny.yaml"),
                               "--data.init_args.val_fraction=0", "--trainer.logger=false"))  # fmt: skip
    assert "SFTDataModule: validation needs held-out rows: set `val_path`" in line and "val_fraction" in line


def test_output_folders_that_cannot_be_written_are_refused_before_training(workdir, tmp_path):
    (tmp_path / "blocker").write_text("a file")
    export = f'[{{"class_path": "lit_rlhf.callbacks.HFExport", "init_args": {{"dirpath": "{tmp_path}/blocker"}}}}]'
    checkpoint = f'[{{"class_path": "ModelCheckpoint", "init_args": {{"dirpath": "{tmp_path}/blocker/ckpt"}}}}]'
    for callbacks, expected in (
        (export, f"error: HFExport dirpath: {tmp_path}/blocker is an existing file, not a folder"),
        (checkpoint, f"error: ModelCheckpoint dirpath: {tmp_path}/blocker/ckpt cannot be created"),
    ):
        proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--trainer.logger=false",
                        f"--trainer.callbacks={callbacks}")  # fmt: skip
        assert error_line(proc, max_lines=None).startswith(expected)  # after the model summary
        assert "epoch 1/" not in proc.stdout + proc.stderr, "no training step ran"
    # a logger's save_dir: refused before the run writes its config there (a raw NotADirectoryError before)
    proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/sft_tiny.yaml"),
                    f"--trainer.logger.init_args.save_dir={tmp_path}/blocker")  # fmt: skip
    expected = f"error: trainer.logger (TensorBoardLogger) save_dir: {tmp_path}/blocker is an existing file, not a folder"
    assert error_line(proc, max_lines=None).startswith(expected)


def test_errors_from_steps_keep_their_traceback():
    # only errors raised by the project's code from instantiation or a setup hook become one line
    from lit_rlhf.cli_errors import in_setup_hook, project_error

    def setup():
        raise ValueError("SFTDataModule: bad")

    def training_step():
        raise ValueError("PPOModule: a bug in the step")

    for fn, one_line in ((setup, True), (training_step, False)):
        try:
            fn()
        except ValueError as err:
            assert project_error(err) is None, "raised outside lit_rlhf: not the project's message"
            assert in_setup_hook(err) is one_line


def test_the_config_writing_a_missing_folder_is_found_in_the_working_directory_and_the_checkout(tmp_path, monkeypatch):
    from lit_rlhf.cli_errors import config_writing, missing_folder_hints

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/mine.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: lit_rlhf.callbacks.HFExport\n      init_args: {dirpath: out/mine}\n"
    )
    assert config_writing("out/mine") == tmp_path / "configs/mine.yaml"
    assert config_writing("runs/ppo_tiny/export/actor") == ROOT / "configs/ppo_tiny.yaml"  # inside an export
    assert config_writing("out/other") is None
    hint = missing_folder_hints("could not load a tokenizer from 'out/mine': no such folder")
    assert hint == " (out/mine is written by the HFExport of configs/mine.yaml: run `lit-rlhf fit --config configs/mine.yaml` first)"
    (tmp_path / "out/mine").mkdir(parents=True)
    assert missing_folder_hints("from 'out/mine'") == "", "an existing folder needs no hint"


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("update.epochs", "abc", "error: model.init_args.update.epochs: expected int, got 'abc'"),
        ("generation.stop_strings", ".", "error: model.init_args.generation.stop_strings: expected list, got '.'"),
        ("scoring.forward_batch_size", "1.5", "error: model.init_args.scoring.forward_batch_size: expected int, got '1.5'"),
    ],
)
def test_a_bad_value_of_a_settings_field_names_the_field_and_keeps_nothing_running(workdir, option, value, expected):
    # not accepted as a group of that one field (every other field of the group silently at its default)
    proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/ppo_tiny.yaml"), f"--model.init_args.{option}", value,
                    "--print_config")  # fmt: skip
    assert error_line(proc, max_lines=None) == expected


def test_one_field_of_a_group_on_the_command_line_keeps_the_others_and_null_sets_optional_fields(workdir):
    args = ("fit", "--config", str(ROOT / "configs/ppo_tiny.yaml"), "--print_config")
    proc = lit_rlhf(workdir, *args, "--model.init_args.generation.top_k", "5", "--model.init_args.kl.target", "null",
                    "--model.init_args.update.clip_coef_high=null")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = yaml.safe_load(proc.stdout)["model"]["init_args"]
    assert model["generation"]["top_k"] == 5 and model["generation"]["max_new_tokens"] == 16  # the config's
    assert model["kl"] == {**model["kl"], "coef": 0.05, "target": None}  # the adaptive controller off
    assert model["update"]["clip_coef_high"] is None and model["update"]["epochs"] == 4


@pytest.mark.parametrize(
    "value, expected",
    [
        ("{ensemble: [a, b], coef: -1}", "error: reward_model.coef must be a finite number >= 0 or None, got -1"),
        ("{ensemble: [a]}", "error: reward_model.ensemble must be at least 2 members"),
        ("{posterior: p, coef: -1}", "error: reward_model.coef must be a finite number >= 0, got -1"),
    ],
    ids=["ensemble-coef", "ensemble-members", "posterior-coef"],
)
def test_a_bad_reward_model_setting_is_one_error_line_before_any_model_loads(workdir, value, expected):
    # before: an ensemble's was three chained jsonargparse tracebacks (exit 1) around the message; and the actor,
    # which this clone has not exported, loaded (or failed) first
    proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"),
                    f"--model.init_args.reward_model={value}")  # fmt: skip
    assert error_line(proc).startswith(expected)


def test_one_field_of_a_reward_model_dict_on_the_command_line(workdir):
    # a posterior's coef overridden alone keeps its folder and is read as a number (before: taken for a field of
    # RewardEnsemble, "expected dict or str or None, got Namespace(...)")
    args = ("fit", "--config", str(ROOT / "configs/ppo_posterior_tiny.yaml"), "--print_config")
    proc = lit_rlhf(workdir, *args, "--model.init_args.reward_model.coef=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    value = yaml.safe_load(proc.stdout)["model"]["init_args"]["reward_model"]
    assert value["posterior"] == "runs/rm_tiny/posterior" and str(value["coef"]) == "0"
    from lit_rlhf.ensembles import coerce_reward_model

    assert coerce_reward_model(value).coef == 0.0


def test_null_fields_become_the_json_form_of_their_group():
    from lit_rlhf.cli import null_fields_as_json

    args = ["fit", "--model.init_args.kl.target", "null", "--model.kl.target=null", "--model.init_args.max_rollouts",
            "null", "--trainer.max_steps", "null", "--model.init_args.update.is_correction.cap", "null"]  # fmt: skip
    assert null_fields_as_json(args) == [
        "fit", "--model.init_args.kl", '{"target": null}', "--model.kl", '{"target": null}',
        "--model.init_args.max_rollouts", "null", "--trainer.max_steps", "null",
        "--model.init_args.update.is_correction", '{"cap": null}',
    ]  # fmt: skip


def test_a_trainer_setting_lightning_refuses_before_training_is_one_error_line_and_predict_is_no_subcommand(workdir):
    actor = '{"name_or_path": null, "config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}, "tokenizer": "data/tiny/tokenizer"}'
    proc = lit_rlhf(workdir, "fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--model.init_args.actor", actor,
                    "--model.init_args.reward_model", "null", "--model.init_args.reward_fn",
                    "lit_rlhf.verifiable:format_reward", "--trainer.gradient_clip_val", "1.0")  # fmt: skip
    line = error_line(proc, max_lines=None)
    assert "gradient clipping is not supported for manual optimization" in line and "update.max_grad_norm" in line
    proc = lit_rlhf(workdir, "predict", "--config", str(ROOT / "configs/sft_tiny.yaml"))
    assert proc.returncode == 2 and "invalid choice: 'predict'" in proc.stderr


def test_a_ckpt_path_lightning_cannot_resolve_is_one_error_line(workdir):
    proc = lit_rlhf(workdir, "validate", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--ckpt_path", "best")
    line = error_line(proc, max_lines=None)
    assert line.startswith("error: --ckpt_path: ") and 'ckpt_path="best"' in line


def test_the_console_script_finds_a_reward_module_in_the_working_directory(tmp_path, monkeypatch):
    # `lit-rlhf fit` next to the config and its my_rewards.py (README), as `python -m` would find it
    from lit_rlhf import cli
    from lit_rlhf.reward_fns import import_reward_fn

    (tmp_path / "cwd_rewards_xyz.py").write_text("def style(prompts, responses):\n    return [0.0] * len(responses)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.curdir, str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_rewards_xyz", raising=False)
    found = []
    monkeypatch.setattr(cli, "run_cli", lambda args: found.append(import_reward_fn("cwd_rewards_xyz:style")))
    cli.main(["fit"])
    assert found[0].__module__ == "cwd_rewards_xyz" and sys.path[0] == str(tmp_path)
    sys.modules.pop("cwd_rewards_xyz", None)

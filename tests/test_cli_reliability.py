"""``lit-rlhf fit`` as a scheduler and a careless user meet it: SIGTERM, --ckpt_path checks, resume rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rlhf.callbacks import EXPORT_MARKER, SIGTERM_EXIT_CODE
from lit_rlhf.cli import model_flags

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "HF_HUB_OFFLINE": "1"}
NO_DROPOUT_GPT2 = json.dumps(
    {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128,
     "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
)  # fmt: skip


def rm_fit(tiny: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    """``lit-rlhf fit --config configs/rm_tiny.yaml`` on the tiny data, run in ``cwd`` (its runs/ lands there)."""
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(ROOT / "configs/rm_tiny.yaml"),
        f"--data.init_args.tokenizer={tiny}/tokenizer", f"--data.init_args.train_path={tiny}/prefs.jsonl",
        "--data.init_args.split=train[:96]", f"--model.init_args.model.tokenizer={tiny}/tokenizer",
        f"--model.init_args.model.config={NO_DROPOUT_GPT2}", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.max_epochs=3", *extra,
    ]  # fmt: skip
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """TensorBoard scalars under ``run_dir``: tag -> {step: value} (later files win)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(run_dir.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def export_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tiny_data_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("rm_full")
    proc = rm_fit(tiny_data_dir, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resume_reproduces_the_run(uninterrupted, tiny_data_dir, tmp_path):
    # 96 rows, val 20% -> 77 train rows -> 5 steps/epoch, 15 steps; SIGTERM arrives as step 8 begins
    proc = rm_fit(tiny_data_dir, tmp_path, "--trainer.callbacks+=faulty_modules.SigtermAt", "--trainer.callbacks.batch=8")
    assert proc.returncode == SIGTERM_EXIT_CODE, proc.stderr[-3000:]
    ckpt = tmp_path / "runs/rm_tiny/checkpoints/last-sigterm.ckpt"
    assert f"Resume with --ckpt_path {ckpt}" in proc.stderr + proc.stdout
    assert torch.load(ckpt, weights_only=False)["global_step"] == 8, "the step in progress is finished, then saved"
    assert not (tmp_path / "runs/rm_tiny/export").exists(), "an interrupted fit exports nothing"

    resumed = rm_fit(tiny_data_dir, tmp_path, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full, parts = scalars(uninterrupted / "runs/rm_tiny"), scalars(tmp_path / "runs/rm_tiny")
    for tag in ("train/loss", "val/loss", "val/accuracy", "train/accuracy"):
        assert parts[tag].keys() == full[tag].keys(), tag
        for step, value in full[tag].items():
            assert parts[tag][step] == pytest.approx(value, abs=1e-5), (tag, step)
    a, b = export_weights(uninterrupted / "runs/rm_tiny/export"), export_weights(tmp_path / "runs/rm_tiny/export")
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


@pytest.mark.slow
def test_a_sigterm_in_the_step_before_a_validation_keeps_that_validation(uninterrupted, tiny_data_dir, tmp_path):
    # SIGTERM as batch 5 (epoch 0's last) begins: Lightning stopped inside the validation that follows, and
    # the checkpoint's counters said that validation was done, so the resumed fit never logged it
    proc = rm_fit(tiny_data_dir, tmp_path, "--trainer.callbacks+=faulty_modules.SigtermAt", "--trainer.callbacks.batch=5")
    assert proc.returncode == SIGTERM_EXIT_CODE, proc.stderr[-3000:]
    resumed = rm_fit(tiny_data_dir, tmp_path, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full, parts = scalars(uninterrupted / "runs/rm_tiny"), scalars(tmp_path / "runs/rm_tiny")
    for tag in ("val/loss", "val/accuracy", "train/loss"):
        assert parts[tag].keys() == full[tag].keys(), tag
        for step, value in full[tag].items():
            assert parts[tag][step] == pytest.approx(value, abs=1e-5), (tag, step)


@pytest.mark.slow
def test_export_is_not_overwritten_by_another_run_but_by_a_resume_or_overwrite(uninterrupted, tiny_data_dir):
    # a second, fresh run into the same folders: refused before training, the export kept
    export = uninterrupted / "runs/rm_tiny/export"
    before = export_weights(export)
    proc = rm_fit(tiny_data_dir, uninterrupted, "--trainer.max_epochs=1")
    assert proc.returncode != 0 and "already holds another run's export" in proc.stderr, proc.stderr[-3000:]
    assert "overwrite: true" in proc.stderr
    assert all(torch.equal(before[k], v) for k, v in export_weights(export).items())
    # the same run resumed with a larger limit may replace its own export
    run_id = json.loads((export / EXPORT_MARKER).read_text())["run_id"]
    proc = rm_fit(tiny_data_dir, uninterrupted, "--ckpt_path=last", "--trainer.max_epochs=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((export / EXPORT_MARKER).read_text())["run_id"] == run_id
    assert any(not torch.equal(before[k], v) for k, v in export_weights(export).items()), "trained further"


def test_ckpt_path_last_without_a_checkpoint_is_an_error(tiny_data_dir, tmp_path):
    proc = rm_fit(tiny_data_dir, tmp_path, "--ckpt_path=last", "--trainer.max_steps=1")
    assert proc.returncode != 0
    assert "--ckpt_path last: no last*.ckpt to resume from" in proc.stderr, proc.stderr[-3000:]
    assert "runs/rm_tiny/checkpoints" in proc.stderr
    assert not (tmp_path / "runs/rm_tiny/export").exists(), "no fresh run was started"


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "the file is empty"),
        (os.urandom(256), "not a PyTorch checkpoint: torch.save writes zip archives"),
        ("truncated", "truncated: a zip archive without its end"),
        ("plain", "a PyTorch file but not a Lightning checkpoint (no 'state_dict'"),
    ],
)
def test_bad_ckpt_path_names_the_file_and_the_problem(content, problem, tiny_data_dir, tmp_path):
    path = tmp_path / "bad.ckpt"
    if content == "truncated":
        torch.save({"state_dict": {"w": torch.ones(4096)}}, path)
        path.write_bytes(path.read_bytes()[:5000])
    elif content == "plain":
        torch.save({"w": torch.ones(3)}, path)
    else:
        path.write_bytes(content)
    proc = rm_fit(tiny_data_dir, tmp_path, f"--ckpt_path={path}")
    assert proc.returncode != 0
    assert f"checkpoint {path}: {problem}" in proc.stderr, proc.stderr[-3000:]


def test_model_flags_are_taken_with_their_values():
    args = ["fit", "--config", "x.yaml", "--model.init_args.max_rollouts", "12", "--trainer.max_steps=3",
            "--model.init_args.seed=4", "--model", "y.yaml", "--modelx", "1"]  # fmt: skip
    assert model_flags(args) == ["--model.init_args.max_rollouts", "12", "--model.init_args.seed=4", "--model", "y.yaml"]


def test_command_line_model_option_wins_over_the_checkpoint_at_resume(uninterrupted, tiny_data_dir, tmp_path, monkeypatch):
    # the checkpoint says center_rewards_coef=0.0; the command line says 0.5: the command line wins
    from lit_rlhf.cli import run_cli

    monkeypatch.chdir(tmp_path)  # the config's runs/ folder
    ckpt = next((uninterrupted / "runs/rm_tiny/checkpoints").glob("epoch=*.ckpt"))
    assert torch.load(ckpt, weights_only=False)["hyper_parameters"]["center_rewards_coef"] == 0.0
    base = [
        f"--config={ROOT / 'configs/rm_tiny.yaml'}", f"--data.init_args.tokenizer={tiny_data_dir}/tokenizer",
        f"--data.init_args.train_path={tiny_data_dir}/prefs.jsonl",
        f"--model.init_args.model.tokenizer={tiny_data_dir}/tokenizer", f"--ckpt_path={ckpt}",
        "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    cli = run_cli(["fit", *base, "--model.init_args.center_rewards_coef=0.5"])
    assert cli.model.hparams.center_rewards_coef == 0.5
    # without the option, the checkpoint's value is used (over the config file's)
    cli = run_cli(["fit", *base])
    assert cli.model.hparams.center_rewards_coef == 0.0


def ppo_fit(tokenizer_dir: str, prompt_file: Path, cwd: Path, *extra: str, config: str = "ppo_tiny",
            subcommand: str = "fit") -> subprocess.CompletedProcess:  # fmt: skip
    """``lit-rlhf fit --config configs/<config>.yaml`` (PPO or GRPO) with a tiny inline actor and a rule reward."""
    actor = {"config": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2}, "tokenizer": tokenizer_dir}
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", subcommand, "--config", str(ROOT / f"configs/{config}.yaml"),
        "--model.init_args.actor=null", f"--model.init_args.actor={json.dumps(actor)}",
        "--model.init_args.reward_model=null", "--model.init_args.reward_fn=ppo_rewards:the_count",
        "--model.init_args.max_rollouts=4", "--model.init_args.generation.max_new_tokens=6",
        f"--data.init_args.tokenizer={tokenizer_dir}", f"--data.init_args.train_path={prompt_file}",
        "--data.init_args.val_path=null", "--data.init_args.test_path=null",
        "--data.init_args.batch_size=8", "--trainer.enable_progress_bar=false", *extra,
    ]  # fmt: skip
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_ppo_sigterm_saves_the_last_finished_rollout_and_resume_reproduces_the_run(tokenizer_dir, prompt_file, tmp_path):
    full = ppo_fit(tokenizer_dir, prompt_file, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    part = tmp_path / "part"
    proc = ppo_fit(tokenizer_dir, prompt_file, part, "--trainer.callbacks+=faulty_modules.SigtermAt", "--trainer.callbacks.batch=2")
    assert proc.returncode == SIGTERM_EXIT_CODE, proc.stderr[-3000:]
    saved = torch.load(part / "runs/ppo_tiny/checkpoints/last-sigterm.ckpt", weights_only=False)
    assert saved["online_state"]["rollouts_done"] == 2, "rollout 2 (in progress at SIGTERM) is finished and saved"
    resumed = ppo_fit(tokenizer_dir, prompt_file, part, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = scalars(tmp_path / "full/runs/ppo_tiny"), scalars(part / "runs/ppo_tiny")
    for tag in ("rollout/score", "rollout/kl_ref", "ppo/policy_loss", "ppo/value_loss", "ppo/kl_coef"):
        assert b[tag].keys() == a[tag].keys() and len(a[tag]) == 4, tag
        for step, value in a[tag].items():
            assert b[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (tag, step)


@pytest.mark.parametrize("content, problem", [(b"", "the file is empty"), (b"garbage!", "not a PyTorch checkpoint")])
def test_checked_checkpoint_io_names_the_file_for_plain_trainer_fit(content, problem, tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_rlhf.checkpoints import CheckedCheckpointIO, CheckpointFileError

    path = tmp_path / "bad.ckpt"
    path.write_bytes(content)
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[CheckedCheckpointIO()],
    )  # fmt: skip
    with pytest.raises(CheckpointFileError, match=f"checkpoint {path}: {problem}"):
        trainer.fit(BoringModel(), ckpt_path=path)
    # a good checkpoint still loads through it
    good = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    good.fit(BoringModel())
    good.save_checkpoint(tmp_path / "good.ckpt")
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[CheckedCheckpointIO()],
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=tmp_path / "good.ckpt")
    assert trainer.global_step == 2


# --------------------------------------------------------------------------------------- resume checks
def write_prompts(path: Path, n: int = 16) -> Path:
    from conftest import make_corpus

    path.write_text("".join(json.dumps({"prompt": " ".join(t.split()[:3])}) + "\n" for t in make_corpus(n, seed=5)))
    return path




@pytest.fixture(scope="module")
def online_checkpoints(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """last.ckpt of a one-rollout PPO fit (K = 1) and of a one-rollout GRPO fit (K = 4)."""
    prompts = write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
    out = {}
    for name in ("ppo", "grpo"):  # both configs keep ModelCheckpoint(dirpath=runs/<name>/checkpoints, save_last)
        cwd = tmp_path_factory.mktemp(f"{name}_one_rollout")
        proc = ppo_fit(tokenizer_dir, prompts, cwd, "--model.init_args.max_rollouts=1", "--trainer.logger=false",
                       config=f"{name}_tiny")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = cwd / f"runs/{name}_tiny/checkpoints/last.ckpt"
        out[f"{name}_prompts"] = prompts
    return out


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_online_resume_takes_a_command_line_model_option(name, online_checkpoints, tokenizer_dir, tmp_path):
    # was: exit 2, 'Parser key "reward_model": ... Not a valid subclass of ModelSpec'
    ckpt = online_checkpoints[name]
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["max_rollouts"] == 1
    proc = ppo_fit(tokenizer_dir, online_checkpoints[f"{name}_prompts"], tmp_path, f"--ckpt_path={ckpt}",
                   "--model.init_args.max_rollouts=2", "--trainer.logger=false", config=f"{name}_tiny")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = torch.load(tmp_path / f"runs/{name}_tiny/checkpoints/last.ckpt", weights_only=True)
    assert resumed["online_state"]["rollouts_done"] == 2, "one more rollout, up to the command line's limit"
    assert resumed["hyper_parameters"]["max_rollouts"] == 2


def test_resume_that_changes_k_is_refused_with_a_message_about_k(online_checkpoints, tokenizer_dir, tmp_path):
    ckpt = online_checkpoints["grpo"]
    proc = ppo_fit(tokenizer_dir, online_checkpoints["grpo_prompts"], tmp_path, f"--ckpt_path={ckpt}",
                   "--model.init_args.generation.num_samples=2", "--trainer.logger=false", config="grpo_tiny")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "generation.num_samples cannot change on resume: the checkpoint has 4, this run 2" in proc.stderr
    assert f"checkpoint {ckpt}" in proc.stderr and "Parser key" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists(), "nothing ran"


def strip_class_path(ckpt: Path, out: Path) -> Path:
    """The checkpoint as a plain ``Trainer`` (not the CLI) writes it: no ``_class_path`` in its hyper-parameters."""
    state = torch.load(ckpt, weights_only=True)
    state["hyper_parameters"].pop("_class_path")
    state["hyper_parameters"].pop("_instantiator", None)
    torch.save(state, out)
    return out


@pytest.mark.parametrize(
    "subcommand, config, source, written_by, expected, class_path",
    [
        ("validate", "dpo_tiny", "grpo", "CriticFreeModule", "DPOModule", "kept"),
        ("validate", "dpo_tiny", "grpo", "CriticFreeModule", "DPOModule", "stripped"),
        ("fit", "grpo_tiny", "ppo", "PPOModule", "CriticFreeModule", "kept"),
        ("fit", "ppo_tiny", "grpo", "CriticFreeModule", "PPOModule", "stripped"),
    ],
)
def test_checkpoint_of_another_module_class_is_refused(
    subcommand, config, source, written_by, expected, class_path, online_checkpoints, tokenizer_dir, tmp_path
):
    # was: validate exits 0 (the checkpoint's class silently replaced the config's), or KeyError 'response_mask'
    ckpt = online_checkpoints[source]
    if class_path == "stripped":
        ckpt = strip_class_path(ckpt, tmp_path / "plain.ckpt")
    cmd = [sys.executable, "-m", "lit_rlhf.cli", subcommand, "--config", str(ROOT / f"configs/{config}.yaml"),
           f"--ckpt_path={ckpt}", "--trainer.logger=false"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert f"checkpoint {ckpt}" in line and written_by in line and expected in line, line
    assert "Traceback" not in proc.stderr


def test_rm_checkpoint_is_refused_by_the_sft_config(uninterrupted, tmp_path):
    ckpt = uninterrupted / "runs/rm_tiny/checkpoints/last.ckpt"
    for path in (ckpt, strip_class_path(ckpt, tmp_path / "plain.ckpt")):
        cmd = [sys.executable, "-m", "lit_rlhf.cli", "validate", "--config", str(ROOT / "configs/sft_tiny.yaml"),
               f"--ckpt_path={path}"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "RewardModelModule" in proc.stderr and "SFTModule" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "the file is empty"),
        ("truncated", "truncated: a zip archive without its end"),
        (b"\x93NUMPY" + bytes(range(200)), "not a PyTorch checkpoint"),
    ],
    ids=["empty", "truncated", "random"],
)
def test_damaged_last_checkpoint_is_named(content, problem, tiny_data_dir, tmp_path):
    # was: torch's zip-reader error, a bare EOFError, or advice to reload with weights_only=False
    path = tmp_path / "runs/rm_tiny/checkpoints/last.ckpt"
    path.parent.mkdir(parents=True)
    if content == "truncated":
        torch.save({"state_dict": {"w": torch.ones(4096)}}, path)
        path.write_bytes(path.read_bytes()[:5000])
    else:
        path.write_bytes(content)
    proc = rm_fit(tiny_data_dir, tmp_path, "--ckpt_path=last")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: --ckpt_path last: checkpoint {path}: {problem}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs/rm_tiny/export").exists()


def test_last_is_the_newest_last_checkpoint_as_lightning_resolves_it(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_rlhf.cli_resume import find_last_checkpoint

    folder = tmp_path / "ckpt"
    trainer = Trainer(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ModelCheckpoint(folder, save_last=True)])  # fmt: skip
    assert find_last_checkpoint(trainer) is None
    trainer.fit(BoringModel())
    assert find_last_checkpoint(trainer) == str(folder / "last.ckpt")
    newer = folder / "last-sigterm.ckpt"
    newer.write_bytes(b"")
    os.utime(newer, (os.path.getmtime(folder / "last.ckpt") + 10,) * 2)
    assert find_last_checkpoint(trainer) == str(newer)
    assert trainer._checkpoint_connector._parse_ckpt_path(trainer.state.fn, "last", True, True) == str(newer)


def test_checkpoint_without_class_path_is_compared_by_its_weights(tokenizer_dir):
    from lit_rlhf.cli_resume import CheckpointInfo
    from lit_rlhf.models import ModelSpec
    from lit_rlhf.modules import DPOModule

    spec = ModelSpec(config={"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2}, tokenizer=tokenizer_dir)
    dpo = DPOModule(spec, num_samples=0)
    # an SFT checkpoint: its hyper-parameters are all DPO arguments, its metric states are not DPO's
    sft = CheckpointInfo("sft.ckpt", {"model": {}, "num_samples": 2, "bucketing": None}, {"model", "train_nll"})
    problem = sft.class_problem(DPOModule, dpo)
    assert "weights under ['train_nll']" in problem and "DPOModule" in problem and "SFTModule" in problem
    assert CheckpointInfo("dpo.ckpt", {"model": {}, "beta": 0.2}, {"model"}).class_problem(DPOModule, dpo) is None


def test_fixed_hyper_parameters_are_compared_generically():
    from lightning.pytorch import LightningModule

    from lit_rlhf.cli_resume import CheckpointInfo

    class Online(LightningModule):
        fixed_on_resume = ("update.groups",)

        def __init__(self, generation: dict, update: dict, max_rollouts: int) -> None:
            super().__init__()
            self.save_hyperparameters()

    saved = CheckpointInfo("x.ckpt", {"generation": {"num_samples": 4}, "update": {"groups": 2}, "max_rollouts": 3}, set())
    assert saved.changed_fixed_hparams(Online({"num_samples": 4}, {"groups": 2}, 12)) == []
    changed = saved.changed_fixed_hparams(Online({"num_samples": 8}, {"groups": 1}, 3))
    assert changed[0].startswith("generation.num_samples cannot change on resume: the checkpoint has 4, this run 8")
    assert changed[1] == "update.groups cannot change on resume: the checkpoint has 2, this run 1"


def test_a_folder_is_a_checkpoint_only_when_it_is_a_sharded_one(tmp_path):
    from lit_rlhf.checkpoints import CheckpointFileError, check_checkpoint_file, load_checkpoint_file

    folder = tmp_path / "checkpoints"  # e.g. --ckpt_path runs/x/checkpoints instead of a file in it
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(b"")
    for check in (check_checkpoint_file, load_checkpoint_file):
        with pytest.raises(CheckpointFileError, match=r"a folder, not a checkpoint file.* it holds \['last.ckpt'\]"):
            check(folder)
    sharded = tmp_path / "sharded.ckpt"  # torch.distributed.checkpoint's layout (Lightning's FSDP): the strategy's
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"x")
    assert check_checkpoint_file(sharded) is None and load_checkpoint_file(sharded) is None

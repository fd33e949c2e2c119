"""The CLI's subcommands with the tiny configs: validate/test run, the output is quiet and shows progress
in a log file; progress bars (including the rollout-aware one) and the CLI's model choices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lit_rlhf.progress import LitProgressBar, QuietModelSummary, RolloutProgressBar, default_callbacks

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Tip:", "Total FLOPs", "Total Flops", "v_num", "LeafSpec", "Loading `train_dataloader`", "Traceback")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder laid out like a fresh clone after `make_tiny_data.py --out data/tiny`."""
    work = tmp_path_factory.mktemp("cli")
    subprocess.run([sys.executable, str(ROOT / "scripts/make_tiny_data.py"), "--out", str(work / "data/tiny"),
                    "--rows", "96"], check=True)  # fmt: skip
    return work


def lit_rlhf(workdir: Path, *args: str) -> str:
    """Run `lit-rlhf ARGS` with output to a pipe (a non-TTY log) and return stdout + stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "lit_rlhf.cli", *args], cwd=workdir, env=env,
                          capture_output=True, text=True)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def test_sft_tiny_fit_is_quiet_and_reports_progress_in_a_log(workdir):
    config = str(ROOT / "configs/sft_tiny.yaml")
    fit = lit_rlhf(workdir, "fit", "--config", config, "--trainer.max_steps=4", "--trainer.callbacks=[]")
    for noise in NOISE:
        assert noise not in fit, f"{noise!r} in the fit output:\n{fit}"
    assert "epoch 1/2 batch 1/" in fit and "train/loss=" in fit  # progress lines in a non-TTY log
    assert "| Name" in fit and "Trainable params" in fit  # the summary itself stays


@pytest.mark.parametrize("name", ["sft", "rm"])
def test_tiny_configs_validate_and_test(workdir, name):
    config = str(ROOT / f"configs/{name}_tiny.yaml")
    validate = lit_rlhf(workdir, "validate", "--config", config)
    assert "val/loss" in validate and "validation at step 0: val/loss=" in validate
    test = lit_rlhf(workdir, "test", "--config", config)
    assert "test/loss" in test and ("test/perplexity" in test if name == "sft" else "test/accuracy" in test)
    for noise in NOISE:
        assert noise not in validate + test, f"{noise!r} in:\n{validate + test}"


@pytest.fixture(scope="module")
def exports(workdir) -> Path:
    """runs/sft_tiny/export and runs/rm_tiny/export after two steps each: what the online and DPO configs load."""
    for name in ("sft", "rm"):
        lit_rlhf(workdir, "fit", "--config", str(ROOT / f"configs/{name}_tiny.yaml"), "--trainer.max_steps=2",
                 "--trainer.limit_val_batches=1", "--trainer.logger=false")  # fmt: skip
    return workdir


@pytest.mark.parametrize(
    "name, metric",
    [
        ("ppo", "kl_ref"),
        pytest.param("grpo", "kl_ref", marks=pytest.mark.slow),  # ~20 s each on 2 shared cores
        pytest.param("dpo", "rewards/accuracies", marks=pytest.mark.slow),
        pytest.param("online_dpo", "kl_ref", marks=pytest.mark.slow),
    ],
    ids=["ppo", "grpo", "dpo", "online_dpo"],
)
def test_online_and_dpo_tiny_configs_validate_and_test(exports, name, metric):
    config = str(ROOT / f"configs/{name}_tiny.yaml")
    validate = lit_rlhf(exports, "validate", "--config", config, "--trainer.logger=false")
    test = lit_rlhf(exports, "test", "--config", config, "--trainer.logger=false")
    assert f"val/{metric}" in validate and f"test/{metric}" in test
    if name != "dpo":  # evaluation rollouts: score and KL in the progress line of a log, table rows
        assert "validation after rollout 0: val/score=" in validate and "val/kl_ref=" in validate
        assert "test/response_length" in test and "test/score" in test
    for noise in (*NOISE, "validation_step", "test_step", "eval mode"):
        assert noise not in validate + test, f"{noise!r} in:\n{validate + test}"


def test_cli_model_choices_hide_internal_bases():
    import lightning.pytorch as pl
    from jsonargparse._typehints import get_all_subclass_paths

    import lit_rlhf.modules  # noqa: F401  (imports the bases too)

    choices = get_all_subclass_paths(pl.LightningModule)  # what --model offers (shortest import paths)
    public = ("SFTModule", "RewardModelModule", "PPOModule", "CriticFreeModule", "DPOModule", "OnlineDPOModule",
              "RewardEnsembleModule")  # fmt: skip
    assert {f"lit_rlhf.{name}" for name in public} <= set(choices)
    internal = (
        "SingleModelModule", "OnlineRLModule", "OnlineBookkeeping", "OnlineEvaluation", "OnlineUpdate", "RolloutScoring",
    )  # fmt: skip
    assert not [c for c in choices if c.endswith(internal)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    help_text = subprocess.run([sys.executable, "-m", "lit_rlhf.cli", "fit", "--help"], env=env,
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert all(name in help_text for name in public)
    assert not [name for name in internal if name in help_text]


class FakeOnline(LightningModule):
    """What the rollout bar reads from an online module: rollouts_done, hparams.max_rollouts, score/kl."""

    def __init__(self, max_rollouts: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(1, 1)
        self.rollouts_done = 0

    def training_step(self, batch, batch_idx):
        self.rollouts_done += 1
        self.log("score", 0.5 * self.rollouts_done, prog_bar=True, logger=False)
        self.log("kl", 0.25, prog_bar=True, logger=False)
        if self.rollouts_done >= self.hparams.max_rollouts:
            self.trainer.should_stop = True
        return self.layer(batch[0]).sum()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(32, 1)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_rollout_progress_bar_lines_in_a_log(tmp_path, capsys, caplog):
    bar = RolloutProgressBar(tty=False, log_every_s=0)
    trainer = Trainer(default_root_dir=tmp_path, logger=False, callbacks=[bar], max_epochs=-1,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.fit(FakeOnline(max_rollouts=3))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rollout ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "score=1.5" in lines[-1] and "kl=0.25" in lines[-1] and "s/rollout=" in lines[-1]
    assert "max_rollouts=3 reached" in caplog.text


def test_rollout_progress_bar_counts_rollouts_in_a_terminal(tmp_path):
    bar = RolloutProgressBar(tty=True)
    trainer = Trainer(default_root_dir=tmp_path, logger=False, callbacks=[bar], max_epochs=-1,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(FakeOnline(max_rollouts=5))
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (5, 5)
    assert bar.train_progress_bar.desc.startswith("Rollouts") and bar.train_progress_bar.unit == "rollout"
    assert "v_num" not in bar.get_metrics(trainer, trainer.lightning_module)


def test_default_callbacks_choose_by_module_and_respect_the_config():
    online, offline = FakeOnline(), torch.nn.Module()
    assert [type(c) for c in default_callbacks(online, {})] == [RolloutProgressBar, QuietModelSummary]
    assert [type(c) for c in default_callbacks(offline, {})] == [LitProgressBar, QuietModelSummary]
    assert default_callbacks(online, {"enable_progress_bar": False, "enable_model_summary": False}) == []
    assert [type(c) for c in default_callbacks(online, {"callbacks": [LitProgressBar()]})] == [QuietModelSummary]

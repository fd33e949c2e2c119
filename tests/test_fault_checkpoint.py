"""FaultCheckpoint through ``lit-rlhf fit``: a fault keeps the steps finished before it, and the resumed fit
is the uninterrupted one (every logged scalar, the final weights); where nothing consistent can be kept, the
message says why and nothing is written."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_cli_reliability import export_weights, ppo_fit, rm_fit, scalars, write_prompts

from lit_rlhf.fault_checkpoint import FaultCheckpoint, step_start_state

# a GRPO fit of 4 rollouts with a one-batch evaluation rollout every 2 rollouts
GRPO = ("--model.init_args.max_rollouts=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1")  # fmt: skip
CHECKPOINTS = "runs/grpo_tiny/checkpoints"


def raise_at(batch: int, hook: str = "on_before_backward", call: int = 1, exception: str = "RuntimeError") -> tuple:
    return ("--trainer.callbacks+=faulty_modules.RaiseAt", f"--trainer.callbacks.batch={batch}",
            f"--trainer.callbacks.hook={hook}", f"--trainer.callbacks.call={call}",
            f"--trainer.callbacks.exception={exception}")  # fmt: skip


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    """24 prompts: 3 rollouts of 8 per epoch, so rollout 4 opens the second epoch."""
    return write_prompts(tmp_path_factory.mktemp("fault_prompts") / "prompts.jsonl", n=24)


def grpo(tokenizer_dir: str, prompts: Path, cwd: Path, *extra: str):
    return ppo_fit(tokenizer_dir, prompts, cwd, *GRPO, f"--data.init_args.val_path={prompts}", *extra, config="grpo_tiny")


@pytest.fixture(scope="module")
def grpo_full(tokenizer_dir, prompts, tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("grpo_full")
    proc = grpo(tokenizer_dir, prompts, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


@pytest.mark.parametrize(
    "hook, batch",
    [("on_before_backward", 3), ("on_before_backward", 4), ("on_validation_batch_start", 2)],
    ids=["in_a_rollout", "in_an_epochs_first_rollout", "in_a_validation"],
)
def test_a_fault_keeps_the_finished_rollouts_and_the_resumed_fit_is_the_uninterrupted_one(
    hook, batch, grpo_full, tokenizer_dir, prompts, tmp_path
):
    # in a rollout: it is generated and scored, then its update fails before the first optimiser step;
    # in_a_validation: the evaluation after rollout 2 fails
    proc = grpo(tokenizer_dir, prompts, tmp_path, *raise_at(batch, hook))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "RuntimeError: RaiseAt" in out, out[-3000:]
    saved = tmp_path / CHECKPOINTS / "last-fault.ckpt"
    done = batch if hook == "on_validation_batch_start" else batch - 1
    assert f"FaultCheckpoint: RuntimeError in the fit; saved {saved}, the state after rollout {done}" in out
    assert torch.load(saved, weights_only=True)["online_state"]["rollouts_done"] == done
    assert not (tmp_path / "runs/grpo_tiny/export").exists(), "a failed fit exports nothing"

    resumed = grpo(tokenizer_dir, prompts, tmp_path, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full, parts = scalars(grpo_full / "runs/grpo_tiny"), scalars(tmp_path / "runs/grpo_tiny")
    assert {"rollout/score", "val/score", "policy/approx_kl"} <= full.keys(), sorted(full)
    assert len(full["val/score"]) == 2, "evaluations after rollouts 2 and 4"
    for tag, values in full.items():
        assert parts[tag] == pytest.approx(values, rel=1e-6, abs=1e-7), tag  # the failed evaluation ran again
    a = checkpoint_weights(grpo_full / CHECKPOINTS / "last.ckpt")
    b = checkpoint_weights(tmp_path / CHECKPOINTS / "last.ckpt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ctrl_c_in_a_rollout_saves_the_finished_rollouts(tokenizer_dir, prompts, tmp_path):
    proc = grpo(tokenizer_dir, prompts, tmp_path, *raise_at(3, exception="KeyboardInterrupt"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "FaultCheckpoint: KeyboardInterrupt in the fit; saved" in out, out[-3000:]
    assert torch.load(tmp_path / CHECKPOINTS / "last-fault.ckpt", weights_only=True)["online_state"]["rollouts_done"] == 2


@pytest.mark.parametrize(
    "batch, call, why",
    [
        (3, 2, "the fault came after an optimiser step of step 9 (a half-updated model)"),
        (1, 1, "no training step had finished in this process"),
    ],
    ids=["after_an_optimiser_step", "in_the_first_step"],
)
def test_nothing_is_saved_where_no_consistent_state_is_left(batch, call, why, tokenizer_dir, prompts, tmp_path):
    # grpo_tiny: 2 epochs x 2 minibatches = 4 optimiser steps per rollout; call 2 of rollout 3 follows step 9
    proc = grpo(tokenizer_dir, prompts, tmp_path, *raise_at(batch, call=call))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "RuntimeError: RaiseAt" in out, out[-3000:]
    assert f"FaultCheckpoint: nothing saved: {why}" in out, out[-3000:]
    assert not (tmp_path / CHECKPOINTS / "last-fault.ckpt").exists()


def test_rm_fault_after_the_forward_resumes_with_the_metric_states_of_the_step_start(tiny_data_dir, tmp_path):
    # automatic optimisation: step 8's forward has updated the training accuracy when its backward fails
    full = rm_fit(tiny_data_dir, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    part = tmp_path / "part"
    proc = rm_fit(tiny_data_dir, part, *raise_at(8))
    assert proc.returncode == 1 and "FaultCheckpoint: RuntimeError in the fit; saved" in proc.stderr, proc.stderr[-3000:]
    saved = torch.load(part / "runs/rm_tiny/checkpoints/last-fault.ckpt", weights_only=True)
    assert saved["global_step"] == 7
    resumed = rm_fit(tiny_data_dir, part, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = scalars(tmp_path / "full/runs/rm_tiny"), scalars(part / "runs/rm_tiny")
    for tag in ("train/loss", "train/accuracy", "val/loss", "val/accuracy"):
        assert b[tag] == pytest.approx(a[tag], abs=1e-6), tag
    wa, wb = export_weights(tmp_path / "full/runs/rm_tiny/export"), export_weights(part / "runs/rm_tiny/export")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_multi_process_fault_is_not_checkpointed_and_says_why():
    callback = FaultCheckpoint()
    callback._steps_done = 3
    assert "2-process fit is not checkpointed" in callback._why_not(SimpleNamespace(world_size=2))
    assert callback._why_not(SimpleNamespace(world_size=1)) is None
    with pytest.raises(ValueError, match="filename must not be empty"):
        FaultCheckpoint(filename="")


def test_step_start_state_is_a_copy_of_the_module_entries_and_metric_states():
    from lightning.pytorch import LightningModule
    from torchmetrics.classification import BinaryAccuracy

    class Module(LightningModule):
        def __init__(self):
            super().__init__()
            self.accuracy = BinaryAccuracy()
            self.counter = [1]

        def on_save_checkpoint(self, checkpoint):
            checkpoint["extra"] = {"counter": self.counter}

    module = Module()
    module.accuracy.persistent(True)
    module.accuracy.update(torch.tensor([1.0, 0.0]), torch.tensor([1, 1]))
    state = step_start_state(module)
    module.counter.append(2)
    module.accuracy.update(torch.tensor([1.0]), torch.tensor([1]))
    assert state["entries"] == {"extra": {"counter": [1]}}
    assert state["metrics"]["accuracy.tp"] == 1 and state["metrics"]["accuracy.fn"] == 1


# -- gradient accumulation: a checkpoint holds no gradients ----------------------------------------------
def _accumulating_sft(tokenizer_dir, tmp_path, callbacks=(), ckpt_path=None):
    import json

    from conftest import gpt2_config
    from lightning.pytorch import Trainer

    from lit_rlhf.callbacks import SigtermCheckpoint
    from lit_rlhf.data import SFTDataModule
    from lit_rlhf.modules import SFTModule

    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"the food {i}", "completion": " was good"}) + "\n" for i in range(16)))
    config = {**gpt2_config(), "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    module = SFTModule(model={"config": config, "tokenizer": tokenizer_dir, "seed": 0}, num_samples=0)
    trainer = Trainer(default_root_dir=tmp_path, max_steps=4, accumulate_grad_batches=2, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[SigtermCheckpoint(str(tmp_path / "ck")), *callbacks])  # fmt: skip
    trainer.fit(module, SFTDataModule(tokenizer_dir, str(rows), batch_size=2, seed=0, val_fraction=0.0), ckpt_path=ckpt_path)
    return module, trainer


class SigtermAt:
    """A SIGTERM to this process at the end of training batch ``batch`` (0-based)."""

    def __new__(cls, batch: int):
        import os
        import signal

        from lightning.pytorch import Callback

        class _SigtermAt(Callback):
            def on_train_batch_end(self, trainer, module, outputs, data, batch_idx):
                if batch_idx == batch:
                    os.kill(os.getpid(), signal.SIGTERM)

        return _SigtermAt()


def test_a_sigterm_in_the_middle_of_an_accumulation_stops_where_the_optimiser_stepped(tokenizer_dir, tmp_path):
    full, _ = _accumulating_sft(tokenizer_dir, tmp_path / "full")
    with pytest.raises(SystemExit) as stop:  # batch 2 of 4 x 2: half of step 2's accumulation
        _accumulating_sft(tokenizer_dir, tmp_path / "part", callbacks=[SigtermAt(2)])
    assert stop.value.code == 143
    checkpoint = tmp_path / "part" / "ck" / "last-sigterm.ckpt"
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 2, "after batch 3, where the optimiser stepped"
    resumed, _ = _accumulating_sft(tokenizer_dir, tmp_path / "resumed", ckpt_path=str(checkpoint))
    for (name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_fault_in_the_middle_of_an_accumulation_saves_nothing_and_says_why(tokenizer_dir, tmp_path):
    from lightning.pytorch import Callback

    class RaiseAt(Callback):
        def on_train_batch_start(self, trainer, module, data, batch_idx):
            if batch_idx == 3:  # batches 0-2 finished: the second accumulation is half done
                raise RuntimeError("RaiseAt")

    with pytest.warns(UserWarning, match=r"nothing saved: the fault came while gradients were accumulated \(accumulate_grad_batches=2, 1 batch"):
        with pytest.raises(RuntimeError, match="RaiseAt"):
            _accumulating_sft(tokenizer_dir, tmp_path, callbacks=[FaultCheckpoint(str(tmp_path / "ck")), RaiseAt()])
    assert not (tmp_path / "ck" / "last-fault.ckpt").exists()


@pytest.mark.slow
def test_a_fault_in_the_evaluation_after_an_epochs_last_rollout_resumes_exactly(tokenizer_dir, tmp_path):
    # 16 prompts, 8 a rollout: the evaluation after rollout 2 follows epoch 0's last rollout, and the
    # uninterrupted run's next epoch drew its DataLoader seed from the global RNG after it; the resumed
    # run sampled one draw early (a documented limit until the restore replayed that draw)
    prompts = write_prompts(tmp_path / "prompts16.jsonl", n=16)
    full, part = tmp_path / "full", tmp_path / "part"
    assert grpo(tokenizer_dir, prompts, full).returncode == 0
    proc = grpo(tokenizer_dir, prompts, part, *raise_at(2, "on_validation_batch_start"))
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    resumed = grpo(tokenizer_dir, prompts, part, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = scalars(full / "runs/grpo_tiny"), scalars(part / "runs/grpo_tiny")
    assert len(a["val/score"]) == 2 and len(a["rollout/score"]) == 4
    for tag, values in a.items():
        assert b[tag] == pytest.approx(values, rel=1e-6, abs=1e-7), tag

"""Non-finite guards: score screening, skipped optimiser steps (SFT/RM), export refusal, failed-fit exit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lit_rlhf.data import PreferenceDataModule, SFTDataModule
from lit_rlhf.guards import (
    NonFiniteError,
    StepGuard,
    all_finite,
    check_finite_weights,
    first_nonfinite_weight,
    screen_scores,
)
from lit_rlhf.models import ModelSpec, export_pretrained, load_tokenizer
from lit_rlhf.modules import DPOModule, RewardModelModule, SFTModule

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 128}


# ------------------------------------------------------------------------------------------------ scores
def test_screen_scores_raise_names_rollout_source_prompt_and_response():
    scores = torch.tensor([0.5, float("nan"), 1.0, float("inf")])
    with pytest.raises(NonFiniteError) as err:
        screen_scores(
            scores, "raise", rollout=7, source="reward_fn my.rewards.score",
            prompts=["p0", "p1", "p2", "p3"], responses=["r0", "r1", "r2", "r3"],
        )  # fmt: skip
    msg = str(err.value)
    for part in ("rollout 7", "reward_fn my.rewards.score", "2 of 4 rows", "rows [1, 3]", "'p1'", "'r1'", "nan"):
        assert part in msg, (part, msg)


def test_screen_scores_drop_returns_keep_mask_and_refuses_to_drop_everything():
    kwargs = dict(rollout=0, source="s", prompts=["a", "b", "c"], responses=["x", "y", "z"])
    keep = screen_scores(torch.tensor([1.0, -math.inf, 2.0]), "drop", **kwargs)
    assert keep.tolist() == [True, False, True]
    assert screen_scores(torch.tensor([1.0, 2.0, 3.0]), "raise", **kwargs).all()
    with pytest.raises(NonFiniteError, match="every row") as err:
        screen_scores(torch.full((3,), float("nan")), "drop", **kwargs)
    assert "nothing to learn from" in str(err.value) and "set scoring.on_nonfinite" not in str(err.value)
    with pytest.raises(ValueError, match="on_nonfinite"):
        screen_scores(torch.ones(3), "ignore", **kwargs)


# ------------------------------------------------------------------------------------------------- steps
@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (None, True),
        (float("nan"), False),
        (float("inf"), False),
        (float("-inf"), False),
        (1e30, True),  # finite, but its square overflows the float32 norm: settled element by element
        (-3.0e38, True),
    ],
)
def test_all_finite_checks_every_element(bad, expected):
    tensors = [torch.randn(7, 5), torch.randn(0), torch.randn(11)]
    if bad is not None:
        tensors[2][4] = bad
    assert all_finite(tensors) is expected
    assert all_finite([]) is True


def test_first_nonfinite_weight_names_the_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert first_nonfinite_weight(model) is None
    with torch.no_grad():
        model[1].weight[0, 0] = 1e30  # finite: not reported
        assert first_nonfinite_weight(model) is None
        model[1].bias[1] = float("nan")
    assert first_nonfinite_weight(model) == "1.bias"


def test_step_guard_drops_gradients_of_a_nonfinite_step_and_counts_it():
    layer = torch.nn.Linear(2, 1)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    guard = StepGuard()
    before = [p.detach().clone() for p in layer.parameters()]
    loss = layer(torch.tensor([[float("nan"), 1.0]])).sum()
    guard.observe_loss(loss)
    loss.backward()
    assert not guard.allow_step(list(layer.parameters()))
    opt.step()
    assert guard.skipped == 1 and all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert not opt.state, "no optimiser moment was touched"
    # the next, finite step goes through: the loss flag was reset
    loss = layer(torch.ones(1, 2)).sum()
    guard.observe_loss(loss)
    loss.backward()
    assert guard.allow_step(list(layer.parameters())) and guard.skipped == 1


def _trainer(root: Path, **kwargs) -> Trainer:
    defaults = dict(
        default_root_dir=root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
    )  # fmt: skip
    return Trainer(**{**defaults, **kwargs})


def _modules(tiny: Path, kind: str):
    spec = ModelSpec(config=TINY_GPT2, tokenizer=f"{tiny}/tokenizer", seed=0)
    opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
    kw = dict(max_length=64, max_prompt_length=16, batch_size=16)
    if kind == "sft":
        return SFTModule(spec, optimizer=opt, num_samples=0), SFTDataModule(f"{tiny}/tokenizer", f"{tiny}/sft.jsonl", **kw)
    prefs = PreferenceDataModule(f"{tiny}/tokenizer", f"{tiny}/prefs.jsonl", **kw)
    if kind == "dpo":
        return DPOModule(spec, optimizer=opt, num_samples=0), prefs
    return RewardModelModule(spec, optimizer=opt), prefs


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo"])
@pytest.mark.parametrize("fault", ["loss", "grad"])
def test_nonfinite_step_is_skipped_counted_and_weights_stay_finite(kind, fault, tiny_data_dir, tmp_path):
    torch.manual_seed(0)
    module, data = _modules(tiny_data_dir, kind)
    bad_step, seen = 2, []
    params = list(module.model.parameters())

    def poison_output(_, __, output):  # NaN embeddings: NaN logits/scores, a NaN loss
        return output + float("nan") if module.global_step == bad_step else output

    def poison_grad(grad):  # finite loss, infinite gradient
        return grad + float("inf") if module.global_step == bad_step else grad

    if fault == "loss":
        module.model.get_input_embeddings().register_forward_hook(poison_output)
    else:
        params[0].register_hook(poison_grad)
    original = module.on_train_batch_start
    module.on_train_batch_start = lambda *a: (seen.append([p.detach().clone() for p in params]), original(*a))[1]
    trainer = _trainer(tmp_path, max_steps=5, log_every_n_steps=1)  # the count is logged on logging steps
    trainer.fit(module, data)
    seen.append([p.detach().clone() for p in params])
    assert module.step_guard.skipped == 1
    assert trainer.logged_metrics["train/skipped_steps"] == 1
    check_finite_weights(module.model, "trained model")
    assert all(torch.equal(a, b) for a, b in zip(seen[bad_step], seen[bad_step + 1])), "skipped step changed weights"
    assert not all(torch.equal(a, b) for a, b in zip(seen[bad_step + 1], seen[bad_step + 2])), "later steps train"


# ------------------------------------------------------------------------------------------------ export
def test_export_refuses_nonfinite_weights_and_writes_nothing(tokenizer_dir, tmp_path):
    from lit_rlhf.models import build_causal_lm

    tok = load_tokenizer(tokenizer_dir)
    model = build_causal_lm(ModelSpec(config=TINY_GPT2, tokenizer=tokenizer_dir, seed=0), tok)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"'transformer\.h\.1\.mlp\.c_fc\.weight'"):
        export_pretrained(model, tok, tmp_path / "export")
    assert not (tmp_path / "runs/rm_tiny/export").exists()


def test_failed_fit_exits_nonzero_and_exports_nothing(tiny_data_dir, tmp_path):
    # A module whose weights turn NaN at the end of training: the export refuses, the command fails.
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(ROOT / "configs/rm_tiny.yaml"),
        "--model.class_path=faulty_modules.NaNAtEndRewardModel",
        f"--data.init_args.tokenizer={tiny_data_dir}/tokenizer",
        f"--data.init_args.train_path={tiny_data_dir}/prefs.jsonl",
        f"--model.init_args.model.tokenizer={tiny_data_dir}/tokenizer",
        f"--trainer.logger.init_args.save_dir={tmp_path}/runs", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "NonFiniteError" in proc.stderr and "holds NaN or infinite values" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "runs/rm_tiny/export").exists()


def test_skipped_steps_reach_the_logger_on_its_steps_only(tiny_data_dir, tmp_path):
    # self.log costs ~1 ms of Lightning bookkeeping: train/skipped_steps is logged on the logging steps only,
    # and every row the logger writes has it
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    module, data = _modules(tiny_data_dir, "rm")
    trainer = _trainer(tmp_path, max_steps=6, log_every_n_steps=2, logger=CSVLogger(tmp_path, name="log"))
    trainer.fit(module, data)
    (path,) = tmp_path.glob("log/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(open(path)) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    assert all(r["train/skipped_steps"] == "0.0" for r in rows)

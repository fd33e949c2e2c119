"""DPOModule: CLI fit that learns held-out preferences, logs TRL-named metrics and exports; precomputed vs
live reference; LoRA reference without a second copy; validate; exact resume; argument checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from test_sft_rm import NO_DROPOUT, TINY_GPT2, StopAt, _trainer, tb_scalars

from lit_rlhf.data import PreferenceDataModule
from lit_rlhf.models import ModelSpec, build_causal_lm, export_pretrained, load_tokenizer, response_logprobs
from lit_rlhf.modules import DPOModule

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    """scripts/make_tiny_data.py's toy pairs: the chosen review is positive, the rejected one negative."""
    out = tmp_path_factory.mktemp("tiny_data")
    script = ROOT / "scripts/make_tiny_data.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--rows", "160"], check=True)
    return out


def _spec(tiny_data: Path, **kwargs) -> ModelSpec:
    return ModelSpec(config={**TINY_GPT2, **NO_DROPOUT}, tokenizer=f"{tiny_data}/tokenizer", seed=0, **kwargs)


def _dpo(tiny_data: Path, **kwargs) -> DPOModule:
    defaults = dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), scheduler=None, num_samples=0)
    return DPOModule(_spec(tiny_data), **{**defaults, **kwargs})


def _data(tiny_data: Path, **kwargs) -> PreferenceDataModule:
    defaults = dict(max_length=64, max_prompt_length=16, batch_size=16)
    return PreferenceDataModule(f"{tiny_data}/tokenizer", f"{tiny_data}/prefs.jsonl", **{**defaults, **kwargs})


def _val_batch(tiny_data: Path, **kwargs) -> dict[str, torch.Tensor]:
    data = _data(tiny_data, **kwargs)
    data.setup("fit")
    return next(iter(data.val_dataloader()))


def tb_tensor_tags(log_dir: Path) -> set[str]:
    """Tags of the non-scalar summaries (text tables) under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in log_dir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["tensors"])
    return tags


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, *args) -> None:
        self.losses.append(outputs["loss"].item())


def test_dpo_cli_fit_learns_held_out_preferences_logs_and_exports(tiny_data, tmp_path):
    initial = tmp_path / "initial"  # stands in for runs/sft_tiny/export
    tokenizer = load_tokenizer(f"{tiny_data}/tokenizer")
    export_pretrained(build_causal_lm(_spec(tiny_data), tokenizer), tokenizer, initial)
    run = tmp_path / "dpo"
    cmd = [
        sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(ROOT / "configs/dpo_tiny.yaml"),
        f"--model.init_args.model.name_or_path={initial}",
        f"--data.init_args.tokenizer={tiny_data}/tokenizer",
        f"--data.init_args.train_path={tiny_data}/prefs.jsonl",
        f"--trainer.logger.init_args.save_dir={run}",
        f"--trainer.default_root_dir={run}",
        "--trainer.callbacks+=lit_rlhf.callbacks.HFExport", f"--trainer.callbacks.dirpath={run}/export",
        "--trainer.max_epochs=4", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    scalars = tb_scalars(run)
    for stage in ("train", "val"):
        for name in METRICS:
            assert f"{stage}/{name}" in scalars, f"{stage}/{name} missing; have {sorted(scalars)}"
    # held-out pairs (the 20% carve-out): chance is 0.5, the toy preference is separable
    assert scalars["val/rewards/accuracies"][-1] >= 0.85, scalars["val/rewards/accuracies"]
    assert scalars["val/rewards/margins"][-1] > 0
    for name in ("train/logps/chosen", "train/logps/rejected", "val/logps/chosen", "val/logps/rejected"):
        assert all(math.isfinite(v) for v in scalars[name]), name
    assert "val/samples/text_summary" in tb_tensor_tags(run), "greedy completions table"
    losses = scalars["train/loss"]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5), "policy == reference at the first step"
    assert sum(losses[-5:]) / 5 < 0.9 * math.log(2), "training loss must fall below log 2"

    # the export is the trained policy: with the initial model as reference, its implicit rewards
    # order held-out-style pairs the right way
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    reference = AutoModelForCausalLM.from_pretrained(initial).eval()
    batch = _val_batch(tiny_data, val_fraction=0.2)
    with torch.no_grad():
        args = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        ratio = response_logprobs(policy, *args)[0] - response_logprobs(reference, *args)[0]
    chosen, rejected = ratio.chunk(2)
    assert (chosen > rejected).float().mean() >= 0.85


def test_precomputed_and_live_reference_give_the_same_losses(tiny_data, tmp_path):
    runs = {}
    for precompute in (False, True):
        torch.manual_seed(0)
        module, recorder = _dpo(tiny_data, precompute_ref_logprobs=precompute), LossRecorder()
        trainer = _trainer(tmp_path, max_steps=6, enable_checkpointing=False, callbacks=[recorder])
        trainer.fit(module, _data(tiny_data))
        validated = trainer.validate(module, _data(tiny_data), verbose=False)[0]  # after the reference is freed
        runs[precompute] = (recorder.losses, validated["val/loss"], module)
    (live, live_val, live_module), (pre, pre_val, pre_module) = runs[False], runs[True]
    assert live[0] == pytest.approx(math.log(2), abs=1e-6), "policy == reference at step 1: loss log 2"
    assert live[-1] < live[0]
    assert pre == pytest.approx(live, abs=1e-5)
    assert pre_val == pytest.approx(live_val, abs=1e-5)
    assert live_module.reference is not None and pre_module.reference is None, "precomputing frees the reference"
    assert set(pre_module.ref_logps) == {"train", "val"}
    assert torch.isfinite(pre_module.ref_logps["train"]).all()


def test_lora_reference_is_the_policy_with_adapters_disabled(tiny_data, tmp_path):
    lora = dict(r=4, lora_alpha=8, target_modules=["c_attn"])
    module = DPOModule(
        _spec(tiny_data, lora=lora), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), scheduler=None, num_samples=0
    )
    assert module.reference is None, "no second copy of the weights"
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in module.model.parameters())
    batch = _val_batch(tiny_data)
    args = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    with torch.no_grad():
        initial = response_logprobs(module.model, *args)[0]
    recorder = LossRecorder()
    _trainer(tmp_path, max_steps=5, enable_checkpointing=False, callbacks=[recorder]).fit(module, _data(tiny_data))
    assert recorder.losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert recorder.losses[-1] < recorder.losses[0]
    module.eval()
    with torch.no_grad():
        trained = response_logprobs(module.model, *args)[0]
        reference = module._score_reference(batch)
    assert not torch.allclose(trained, initial), "the adapters trained"
    torch.testing.assert_close(reference, initial, msg="the reference is the initial policy")


@pytest.mark.parametrize("precompute", [False, True])
def test_validate_untrained_policy_gives_log2_and_zero_rewards(tiny_data, tmp_path, precompute):
    module = _dpo(tiny_data, precompute_ref_logprobs=precompute)
    metrics = _trainer(tmp_path).validate(module, _data(tiny_data), verbose=False)[0]
    # policy == reference: every implicit reward is 0, so the loss is -log sigmoid(0) = log 2
    assert metrics["val/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[f"val/{name}"] == pytest.approx(0.0, abs=1e-6), name
    assert metrics["val/logps/chosen"] < 0 and metrics["val/logps/rejected"] < 0


@pytest.mark.parametrize("precompute", [False, True])
def test_test_untrained_policy_on_the_test_path_logs_test_metrics(tiny_data, tmp_path, precompute):
    module = _dpo(tiny_data, precompute_ref_logprobs=precompute)
    data = _data(tiny_data, test_path=f"{tiny_data}/prefs_test.jsonl")
    metrics = _trainer(tmp_path).test(module, data, verbose=False)[0]
    assert set(metrics) == {f"test/{name}" for name in METRICS}
    assert metrics["test/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["test/rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert data.stats["test"]["rows"] == 40 and ("test" in module.ref_logps) == precompute


def test_fit_then_test_with_a_precomputed_reference(tiny_data, tmp_path):
    # Lightning's fit-then-test pattern: the test split is scored with the reference before it is freed
    runs = {}
    for precompute in (False, True):
        torch.manual_seed(0)
        module = _dpo(tiny_data, precompute_ref_logprobs=precompute)
        data = _data(tiny_data, test_path=f"{tiny_data}/prefs_test.jsonl")
        trainer = _trainer(tmp_path / str(precompute), max_steps=3, enable_checkpointing=False)
        trainer.fit(module, data)
        runs[precompute] = trainer.test(module, data, verbose=False)[0]
    assert set(runs[True]) == {f"test/{name}" for name in METRICS}
    assert runs[True]["test/loss"] == pytest.approx(runs[False]["test/loss"], abs=1e-5)


@pytest.mark.parametrize("precompute", [False, True])
def test_nll_coef_adds_the_chosen_per_token_nll(tiny_data, tmp_path, precompute):
    # the untrained policy: DPO's loss is log 2, so the loss is log 2 + alpha * the chosen per-token NLL
    module = _dpo(tiny_data, precompute_ref_logprobs=precompute, nll_coef=0.5)
    metrics = _trainer(tmp_path).validate(module, _data(tiny_data), verbose=False)[0]
    assert metrics["val/nll_loss"] > 0
    assert metrics["val/loss"] == pytest.approx(math.log(2) + 0.5 * metrics["val/nll_loss"], rel=1e-5)
    plain = _trainer(tmp_path).validate(_dpo(tiny_data), _data(tiny_data), verbose=False)[0]
    assert "val/nll_loss" not in plain and plain["val/loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize(("loss_type", "extra"), [("ipo", {}), ("simpo", {"simpo_gamma": 0.5})])
def test_ipo_and_simpo_fit(tiny_data, tmp_path, loss_type, extra):
    module, recorder = _dpo(tiny_data, loss_type=loss_type, beta=1.0, **extra), LossRecorder()
    assert (module.reference is None) == (loss_type == "simpo"), "SimPO is reference-free"
    _trainer(tmp_path, max_steps=6, enable_checkpointing=False, callbacks=[recorder]).fit(module, _data(tiny_data))
    assert all(math.isfinite(v) for v in recorder.losses)
    assert recorder.losses[-1] < recorder.losses[0]
    if loss_type == "ipo":  # h = 0 at the start: (0 - 1 / (2 beta))^2 = 0.25
        assert recorder.losses[0] == pytest.approx(0.25, abs=1e-6)


def test_resume_with_precomputed_reference_continues_exactly(tiny_data, tmp_path):
    # Uninterrupted: 6 steps. Interrupted: 3 steps with a checkpoint, then a new Trainer resumes to 6; the
    # resumed module recomputes the reference log-probs from its (initial-policy) reference.
    def module() -> DPOModule:
        return _dpo(tiny_data, precompute_ref_logprobs=True, scheduler=lambda o: torch.optim.lr_scheduler.LinearLR(o))

    torch.manual_seed(0)
    full = module()
    _trainer(tmp_path / "a", max_steps=6, enable_checkpointing=False, limit_val_batches=0).fit(full, _data(tiny_data))

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=3)
    interrupted = _trainer(tmp_path / "b", max_steps=6, callbacks=[ckpt, StopAt(3)], limit_val_batches=0)
    interrupted.fit(module(), _data(tiny_data))
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 3
    assert not any(k.startswith("reference.") for k in saved["state_dict"]), "frozen weights not checkpointed"

    resumed = module()
    trainer = _trainer(tmp_path / "c", max_steps=6, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(resumed, _data(tiny_data), ckpt_path=path)
    assert trainer.global_step == 6
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")


def test_accepts_dict_and_path_specs(tiny_data):
    fields = {"config": {**TINY_GPT2, **NO_DROPOUT}, "tokenizer": f"{tiny_data}/tokenizer", "seed": 0}
    module = DPOModule(fields, reference=fields, num_samples=0)
    assert module.spec == ModelSpec(**fields) and module.reference is not None
    with pytest.raises(TypeError, match="reference"):
        DPOModule(fields, reference=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beta=0.0), "beta"),
        (dict(loss_type="hinge"), "loss_type"),
        (dict(label_smoothing=0.5), "label_smoothing"),
        (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing"),
        (dict(simpo_gamma=1.0), "simpo_gamma"),
        (dict(loss_type="simpo", precompute_ref_logprobs=True), "reference-free"),
        (dict(num_samples=-1), "num_samples"),
        (dict(nll_coef=-0.1), "nll_coef"),
        (dict(nll_coef=float("nan")), "nll_coef"),
    ],
)
def test_bad_arguments_are_named(tiny_data, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _dpo(tiny_data, **kwargs)


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_precompute_with_a_non_finite_reference_says_so(tiny_data, tmp_path, stage):
    # a reference whose weights hold NaN: its log-probs are NaN, which is not "rows out of order"
    from lit_rlhf.guards import NonFiniteError

    module = _dpo(tiny_data, precompute_ref_logprobs=True)
    with torch.no_grad():
        next(module.reference.parameters()).fill_(float("nan"))
    trainer = _trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    with pytest.raises(NonFiniteError) as err:
        getattr(trainer, stage)(module, _data(tiny_data))
    message = str(err.value)
    assert "reference model" in message and "non-finite" in message and "row_index out of order" not in message
    split = "train" if stage == "fit" else "val"
    assert f"of the {split} split" in message and "the initial policy" in message and "[0, 1, 2" in message


def test_precompute_rows_without_log_probs_are_still_named(tiny_data, tmp_path):
    module = _dpo(tiny_data, precompute_ref_logprobs=True)
    data = _data(tiny_data)
    data.setup("fit")
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.strategy.connect(module)
    module.trainer = trainer
    broken = data.val_dataset.map(lambda row: {"row_index": 0})  # every pair claims row 0
    with pytest.raises(RuntimeError, match=r"rows of the val split got no reference log-probs.*row_index out of order"):
        module._score_dataset(broken, data.collator, 16, "val")


def test_another_held_out_set_after_fit_is_not_read_from_the_fits_tables(tiny_data, tmp_path):
    """The precomputed tables are looked up by row: after fit (the reference freed), validating on another
    data module's rows is refused instead of reading the fit's val rows' log-probs."""
    module = _dpo(tiny_data, precompute_ref_logprobs=True)
    trainer = _trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    trainer.fit(module, _data(tiny_data))
    other = _data(tiny_data, val_path=f"{tiny_data}/prefs_test.jsonl", val_split="train[:20]")
    with pytest.raises(RuntimeError, match="the val split is not one scored when the fit started"):
        trainer.validate(module, other, verbose=False)


def test_fit_then_test_with_a_test_split_of_the_training_source(tiny_data, tmp_path):
    data = _data(tiny_data, split="train[:120]", test_split="train[120:]")
    module = _dpo(tiny_data, precompute_ref_logprobs=True)
    trainer = _trainer(tmp_path, max_steps=1, enable_checkpointing=False)
    trainer.fit(module, data)
    assert "test" in module.ref_logps  # scored at fit start, before the reference was freed
    assert "test/loss" in trainer.test(module, data, verbose=False)[0]


def test_precomputed_reference_under_bf16_mixed_matches_the_policy(tiny_data, tmp_path):
    """Scored under the precision's autocast like the policy: an untrained policy's loss is exactly log 2."""
    module = _dpo(tiny_data, precompute_ref_logprobs=True, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    trainer = _trainer(tmp_path, max_steps=1, enable_checkpointing=False, precision="bf16-mixed")
    data = _data(tiny_data)
    trainer.fit(module, data)
    assert trainer.validate(module, data, verbose=False)[0]["val/loss"] == pytest.approx(math.log(2), abs=1e-6)

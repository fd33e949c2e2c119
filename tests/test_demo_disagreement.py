"""The demo's disagreement source and study: texts per prompt, argument checks, texts cut to the model's positions,
a reused stage's texts written back, sampling counted in the stage's time."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from test_demo_reuse import fits  # noqa: F401 (the stand-in fits, a fixture)

from lit_rlhf.demo import assets, disagreement_study, ensemble_runs, evaluate, pipeline, stages, unlabelled
from lit_rlhf.demo.stages import StageRunner

N_PROMPTS = 10


@pytest.fixture
def tiny_out(tmp_path, tokenizer_dir) -> Path:
    """A demo folder with what the unlabelled texts and the study read: a tiny SFT policy (GPT-2, 64 positions),
    10 training prompts, a few pairs and report.json."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from lit_rlhf.models import load_tokenizer

    out = tmp_path / "demo out"  # a space, as a user's folder may have
    tokenizer = load_tokenizer(tokenizer_dir)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(out / "sft")
    tokenizer.save_pretrained(out / "sft")
    (out / "assets").mkdir()
    prompts = [{"prompt": f"review {k}: the"} for k in range(N_PROMPTS)]
    (out / "assets" / "prompts_train.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    pairs = [{"prompt": "a b", "chosen": " c d", "rejected": " e f"}] * 8
    for name in ("prefs_train.jsonl", "prefs_val.jsonl"):
        (out / "assets" / name).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (out / "report.json").write_text("{}")
    return out


# 1. more unlabelled texts than training prompts


def test_unlabelled_texts_refuse_more_texts_than_prompts(tiny_out):
    texts, stats = unlabelled.unlabelled_texts(tiny_out, N_PROMPTS, forced_share=0.5, min_new_tokens=2)
    assert len(texts) == stats["n"] == N_PROMPTS
    # before: 2 x prompts gave 10 texts, none kept from ending, stats still saying forced_share 0.5;
    # 64 x prompts (the study's default 2,048 on a --small folder) died with IndexError in the tokenizer
    for n in (2 * N_PROMPTS, 64 * N_PROMPTS):
        with pytest.raises(ValueError, match=r"prompts_train\.jsonl: 10 training prompts, fewer than"):
            unlabelled.unlabelled_texts(tiny_out, n, forced_share=0.5, min_new_tokens=2)


def test_disagreement_study_unlabelled_above_the_prompts_is_a_usage_error(tiny_out, capsys):
    with pytest.raises(SystemExit) as exit_info:
        disagreement_study.main(["--out", str(tiny_out), "--small", "--threads", "1"])  # --unlabelled 2048
    assert exit_info.value.code == 2 and "--unlabelled 2048: at most the 10 training prompts" in capsys.readouterr().err


# 2. the study's argument checks


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--coefs", "nan"], "finite"),
        (["--coefs", "0,inf"], "finite"),
        (["--target", "nan"], "finite"),
        (["--temperature", "inf"], "finite"),
        (["--threads", "-1"], "--threads must be >= 1"),
        (["--threads", "0", "--ppo-seeds", "0"], "--threads must be >= 1"),
    ],
)
def test_disagreement_study_non_finite_numbers_and_bad_threads_are_usage_errors(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        disagreement_study.main(["--out", str(tmp_path), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# 3. the study's loop cuts the unlabelled texts as the module does (disagreement.max_length: 64)


def test_study_loop_cuts_long_unlabelled_texts_to_the_models_positions(tiny_out):
    from lit_rlhf.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_out / "sft"))
    long = "review 0: the " + " ".join(["good"] * 100)  # more tokens than the 64 positions
    assert len(tokenizer(long)["input_ids"]) > 64
    pairs = evaluate.read_jsonl(tiny_out / "assets" / "prefs_train.jsonl")
    members = disagreement_study.train_ensemble(tiny_out, tokenizer, pairs, [long, "review 1: the good"], 0, 1.0,
                                                1.0, steps=1)  # fmt: skip  (before: IndexError in the embedding)
    assert len(members) == 3


def test_study_module_runs_cut_the_texts_as_the_pipeline_config_does(tiny_out, monkeypatch):
    (tiny_out / "report.json").write_text(json.dumps({"sft_gold_mean": 0.0, "sft_gold_std": 1.0}))
    (tiny_out / "assets" / "prompts_eval.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    fitted = []

    def first_fit(path):
        fitted.append(yaml.safe_load(Path(path).read_text()))
        raise KeyboardInterrupt  # the ensemble's config is all this test needs

    monkeypatch.setattr(stages, "fit_here", first_fit)
    texts = unlabelled.write_texts(["a b"], tiny_out / "prior_study" / "unlabelled.jsonl")
    with pytest.raises(KeyboardInterrupt):
        disagreement_study.module_runs(tiny_out, texts, 0, 1.0, 1.0, [0], 1, small=True)
    pipeline_config = stages.load_config("rm_weak_disagreement_ensemble", tiny_out, small=True)
    want = pipeline_config["model"]["init_args"]["disagreement"]["max_length"]  # 64
    assert fitted[0]["model"]["init_args"]["disagreement"]["max_length"] == want  # before: absent (512)


# 4. --reuse of the disagreement stage puts back texts that were deleted


@pytest.fixture
def fits_and_texts(fits, monkeypatch) -> list[str]:  # noqa: F811 (test_demo_reuse's fixture)
    """test_demo_reuse's stand-in fits, with the disagreement texts written (slowly, as sampling is)."""

    def fake_texts(out, n):
        time.sleep(0.3)  # the sampling takes time
        return unlabelled.write_texts([f"text {k}" for k in range(n)], out / ensemble_runs.DISAGREEMENT_TEXTS)

    monkeypatch.setattr(ensemble_runs, "write_disagreement_texts", fake_texts)
    return fits


def _run(out: Path) -> StageRunner:
    manifest = {"args": {**assets.SMALL, "seed": 0}, "max_response_tokens": 1}
    runner = StageRunner(out, reuse=True)
    pipeline.run_stages(runner, out, True, [], [0], True, manifest, ensemble=tuple(ensemble_runs.SOURCES))
    return runner


def test_a_reused_disagreement_stage_writes_back_its_deleted_texts(tmp_path, fits_and_texts):
    out = tmp_path / "demo"
    _run(out)
    texts = out / ensemble_runs.DISAGREEMENT_TEXTS
    config = yaml.safe_load((out / "configs" / "rm_weak_disagreement_ensemble.yaml").read_text())
    assert config["model"]["init_args"]["disagreement"]["texts"] == str(texts)
    texts.unlink()
    runner = _run(out)
    assert runner.records["rm_weak_disagreement_ensemble"].reused
    assert texts.is_file()  # before: the reused stage's config names a file that is no longer there


# 5. the texts' sampling counts in the stage's wall time


def test_the_disagreement_stage_wall_time_includes_sampling_its_texts(tmp_path, fits_and_texts):
    runner = _run(tmp_path / "demo")
    assert runner.records["rm_weak_disagreement_ensemble"].wall_s >= 0.3  # before: ~0 (the fit alone)

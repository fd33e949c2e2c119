"""RewardEnsembleModule(disagreement=...): the D-BAT term on unlabelled texts, by hand; its settings and data
checked with errors that name the file, row and field; a fit logs it and records it; resume is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from ppo_helpers import adamw
from test_reward_ensembles import TINY
from test_sft_rm import StopAt

from lit_rlhf import functional as F
from lit_rlhf.callbacks import HFExport
from lit_rlhf.data import PreferenceDataModule
from lit_rlhf.data.formats import DataFormatError
from lit_rlhf.ensembles import ENSEMBLE_MANIFEST
from lit_rlhf.modules import RewardEnsembleModule
from lit_rlhf.modules.disagreement import Disagreement, UnlabelledTexts, read_texts


@pytest.fixture(scope="module")
def texts_file(tiny_data_dir, tmp_path_factory) -> Path:
    """Unlabelled texts: the tiny pairs' prompts with both responses run together (none of them a pair's text)."""
    rows = [json.loads(line) for line in (tiny_data_dir / "prefs.jsonl").read_text().splitlines()[:40]]
    path = tmp_path_factory.mktemp("unlabelled") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": r["prompt"] + r["chosen"] + r["rejected"]}) + "\n" for r in rows))
    return path


def module(tiny: Path, texts: Path | None, **disagreement) -> RewardEnsembleModule:
    settings = None if texts is None else {"texts": str(texts), "batch_size": 4, **disagreement}
    return RewardEnsembleModule({"config": TINY, "tokenizer": f"{tiny}/tokenizer"}, num_members=3, bootstrap=True,
                                optimizer=adamw(1e-3), scheduler=None, disagreement=settings)  # fmt: skip


def data(tiny: Path) -> PreferenceDataModule:
    return PreferenceDataModule(f"{tiny}/tokenizer", f"{tiny}/prefs.jsonl", max_length=64, max_prompt_length=16,
                                batch_size=8, split="train[:64]", val_fraction=0.25, seed=0)  # fmt: skip


def trainer(root: Path, **kw) -> Trainer:
    kw = {"max_steps": 4, "enable_checkpointing": False, "limit_val_batches": 0, **kw}
    return Trainer(default_root_dir=root, logger=CSVLogger(root, name="rm"), enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0, deterministic=True,
                   **kw)  # fmt: skip


def test_the_term_is_the_functional_loss_of_the_members_scores(tiny_data_dir, texts_file):
    ensemble = module(tiny_data_dir, texts_file, target=0.5)
    texts = UnlabelledTexts(Disagreement(texts=str(texts_file), batch_size=4), ensemble.tokenizer)
    scores = torch.randn(3, 6)
    with torch.no_grad():
        term, free = ensemble.disagreement_term(scores, step=2)
        ids, mask = texts.batch(2)
        expected = ensemble(ids, mask)  # (3, 4): every member's score of the step's texts
    torch.testing.assert_close(free, expected)
    torch.testing.assert_close(term, F.disagreement_loss(scores, expected, 0.5))


def test_the_batches_are_a_function_of_step_and_rank(tiny_data_dir, texts_file):
    ensemble = module(tiny_data_dir, texts_file)
    texts = ensemble.unlabelled()
    assert len(texts.ids) == 40 and texts.order.sort().values.tolist() == list(range(40))
    assert torch.equal(texts.batch(3)[0], texts.batch(3)[0])
    # 40 texts, 4 a step: steps 0..9 draw each text once; two ranks draw disjoint rows at one step
    seen = [row for step in range(10) for row in texts.order[torch.arange(step * 4, step * 4 + 4)].tolist()]
    assert sorted(seen) == list(range(40))
    ids, mask = texts.batch(0, rank=1, world_size=2)
    assert torch.equal(ids, texts.batch(1)[0]) and mask.sum(1).min() >= 1
    # right-padded: every row's real tokens first
    assert torch.equal(mask, (torch.arange(mask.shape[1]) < mask.sum(1, keepdim=True)).long())


def test_a_fit_logs_the_term_and_the_export_records_it(tiny_data_dir, texts_file, tmp_path):
    torch.manual_seed(0)
    plain, diverse = module(tiny_data_dir, None), module(tiny_data_dir, texts_file, coef=2.0, target=3.0)
    trainer(tmp_path / "plain").fit(plain, data(tiny_data_dir))
    run = trainer(tmp_path / "diverse", callbacks=[HFExport(str(tmp_path / "export"))])
    run.fit(diverse, data(tiny_data_dir))
    assert {"train/disagreement", "train/unlabelled_std"} <= set(run.callback_metrics)
    assert not torch.equal(plain.model[0].score.weight, diverse.model[0].score.weight)
    manifest = json.loads((tmp_path / "export" / ENSEMBLE_MANIFEST).read_text())
    assert manifest["disagreement"] == {"texts": str(texts_file), "coef": 2.0, "target": 3.0, "batch_size": 4,
                                        "max_length": 512, "seed": 0}  # fmt: skip
    assert diverse.hparams.disagreement["coef"] == 2.0  # plain values in hparams.yaml


def test_resume_continues_exactly(tiny_data_dir, texts_file, tmp_path):
    torch.manual_seed(0)
    full = module(tiny_data_dir, texts_file)
    trainer(tmp_path / "a", max_steps=6).fit(full, data(tiny_data_dir))
    first = module(tiny_data_dir, texts_file)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_train_steps=3)
    trainer(tmp_path / "b", max_steps=6, callbacks=[ckpt, StopAt(3)], enable_checkpointing=True).fit(
        first, data(tiny_data_dir)
    )
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")
    resumed = module(tiny_data_dir, texts_file)
    trainer(tmp_path / "c", max_steps=6).fit(resumed, data(tiny_data_dir), ckpt_path=path)
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, msg=f"{name} differs after resume")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"texts": "texts.json"}, "disagreement.texts must be a .jsonl file path"),
        ({"coef": 0.0}, "disagreement.coef must be a finite number > 0"),
        ({"target": float("nan")}, "disagreement.target must be a finite number > 0"),
        ({"batch_size": 0}, "disagreement.batch_size must be an integer >= 1"),
        ({"batch_size": 2.5}, "disagreement.batch_size must be"),
    ],
)
def test_settings_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        Disagreement.coerce({"texts": "texts.jsonl", **fields})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"text": "a"}\n{"txt": "b"}\n', r"row 1 \(0-based\), field 'text': needs a non-empty string, got None"),
        ('{"text": "a"}\n\n{"text": "  "}\n', r"row 1 \(0-based\), field 'text': needs a non-empty string"),
        ('["a"]\n', r"row 0 \(0-based\), field 'text': needs a non-empty string, got list"),
        ('{"text": "a"}\n{"text": "b\n', r"row 1 \(0-based\): malformed JSON"),
        ("\n", "the file has no rows"),
    ],
)
def test_bad_texts_name_the_file_row_and_field(tmp_path, content, message):
    path = tmp_path / "texts.jsonl"
    path.write_text(content)
    with pytest.raises(DataFormatError, match=message) as info:
        read_texts(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(DataFormatError, match="texts.jsonl: cannot read"):
        read_texts(str(tmp_path / "missing" / "texts.jsonl"))


def test_texts_past_the_models_positions_are_refused(tiny_data_dir, tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "word " * 400}) + "\n")
    with pytest.raises(ValueError, match="unlabelled texts of .*long.jsonl .*past the 128"):
        module(tiny_data_dir, path).unlabelled()  # read when first needed (a fit reads them in setup)
    assert module(tiny_data_dir, path, max_length=100).unlabelled() is not None  # cut to the last 100: accepted


def test_texts_in_other_encodings_name_the_file_and_row(tmp_path):
    path = tmp_path / "texts.jsonl"
    good = json.dumps({"text": "the food was good"}) + "\n"
    path.write_bytes(("\ufeff" + good + "\n" + good.replace("\n", "\r\n")).encode())  # a BOM, a blank line, CRLF
    assert read_texts(str(path)) == ["the food was good"] * 2
    path.write_bytes((good * 1000).encode() + '{"text": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"row 1000 \(0-based\): line 1001: not valid UTF-8 \(byte b'\\xe9' at byte 14 of the line"):
        read_texts(str(path))
    path.write_text(good + '{"text": "a \\ud800 b"}\n')
    with pytest.raises(DataFormatError, match=r"row 1 \(0-based\), field 'text': a lone surrogate"):
        read_texts(str(path))


def test_a_checkpoint_loads_without_the_texts(tiny_data_dir, texts_file, tmp_path):
    own = tmp_path / "own.jsonl"
    own.write_bytes(texts_file.read_bytes())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    trainer(tmp_path / "b", max_steps=1, callbacks=[ckpt], enable_checkpointing=True).fit(
        module(tiny_data_dir, own), data(tiny_data_dir)
    )
    (path,) = (tmp_path / "ckpt").glob("*.ckpt")
    own.unlink()  # e.g. testing or exporting the members on another machine
    loaded = RewardEnsembleModule.load_from_checkpoint(path)
    assert loaded.disagreement.texts == str(own)
    with pytest.raises(DataFormatError, match="own.jsonl: cannot read the unlabelled texts"):
        trainer(tmp_path / "c", max_steps=2).fit(loaded, data(tiny_data_dir), ckpt_path=path)  # a fit needs them

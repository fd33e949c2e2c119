"""Data errors name the file, the row (in the file, also under a split slice) and the field."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lit_rlhf.data import DataFormatError, PreferenceDataModule, PromptDataModule

datasets.disable_progress_bars()
PAIR = {"prompt": "the food was", "chosen": " good", "rejected": " bad"}


def lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def prefs(tokenizer_dir, path, **kwargs) -> PreferenceDataModule:
    return PreferenceDataModule(tokenizer_dir, str(path), val_fraction=0.0, batch_size=1, **kwargs)


@pytest.mark.parametrize("row", [3, 0])  # row 0 is also read alone, before the map (its prompt form)
def test_non_utf8_byte_names_file_line_and_row(tokenizer_dir, tmp_path, row):
    path = tmp_path / "prefs.jsonl"
    bad = b'{"prompt": "a", "chosen": "\xff ok", "rejected": "b"}\n'
    path.write_bytes(lines([PAIR] * row) + bad + lines([PAIR] * 2))
    with pytest.raises(DataFormatError) as err:
        prefs(tokenizer_dir, path).setup()
    msg = str(err.value)
    assert msg.startswith(str(path)) and f"row {row} (0-based)" in msg, msg
    assert f"line {row + 1}: not valid UTF-8" in msg, msg


def test_truncated_json_line_names_file_line_and_row(tokenizer_dir, tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(lines([PAIR] * 5) + b'{"prompt": "a", "chosen": "b", "rej')
    with pytest.raises(DataFormatError) as err:
        prefs(tokenizer_dir, path).setup()
    msg = str(err.value)
    assert msg.startswith(str(path)) and "row 5 (0-based)" in msg and "line 6: malformed JSON" in msg, msg


@pytest.mark.parametrize(
    "line, problem",
    [(b"5\n", "a JSON line must be an object ({...}), got int"), (b'["a", "b"]\n', "got list"),
     (b'{"prompt": "\\ud800", "chosen": "b", "rejected": "c"}\n', "a lone surrogate escape")],
)  # fmt: skip
def test_a_json_line_that_is_no_row_names_file_line_and_row(line, problem, tokenizer_dir, tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(lines([PAIR] * 2) + line + lines([PAIR]))
    with pytest.raises(DataFormatError) as err:
        prefs(tokenizer_dir, path).setup()
    msg = str(err.value)
    assert msg.startswith(str(path)) and "row 2 (0-based)" in msg and "line 3: " in msg and problem in msg, msg


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_empty_file_says_so(content, tokenizer_dir, tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match="the file is empty") as err:
        prefs(tokenizer_dir, path).setup()
    assert str(err.value).startswith(str(path)) and "StopIteration" not in str(err.value)


@pytest.mark.parametrize("file_type", ["jsonl", "parquet"])
def test_bad_row_under_a_slice_is_numbered_in_the_file(file_type, tokenizer_dir, tmp_path):
    rows = [{"prompt": f"the food {i}"} for i in range(30)]
    rows[17] = {"prompt": ""}
    path = tmp_path / f"prompts.{file_type}"
    if file_type == "jsonl":
        path.write_bytes(lines(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataFormatError, match=r"row 17 \(0-based\), field 'prompt': empty"):
        PromptDataModule(tokenizer_dir, str(path), split="train[10:]", val_fraction=0.0).setup()
    # rows kept by the slice, in order, without the row-number column
    rows[17] = {"prompt": "fine"}
    path.write_bytes(lines(rows)) if file_type == "jsonl" else pq.write_table(pa.Table.from_pylist(rows), path)
    dm = PromptDataModule(tokenizer_dir, str(path), split="train[:3]+train[-2:]", val_fraction=0.0)
    dm.setup()
    decoded = [dm.tokenizer.decode(r["prompt_input_ids"], skip_special_tokens=True) for r in dm.train_dataset]
    assert decoded == [r["prompt"] for r in rows[:3] + rows[-2:]]
    assert "__file_row__" not in dm.train_dataset.column_names


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"prompt": "the food was", "chosen": " good", "rejected": " good"}, "explicit"),
        ({"prompt": "the food was", "chosen": " good", "rejected": " good"}, "auto"),
        (
            {
                "conversations": [{"from": "human", "value": "the food?"}],
                "chosen": {"from": "gpt", "value": "good"},
                "rejected": {"from": "gpt", "value": "good"},
            },
            "sharegpt",
        ),
        ({"chosen": "the food was good", "rejected": "the food was good"}, "implicit"),
    ],
)
def test_chosen_equal_to_rejected_is_refused_in_every_format(row, fmt, tokenizer_dir, tmp_path):
    path = tmp_path / "prefs.jsonl"
    good = {k: (v.replace("good", "bad") if k == "rejected" and isinstance(v, str) else v) for k, v in row.items()}
    if fmt == "sharegpt":
        good["rejected"] = {"from": "gpt", "value": "bad"}
    path.write_bytes(lines([good, good, row]))
    with pytest.raises(DataFormatError, match=r"row 2 \(0-based\), field 'rejected': identical to chosen"):
        prefs(tokenizer_dir, path, format=fmt).setup()


@pytest.mark.parametrize("kind", ["prompt", "preference", "sft"])
def test_validate_without_a_validation_split_names_val_path_and_val_fraction(kind, tokenizer_dir, tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_rlhf.data import SFTDataModule

    path = tmp_path / "rows.jsonl"
    row = {"prompt": {"prompt": "the food"}, "preference": PAIR, "sft": {"prompt": "the", "completion": " food"}}[kind]
    path.write_bytes(lines([row] * 8))
    cls = {"prompt": PromptDataModule, "preference": PreferenceDataModule, "sft": SFTDataModule}[kind]
    data = cls(tokenizer_dir, str(path), val_fraction=0.0, batch_size=2)
    trainer = Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"validation needs held-out rows: set `val_path`.*`val_fraction` > 0"):
        trainer.validate(BoringModel(), data)

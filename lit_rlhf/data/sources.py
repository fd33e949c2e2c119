"""Loading a data source with ``datasets`` and carving a validation split from it.

``datasets`` (with pyarrow and pandas, ~100 MB of resident memory) is imported when a source is loaded,
not with this module: the training modules import the data package for its batch contract only.
"""

from __future__ import annotations

import csv
import json
import os
from typing import TYPE_CHECKING, Any

from lit_rlhf.data.formats import DataFormatError

if TYPE_CHECKING:
    from datasets import Dataset

# Local file types, by extension, and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Files that ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write into their folder.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")
# Column that load_source adds to a slice of a local file: each row's 0-based row number in the file.
FILE_ROW_COLUMN = "__file_row__"


def check_text_file(path: str) -> None:
    """Find the first undecodable, malformed or missing content of a local json/jsonl/csv file.

    Raises :class:`DataFormatError` naming the line (and, for JSON lines, the row: the 0-based count of
    non-blank lines before it, which is the row's index in the dataset) for a byte that is not UTF-8, a
    JSON line that does not parse (e.g. truncated), or a file without rows. Returns when it finds none.
    Called after ``datasets`` failed, to say where, so good data costs nothing extra.
    """
    json_lines = os.path.splitext(path)[1].lower() == ".jsonl"
    rows = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            row = rows if json_lines else None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = raw[err.start : err.start + 1]
                raise DataFormatError(
                    path, f"line {line_no}: not valid UTF-8 (byte {bad!r} at byte {err.start + 1} of the line)", row
                ) from err
            if not text.strip():
                continue
            if json_lines:
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as err:
                    raise DataFormatError(
                        path, f"line {line_no}: malformed JSON ({err.msg} at column {err.colno}); truncated?", row
                    ) from err
                if not isinstance(value, dict):
                    raise DataFormatError(
                        path, f"line {line_no}: a JSON line must be an object ({{...}}), got {type(value).__name__}", row
                    )
                try:  # a lone UTF-16 surrogate escape ("\ud800") parses, but is no text
                    json.dumps(value, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError as err:
                    raise DataFormatError(path, f"line {line_no}: a lone surrogate escape in a string ({err.reason})", row) from err
            rows += 1
    if rows == 0:
        raise DataFormatError(path, "the file is empty (no rows)")


def _select_slice(dataset: Dataset, split: str, path: str) -> Dataset:
    """Apply a ``datasets`` slice such as ``train[10:]`` to a local file's (or saved ``Dataset``'s) one split,
    recording each row's number in the file (``FILE_ROW_COLUMN``) so that errors point at the file, not the
    slice."""
    from datasets import ReadInstruction

    try:
        parts = ReadInstruction.from_spec(split).to_absolute({"train": len(dataset)})
    except (ValueError, AssertionError) as err:
        raise DataFormatError(path, f"cannot read the data: bad split {split!r} for a local file or saved Dataset ('train' or a slice such as 'train[:100]'): {err}") from err
    if any(part.splitname != "train" for part in parts):
        raise DataFormatError(path, f"cannot read the data: a local file or saved Dataset has one split, 'train'; got {split!r}")
    rows = [r for part in parts for r in range(part.from_, part.to)]
    return dataset.add_column(FILE_ROW_COLUMN, list(range(len(dataset)))).select(rows)


def _csv_as_written(path: str) -> dict[str, Any]:
    """``load_dataset("csv")`` options that keep every cell the text it is: pandas would read a column of
    numbers as numbers (an answer ``4`` as 4, or 4.0 beside an empty cell) and ``None``, ``NA`` or an empty
    cell as missing. A bad header is left to the reader's own error."""
    from datasets import Features, Value

    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which pandas drops from the names
        with open(path, encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return {}
    if not header or len(set(header)) != len(header):
        return {}
    return {"features": Features({name: Value("string") for name in header}), "keep_default_na": False}


def load_source(path: str, split: str = "train", cache_dir: str | None = None) -> Dataset:
    """Load ``path`` as one ``Dataset``.

    ``path`` is, in this order: a folder written by ``save_to_disk`` (``load_from_disk``; ``split`` picks
    a split of a saved ``DatasetDict``, or slices a saved ``Dataset`` as a local file's one split); a local
    ``.json``/``.jsonl``/``.parquet``/``.csv`` file (its
    one split is ``"train"``: all rows; a ``datasets`` slice of it such as ``"train[:1200]"`` keeps those
    rows); otherwise a hub dataset name or a folder of data files
    (``load_dataset(path, split=split)``). Any failure is a :class:`DataFormatError` naming ``path``.
    """
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    ext = os.path.splitext(path)[1].lower()
    try:
        if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in SAVED_DATASET_MARKERS):
            dataset = load_from_disk(path)
            if isinstance(dataset, DatasetDict):
                if split not in dataset:
                    raise DataFormatError(
                        path, f"no split {split!r}; the saved dataset has {sorted(dataset)}"
                    )
                dataset = dataset[split]
            elif split != "train":  # one saved Dataset: one split, as a local file has
                dataset = _select_slice(dataset, split, path)
        elif ext in FILE_BUILDERS:
            if not os.path.isfile(path):
                raise DataFormatError(path, "file not found")
            options = _csv_as_written(path) if ext == ".csv" else {}
            dataset = load_dataset(FILE_BUILDERS[ext], data_files=path, split="train", cache_dir=cache_dir, **options)
            if split != "train":
                dataset = _select_slice(dataset, split, path)
        elif os.path.isfile(path):
            raise DataFormatError(path, f"unknown file type {ext!r}; expected one of {sorted(FILE_BUILDERS)}")
        else:
            dataset = load_dataset(path, split=split, cache_dir=cache_dir)
    except DataFormatError:
        raise
    except Exception as err:  # datasets/pyarrow raise many types; all mean "this source cannot be read"
        if ext in FILE_BUILDERS and ext != ".parquet" and os.path.isfile(path):
            check_text_file(path)  # names the line when it can
        cause = f" ({type(err.__cause__).__name__}: {err.__cause__})" if err.__cause__ is not None else ""
        raise DataFormatError(path, f"cannot read the data: {type(err).__name__}: {err}{cause}") from err
    if not isinstance(dataset, Dataset):
        raise DataFormatError(path, f"expected a Dataset, got {type(dataset).__name__}")
    if len(dataset) == 0:
        raise DataFormatError(path, "no rows")
    return dataset


def carve_validation(
    dataset: Dataset, val_fraction: float, seed: int, source: str
) -> tuple[Dataset, Dataset]:
    """Split off a seeded random ``val_fraction`` of the rows (at least one) as (train, val); disjoint."""
    n_val = max(1, round(len(dataset) * val_fraction))
    if n_val >= len(dataset):
        raise DataFormatError(
            source, f"val_fraction={val_fraction} of {len(dataset)} rows leaves no training rows"
        )
    parts = dataset.train_test_split(test_size=n_val, shuffle=True, seed=seed)
    return parts["train"], parts["test"]

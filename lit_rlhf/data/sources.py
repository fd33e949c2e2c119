"""Loading a data source with ``datasets`` and carving a validation split from it."""

from __future__ import annotations

import os

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from lit_rlhf.data.formats import DataFormatError

# Local file types, by extension, and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Files that ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` write into their folder.
SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def load_source(path: str, split: str = "train", cache_dir: str | None = None) -> Dataset:
    """Load ``path`` as one ``Dataset``.

    ``path`` is, in this order: a folder written by ``save_to_disk`` (``load_from_disk``; ``split`` picks
    a split of a saved ``DatasetDict``); a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file (its
    one split is ``"train"``: all rows; a ``datasets`` slice of it such as ``"train[:1200]"`` keeps those
    rows); otherwise a hub dataset name or a folder of data files
    (``load_dataset(path, split=split)``). Any failure is a :class:`DataFormatError` naming ``path``.
    """
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
        elif ext in FILE_BUILDERS:
            if not os.path.isfile(path):
                raise DataFormatError(path, "file not found")
            dataset = load_dataset(FILE_BUILDERS[ext], data_files=path, split=split, cache_dir=cache_dir)
        elif os.path.isfile(path):
            raise DataFormatError(path, f"unknown file type {ext!r}; expected one of {sorted(FILE_BUILDERS)}")
        else:
            dataset = load_dataset(path, split=split, cache_dir=cache_dir)
    except DataFormatError:
        raise
    except Exception as err:  # datasets/pyarrow raise many types; all mean "this source cannot be read"
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

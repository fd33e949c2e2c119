"""PreferenceDataModule: (prompt, chosen, rejected) pairs for reward-model training."""

from __future__ import annotations

from typing_extensions import override

from lit_rlhf.data.base import LengthPolicy, RLHFDataModule
from lit_rlhf.data.collators import PreferenceCollator
from lit_rlhf.data.formats import (
    PreferenceFormat,
    RowRef,
    Text,
    detect_preference_format,
    parse_preference_row,
)


def parse_preference(row: dict, fmt: str, ref: RowRef) -> tuple[Text, tuple[Text, ...], dict[str, float]]:
    pair = parse_preference_row(row, fmt, ref)
    extras = {} if pair.margin is None else {"margin": pair.margin}
    return pair.prompt, (pair.chosen, pair.rejected), extras


class PreferenceDataModule(RLHFDataModule):
    """Preference pairs from a hub dataset, a ``save_to_disk`` folder or a json/jsonl/parquet/csv file.

    Row formats (see :mod:`lit_rlhf.data.formats`): explicit ``prompt``/``chosen``/``rejected``,
    implicit ``chosen``/``rejected`` (Anthropic HH) and ShareGPT ``conversations`` + ``chosen``/``rejected``;
    an optional ``margin`` column. Batches come from :class:`~lit_rlhf.data.collators.PreferenceCollator`:
    ``input_ids``, ``attention_mask``, ``response_mask`` (2B, L), chosen rows first, ``margin`` (B,) and
    ``row_index`` (B,), each pair's position in its split (``train_dataset`` / ``val_dataset`` / ``test_dataset``).
    """

    slots = ("chosen", "rejected")
    collator_class = PreferenceCollator
    parse = staticmethod(parse_preference)

    def __init__(
        self,
        tokenizer: str,
        train_path: str,
        val_path: str | None = None,
        val_fraction: float = 0.1,
        format: PreferenceFormat = "auto",
        split: str = "train",
        max_length: int = 512,
        max_prompt_length: int = 256,
        length_policy: LengthPolicy = "truncate",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        val_split: str | None = None,
        test_path: str | None = None,
        test_split: str | None = None,
        cache_dir: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        """
        Args:
            tokenizer: tokenizer hub id or folder (loaded with the project's pad-token policy).
            train_path: hub dataset name, ``save_to_disk`` folder, or .json/.jsonl/.parquet/.csv file.
            val_path: validation source like ``train_path``; None carves ``val_fraction`` from the training rows
                (unless ``val_split`` names a held-out split of ``train_path``).
            val_fraction: seeded fraction of the training rows held out for validation when ``val_path`` is None.
            format: row format: "explicit", "implicit", "sharegpt", or "auto" to detect it from the columns.
            split: split of a hub dataset or saved DatasetDict; of a local file: "train" (all rows) or
                a slice such as "train[:1200]".
            max_length: token limit of prompt + response (each of chosen and rejected).
            max_prompt_length: token limit of the prompt (its end is kept when truncating, after a leading BOS).
            length_policy: over-long rows are "truncate"d or "drop"ped; counts are logged and kept in ``stats``.
                A truncated pair whose chosen and rejected tokens are then identical (they differ only past
                ``max_length``) is dropped as well (zero gradient), counted as ``stats[split]["identical"]``.
            batch_size: pairs per training batch (the model sees 2 * batch_size sequences).
            val_batch_size: pairs per validation batch; None means ``batch_size``.
            num_workers: DataLoader worker processes.
            seed: seed of the validation carve-out and of the training order; None follows the global
                seed (``seed_everything``).
            val_split: split to load from ``val_path``; None means ``split``. Without ``val_path``, a split
                or slice of ``train_path`` (e.g. "test", or "train[90%:]" beside split="train[:90%]"), and no rows are carved.
            test_path: held-out source for ``test`` (``lit-rlhf test``), read like ``train_path``.
            test_split: split to load from ``test_path``; None means ``split``. Without ``test_path``, a split
                or slice of ``train_path`` (e.g. "test", or "train[90%:]" beside split="train[:90%]").
            cache_dir: ``datasets`` cache folder for loading hub/file data; None uses the HF default.
            trust_remote_code: load a tokenizer shipped as custom code (as ``ModelSpec.trust_remote_code``).
        """
        super().__init__()
        self.save_hyperparameters()
        if format not in ("auto", "explicit", "implicit", "sharegpt"):
            raise ValueError(
                f"PreferenceDataModule: format must be auto/explicit/implicit/sharegpt, got {format!r}"
            )
        self._build()

    def detect_format(self, columns: list[str], source: str) -> str:
        return detect_preference_format(columns, source, self.hparams.format)

    @override
    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        # DPOModule keys precomputed reference log-probs by a pair's position in its split
        for name in ("train_dataset", "val_dataset", "test_dataset"):
            dataset = getattr(self, name)
            if dataset is not None and "row_index" not in dataset.column_names:
                setattr(self, name, dataset.add_column("row_index", list(range(len(dataset)))))

"""SFTDataModule: (prompt, completion) rows for supervised fine-tuning with the loss on the completion."""

from __future__ import annotations

from lit_rlhf.data.base import LengthPolicy, RLHFDataModule
from lit_rlhf.data.collators import SFTCollator
from lit_rlhf.data.formats import RowRef, Text, detect_sft_format, parse_sft_row


def parse_sft(row: dict, fmt: str, ref: RowRef) -> tuple[Text, tuple[Text, ...], dict[str, float]]:
    prompt, completion = parse_sft_row(row, fmt, ref)
    return prompt, (completion,), {}


class SFTDataModule(RLHFDataModule):
    """SFT rows from a hub dataset, a ``save_to_disk`` folder or a json/jsonl/parquet/csv file.

    Rows have ``prompt`` + ``completion`` (or ``response``), or ``messages``/``conversations`` ending with an
    assistant message (multi-turn: every assistant turn is trained, the user turns between them are not).
    Batches (RIGHT-padded): ``input_ids``, ``attention_mask``, ``labels`` (-100 on prompt, user turns and
    padding), ``response_mask`` (1 on the trained tokens), all (B, L).
    """

    example_test_file = "data/tiny/sft_test.jsonl"
    slots = ("completion",)
    loss_masks = True
    collator_class = SFTCollator
    parse = staticmethod(parse_sft)

    def __init__(
        self,
        tokenizer: str,
        train_path: str,
        val_path: str | None = None,
        val_fraction: float = 0.1,
        max_length: int = 512,
        max_prompt_length: int = 256,
        length_policy: LengthPolicy = "truncate",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        split: str = "train",
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
            max_length: token limit of prompt + completion.
            max_prompt_length: token limit of the prompt (its end is kept when truncating, after a leading BOS).
            length_policy: over-long rows are "truncate"d or "drop"ped; counts are logged and kept in ``stats``.
            batch_size: rows per training batch.
            val_batch_size: rows per validation batch; None means ``batch_size``.
            num_workers: DataLoader worker processes.
            seed: seed of the validation carve-out and of the training order; None follows the global
                seed (``seed_everything``).
            split: split of a hub dataset or saved DatasetDict; of a local file: "train" (all rows) or
                a slice such as "train[:1200]".
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
        self._build()

    def detect_format(self, columns: list[str], source: str) -> str:
        return detect_sft_format(columns, source)

"""What the data modules share: load, validate and tokenise every row, carve val, length limits, loaders.

``setup`` reads every row of every source once through ``Dataset.map`` (cached by ``datasets`` for
file-backed data), so a malformed row stops the run with a :class:`DataFormatError` before training.
Rows over the length limits are truncated or dropped (``length_policy``); pairs whose responses are
identical once truncated are dropped; the counts are logged and kept in ``stats``. The training loader uses :class:`ResumableSampler`; its position is part of the module's
``state_dict``, which Lightning saves in checkpoints, so a resumed fit continues with the next batch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, SequentialSampler
from typing_extensions import override

from lit_rlhf.data.collators import ROW_COLUMN_PREFIX
from lit_rlhf.data.encode import RowParser, encode_batch
from lit_rlhf.data.formats import DataFormatError, RowRef, Text
from lit_rlhf.data.sampler import HeldOutBatches, ResumableSampler
from lit_rlhf.data.sources import FILE_ROW_COLUMN, carve_validation, check_text_file, load_source
from lit_rlhf.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from datasets import Dataset  # imported by ``load_source`` when a source is read

LengthPolicy = Literal["truncate", "drop"]
def resolve_seed(seed: int | None) -> int:
    """``seed``, or when None the global seed of ``seed_everything`` (its ``PL_GLOBAL_SEED``; 0 if unset).

    An exact resume needs the same global seed: LightningCLI writes the seed it drew into the run's
    ``config.yaml`` (``seed_everything: <int>``), so re-running that config resumes identically.
    """
    return seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))


def _not_flagged(flags: list[bool]) -> list[bool]:
    return [not f for f in flags]


class RLHFDataModule(LightningDataModule):
    """Base class; subclasses define ``__init__`` (calling ``save_hyperparameters`` then ``_build``),
    ``slots``, ``collator_class``, ``parse`` and ``detect_format``."""

    slots: ClassVar[tuple[str, ...]]
    collator_class: ClassVar[type]
    parse: ClassVar[RowParser]
    example_test_file: ClassVar[str] = "data/tiny/prefs_test.jsonl"  # of this kind of rows, for messages
    # whether rows carry ``<slot>_loss_mask`` (a multi-turn response trained on its assistant turns only)
    loss_masks: ClassVar[bool] = False

    def detect_format(self, columns: list[str], source: str) -> str:
        raise NotImplementedError

    def _build(self) -> None:
        """Check the hyperparameters (fail at construction, not mid-run) and load the tokenizer."""
        hp = self.hparams
        max_length = hp.get("max_length")
        def path_or_none(name: str) -> bool:
            return hp.get(name) is None or (isinstance(hp.get(name), str) and hp.get(name).strip() != "")

        checks = [
            ("train_path", isinstance(hp.train_path, str) and hp.train_path.strip() != "", "a non-empty path or name"),
            ("val_path", path_or_none("val_path"), "None or a non-empty path or name"),
            ("test_path", path_or_none("test_path"), "None or a non-empty path or name"),
            ("val_fraction", 0 <= hp.val_fraction < 1, "in [0, 1)"),
            ("max_prompt_length", hp.max_prompt_length >= 1, ">= 1"),
            ("max_length", max_length is None or max_length > hp.max_prompt_length,
             f"> max_prompt_length ({hp.max_prompt_length}: lower it too)"),
            ("length_policy", hp.length_policy in ("truncate", "drop"), "'truncate' or 'drop'"),
            ("batch_size", hp.batch_size >= 1, ">= 1"),
            ("val_batch_size", hp.val_batch_size is None or hp.val_batch_size >= 1, "None or >= 1"),
            ("num_workers", hp.num_workers >= 0, ">= 0"),
        ]
        for stage in ("val", "test"):  # a held-out split of the training source that is the training split
            if hp.get(f"{stage}_path") is None and hp.get(f"{stage}_split") == hp.split:
                raise ValueError(
                    f"{type(self).__name__}: {stage}_split={hp.split!r} without {stage}_path reads the training"
                    f" split of train_path again: its rows would be training rows. Give another split or slice"
                    f" (e.g. split='train[:90%]', {stage}_split='train[90%:]') or a {stage}_path"
                )
        for name, ok, requirement in checks:
            if not ok:
                raise ValueError(f"{type(self).__name__}: {name} must be {requirement}, got {hp.get(name)!r}")
        self.tokenizer = load_tokenizer(hp.tokenizer, trust_remote_code=bool(hp.get("trust_remote_code", False)))
        self.collator = self.collator_class(self.tokenizer.pad_token_id)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.train_sampler: ResumableSampler | None = None
        # per split: rows (before the length policy), truncated, dropped
        self.stats: dict[str, dict[str, int]] = {}
        self._resume = {"epoch": 0, "consumed": 0, "offset": 0, "batches": 0}

    @override
    def prepare_data(self) -> None:
        """Download, validate and tokenise every source once per node, filling the ``datasets`` cache
        that each rank's ``setup`` then reads instead of repeating the work."""
        hp = self.hparams
        self._encode(hp.train_path, hp.split)
        if self.held_out("val") is not None:
            self._encode(*self.held_out("val"))

    @override
    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "test"):
            self._setup_test()
        if stage == "test" or self.train_dataset is not None:
            return
        hp = self.hparams
        train = self._encode(hp.train_path, hp.split)
        val, held_out = None, self.held_out("val")
        val_source = hp.train_path if held_out is None else held_out[0]
        if held_out is not None:
            val = self._encode(*held_out)
        elif hp.val_fraction > 0:
            train, val = carve_validation(train, hp.val_fraction, resolve_seed(hp.seed), hp.train_path)
        self.train_dataset = self._apply_length_policy(train, "train", hp.train_path)
        self.val_dataset = None if val is None else self._apply_length_policy(val, "val", val_source)

    def _setup_test(self) -> None:
        """The test split (``lit-rlhf test`` / ``trainer.test``): ``test_path``, read like ``train_path``."""
        held_out = self.held_out("test")
        if self.test_dataset is None and held_out is not None:
            test = self._encode(*held_out)
            self.test_dataset = self._apply_length_policy(test, "test", held_out[0])

    def held_out(self, stage: Literal["val", "test"]) -> tuple[str, str] | None:
        """(source, split) of the validation or test rows: ``<stage>_path`` with ``<stage>_split`` (default
        ``split``); without a path, ``<stage>_split`` of ``train_path`` (e.g. a hub dataset's "test" split,
        or the slice "train[90%:]" of a local file); None when neither is set."""
        hp = self.hparams
        path, split = hp.get(f"{stage}_path"), hp.get(f"{stage}_split")
        if path is not None:
            return path, split or hp.split
        return None if split is None else (hp.train_path, split)

    def row_columns(self, columns: list[str], fmt: str) -> list[str]:
        """The source columns kept beside the tokens, for the collator to pass on (none here)."""
        return []

    def _first_row(self, dataset: Dataset, fmt: str, path: str) -> tuple[int, Text, tuple[str, ...]] | None:
        """(number, prompt, extra columns) of the source's first row, which every row's extra columns match."""
        if len(dataset) == 0:
            return None
        row = dict(dataset[0])
        number = row.pop(FILE_ROW_COLUMN, 0)
        prompt, _, extras = type(self).parse(row, fmt, RowRef(path, number))
        return number, prompt, tuple(sorted(extras))

    def _encode(self, path: str, split: str) -> Dataset:
        dataset = load_source(path, split, self.hparams.cache_dir)
        columns = [c for c in dataset.column_names if c != FILE_ROW_COLUMN]
        fmt = self.detect_format(columns, path)
        kept = self.row_columns(columns, fmt)
        if kept:  # renamed, so no column of the source can collide with the encoded ones
            dataset = dataset.rename_columns({c: ROW_COLUMN_PREFIX + c for c in kept})
        fn_kwargs = dict(
            parse=type(self).parse,
            fmt=fmt,
            source=path,
            slots=self.slots,
            tokenizer=self.tokenizer,
            max_prompt_length=self.hparams.max_prompt_length,
            max_length=self.hparams.get("max_length"),
            loss_masks=self.loss_masks,
        )
        try:
            fn_kwargs["first_row"] = self._first_row(dataset, fmt, path)
            return dataset.map(
                encode_batch,
                batched=True,
                with_indices=True,
                remove_columns=[c for c in dataset.column_names if not c.startswith(ROW_COLUMN_PREFIX)],
                fn_kwargs=fn_kwargs,
                desc=f"Validating and tokenizing {path}",
            )
        except UnicodeDecodeError as err:  # pyarrow keeps bytes that are not UTF-8; Python refuses them
            if os.path.isfile(path):
                check_text_file(path)  # names the line
            raise DataFormatError(path, f"text that is not valid UTF-8 ({err})") from err

    def _apply_length_policy(self, dataset: Dataset, split: str, source: str) -> Dataset:
        hp = self.hparams
        rows, over = len(dataset), sum(dataset["over_length"])
        if hp.length_policy == "drop" and over:
            dataset = dataset.filter(_not_flagged, input_columns="over_length", batched=True)
        dataset = dataset.remove_columns("over_length")
        truncated, dropped = (over, 0) if hp.length_policy == "truncate" else (0, over)
        self.stats[split] = {"rows": rows, "truncated": truncated, "dropped": dropped}
        limits = f"max_prompt_length={hp.max_prompt_length}, max_length={hp.get('max_length')}"
        identical = ""
        if "identical" in dataset.column_names:  # responses equal once truncated: nothing to learn
            same = sum(dataset["identical"])
            if same:
                dataset = dataset.filter(_not_flagged, input_columns="identical", batched=True)
            dataset = dataset.remove_columns("identical")
            self.stats[split]["identical"] = same
            identical = f"; {same} dropped as identical after truncation (responses differ only past max_length)"
        rank_zero_info(
            f"{type(self).__name__} {split} data ({source}): {rows} rows; over the length limits ({limits}):"
            f" {truncated} truncated, {dropped} dropped{identical}"
        )
        if len(dataset) == 0:
            why = "exceed the length limits" if not self.stats[split].get("identical") else (
                "exceed the length limits or have responses identical after truncation"
            )
            raise DataFormatError(source, f"all {rows} rows of the {split} split {why} ({limits})")
        return dataset

    @override
    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before train_dataloader()")
        resume = self._resume
        self.train_sampler = ResumableSampler(
            self.train_dataset, shuffle=True, seed=resolve_seed(self.hparams.seed), epoch_offset=resume["offset"]
        )
        self.train_sampler.set_epoch(resume["epoch"] + resume["offset"])  # Lightning's epoch number
        self.train_sampler.set_consumed(resume["consumed"])
        per_batch = self.hparams.batch_size * self.train_sampler.num_replicas
        epoch_rows = -(-self.train_sampler.num_samples // self.hparams.batch_size) * per_batch
        if resume["consumed"] > epoch_rows:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint's training position ({resume['consumed']} rows of its"
                f" epoch consumed) is past the {len(self.train_dataset)} training rows of"
                f" {self.hparams.train_path!r}: the training data (train_path, split, val_fraction,"
                " length_policy) changed since the checkpoint; resume with the data it was written with"
            )
        if self._drop_last() and len(self.train_sampler) < self.hparams.batch_size:
            raise ValueError(
                f"{type(self).__name__}: {len(self.train_sampler)} training rows per rank are fewer than"
                f" batch_size={self.hparams.batch_size}; with drop_last there would be no batch at all"
            )
        return self._loader(
            self.train_dataset, self.hparams.batch_size, self.train_sampler, self._drop_last()
        )

    @override
    def val_dataloader(self) -> DataLoader | list:
        if self.val_dataset is None:
            if self.trainer is not None and self.trainer.state.fn == TrainerFn.VALIDATING:
                raise ValueError(
                    f"{type(self).__name__}: validation needs held-out rows: set `val_path` (a source like"
                    " `train_path`, e.g. --data.init_args.val_path=data/tiny/prompts_val.jsonl) or `val_fraction`"
                    f" > 0 to carve them from `train_path` (got val_path=None, val_fraction={self.hparams.val_fraction})"
                )
            return []  # fit without validation rows: Lightning skips validation on an empty list
        hp = self.hparams
        return self._held_out_loader(self.val_dataset, hp.val_batch_size or hp.batch_size)

    @override
    def test_dataloader(self) -> DataLoader:
        if self.test_dataset is None:
            raise ValueError(
                f"{type(self).__name__}: testing needs held-out rows: set `test_path` (a source like"
                f" `train_path`, e.g. --data.init_args.test_path={self.example_test_file})"
            )
        hp = self.hparams
        return self._held_out_loader(self.test_dataset, hp.val_batch_size or hp.batch_size)

    def _drop_last(self) -> bool:
        return bool(self.hparams.get("drop_last", False))

    def _held_out_loader(self, dataset: Dataset, batch_size: int) -> DataLoader:
        """Validation/test batches in order, each row once on any number of ranks (:class:`HeldOutBatches`)."""
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_sampler=HeldOutBatches(SequentialSampler(dataset), batch_size, drop_last=False),
            collate_fn=self.collator,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def _loader(self, dataset: Dataset, batch_size: int, sampler: Any, drop_last: bool) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=self.collator,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=drop_last,
        )

    @override
    def state_dict(self) -> dict[str, int]:
        """Training-sampler position at checkpoint time: the epoch of the order, the samples of it consumed by
        all ranks together, the offset of Lightning's epoch number over the order's, and Lightning's count of
        the epoch's batches that ``consumed`` goes with.

        An epoch a limit cut short (``max_steps``, an online module's ``max_rollouts``) counts as finished for
        Lightning, which starts a new epoch when the run is resumed with a larger limit: that new epoch then
        continues the cut one's order (the offset grows by one), so an extended run sees the rows an
        uninterrupted one would.
        """
        if self.trainer is None or self.train_sampler is None:
            return {}
        epochs = self.trainer.fit_loop.epoch_progress.current
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        offset = self._resume["offset"]
        if epochs.processed != epochs.started:  # inside an epoch
            return self._position(epochs.processed, batches, offset)
        # between epochs (e.g. the checkpoint saved in ``on_train_epoch_end``, after Lightning counted the
        # epoch as processed): the next epoch starts from its beginning unless a limit cut this one short
        ended = self._position(epochs.processed - 1, batches, offset)
        rows, per_batch = len(self.train_dataset), self.hparams.batch_size * self.train_sampler.num_replicas
        left = rows - ended["consumed"]
        # cut short: fewer batches than Lightning's epoch holds (limit_train_batches included) with rows left
        short = 0 < batches < self.trainer.num_training_batches
        if short and left > 0 and not (self._drop_last() and left < per_batch):
            return {**ended, "offset": offset + 1, "batches": 0}
        return {"epoch": epochs.processed - offset, "consumed": 0, "offset": offset, "batches": 0}

    def _position(self, lightning_epoch: int, batches: int, offset: int) -> dict[str, int]:
        """The order's position after ``batches`` batches of Lightning's epoch ``lightning_epoch``: in the epoch
        the run resumed into, the restored position plus the batches since (at this run's batch size, which
        may differ from the checkpoint's)."""
        per_batch = self.hparams.batch_size * self.train_sampler.num_replicas
        resume = self._resume
        if lightning_epoch == resume["epoch"] + resume["offset"]:
            consumed = resume["consumed"] + (batches - resume["batches"]) * per_batch
        else:
            consumed = batches * per_batch
        return {"epoch": lightning_epoch - offset, "consumed": consumed, "offset": offset, "batches": batches}

    @override
    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume the training order where :meth:`state_dict` left it (applied by ``train_dataloader``)."""
        consumed = int(state_dict.get("consumed", 0))
        # checkpoints of earlier versions: no offset, and ``consumed`` counted at one batch size throughout
        batches = state_dict.get("batches")
        if batches is None:
            replicas = self.trainer.world_size if self.trainer is not None else 1
            batches = consumed // (self.hparams.batch_size * replicas)
        self._resume = {
            "epoch": int(state_dict.get("epoch", 0)),
            "consumed": consumed,
            "offset": int(state_dict.get("offset", 0)),
            "batches": int(batches),
        }

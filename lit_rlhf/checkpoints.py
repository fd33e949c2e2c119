"""Reading a checkpoint file given by a user, with errors that name the file and what is wrong with it."""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from typing_extensions import override

ZIP_MAGIC = b"PK\x03\x04"


class CheckpointFileError(ValueError):
    """A checkpoint path that cannot be resumed from; the message names the file and the problem."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        super().__init__(f"checkpoint {path}: {problem}")


# what a folder holds when it is a sharded checkpoint: torch.distributed.checkpoint's index (Lightning's FSDP
# strategies), DeepSpeed's pointer to its newest tag
SHARDED_MARKERS = (".metadata", "latest")


def check_checkpoint_folder(path: str) -> None:
    """A folder given as a checkpoint must be a sharded one (left to the strategy); any other folder, e.g. the
    ``checkpoints`` folder itself, is refused naming the checkpoint files it holds."""
    if any(os.path.exists(os.path.join(path, marker)) for marker in SHARDED_MARKERS):
        return
    files = sorted(f for f in os.listdir(path) if f.endswith(".ckpt"))
    hint = f"; it holds {files[:5]}{' ...' if len(files) > 5 else ''}: give one of them" if files else ""
    raise CheckpointFileError(
        path, f"a folder, not a checkpoint file, nor a sharded checkpoint (no {' or '.join(SHARDED_MARKERS)} in it){hint}"
    )


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """Cheap checks of a checkpoint file without loading it: exists, not empty, a complete zip archive.

    Raises :class:`CheckpointFileError`; a folder is left to the strategy when it is a sharded checkpoint
    (:func:`check_checkpoint_folder`), refused otherwise.
    """
    path = str(path)
    if os.path.isdir(path):
        return check_checkpoint_folder(path)
    if not os.path.exists(path):
        raise CheckpointFileError(path, "no such file")
    if os.path.getsize(path) == 0:
        raise CheckpointFileError(path, "the file is empty (0 bytes); was its save interrupted?")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive whose index sits at its end
        with open(path, "rb") as f:
            head = f.read(8)
        if head.startswith(ZIP_MAGIC):
            raise CheckpointFileError(path, "truncated: a zip archive without its end; was its save interrupted?")
        raise CheckpointFileError(
            path, f"not a PyTorch checkpoint: torch.save writes zip archives, this file starts with {head!r}"
        )


def _not_lightning(path: str, checkpoint: Any) -> CheckpointFileError | None:
    if isinstance(checkpoint, dict) and "state_dict" in checkpoint:
        return None
    found = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
    return CheckpointFileError(path, f"a PyTorch file but not a Lightning checkpoint (no 'state_dict'; found {found})")


def load_checkpoint_file(path: str | os.PathLike) -> dict[str, Any] | None:
    """Load a Lightning checkpoint file (weights only, on CPU) or raise :class:`CheckpointFileError`.

    A folder (a sharded FSDP checkpoint) is left to the strategy: returns None. Missing, empty, truncated,
    random-bytes and non-Lightning files are refused with what is wrong with them. The tensors are
    memory-mapped, not read: checking a large checkpoint (on every rank) costs next to no memory.
    """
    path = str(path)
    if os.path.isdir(path):
        return check_checkpoint_folder(path)
    check_checkpoint_file(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # a damaged archive member, or objects a weights-only load refuses
        first = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointFileError(path, f"cannot be loaded ({type(err).__name__}: {first})") from err
    problem = _not_lightning(path, checkpoint)
    if problem is not None:
        raise problem
    return checkpoint


class CheckedCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose ``load_checkpoint`` names the file and what is wrong with it, for
    ``Trainer(plugins=[CheckedCheckpointIO()]).fit(..., ckpt_path=...)`` outside the CLI (single-file
    checkpoints; strategies that load sharded folders themselves bypass it)."""

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path):
            check_checkpoint_file(path)
        try:
            checkpoint = super().load_checkpoint(path, *args, **kwargs)
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise CheckpointFileError(str(path), f"cannot be loaded ({type(err).__name__}: {first})") from err
        problem = _not_lightning(str(path), checkpoint)
        if problem is not None:
            raise problem
        return checkpoint

"""Callbacks: Hugging Face export at the end of fit; a resumable checkpoint on SIGTERM; training peak memory."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_rlhf.peak_memory import PeakMemory  # noqa: F401  (configs name it lit_rlhf.callbacks.PeakMemory)

log = logging.getLogger(__name__)

# Written by HFExport next to the weights: which run wrote the folder.
EXPORT_MARKER = "lit_rlhf_export.json"
# Exit status of a fit stopped by SIGTERM: 128 + 15, what a shell reports for a process killed by SIGTERM.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def check_output_folder(path: str | os.PathLike, setting: str) -> None:
    """Raise when ``path`` is not, and cannot become, a folder this process can write into.

    Nothing is created: an existing folder must be writable; a missing one needs its nearest existing
    ancestor to be a writable folder. ``setting`` names where the path was given (e.g. "HFExport dirpath")
    in the message. Remote paths (``s3://...``) are left to their filesystem.
    """
    if "://" in str(path):
        return
    folder = Path(path).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(
            f"{setting}: {folder} is an existing file, not a folder; choose another path or remove the file"
        )
    ancestor = folder
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{setting}: {folder} cannot be created: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        what = "written into" if ancestor == folder else f"created (no write permission on {ancestor})"
        raise PermissionError(f"{setting}: {folder} cannot be {what}")


class HFExport(Callback):
    """At the end of ``fit``, write the module's trained model(s) with ``save_pretrained`` to ``dirpath``.

    The module decides what that means through its ``export_pretrained(folder)`` method: SFT writes a
    causal LM, the reward model a sequence classifier, PPO the actor (``dirpath``/actor) and critic
    (``dirpath``/critic). Every rank calls it (sharded models gather collectively); only rank 0 writes.
    Non-finite weights are refused (:func:`lit_rlhf.models.export_pretrained`), so a fit whose weights
    turned NaN fails instead of exporting them.

    A run never silently replaces another run's export: the folder gets a ``lit_rlhf_export.json`` marker
    holding the run's id (kept in checkpoints, so a resumed run is the same run); a non-empty ``dirpath``
    without this run's marker is refused when the fit starts (under FSDP, ModelParallel and DeepSpeed when
    training starts: those restore a resumed run's id only after ``on_fit_start``), unless ``overwrite``
    is true.

    With several processes every rank checks the folder (they must all agree, or the collective export
    would hang), so the ranks share global rank 0's run id (broadcast at ``setup``), and at the end of the
    fit every rank has checked before rank 0 writes (a barrier): on a shared filesystem a rank reaching
    ``on_fit_end`` after rank 0 has written would otherwise find "another run's export" there and fail.

    Args:
        dirpath: output folder; relative paths are taken from the working directory.
        overwrite: replace whatever ``dirpath`` holds (another run's export included): at the end of the fit
            its content is deleted before the export is written (:meth:`clear_destination` says what is kept).
    """

    def __init__(self, dirpath: str, overwrite: bool = False) -> None:
        self.dirpath = dirpath
        self.overwrite = overwrite
        self.run_id = uuid.uuid4().hex

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath)  # several exports may run side by side

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.run_id = state_dict.get("run_id", self.run_id)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # one id for all ranks (each drew its own uuid); a resumed run then loads the checkpoint's
        self.run_id = trainer.strategy.broadcast(self.run_id)

    def check_destination(self) -> None:
        """Raise when ``dirpath`` cannot be written (an existing file, an uncreatable or read-only folder),
        or ``FileExistsError`` when it holds files that this run did not write (and not ``overwrite``)."""
        check_output_folder(self.dirpath, "HFExport dirpath")
        folder = Path(self.dirpath)
        if self.overwrite or not folder.is_dir() or not any(folder.iterdir()):
            return
        owner = export_owner(folder)
        if owner != self.run_id:
            whose = f"another run's export (run {owner})" if owner else "files that HFExport did not write"
            raise FileExistsError(
                f"HFExport: {folder.resolve()} already holds {whose}; choose another dirpath, delete it, or set"
                " overwrite: true in the HFExport entry of trainer.callbacks"
            )

    def clear_destination(self) -> None:
        """With ``overwrite``, remove what another run's export left in ``dirpath``, so that the folder then
        holds this export alone (a PPO run's ``critic/`` does not stay beside a GRPO run's ``actor/``, an
        ensemble's ``member_2/`` beside a 2-member export, an SFT export's weights beside a PPO export's
        sub-folders). Rank 0, before the barrier; a file that cannot be removed is warned about, not raised.

        Only a folder whose marker names another run is touched (an HFExport folder: files that HFExport did
        not write are written over, never deleted), and in it only what an export writes: its files and its
        ``actor``, ``critic`` and ``member_<k>`` sub-folders. Other sub-folders (logs, checkpoints) stay, and
        the working directory, its ancestors and the home folder are never cleared.
        """
        folder = Path(self.dirpath).expanduser()
        owner = export_owner(folder) if folder.is_dir() else None
        if not self.overwrite or owner is None or owner == self.run_id:
            return
        folder, cwd = folder.resolve(), Path.cwd().resolve()
        if folder in (cwd, *cwd.parents, Path.home().resolve(), *Path.home().resolve().parents):
            rank_zero_warn(f"HFExport: {folder} holds the working directory or the home folder: nothing removed")
            return
        for entry in folder.iterdir():
            export_folder = entry.name in ("actor", "critic") or re.fullmatch(r"member_\d+", entry.name)
            try:
                if entry.is_dir() and not entry.is_symlink():
                    if export_folder:
                        shutil.rmtree(entry)
                elif entry.name != EXPORT_MARKER:
                    entry.unlink()
            except OSError as err:
                rank_zero_warn(f"HFExport: could not remove {entry} of the previous export ({err})")

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # fail before training, not after it (a resumed run has its run id back by now, except below)
        if not _callbacks_restored_late(trainer):
            self.check_destination()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if _callbacks_restored_late(trainer):
            self.check_destination()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.fast_dev_run:  # a dev run writes no artifacts (Lightning's rule): a real fit is not blocked
            rank_zero_info("HFExport: fast_dev_run, nothing exported")
            return
        export = getattr(pl_module, "export_pretrained", None)
        if export is None:
            raise TypeError(f"{type(pl_module).__name__} has no export_pretrained(folder) method")
        self.check_destination()
        if trainer.is_global_zero:
            self.clear_destination()
        trainer.strategy.barrier("HFExport")  # every rank has looked at the folder before rank 0 writes
        folder = Path(self.dirpath)
        marker, existed = folder / EXPORT_MARKER, folder.exists()
        if trainer.is_global_zero:  # claimed before writing: an export killed midway is this run's to redo on resume
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"run_id": self.run_id, "complete": False}) + "\n")
        try:
            export(self.dirpath)
        except BaseException:  # an export that refuses (e.g. non-finite weights) leaves no claimed, empty folder
            if trainer.is_global_zero:
                marker.unlink(missing_ok=True)
                if not existed and folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            raise
        if trainer.is_global_zero:
            marker.write_text(json.dumps({"run_id": self.run_id}) + "\n")
        rank_zero_info(f"HFExport: wrote {Path(self.dirpath).resolve()}")


def export_owner(folder: Path) -> str | None:
    """The run id in ``folder``'s HFExport marker (None: no marker; ``"unreadable"`` for a marker that is not
    the JSON object HFExport writes, e.g. cut short by a crash: a folder another run wrote)."""
    marker = folder / EXPORT_MARKER
    if not marker.is_file():
        return None
    try:
        owner = json.loads(marker.read_text())
    except (OSError, ValueError):
        return "unreadable"
    return owner.get("run_id", "unreadable") if isinstance(owner, dict) else "unreadable"


def checkpoint_file(trainer: Trainer, dirpath: str | None, filename: str) -> str:
    """``dirpath/filename.ckpt``; without ``dirpath`` the first ``ModelCheckpoint``'s folder (where
    ``ckpt_path="last"`` looks), else ``default_root_dir/checkpoints``."""
    folder = dirpath
    if folder is None and trainer.checkpoint_callback is not None:
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
    if folder is None:
        folder = os.path.join(trainer.default_root_dir, "checkpoints")
    return os.path.join(folder, filename + ".ckpt")


def _callbacks_restored_late(trainer: Trainer) -> bool:
    """Whether the strategy restores a resumed fit's callback states only after ``on_fit_start`` (FSDP,
    ModelParallel, DeepSpeed: ``restore_checkpoint_after_setup``; whether the fit resumes is not known yet
    then); they are back by ``on_train_start``."""
    return trainer.strategy.restore_checkpoint_after_setup


class CheckpointFolderCheck(Callback):
    """At the start of ``fit``, check that every ``ModelCheckpoint`` folder can be written (or created).

    ``ModelCheckpoint`` creates its ``dirpath`` only when it first saves, so a folder under a file or
    without write permission would otherwise fail after the first epoch or validation (the folder of a
    :class:`SigtermCheckpoint` too: it would fail when the job is pre-empted). ``lit-rlhf fit`` adds this
    callback; with a plain ``Trainer`` add it to ``callbacks``.
    """

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for callback in trainer.checkpoint_callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath is not None:
                check_output_folder(dirpath, f"{type(callback).__name__} dirpath")
        for callback in trainer.callbacks:
            # SigtermCheckpoint, FaultCheckpoint: their files go to folders of their own choosing
            path = getattr(callback, "checkpoint_path", None)
            if callable(path) and not isinstance(callback, ModelCheckpoint):
                check_output_folder(os.path.dirname(path(trainer)), f"{type(callback).__name__} dirpath")


class SigtermCheckpoint(Callback):
    """On SIGTERM, save a resumable checkpoint of the last finished step, then exit with status 143.

    Lightning already catches SIGTERM (what SLURM and Kubernetes send before killing a job): its handler
    only sets ``trainer.received_sigterm``; the training loop finishes the step in progress (for PPO: the
    rollout and its update) and then raises :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException`
    at the step boundary, which reaches every callback's ``on_exception``. This callback saves the checkpoint
    there (all ranks take part, as sharded checkpoints need) and sets the exit status to 143 (128 + 15,
    "terminated by SIGTERM"); Lightning's own exception is a ``SystemExit`` with status 0, which would
    report the interrupted fit as a success and stop a Kubernetes ``OnFailure``/``backoffLimit`` or a
    wrapper script from retrying it. Resume with ``--ckpt_path last`` (or the printed path).

    With several processes (DDP, FSDP) every rank must stop at the same step boundary: one rank leaving
    while another waits in the next step's collectives hangs the job. Lightning's handler is not safe there:
    it runs a ``broadcast`` inside the signal handler, which pairs with whatever collective the other ranks
    are in (or hangs when only one rank got the signal, e.g. ``kill`` of one worker), and each rank then stops
    on its own flag. From ``on_train_start`` this callback replaces it by one that just notes the signal; at
    the end of every training batch (and validation run) the ranks reduce the notes with a max, and all of
    them set ``trainer.received_sigterm`` together, so Lightning stops them at the same boundary. With
    ``accumulate_grad_batches`` that boundary is a batch where the optimiser stepped, also in one process: a
    checkpoint holds no gradients, so a stop in the middle of an accumulation could not resume exactly. A
    SIGTERM to one rank, or to ``torchrun`` (which forwards it to every worker), therefore stops every rank
    after the same step with status 143, and the checkpoint is written once.

    The file is ``last-sigterm.ckpt`` in the first ``ModelCheckpoint``'s folder (``ckpt_path="last"`` picks
    the newest ``last*.ckpt`` there), else in ``default_root_dir/checkpoints``; ``dirpath`` overrides it.

    Args:
        dirpath: folder of the checkpoint; None: as described above.
        filename: file name without the ``.ckpt`` extension.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last-sigterm") -> None:
        if not filename:
            raise ValueError("SigtermCheckpoint: filename must not be empty")
        self.dirpath = dirpath
        self.filename = filename
        self._requested = False  # a SIGTERM reached this rank (see the class notes)
        self._synced = False  # this callback's handler replaces Lightning's in this fit

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._requested, self._synced = False, False
        # Lightning registered its SIGTERM handlers before the training loop (a composition of handlers, in
        # the main thread only): swap its notifier, which runs a collective, for one that only notes it.
        notifier = trainer._signal_connector._sigterm_notifier_fn
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
        if isinstance(handlers, list) and notifier in handlers:
            launcher = trainer.strategy.launcher

            def note(signum: int, frame: Any) -> None:
                log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}; stopping at the step boundary")
                if not self._requested and launcher is not None:
                    launcher.kill(signum)  # processes Lightning started itself get it too, as with its handler
                self._requested = True

            handlers[handlers.index(notifier)] = note
            self._synced = True

    def _stop_together(self, trainer: Trainer, at_batch_end: bool = False) -> None:
        """Collective: whether a SIGTERM reached any rank; if so every rank sets ``received_sigterm`` here, at the
        end of a batch where the optimiser stepped (with ``accumulate_grad_batches``, not in the middle of an
        accumulation: a checkpoint holds no gradients) or of a validation run."""
        if not self._synced:
            return
        requested = self._requested
        if self._distributed(trainer):
            flag = torch.tensor([float(requested)], device=trainer.strategy.root_device)
            requested = trainer.strategy.reduce(flag, reduce_op="max").item() > 0
        loop = trainer.fit_loop.epoch_loop
        stepped = not at_batch_end or loop._accumulated_batches_reached() or loop._num_ready_batches_reached()
        if requested and stepped:
            trainer._signal_connector.received_sigterm = True

    @staticmethod
    def _distributed(trainer: Trainer) -> bool:
        return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._stop_together(trainer, at_batch_end=True)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_together(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._synced = False

    def checkpoint_path(self, trainer: Trainer) -> str:
        return checkpoint_file(trainer, self.dirpath, self.filename)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        from lit_rlhf.fault_checkpoint import (  # (it imports this module)
            progress_set_to,
            validation_rerun_counters,
        )

        path = self.checkpoint_path(trainer)
        # stopped inside a validation of fit (the SIGTERM came in the step before it, or the validation itself):
        # the counters say so, and the resumed fit runs that validation again rather than skipping it
        counters = validation_rerun_counters(trainer) if trainer.validating and trainer.state.fn == "fit" else []
        with progress_set_to(counters):
            trainer.save_checkpoint(path)
        rank_zero_info(
            f"SIGTERM: saved {path} at step {trainer.global_step}; exiting with status {SIGTERM_EXIT_CODE}."
            f" Resume with --ckpt_path {path}"
        )
        exception.code = SIGTERM_EXIT_CODE

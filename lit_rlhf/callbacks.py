"""Callbacks: Hugging Face export at the end of fit; a resumable checkpoint on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

# Written by HFExport next to the weights: which run wrote the folder.
EXPORT_MARKER = "lit_rlhf_export.json"
# Exit status of a fit stopped by SIGTERM: 128 + 15, what a shell reports for a process killed by SIGTERM.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class HFExport(Callback):
    """At the end of ``fit``, write the module's trained model(s) with ``save_pretrained`` to ``dirpath``.

    The module decides what that means through its ``export_pretrained(folder)`` method: SFT writes a
    causal LM, the reward model a sequence classifier, PPO the actor (``dirpath``/actor) and critic
    (``dirpath``/critic). Every rank calls it (sharded models gather collectively); only rank 0 writes.
    Non-finite weights are refused (:func:`lit_rlhf.models.export_pretrained`), so a fit whose weights
    turned NaN fails instead of exporting them.

    A run never silently replaces another run's export: the folder gets a ``lit_rlhf_export.json`` marker
    holding the run's id (kept in checkpoints, so a resumed run is the same run); a non-empty ``dirpath``
    without this run's marker is refused when the fit starts, unless ``overwrite`` is true.

    Args:
        dirpath: output folder; relative paths are taken from the working directory.
        overwrite: replace whatever ``dirpath`` holds (another run's export included).
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

    def check_destination(self) -> None:
        """Raise ``FileExistsError`` when ``dirpath`` holds files that this run did not write (and not ``overwrite``)."""
        folder = Path(self.dirpath)
        if self.overwrite or not folder.is_dir() or not any(folder.iterdir()):
            return
        marker = folder / EXPORT_MARKER
        owner = json.loads(marker.read_text()).get("run_id") if marker.is_file() else None
        if owner != self.run_id:
            whose = f"another run's export (run {owner})" if owner else "files that HFExport did not write"
            raise FileExistsError(
                f"HFExport: {folder.resolve()} already holds {whose}; choose another dirpath, delete it, or set"
                " overwrite: true in the HFExport entry of trainer.callbacks"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # fail before training, not after it (a resumed run has its run id back by now)
        self.check_destination()

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        export = getattr(pl_module, "export_pretrained", None)
        if export is None:
            raise TypeError(f"{type(pl_module).__name__} has no export_pretrained(folder) method")
        self.check_destination()
        export(self.dirpath)
        if trainer.is_global_zero:
            (Path(self.dirpath) / EXPORT_MARKER).write_text(json.dumps({"run_id": self.run_id}) + "\n")
        rank_zero_info(f"HFExport: wrote {Path(self.dirpath).resolve()}")


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

    def checkpoint_path(self, trainer: Trainer) -> str:
        folder = self.dirpath
        if folder is None and trainer.checkpoint_callback is not None:
            folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        if folder is None:
            folder = os.path.join(trainer.default_root_dir, "checkpoints")
        return os.path.join(folder, self.filename + ".ckpt")

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        path = self.checkpoint_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(
            f"SIGTERM: saved {path} at step {trainer.global_step}; exiting with status {SIGTERM_EXIT_CODE}."
            f" Resume with --ckpt_path {path}"
        )
        exception.code = SIGTERM_EXIT_CODE

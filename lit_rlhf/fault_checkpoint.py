"""A resumable checkpoint when a fit fails: the steps finished before the fault are kept.

A reward function that raises (a judge service down), a tool environment that crashes, memory running out
in a rollout, Ctrl-C: Lightning ends the fit with the exception, and every step since the last
``ModelCheckpoint`` save is lost (the default one saves once per epoch, for an online module a whole pass
over the prompts). :class:`FaultCheckpoint` saves ``last-fault.ckpt`` with the state of the last finished
step instead, so ``--ckpt_path last`` goes on from there; the exception still ends the fit (the command exits
non-zero with its traceback), and the resumed fit runs exactly as an uninterrupted one (the same prompts,
samples, weights and logged metrics; tested in ``tests/test_fault_checkpoint.py``).

The state of the last finished step is still there while no optimiser step of the failing step has run
(``on_before_optimizer_step`` tells): weights, optimiser and schedulers are untouched. What the step changed
before its first optimiser step is put back in the checkpoint: the module's own checkpoint entries (its
``on_save_checkpoint``: for the online modules the RNG that sampling drew from, the replay buffer's
shuffling, the controllers), taken at the step's start; its torchmetrics states; and Lightning's progress
counters, set back to the step boundary (the failed batch counts as never fetched, so the data module's
position excludes it). A fault between steps (in a validation inside ``fit``) saves the boundary as it is.

Nothing is saved, and the message says why, when the fault came after an optimiser step of the failing step
(a half-updated model: resume from the last regular checkpoint), when no step has finished in this process
(nothing to keep), or with several processes: a fault on one rank leaves the others inside a collective, and
a checkpoint, which synchronises the ranks, would hang the job; there ``SigtermCheckpoint`` and a
``ModelCheckpoint`` with ``every_n_train_steps`` keep the work.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchmetrics import Metric
from typing_extensions import override

from lit_rlhf.callbacks import checkpoint_file

__all__ = ["FaultCheckpoint", "step_start_state"]

PROGRESS_FIELDS = ("ready", "started", "processed", "completed")


def step_start_state(pl_module: LightningModule) -> dict[str, Any]:
    """A copy of what a step may change before its first optimiser step: the module's own checkpoint
    entries (``on_save_checkpoint`` on an empty state dict) and its torchmetrics states (by state-dict key)."""
    scratch: dict[str, Any] = {"state_dict": {}}
    pl_module.on_save_checkpoint(scratch)
    entries = {key: value for key, value in scratch.items() if key != "state_dict"}
    metrics: dict[str, Any] = {}
    for name, module in pl_module.named_modules():
        if isinstance(module, Metric):
            metrics.update(module.state_dict(prefix=f"{name}." if name else ""))
    return copy.deepcopy({"entries": entries, "metrics": metrics})


class FaultCheckpoint(Callback):
    """On an exception in ``fit``, save a resumable checkpoint of the last finished step (see the module notes).

    ``lit-rlhf fit`` adds it to every fit; add it to your own ``Trainer`` the same way. The file is
    ``last-fault.ckpt`` in the first ``ModelCheckpoint``'s folder (``ckpt_path="last"`` picks the newest
    ``last*.ckpt`` there), else in ``default_root_dir/checkpoints``; ``dirpath`` overrides it. A SIGTERM is
    left to :class:`~lit_rlhf.callbacks.SigtermCheckpoint` (it stops at a step boundary itself).

    Args:
        dirpath: folder of the checkpoint; None: as described above.
        filename: file name without the ``.ckpt`` extension.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "last-fault") -> None:
        if not filename:
            raise ValueError("FaultCheckpoint: filename must not be empty")
        self.dirpath, self.filename = dirpath, filename
        self._hooks: list[Any] = []
        self._reset()

    def _reset(self) -> None:
        self._steps_done = 0  # training steps finished in this process
        self._in_step = False  # between a step's on_train_batch_start and its on_train_batch_end
        self._stepped = False  # an optimiser step ran in the current step
        self._start: dict[str, Any] | None = None  # step_start_state of the current step

    def checkpoint_path(self, trainer: Trainer) -> str:
        return checkpoint_file(trainer, self.dirpath, self.filename)

    def _single_process(self, trainer: Trainer) -> bool:
        return trainer.world_size == 1

    def _note_optimizer_step(self, *args: Any) -> None:
        self._stepped = True

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()
        self._reset()
        if self._single_process(trainer):
            # an optimiser stepped outside Lightning's optimizer_step (a module's own call) is seen afterwards
            self._hooks = [opt.register_step_post_hook(self._note_optimizer_step) for opt in trainer.optimizers]

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        # after the backward, before the parameters change (automatic optimisation runs the training step
        # inside optimizer.step(closure), so torch's pre-step hooks come too early)
        self._note_optimizer_step()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._in_step, self._stepped = True, False
        # before the first finished step there is nothing to keep (and a resumed module may not have applied
        # its checkpoint's RNG yet)
        self._start = step_start_state(pl_module) if self._steps_done and self._single_process(trainer) else None

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._steps_done += 1
        self._in_step, self._stepped, self._start = False, False, None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _why_not(self, trainer: Trainer) -> str | None:
        """Why no checkpoint can be saved for this fault (None: it can)."""
        if not self._single_process(trainer):
            return f"a fault in a {trainer.world_size}-process fit is not checkpointed (the other ranks may be inside a collective)"
        if not self._steps_done:
            return "no training step had finished in this process"
        if self._in_step and (self._stepped or self._start is None):
            return (
                f"the fault came after an optimiser step of step {trainer.global_step} (a half-updated model);"
                " resume from the last regular checkpoint"
            )
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        finished = trainer.fit_loop.epoch_loop.batch_progress.current.completed if accumulate > 1 else 0
        if finished % accumulate:
            return (
                f"the fault came while gradients were accumulated (accumulate_grad_batches={accumulate}, "
                f"{finished % accumulate} batch(es) in): a checkpoint holds no gradients, so a resume would "
                "lose them; resume from the last regular checkpoint"
            )
        return None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        try:
            why = self._why_not(trainer)
            if why is not None and trainer.fit_loop.epoch_loop.batch_progress.total.started == 0:
                return  # a fault before training (set-up, data, a check): nothing was done, nothing to say
            if why is not None:
                rank_zero_warn(f"FaultCheckpoint: nothing saved: {why}")
                return
            path = self.checkpoint_path(trainer)
            self._save(trainer, path)
        except Exception as err:  # the fit's own exception is the one to report
            rank_zero_warn(f"FaultCheckpoint: saving the checkpoint failed ({type(err).__name__}: {err})")
            return
        finally:
            self._remove_hooks()
        batches = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        unit = "rollout" if hasattr(pl_module, "rollouts_done") else "training batch"  # an online module's batch
        rank_zero_info(
            f"FaultCheckpoint: {type(exception).__name__} in the fit; saved {path}, the state after {unit}"
            f" {batches}. Resume with --ckpt_path last (or {path})"
        )

    def _save(self, trainer: Trainer, path: str) -> None:
        """Write the checkpoint of the last step boundary (the current step rolled back when one was running)."""
        epoch_loop = trainer.fit_loop.epoch_loop
        rolled_back = self._in_step and self._start is not None
        if rolled_back:
            # the failed batch counts as never fetched (the data module reads ``processed``); the counters say
            # "saved at the end of the last finished batch" (Lightning then counts that batch completed and its
            # logging step taken, and does not run its validation again), also in an epoch's first batch
            progress = epoch_loop.batch_progress
            counters = [
                (tracker, (tracker.completed,) * 3 + (tracker.completed - 1,))
                for tracker in (progress.total, progress.current)
            ]
        elif trainer.validating:
            counters = validation_rerun_counters(trainer)
        else:
            counters = []
        with progress_set_to(counters):
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if rolled_back and epoch_loop.batch_progress.current.completed > 0:
            # fetching the failed batch may have flagged it the epoch's last: the finished one was not
            checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = False
        if rolled_back:
            checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
            checkpoint.update(self._start["entries"])
            checkpoint["state_dict"].update(self._start["metrics"])
        trainer.strategy.save_checkpoint(checkpoint, path)


def validation_rerun_counters(trainer: Trainer) -> list[tuple[Any, tuple[int, int, int, int]]]:
    """The validation loop's counters of a checkpoint saved inside a validation of ``fit`` (the training step
    finished) such that the resumed fit runs that validation again: Lightning does when its counters say it
    stopped in its first batch ("restarted mid-evaluation"). For :func:`progress_set_to`."""
    progress = trainer.fit_loop.epoch_loop.val_loop.batch_progress
    before = progress.total.completed - progress.current.completed  # earlier validations' batches
    return [(progress.total, (before + 1, before + 1, before, before)), (progress.current, (1, 1, 0, 0))]


@contextmanager
def progress_set_to(counters: list[tuple[Any, tuple[int, int, int, int]]]) -> Iterator[None]:
    """Set Lightning progress trackers to (ready, started, processed, completed) for the block; then back."""
    saved = [(tracker, [getattr(tracker, field) for field in PROGRESS_FIELDS]) for tracker, _ in counters]
    try:
        for tracker, values in counters:
            for field, value in zip(PROGRESS_FIELDS, values):
                setattr(tracker, field, value)
        yield
    finally:
        for tracker, values in saved:
            for field, value in zip(PROGRESS_FIELDS, values):
                setattr(tracker, field, value)

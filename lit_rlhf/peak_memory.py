"""PeakMemory: the training loop's own peak memory, apart from what the process held before it."""

from __future__ import annotations

import gc
import json
import os
import re
import resource
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lit_rlhf.modules.samples import logger_step

__all__ = ["PeakMemory"]


class PeakMemory(Callback):
    """The peak memory of the training loop itself, apart from what the process held before it.

    A process's peak RSS (``ru_maxrss``) is mostly imports and model loading on small models, and is
    whatever came first when loading peaks above training. This callback measures training alone: at
    ``on_train_start`` it collects garbage, reads the resident set and resets the kernel's high-water mark (Linux: writing
    5 to ``/proc/self/clear_refs``), and at ``on_train_end`` it reads the new high-water mark (``VmHWM``).
    Where the mark cannot be reset (not Linux, or no permission), the lifetime ``ru_maxrss`` is used and
    ``train_peak_rss_growth_mb`` is then a lower bound. On CUDA the allocator's peak is also reported.

    Logged at the end of training (rank 0's process; every logger, on the step axis of the module's own
    scalars: the batches trained, for an online module its rollouts, not its optimiser steps): ``memory/train_peak_rss_mb``,
    ``memory/train_peak_rss_growth_mb`` (peak minus the resident set at the start of training) and
    ``memory/cuda_max_allocated_mb`` on CUDA; with ``output``, the same figures as JSON in that file.

    Args:
        output: optional JSON file for the figures (its folder is created).
    """

    def __init__(self, output: str | None = None) -> None:
        self.output = output
        self.start_rss_mb: float | None = None
        self.reset_ok = False

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.output is not None:  # written at the end of training: check its folder before
            if os.path.isdir(self.output):
                raise IsADirectoryError(f"PeakMemory output: {os.path.abspath(self.output)} is a folder, not a file")
            from lit_rlhf.callbacks import check_output_folder  # (callbacks imports this module)

            check_output_folder(Path(self.output).parent, "PeakMemory output")

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # earlier work's garbage (objects in reference cycles, e.g. a finished Trainer holding tensors) is
        # collected first: freed by the collector during training, it would lower the resident set below its
        # start and hide the training's own peak under the mark (seen: a 256 MB step measured as +0 MB)
        gc.collect()
        self.start_rss_mb = _proc_status_mb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = _proc_status_mb("VmHWM") is not None
        except OSError:
            self.reset_ok = False
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        peak = _proc_status_mb("VmHWM") if self.reset_ok else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        figures = {"memory/train_peak_rss_mb": peak, "memory/hwm_reset": float(self.reset_ok)}
        if self.start_rss_mb is not None:
            figures["memory/train_peak_rss_growth_mb"] = max(0.0, peak - self.start_rss_mb)
        if pl_module.device.type == "cuda":
            figures["memory/cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:  # on the step axis of the module's own scalars (an online module's rollouts)
            logger.log_metrics(figures, step=logger_step(trainer))
            logger.save()
        if self.output is not None:
            path = Path(self.output)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({k.split("/", 1)[1]: v for k, v in figures.items()}, indent=1) + "\n")
        growth = figures.get("memory/train_peak_rss_growth_mb", float("nan"))
        rank_zero_info(f"PeakMemory: training peak RSS {peak:.0f} MB ({growth:+.0f} MB over the start of training)")


def _proc_status_mb(field: str) -> float | None:
    """A ``kB`` field of ``/proc/self/status`` in MB (None where there is no such file or field)."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None

"""The machine a demo's figures were measured on: the CPU model and vector units, the math libraries' code
paths where an environment variable forces one, torch's threads, the versions, and the threads, CPU and forced
code path of each stage (a ``--reuse`` may mix fits of other settings)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CPU_FEATURES", "FLOAT_PATH_VARIABLES", "cpu_features_text", "cpu_model", "float_path", "machine", "machine_line",
    "stage_machine",
]  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


# The vector units that tell the CPU kinds of this project's machines apart (one "model name" can be either
# Xeon; float32 products round alike with or without AMX, which only bf16 and int8 products use).
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_features_text(present: list[str]) -> str:
    """Which of ``CPU_FEATURES`` the CPU has and which it lacks, e.g. ``avx2, avx512f; no avx512_bf16, amx_bf16``."""
    absent = [f for f in CPU_FEATURES if f not in present]
    parts = [", ".join(present)] if present else []
    return "; ".join(parts + ([f"no {', '.join(absent)}"] if absent else []))


# The environment variables that pick the math libraries' code paths. Each path sums float32 products in its own
# order, so forcing another one moves the demo's figures as another CPU kind does: on an AVX-512 Xeon,
# MKL_ENABLE_INSTRUCTIONS=AVX2 (MKL's matrix products) gave another SFT policy, RM and every figure after them.
# MKL reads its variables once, when it first runs: set them before the process starts.
FLOAT_PATH_VARIABLES = ("MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def float_path() -> str:
    """The code paths forced by ``FLOAT_PATH_VARIABLES`` in this process's environment, e.g.
    ``MKL_ENABLE_INSTRUCTIONS=AVX2``; ``""`` where none is (each library picks its path for the CPU)."""
    return ", ".join(f"{name}={os.environ[name]}" for name in FLOAT_PATH_VARIABLES if os.environ.get(name))


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU model, a forced math code path (:func:`float_path`), torch's
    CPU threads and the versions (float rounding, hence the demo's figures, moves with each of them)."""
    import transformers

    features = []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = set(next(line.split(":", 1)[1].split() for line in lines if line.startswith("flags")))
        features = [f for f in CPU_FEATURES if f in flags]
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu_model(), "cpu_features": features, "float_path": float_path(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip


def _groups(values: dict[str, Any]) -> str:
    """``{"sft": 2, "rm": 2, "ppo": 1}`` -> ``2: sft, rm; 1: ppo`` (None: ``unknown``)."""
    groups: dict[str, list[str]] = {}
    for name, value in values.items():
        groups.setdefault("unknown" if value is None else str(value), []).append(name)
    return "; ".join(f"{value}: {', '.join(names)}" for value, names in groups.items())


# What each stage record keeps of its machine, and how the note names a mixture of it.
_STAGE_FIELDS = (("threads", "with different thread counts"), ("cpu", "on different CPUs"),
                 ("float_path", "on different forced code paths"))  # fmt: skip


def _shown(field: str, value: Any) -> Any:
    return "none forced" if field == "float_path" and value == "" else value


def stage_machine(runs: dict, current: dict[str, Any]) -> dict[str, Any]:
    """The torch threads, CPU and forced code path each fit of ``runs`` (run ->
    :class:`~lit_rlhf.demo.stages.StageRecord`) ran with, reused ones included (``threads_per_stage``,
    ``cpu_per_stage``, ``float_path_per_stage``; None where a record predates them), and ``note``: a sentence
    when they are not all ``current``'s (:func:`machine`), else None. A forced code path reads ``none forced``
    where the record has ``""`` and ``unknown`` where it predates the field."""
    per_stage = {field: {name: getattr(run, field) for name, run in runs.items()} for field, _ in _STAGE_FIELDS}
    notes = []
    for field, what in _STAGE_FIELDS:
        now = current.get(field, "")  # "": a machine dict from before float_path was kept
        if set(per_stage[field].values()) != {now}:
            shown = {name: _shown(field, value) for name, value in per_stage[field].items()}
            notes.append(f"stages ran {what} (this run: {_shown(field, now)}): {_groups(shown)}")
    return {f"{field}_per_stage": values for field, values in per_stage.items()} | {"note": "; ".join(notes) or None}


def machine_line(machine_: dict[str, Any]) -> list[str]:
    """The report's line on the machine (and, when the fits ran with other threads, CPUs or code paths, the note)."""
    lines = [
        f"- Measured on {machine_['cpu']} ({cpu_features_text(machine_.get('cpu_features', []))})"
        + (f", code path forced by {machine_['float_path']}," if machine_.get("float_path") else "")
        + f" with {machine_['threads']} torch threads"
        f" (torch {machine_['torch']}, transformers {machine_['transformers']})."
    ]
    if machine_.get("note"):
        lines.append(f"- **Mixed machine settings**: {machine_['note']}.")
    return lines

"""The demo's fit stages: their configs under ``OUT``, running them (in this process or in a child process
whose peak memory is measured), and reusing a stage already run with the same config and inputs.

A stage's config is ``configs/demo/<config>.yaml`` with every ``runs/demo/`` path moved under ``OUT``
(and, with ``--small``, tiny sizes merged in), written to ``OUT/configs/<run>.yaml``. Every finished
stage is recorded in ``OUT/stages.json`` with a key: the hash of its config text and of the keys of the
stages whose outputs it reads, with the output folder ``OUT`` itself written as a placeholder, so the same
folder spelt another way (``runs/demo`` or its absolute path) gives the same keys. ``--reuse`` skips a stage
whose key is recorded and whose export folder is there (it trusts that the code did not change in between);
a key recorded before the placeholder (``OUT`` hashed as spelt) is still recognised. A stage that is run
(again) first loses its record and its logs, gold curve and memory figures, so a fit that does not finish
leaves nothing a later ``--reuse`` could mistake for its outputs. Each record also keeps the torch thread
count, the CPU model and the forced math code path (``machine.float_path``) the stage ran with (a reused stage
may come from another ``--threads``, CPU or path).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lit_rlhf.demo.machine import cpu_model, float_path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "demo"
DEFAULT_ROOT = "runs/demo/"  # the prefix of every path in configs/demo/*.yaml

_TINY_MODEL = {"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}
_TINY_TRAINER = {"max_steps": 4, "val_check_interval": 2, "log_every_n_steps": 1, "enable_model_summary": False}
_TINY_PPO = {
    "trainer": {"enable_model_summary": False},
    "model": {"init_args": {"max_rollouts": 2, "scoring": {"forward_batch_size": 8}, "update": {"epochs": 1}}},
    "data": {"init_args": {"batch_size": 8}},
}
# The critic-free miniatures sample as many responses as _TINY_PPO (2 rollouts x 8 prompts x 1): K = 4
# responses to 2 prompts, or one response to each of 8.
_TINY_GROUP = {
    "trainer": {"enable_model_summary": False},
    "model": {"init_args": {"max_rollouts": 2, "scoring": {"forward_batch_size": 8}, "update": {"epochs": 1}}},
    "data": {"init_args": {"batch_size": 2}},
}
# --small: a miniature of every stage (tests), merged into the configs. An algorithm without an entry
# here runs its own config unchanged under --small.
SMALL_OVERRIDES: dict[str, dict[str, Any]] = {
    "sft": {
        "trainer": _TINY_TRAINER,
        "model": {"init_args": {"model": {"config": _TINY_MODEL}, "num_samples": 2}},
        "data": {"init_args": {"batch_size": 16, "val_batch_size": 16}},
    },
    "rm": {"trainer": _TINY_TRAINER, "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}}},
    "rm_weak": {"trainer": _TINY_TRAINER, "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}}},
    "rm_weak_ensemble": {"trainer": _TINY_TRAINER, "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}}},
    "rm_weak_disagreement_ensemble": {
        "trainer": _TINY_TRAINER,
        "model": {"init_args": {"disagreement": {"batch_size": 8}}},
        "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}},
    },
    "ppo": _TINY_PPO,
    "ppo_overoptimize": _TINY_PPO,
    "ppo_overoptimize_ensemble": _TINY_PPO,
    "ppo_overoptimize_pretrain_ensemble": _TINY_PPO,
    "ppo_overoptimize_disagreement_ensemble": _TINY_PPO,
    "ppo_overoptimize_posterior": _TINY_PPO,
    "grpo": _TINY_GROUP,
    "rloo": _TINY_GROUP,
    "reinforce_pp": _TINY_PPO,
    "online_dpo": _TINY_GROUP,
    "dpo": {  # 2 optimiser steps: its gold curve has as many points as the online miniatures'
        "trainer": {**_TINY_TRAINER, "max_steps": 2},
        "model": {"init_args": {"num_samples": 2}},
        "data": {"init_args": {"batch_size": 8, "val_batch_size": 16}},
    },
}


def merge(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in recursively (dicts merge, anything else replaces); no mutation."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def move_paths(node: Any, out: Path) -> Any:
    """Every string ``runs/demo/X`` of a config becomes ``OUT/X``."""
    if isinstance(node, dict):
        return {k: move_paths(v, out) for k, v in node.items()}
    if isinstance(node, list):
        return [move_paths(v, out) for v in node]
    if isinstance(node, str) and node.startswith(DEFAULT_ROOT):
        return str(out / node[len(DEFAULT_ROOT) :])
    return node


def load_config(name: str, out: Path, small: bool) -> dict:
    """``configs/demo/<name>.yaml`` with its paths under ``out`` (and tiny sizes if ``small``)."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"demo stage {name!r}: no config {path}")
    config = move_paths(yaml.safe_load(path.read_text()), out)
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"].endswith("HFExport"):  # a rerun of the pipeline replaces its own exports
            callback["init_args"]["overwrite"] = True
    return merge(config, SMALL_OVERRIDES.get(name, {})) if small else config


def write_config(config: dict, out: Path, run: str) -> Path:
    path = out / "configs" / f"{run}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def export_dir(config: dict) -> str:
    """The ``dirpath`` of the config's HFExport callback (where the stage's models are written)."""
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"].endswith("HFExport"):
            return callback["init_args"]["dirpath"]
    raise ValueError("a demo stage config needs a lit_rlhf.callbacks.HFExport callback")


def name_run(config: dict, run: str, seed: int, seed_args: tuple[str, ...], out: Path) -> dict:
    """``config`` (changed in place and returned) as run ``run`` with training seed ``seed``: ``seed_everything``
    and each ``model.init_args`` key of ``seed_args`` set to ``seed``, its TensorBoard name ``run`` and its
    HFExport folder ``OUT/<run>``."""
    config["seed_everything"] = seed
    for arg in seed_args:
        config["model"]["init_args"][arg] = seed
    config["trainer"]["logger"]["init_args"]["name"] = run
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"].endswith("HFExport"):
            callback["init_args"]["dirpath"] = str(out / run)
    return config


OUT_PLACEHOLDER = "<OUT>"  # what the output folder's path is hashed as in a stage key


def _out_spellings(out: Path) -> list[str]:
    """The spellings of ``out`` that may start a config path: as given and resolved (longest first)."""
    spellings = {str(out), str(out.resolve()), os.path.abspath(out)}
    return sorted((s for s in spellings if s not in ("", ".")), key=len, reverse=True)


def without_out(node: Any, out: Path) -> Any:
    """``node`` (a config) with every path under ``out``, in any spelling of :func:`_out_spellings`, starting
    with :data:`OUT_PLACEHOLDER` instead."""
    if isinstance(node, dict):
        return {k: without_out(v, out) for k, v in node.items()}
    if isinstance(node, list):
        return [without_out(v, out) for v in node]
    if isinstance(node, str):
        for spelling in _out_spellings(out):
            if node == spelling or node.startswith(spelling.rstrip(os.sep) + os.sep):
                return OUT_PLACEHOLDER + node[len(spelling.rstrip(os.sep)) :]
    return node


@dataclass
class StageRecord:
    """What the report needs of a finished stage (also what ``stages.json`` keeps for ``--reuse``).

    ``threads``, ``cpu`` and ``float_path`` are the torch thread count, the CPU model and the forced math code
    path (:func:`~lit_rlhf.demo.machine.float_path`, ``""`` for none) the stage ran with (None in records
    written before they were kept)."""

    run: str
    key: str
    config: dict
    log_dir: str
    wall_s: float
    peak_rss_mb: float | None = None
    reused: bool = False
    threads: int | None = None
    cpu: str | None = None
    float_path: str | None = None


class StageRunner:
    """Runs the fits of one demo output folder; see the module docstring for ``reuse``.

    Args:
        out: the demo's output folder.
        reuse: skip stages recorded in ``OUT/stages.json`` with the same key and an existing export.
    """

    def __init__(self, out: Path, reuse: bool = False) -> None:
        self.out, self.reuse = out, reuse
        self.book = out / "stages.json"
        self.recorded: dict[str, dict] = json.loads(self.book.read_text()) if self.book.exists() else {}
        self.records: dict[str, StageRecord] = {}
        self.legacy_keys: dict[str, str] = {}  # run -> its key with OUT hashed as spelt (older stages.json)

    def key(self, config: dict, inputs: tuple[str, ...], salt: str = "") -> str:
        """Hash of the config text (``OUT`` as a placeholder) and of the keys of the ``inputs`` stages (and ``salt``)."""
        return self._hash(without_out(config, self.out), [self.records[name].key for name in inputs], salt)

    def legacy_key(self, config: dict, inputs: tuple[str, ...], salt: str = "") -> str:
        """The key of older versions: ``OUT`` hashed as spelt, chained through the inputs' legacy keys."""
        return self._hash(config, [self.legacy_keys.get(name, self.records[name].key) for name in inputs], salt)

    @staticmethod
    def _hash(config: dict, input_keys: list[str], salt: str) -> str:
        text = yaml.safe_dump(config, sort_keys=True) + salt + "".join(input_keys)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _write_book(self) -> None:
        self.book.write_text(json.dumps(self.recorded, indent=1) + "\n")

    def forget(self, run: str, log_dir: str) -> None:
        """Drop ``run``'s record from ``stages.json`` and delete its logs, gold curve and memory figures:
        what a fit about to (re)start replaces, so that an interrupted fit leaves none of it behind."""
        if self.recorded.pop(run, None) is not None:
            self._write_book()
        shutil.rmtree(log_dir, ignore_errors=True)
        for folder in ("curves", "memory"):
            (self.out / folder / f"{run}.json").unlink(missing_ok=True)

    def fit(
        self, run: str, config: dict, inputs: tuple[str, ...] = (), *, subprocess_: bool = False, salt: str = "",
        before: Callable[[], object] | None = None,
    ) -> StageRecord:  # fmt: skip
        """Fit ``config`` as stage ``run`` (reused if allowed), in a child process if ``subprocess_``; ``before``
        (e.g. writing a data file the fit reads) is called first when the fit runs, not when it is reused."""
        import torch

        key, legacy = self.key(config, inputs, salt), self.legacy_key(config, inputs, salt)
        previous = self.recorded.get(run)
        if self.reuse and previous and previous["key"] in (key, legacy) and Path(export_dir(config)).exists():
            print(f"\n=== {run}: reusing the run recorded in {self.book}", flush=True)
            record = StageRecord(**{**previous, "key": key, "reused": True})
        else:
            logger = config["trainer"]["logger"]["init_args"]
            log_dir = str(Path(logger["save_dir"]) / logger["name"])
            self.forget(run, log_dir)
            threads, start = torch.get_num_threads(), time.perf_counter()  # the stage's time includes ``before``
            if before is not None:
                before()
            path = write_config(config, self.out, run)
            print(f"\n=== {run}: lit-rlhf fit --config {path}", flush=True)
            peak_rss_mb = fit_in_child(path) if subprocess_ else fit_here(path)
            wall_s = time.perf_counter() - start
            record = StageRecord(run, key, config, log_dir, wall_s, peak_rss_mb, threads=threads, cpu=cpu_model(),
                                 float_path=float_path())  # fmt: skip
        self.records[run], self.legacy_keys[run] = record, legacy
        self.recorded[run] = {k: v for k, v in record.__dict__.items() if k != "reused"}
        self._write_book()
        return record


def fit_here(config_path: Path) -> None:
    """``lit-rlhf fit --config config_path`` in this process (no peak-memory figure: it is shared)."""
    from lit_rlhf.cli import run_cli

    with warnings.catch_warnings():  # the pipeline's own argv is not meant for the CLI: no need to say so
        warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
        run_cli(["fit", "--config", str(config_path)])


def fit_in_child(config_path: Path) -> float:
    """``lit-rlhf fit --config config_path`` in a child Python process; returns its peak RSS in MB.

    The child imports the same ``lit_rlhf`` as this process and uses as many torch threads. Its peak
    resident set (``ru_maxrss`` of that child alone, from ``os.wait4``) includes its imports. glibc's
    malloc serves every block of 1 MiB or more with its own mapping in the child
    (``MALLOC_MMAP_THRESHOLD_``, unless already set), so a freed large tensor leaves the resident set at
    once and the peak measures what the run held rather than what the allocator kept cached (without it,
    runs that hold the same tensors differed by up to 50 MB of training peak; 64 KiB made the fits 50-70%
    slower, 1 MiB costs no time); numerics are unchanged.
    A failed fit raises ``RuntimeError`` with the command.
    """
    import torch

    import lit_rlhf

    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1024 * 1024))
    root = str(Path(lit_rlhf.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "lit_rlhf.cli", "fit", "--config", str(config_path)]
    child = subprocess.Popen(command, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    if child.returncode != 0:
        raise RuntimeError(f"demo stage failed (exit {child.returncode}): {' '.join(command)}")
    return usage.ru_maxrss / 1024  # KiB on Linux

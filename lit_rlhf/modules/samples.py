"""Sample texts for every logger: pulling prompts out of batches and logging text tables.

A table is logged at an explicit x-axis ``step`` so that it lines up with the scalars of the same step:
:func:`logger_step` is the value Lightning gives the scalars that ``self.log`` records now (the number of
optimiser-stepping batches; for an online module with one batch per rollout, the rollout index).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

SAMPLES_FILE = "samples.jsonl"  # beside a CSVLogger's metrics.csv


def prompts_from_batch(batch: dict[str, torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first ``n`` prompts of a right-padded SFT batch: real tokens before the response starts (the
    first trained token: a multi-turn response's user turns are untrained but not prompt)."""
    prompts = []
    for row, attention, response in zip(batch["input_ids"][:n], batch["attention_mask"][:n], batch["response_mask"][:n]):
        start = int(response.bool().int().argmax()) if response.any() else len(row)
        prompts.append(row[:start][attention[:start].bool()].detach().cpu())
    return prompts


def logger_step(trainer: Trainer) -> int:
    """The step at which Lightning logs the scalars recorded now with ``self.log`` (training and
    validation alike): ``fit_loop.epoch_loop._batches_that_stepped``, as Lightning's own
    ``LearningRateMonitor`` reads it. ``global_step`` is one ahead of it during mid-epoch validation."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``header`` as a markdown table (TensorBoard's text plugin renders it)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _log_to(logger: Logger, tag: str, header: list[str], rows: list[list[str]], step: int) -> bool:
    """Write the table to one logger; False when the logger has no place for text."""
    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text(tag, markdown_table(header, rows), global_step=step)
    elif isinstance(logger, CSVLogger):
        path = Path(logger.log_dir) / SAMPLES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, "tag": tag, **dict(zip(header, row))}) + "\n")
    elif isinstance(logger, MLFlowLogger):
        data = {name: [row[i] for row in rows] for i, name in enumerate(header)}
        logger.experiment.log_table(logger.run_id, data, artifact_file=f"{tag}/step_{step:07d}.json")
    elif isinstance(logger, WandbLogger):
        logger.log_table(key=tag, columns=header, data=rows, step=step)
    else:
        return False
    return True


_warned: set[str] = set()


def log_text_table(
    module: LightningModule,
    tag: str,
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    step: int | None = None,
) -> None:
    """Log ``rows`` as a text table to every logger of the trainer (rank 0 only).

    TensorBoard: a markdown table (TEXT tab). CSVLogger: one JSON line per row in ``samples.jsonl``
    beside ``metrics.csv``, with ``step`` and ``tag``. MLflow: a table artifact ``<tag>/step_<step>.json``.
    W&B: ``wandb.Table`` under ``tag``. Any other logger gets a one-time warning.

    Args:
        module: the logging module (its trainer's loggers are used).
        tag: table name, e.g. ``val/samples``.
        header: column names.
        rows: cell values (converted with ``str``).
        step: x-axis value; pass the step of the scalars this table belongs with (an online module
            passes its rollout index). None means :func:`logger_step`.
    """
    trainer = module._trainer  # None outside a Trainer
    if trainer is None or not trainer.is_global_zero:
        return
    step = logger_step(trainer) if step is None else int(step)
    cells = [[str(c) for c in row] for row in rows]
    for logger in trainer.loggers:
        if not _log_to(logger, tag, list(header), cells, step) and type(logger).__name__ not in _warned:
            _warned.add(type(logger).__name__)
            rank_zero_warn(f"log_text_table: {type(logger).__name__} has no text tables; {tag!r} not logged there")

"""Sample texts for TensorBoard: pulling prompts out of batches and logging markdown tables."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger


def prompts_from_batch(batch: dict[str, torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first ``n`` prompts of a right-padded SFT batch: real tokens before the response starts."""
    prompt_mask = batch["attention_mask"].bool() & ~batch["response_mask"].bool()
    return [row[m].detach().cpu() for row, m in zip(batch["input_ids"][:n], prompt_mask[:n])]


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def log_text_table(
    module: LightningModule, tag: str, header: Sequence[str], rows: Sequence[Sequence[object]]
) -> None:
    """Log ``rows`` as a markdown table to every TensorBoard logger of the trainer (rank 0 only)."""
    if module.trainer is None or not module.trainer.is_global_zero:
        return
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    for logger in module.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, "\n".join(lines), global_step=module.global_step)

"""Reward-model ensemble members that agree on the preference pairs and disagree on unlabelled text.

Diversity by disagreement (D-BAT: Pagliardini et al. 2023, "Agree to Disagree", ICLR 2023, arXiv:2202.04414,
sec. 3) for :class:`~lit_rlhf.modules.reward_ensemble.RewardEnsembleModule`: each training step adds
``coef * functional.disagreement_loss`` of the members' scores of the step's pair texts and of a batch of
unlabelled texts, so that their spread, which an uncertainty-weighted aggregate (mean - k std, Coste et al.
2024, arXiv:2310.02743) subtracts, grows where no pair constrains them. The unlabelled texts should look like
what a policy may drift to, e.g. samples of the SFT policy at a raised temperature, some kept from ending early;
they need no labels.

The unlabelled batch of step i is a function of i (a seeded permutation of the texts), so a resumed fit draws
what an uninterrupted one would; under several ranks each rank draws its own rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import ClassVar

import torch

from lit_rlhf.data.formats import DataFormatError
from lit_rlhf.data.sources import check_text_file
from lit_rlhf.settings import Settings


@dataclasses.dataclass
class Disagreement(Settings):
    """The disagreement term of a reward-model ensemble (see the module).

    Attributes:
        texts: a ``.jsonl`` file of unlabelled texts, one ``{"text": ...}`` object per line: whole sequences
            as the members score them (prompt and response, with the EOS token's text where it ended).
        coef: the term's weight (> 0) beside the members' summed Bradley-Terry losses.
        target: the spread (population standard deviation of the members' scores) asked for on each
            unlabelled text (> 0), in the scores' units; the hinge stops the members drifting apart without end.
        batch_size: unlabelled texts per training step (and rank).
        max_length: texts are cut to their last ``max_length`` tokens (a score reads the last one).
        seed: the seed of the texts' order.
    """

    group: ClassVar[str] = "disagreement"

    texts: str = ""
    coef: float = 1.0
    target: float = 1.0
    batch_size: int = 32
    max_length: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_types()
        self.require("texts", isinstance(self.texts, str) and self.texts.endswith(".jsonl"), "a .jsonl file path")
        for name in ("coef", "target"):
            value = getattr(self, name)
            self.require(name, math.isfinite(value) and value > 0, "a finite number > 0")
        for name in ("batch_size", "max_length"):
            self.require(name, getattr(self, name) >= 1, "an integer >= 1")


def read_texts(path: str) -> list[str]:
    """The ``text`` of every row of a ``.jsonl`` file (UTF-8, a leading byte-order mark allowed; a row is a
    non-blank line); a :class:`DataFormatError` names the file, row and field of the first row that is not
    UTF-8 (``data.sources.check_text_file`` names its line) or not an object with a non-empty string ``text``,
    or says the file has no rows."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = [line for line in f if line.strip()]
    except UnicodeDecodeError as err:
        check_text_file(path)  # raises, naming the line, row and byte
        raise DataFormatError(path, f"not valid UTF-8: {err}") from err
    except OSError as err:
        raise DataFormatError(path, f"cannot read the unlabelled texts: {err}") from err
    texts: list[str] = []
    for row, line in enumerate(lines):
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataFormatError(path, f"malformed JSON ({err.msg} at column {err.colno}); truncated?", row) from err
        text = value.get("text") if isinstance(value, dict) else None
        if not isinstance(text, str) or not text.strip():
            got = type(value).__name__ if not isinstance(value, dict) else repr(text)
            raise DataFormatError(path, f"needs a non-empty string, got {got}", row, "text")
        try:  # a lone UTF-16 surrogate escape ("\ud800") parses, but is no text (the tokenizer refuses it)
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise DataFormatError(path, f"a lone surrogate escape in the string ({err.reason})", row, "text") from err
        texts.append(text)
    if not texts:
        raise DataFormatError(path, "the file has no rows")
    return texts


class UnlabelledTexts:
    """The tokenised texts of a :class:`Disagreement` and the batch of each training step."""

    def __init__(self, settings: Disagreement, tokenizer) -> None:
        self.settings = settings
        texts = read_texts(settings.texts)
        # tokenised as a plain prompt is (the tokenizer's own special tokens, e.g. BOS), the EOS text kept as
        # written; the last max_length tokens kept (a score reads the last one)
        self.ids = [ids[-settings.max_length :] for ids in tokenizer(texts)["input_ids"]]
        empty = next((row for row, ids in enumerate(self.ids) if not ids), None)
        if empty is not None:
            raise DataFormatError(settings.texts, "tokenises to no tokens", empty, "text")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(settings.seed))

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The (U, L) right-padded token ids and attention mask of training step ``step`` on ``rank``."""
        size, n = self.settings.batch_size, len(self.ids)
        start = (step * world_size + rank) * size
        rows = self.order[torch.arange(start, start + size) % n].tolist()
        length = max(len(self.ids[r]) for r in rows)
        input_ids = torch.full((size, length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((size, length), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(self.ids[r])] = torch.tensor(self.ids[r])
            attention_mask[i, : len(self.ids[r])] = 1
        return input_ids, attention_mask

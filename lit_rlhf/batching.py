"""Length-bucketed micro-batches under a token budget: less compute spent on padding, same numbers.

A padded batch spends ``rows x longest row`` tokens of compute. Sorting the rows by length, cutting them
into micro-batches of at most ``token_budget`` padded tokens (and ``max_rows`` rows), and dropping the
columns that are padding in every row of a micro-batch spends about the real tokens only. It is not
packing: each row stays a row, so attention, positions (computed from the mask, see
``lit_rlhf.models.scoring``) and every per-row result are those of the padded batch; only the matmul
shapes change (float rounding).

Shapes: N rows, S padded segments per row (1 for a right-padded sequence; 2 for a rollout, whose
left-padded prompt and right-padded response are padded separately), L columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar
from weakref import WeakKeyDictionary

import torch

from lit_rlhf.settings import Settings

__all__ = [
    "SPLIT_WORK",
    "Bucketing",
    "MicroBatch",
    "padded_tokens",
    "plan_micro_batches",
    "scatter_rows",
    "sequence_micro_batches",
    "rollout_micro_batches",
    "trim_prompt_response",
    "trim_sequences",
]

# Bucketing.split_cost="auto": a micro-batch's fixed cost taken as the work of SPLIT_WORK / N tokens of a
# model of N parameters (2 N FLOPs a token forward, so ~2 GFLOP: deliberately more than the 1-3 ms a
# micro-batch's fixed cost measures on one CPU core; splitting pays from a few million parameters on).
SPLIT_WORK = 1 << 30
Rows = torch.Tensor | slice
MicroBatch = tuple[Rows, slice, int]  # (rows, columns, response length) of one micro-batch


def plan_micro_batches(
    lengths: torch.Tensor,
    token_budget: int | None = None,
    max_rows: int | None = None,
    group_size: int = 1,
    split_cost: int | None = None,
) -> list[torch.Tensor]:
    """Cut rows sorted by length into micro-batches of at most ``token_budget`` padded tokens.

    Groups of ``group_size`` consecutive rows (the K responses of a prompt, a pair) stay whole and in
    order. Groups are sorted by their padded length, longest first (ties by position: deterministic).
    Without ``split_cost`` they are added to the current micro-batch until one more would take it past
    ``token_budget`` padded tokens (rows x the sum over segments of the longest length) or ``max_rows``
    rows. With it, the sorted groups are cut where the plan's padded tokens plus ``split_cost`` per
    micro-batch are least, under the same limits (an exact dynamic programme over the cut points, see
    :func:`_cheapest_cuts`): a batch that fits one micro-batch is still split where that removes more
    padding than a micro-batch costs. A group that alone exceeds a limit gets a micro-batch of its own.

    Args:
        lengths: (N,) or (N, S) real tokens of each row (per separately padded segment).
        token_budget: > 0, the cap on rows x padded length; None = no token cap.
        max_rows: > 0, the cap on rows per micro-batch; None = no row cap.
        group_size: rows that must share a micro-batch (N must be a multiple of it).
        split_cost: >= 0, the padded tokens one more micro-batch is worth (its fixed cost); None = the
            greedy fill.

    Returns:
        (n_i,) long row indices of each micro-batch; every row appears in exactly one.
    """
    if lengths.dim() == 1:
        lengths = lengths[:, None]  # (N, 1)
    n, segments = lengths.shape
    for name, value in (("token_budget", token_budget), ("max_rows", max_rows)):
        if value is not None and value <= 0:
            raise ValueError(f"plan_micro_batches: {name} must be > 0 or None, got {value}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"plan_micro_batches: {n} rows are not whole groups of group_size={group_size}")
    if split_cost is not None and split_cost < 0:
        raise ValueError(f"plan_micro_batches: split_cost must be >= 0 or None, got {split_cost}")
    group_lengths = lengths.detach().long().cpu().view(-1, group_size, segments).amax(dim=1)  # (G, S)
    order = torch.sort(group_lengths.sum(1), descending=True, stable=True).indices  # (G,)
    group_rows = torch.arange(n).view(-1, group_size)  # (G, K)
    widths = group_lengths.tolist()
    if split_cost is not None:
        sorted_widths = [widths[g] for g in order.tolist()]
        cuts = _cheapest_cuts(sorted_widths, group_size, token_budget, max_rows, split_cost)
        return [group_rows[order[a:b]].flatten() for a, b in zip(cuts[:-1], cuts[1:])]
    plans = _greedy_plans(order.tolist(), widths, segments, group_size, token_budget, max_rows)
    return [group_rows[groups].flatten() for groups in plans]


def _greedy_plans(
    order: list[int],
    widths: list[list[int]],
    segments: int,
    group_size: int,
    token_budget: int | None,
    max_rows: int | None,
) -> list[list[int]]:
    """The greedy fill: the groups taken in ``order`` (their (S,) ``widths`` indexed by group) are added
    to the current micro-batch until one more would take it past ``token_budget`` padded tokens or
    ``max_rows`` rows. Returns the groups of each micro-batch."""
    plans: list[list[int]] = []
    current: list[int] = []
    longest = [0] * segments
    for g in order:
        merged = [max(a, b) for a, b in zip(longest, widths[g])]
        rows = (len(current) + 1) * group_size
        over = (token_budget is not None and rows * sum(merged) > token_budget) or (
            max_rows is not None and rows > max_rows
        )
        if current and over:
            plans.append(current)
            current, merged = [], widths[g]
        current.append(g)
        longest = merged
    if current:
        plans.append(current)
    return plans


def _cheapest_cuts(
    widths: list[list[int]], group_size: int, token_budget: int | None, max_rows: int | None, split_cost: int
) -> list[int]:
    """Cut points 0 = c_0 < ... < c_m = G of the G sorted groups minimising the sum over micro-batches of
    (rows x the sum over segments of the longest length) + ``split_cost``, each micro-batch within
    ``token_budget`` and ``max_rows`` unless it is a single group. best[j] is the least cost of the
    first j groups; the last micro-batch ending at j starts at i, scanned from j - 1 down while the
    limits hold (its width and rows only grow as i falls)."""
    G, segments = len(widths), len(widths[0]) if widths else 1
    best, start = [0] + [0] * G, [0] * (G + 1)
    for j in range(1, G + 1):
        longest, best[j] = [0] * segments, None
        for i in range(j - 1, -1, -1):
            longest = [max(a, b) for a, b in zip(longest, widths[i])]
            rows = (j - i) * group_size
            tokens = rows * sum(longest)
            if i < j - 1 and (
                (token_budget is not None and tokens > token_budget) or (max_rows is not None and rows > max_rows)
            ):
                break
            cost = best[i] + tokens + split_cost
            if best[j] is None or cost < best[j]:
                best[j], start[j] = cost, i
    cuts = [G]
    while cuts[-1] > 0:
        cuts.append(start[cuts[-1]])
    return cuts[::-1]


def padded_tokens(lengths: torch.Tensor, plan: Sequence[torch.Tensor]) -> int:
    """Tokens computed by ``plan`` with trimmed micro-batches: sum of rows x the sum of segment maxima."""
    if lengths.dim() == 1:
        lengths = lengths[:, None]
    lengths = lengths.detach().long().cpu()
    return sum(len(rows) * int(lengths[rows].amax(0).sum()) for rows in plan)


@dataclass
class Bucketing(Settings):
    """Length-bucketed micro-batches (see :mod:`lit_rlhf.batching`): exact, on where it saves compute.

    Attributes:
        enabled: sort rows by length into micro-batches and trim their all-padding columns (False =
            the plain padded path: consecutive rows at the batch's full width).
        token_budget: the most padded tokens (rows x trimmed length) of a bucketed micro-batch
            (None = no token cap; the online modules' ``forward_batch_size`` still caps the rows).
        min_saving: in [0, 1): a batch is bucketed only when that removes at least this share of the
            plain path's padded tokens; otherwise it takes the plain path (short or equal-length rows
            gain nothing from more, smaller forwards).
        split_cost: the padded tokens one more micro-batch is worth (its fixed cost: Python, kernel
            launches, smaller matmuls): rows that fit one micro-batch are still split by length where
            that removes more padding than this per extra micro-batch (``plan_micro_batches``). ``"auto"``
            (default) takes ``SPLIT_WORK / N`` tokens for a model of N parameters outside its input
            embedding (:meth:`resolved`): 86 tokens at the benchmarks' 12.4M, ~2,000 at the demo's 0.5M
            (whose micro-batches then stay whole: a few milliseconds to gain). None = fill micro-batches
            up to the budget without splitting.
    """

    group: ClassVar[str] = "bucketing"

    enabled: bool = True
    token_budget: int | None = 4096
    min_saving: float = 0.1
    split_cost: int | str | None = "auto"

    def __post_init__(self) -> None:
        self.check_types()
        if self.token_budget is not None and self.token_budget <= 0:
            raise ValueError(f"bucketing.token_budget must be > 0 or None, got {self.token_budget}")
        if not 0.0 <= self.min_saving < 1.0:
            raise ValueError(f"bucketing.min_saving must be in [0, 1), got {self.min_saving}")
        cost = self.split_cost
        if not (cost is None or cost == "auto" or (isinstance(cost, int) and not isinstance(cost, bool) and cost >= 0)):
            raise ValueError(f"bucketing.split_cost must be an int >= 0, 'auto' or None, got {cost!r}")

    def resolved(self, model: torch.nn.Module) -> Bucketing:
        """These settings with ``split_cost="auto"`` resolved for ``model`` (other values unchanged)."""
        if self.split_cost != "auto":
            return self
        return replace(self, split_cost=max(1, round(SPLIT_WORK / max(_non_embedding_params(model), 1))))

    @classmethod
    def coerce(cls, value: Any, argument: str = "bucketing") -> Bucketing:
        """Settings from what a user passes: ``Bucketing``, a dict of its fields, None (defaults) or a bool
        (``enabled``); see :meth:`Settings.coerce`."""
        if isinstance(value, bool):
            return cls(enabled=value)
        return super().coerce(value, argument)

    def plan(
        self, lengths: torch.Tensor, width: int, max_rows: int | None = None, group_size: int = 1
    ) -> list[torch.Tensor] | None:
        """The bucketed plan of rows of ``lengths`` (N,) or (N, S) padded to ``width`` columns, or None
        where the plain path is taken (disabled, or saving less than ``min_saving``)."""
        if not self.enabled or lengths.shape[0] == 0:
            return None
        plain = lengths.shape[0] * width
        if int(lengths.sum()) > (1.0 - self.min_saving) * plain:  # no plan can save min_saving
            return None
        split_cost = None if self.split_cost == "auto" else self.split_cost  # unresolved: no split
        plan = plan_micro_batches(lengths, self.token_budget, max_rows, group_size, split_cost)
        return plan if padded_tokens(lengths, plan) <= (1.0 - self.min_saving) * plain else None


def trim_sequences(attention_mask: torch.Tensor) -> slice:
    """The columns from the first to the last one holding a real token in any row (at least one column).

    Args:
        attention_mask: (b, L), 1 on real tokens, any padding side.
    """
    real = attention_mask.bool().any(0).nonzero().flatten()  # (columns with a real token,)
    if real.numel() == 0:
        return slice(0, 1)
    return slice(int(real[0]), int(real[-1]) + 1)


def trim_prompt_response(attention_mask: torch.Tensor, response_length: int) -> tuple[slice, int]:
    """Columns of (left-padded prompt + right-padded response) rows that are not padding in every row.

    Args:
        attention_mask: (b, P+T) mask of the rows. response_length: T.

    Returns:
        columns: the slice of the P+T columns to keep (at least one prompt column); t: the response
        columns kept, at least 1 (the kept columns end with them).
    """
    prompt_length = attention_mask.shape[1] - response_length
    real = attention_mask.bool().any(0)  # (P+T,)
    prompt_real = real[:prompt_length].nonzero().flatten()
    start = min(int(prompt_real[0]), prompt_length - 1) if prompt_real.numel() else prompt_length - 1
    response_real = real[prompt_length:].nonzero().flatten()
    t = int(response_real[-1]) + 1 if response_real.numel() else 1
    return slice(start, prompt_length + t), t


def rollout_micro_batches(
    attention_mask: torch.Tensor,
    response_length: int,
    bucketing: Bucketing,
    max_rows: int,
    group_size: int = 1,
) -> list[MicroBatch]:
    """(rows, columns, t) of the micro-batches of (B, P+T) prompt + response rows.

    Bucketed: length-sorted rows with their trimmed columns and response length t; plain: consecutive
    chunks of ``max_rows`` rows at the full width (today's layout).
    """
    n, width = attention_mask.shape
    prompt_length = width - response_length
    lengths = torch.stack(
        [attention_mask[:, :prompt_length].sum(1), attention_mask[:, prompt_length:].sum(1)], dim=1
    )  # (B, 2)
    plan = bucketing.plan(lengths, width, max_rows, group_size)
    if plan is None:
        full = slice(0, width)
        return [(slice(s, min(s + max_rows, n)), full, response_length) for s in range(0, n, max_rows)]
    rows = [index.to(attention_mask.device) for index in plan]
    return [(index, *trim_prompt_response(attention_mask[index], response_length)) for index in rows]


def sequence_micro_batches(
    attention_mask: torch.Tensor, bucketing: Bucketing, group_size: int = 1
) -> list[tuple[Rows, slice]]:
    """(rows, columns) of the micro-batches of (N, L) sequences padded on any side.

    Bucketed: length-sorted rows under the token budget with their trimmed columns; plain: the whole
    batch at its full width.
    """
    n, width = attention_mask.shape
    plan = bucketing.plan(attention_mask.sum(1), width, None, group_size)
    if plan is None:
        return [(slice(0, n), slice(0, width))]
    rows = [index.to(attention_mask.device) for index in plan]
    return [(index, trim_sequences(attention_mask[index])) for index in rows]


def scatter_rows(parts: Sequence[torch.Tensor], rows: Sequence[Rows], n: int, width: int | None = None) -> torch.Tensor:
    """Micro-batch outputs back in batch order (differentiable).

    Args:
        parts: (n_i,) or (n_i, w_i) outputs of each micro-batch, w_i <= width.
        rows: the row indices of each micro-batch, or consecutive slices in batch order (plain path).
        n: rows of the batch. width: the output's columns (2-D parts are zero-padded on the right).

    Returns:
        (n,) or (n, width).
    """
    if width is not None:
        parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    out = torch.cat(list(parts))
    if all(isinstance(r, slice) for r in rows):  # the plain path: consecutive chunks in order
        return out
    device = out.device
    order = torch.cat(
        [torch.arange(n, device=device)[r] if isinstance(r, slice) else r.to(device) for r in rows]
    )  # (n,) batch row of each output row
    return out[torch.argsort(order)]


# model -> its non-embedding parameter count: planned on every micro-batch call, counted once per model
# (walking a model's parameters costs ~0.3 ms, ~2% of a small model's step)
_PARAM_COUNTS: WeakKeyDictionary[torch.nn.Module, int] = WeakKeyDictionary()


def _non_embedding_params(model: torch.nn.Module) -> int:
    if model not in _PARAM_COUNTS:
        get_embedding = getattr(model, "get_input_embeddings", None)
        embedding = get_embedding() if callable(get_embedding) else None
        skip = {id(p) for p in embedding.parameters()} if isinstance(embedding, torch.nn.Module) else set()
        _PARAM_COUNTS[model] = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return _PARAM_COUNTS[model]

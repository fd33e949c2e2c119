"""Shared-prompt layout: the rows that share a prompt computed as ONE row ``[prompt | r1 | ... | rK]``.

The K responses of a GRPO/RLOO group and the chosen/rejected of a DPO/RM pair repeat their prompt K (2)
times in the padded layout. Here each prompt is computed once: a block 4D attention mask lets every
response attend to the prompt's tokens and causally to itself only, and per-response position ids
continue from the prompt's length, so every response token sees exactly the keys, values and
positions it sees in its own padded row (log-probs equal up to float summation order, ~1e-6 in
float32). Same idea as Wang & Hegde 2024 (arXiv 2410.20305, "prefix sharing" for DPO).

Shapes: N rows of (prompt + response) ids of width L (any padding), G groups of consecutive rows with
the same prompt, L' the packed width (longest prompt + its responses), T the response width.

The custom mask goes through ``transformers`` as is (a 4D mask skips its mask creation, see
``masking_utils._preprocess_mask_arguments``): ``sdpa`` takes a bool mask (True = attend), ``eager``
an additive float one (0 or the dtype's min). Other attention implementations (flash-attention needs
packed-sequence kwargs, flex a BlockMask) are not supported, nor are architectures outside
``SHARED_PREFIX_MODEL_TYPES`` or with windowed attention: :func:`unsupported_reason`
(:mod:`lit_rlhf.models.shared_prefix_support`) says why and the callers use the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from lit_rlhf.functional import entropy_from_logits, logprobs_from_logits, masked_sum
from lit_rlhf.models.lm_head import chunkable_head, final_hidden_states, head_settings, head_token_scores
from lit_rlhf.models.scoring import scatter_tokens, token_values
from lit_rlhf.models.shared_prefix_support import (
    SHARED_PREFIX_MODEL_TYPES,
    mask_dtype,
    refuse_unsupported_shared_prefix,
    sliding_window,
    unsupported_reason,
)

__all__ = [
    "SHARED_PREFIX_MODEL_TYPES",
    "SHARED_PREFIX_MODES",
    "SharedPrefixLayout",
    "check_shared_prefix_mode",
    "layout_fits",
    "pack_shared_prefix",
    "packed_policy_forward",
    "packed_response_logprobs",
    "packed_sequence_scores",
    "packed_token_scores",
    "pair_layout",
    "refuse_unsupported_shared_prefix",
    "shared_prefix_layout",
    "sliding_window",
    "unsupported_reason",
]

SHARED_PREFIX_MODES = ("auto", "on", "off")
# ``auto`` packs a batch when its estimated forward cost is at most this share of the padded one: the
# packed forward pays for the gathers and a dense (G, L', L') mask that the estimate leaves out. And only
# when the prompts are at least as long as the responses (mean real lengths): below that the packed step
# was measured no faster on CPU with sdpa (scripts/bench/shared_prefix_bench.py), whatever the estimate.
AUTO_MARGIN = 0.75


def check_shared_prefix_mode(value: str, argument: str = "shared_prefix") -> str:
    """``value`` if it is one of ``auto``/``on``/``off``, else a ValueError naming ``argument``."""
    if value not in SHARED_PREFIX_MODES:
        raise ValueError(f"{argument} must be one of {SHARED_PREFIX_MODES}, got {value!r}")
    return value


@dataclass
class SharedPrefixLayout:
    """G packed rows and the maps that read per-response quantities back (see the module docstring).

    Attributes:
        input_ids: (G, L') ``[prompt | r1 | ... | rK | pad]``.
        attention_mask: (G, 1, L', L') bool (True = attend) or additive float (0 / dtype min).
        position_ids: (G, L') prompt 0..p-1, each response p..p+t-1, padding 0.
        predict_index: (N, T) flat index into (G * L') of the position whose logits predict response
            token t of row n (the prompt's last token for t = 0); a real position on padding.
        labels: (N, T) response token t of row n (the pad id on padding).
        response_mask: (N, T) bool, True on real response tokens.
        last_index: (N,) flat index of row n's last real token (the prompt's last one if it has no response).
        logits_to_keep: the LM head is needed on the last ``logits_to_keep`` positions only.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    predict_index: torch.Tensor
    labels: torch.Tensor
    response_mask: torch.Tensor
    last_index: torch.Tensor
    logits_to_keep: int

    def forward_kwargs(self) -> dict:
        return dict(
            input_ids=self.input_ids,
            attention_mask=self.attention_mask,
            position_ids=self.position_ids,
            use_cache=False,
        )

    def gather(self, per_position: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """(G, L'', ...) -> index's shape + (...): rows of the last L'' positions at flat ``index``."""
        G, kept = per_position.shape[:2]
        width = self.input_ids.shape[1]
        row, col = index // width, index % width - (width - kept)
        return per_position.reshape(G * kept, *per_position.shape[2:])[row * kept + col]


def _compact(ids: torch.Tensor, mask: torch.Tensor, fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L) ids with a (N, L) mask -> masked tokens moved to the left, in order: (N, max len), lengths (N,)."""
    lengths = mask.sum(1)
    out = torch.full((ids.shape[0], max(int(lengths.max()), 1)), fill, dtype=ids.dtype, device=ids.device)
    rows, cols = mask.nonzero(as_tuple=True)
    out[rows, mask.long().cumsum(1)[rows, cols] - 1] = ids[rows, cols]
    return out, lengths


def pack_shared_prefix(
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
    mask_dtype: torch.dtype = torch.bool,
    response_width: int | None = None,
    order: torch.Tensor | None = None,
) -> SharedPrefixLayout:
    """Pack rows whose consecutive runs share a prompt into one row per run.

    Args:
        input_ids: (N, L) prompt + response ids, any padding (the real tokens of the prompt and of the
            response are read in order through the masks).
        prompt_mask, response_mask: (N, L), 1 on the prompt's / response's real tokens. Consecutive rows
            with equal prompts form a group (a K-sample group, or a pair put next to each other).
        pad_token_id: filler of the packed row's tail.
        mask_dtype: ``torch.bool`` for sdpa, the model's float dtype for eager (additive mask).
        response_width: T of the outputs (default: the longest response).
        order: (N,) pack the rows in this order (e.g. a pair's chosen and rejected next to each
            other); the read-back maps stay in the rows' original order.

    Returns:
        the :class:`SharedPrefixLayout`.

    Raises:
        ValueError: a row without prompt tokens (its first response token has nothing to be predicted from).
    """
    if order is not None:
        layout = pack_shared_prefix(
            input_ids[order], prompt_mask[order], response_mask[order], pad_token_id, mask_dtype, response_width
        )
        return _restore_order(layout, order)
    prompts, p_len = _compact(input_ids, prompt_mask.bool(), pad_token_id)  # (N, Pm), (N,)
    responses, r_len = _compact(input_ids, response_mask.bool(), pad_token_id)  # (N, Tm), (N,)
    if bool((p_len == 0).any()):
        raise ValueError("pack_shared_prefix: every row needs at least one prompt token")
    # 1. Groups: runs of consecutive rows with the same prompt; row n's response starts after its
    #    group's prompt and the responses of the rows before it in the group.
    groups = _groups(prompts, p_len, r_len)
    # 2. Packed ids, segment of every position (-1 padding, 0 prompt, n + 1 row n's response) and positions.
    ids, segment, positions = _packed_rows(prompts, p_len, responses, r_len, groups, pad_token_id)
    # 3. Block mask: a real query attends to real keys at or before it that are the prompt or its own
    #    segment; every query attends to itself (padding queries then give finite, unread outputs).
    attention_mask = _block_mask(segment, mask_dtype)
    # 4. Read-back maps: response token t is predicted at the position before it (the prompt's last for t = 0).
    T = int(r_len.max()) if response_width is None else response_width
    predict_index, labels, real, last = _read_back_maps(responses, p_len, r_len, groups, T, pad_token_id)
    return SharedPrefixLayout(
        input_ids=ids,
        attention_mask=attention_mask,
        position_ids=positions,
        predict_index=predict_index,
        labels=labels,
        response_mask=real,
        last_index=last,
        logits_to_keep=groups.width - int(p_len.min()) + 1,
    )


def _restore_order(layout: SharedPrefixLayout, order: torch.Tensor) -> SharedPrefixLayout:
    """``layout`` of the rows taken in ``order`` (N,), its read-back maps put back in the rows' own order."""
    back = torch.argsort(order)  # row n of the input is row back[n] of the packed order
    for name in ("predict_index", "labels", "response_mask", "last_index"):
        setattr(layout, name, getattr(layout, name)[back])
    return layout


class _Groups(NamedTuple):
    """The G runs of consecutive rows (of N) that share a prompt, and where each row's response goes."""

    group: torch.Tensor  # (N,) long, the group of each row
    first: torch.Tensor  # (G,) long, the first row of each group
    start: torch.Tensor  # (N,) long, packed column of the row's first response token
    width: int  # L', the longest packed row


def _groups(prompts: torch.Tensor, p_len: torch.Tensor, r_len: torch.Tensor) -> _Groups:
    """(N, Pm) compacted prompts, (N,) prompt and (N,) response lengths -> the :class:`_Groups`."""
    same = (p_len[1:] == p_len[:-1]) & (prompts[1:] == prompts[:-1]).all(1)  # (N-1,)
    device = prompts.device
    new_group = torch.cat([torch.ones(1, dtype=torch.bool, device=device), ~same])  # (N,)
    group = new_group.long().cumsum(0) - 1  # (N,)
    first = new_group.nonzero().squeeze(1)  # (G,) first row of each group
    G = first.shape[0]
    before = r_len.cumsum(0) - r_len  # (N,) response tokens of all earlier rows
    start = p_len + before - before[first][group]  # (N,) packed column of the response's first token
    row_len = p_len[first] + torch.zeros(G, dtype=r_len.dtype, device=device).index_add(0, group, r_len)
    return _Groups(group, first, start, int(row_len.max()))


def _packed_rows(
    prompts: torch.Tensor,
    p_len: torch.Tensor,
    responses: torch.Tensor,
    r_len: torch.Tensor,
    groups: _Groups,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, Pm) compacted prompts and (N, Tm) responses with their (N,) lengths -> the (G, L') packed ids,
    segments (-1 padding, 0 prompt, n + 1 row n's response) and position ids."""
    group, first, start, width = groups
    G, device = first.shape[0], prompts.device
    ids = torch.full((G, width), pad_token_id, dtype=prompts.dtype, device=device)
    segment = torch.full((G, width), -1, dtype=torch.long, device=device)
    positions = torch.zeros((G, width), dtype=torch.long, device=device)
    col = torch.arange(prompts.shape[1], device=device)
    in_prompt = col < p_len[first, None]  # (G, Pm)
    ids[:, : prompts.shape[1]] = torch.where(in_prompt, prompts[first], pad_token_id)
    segment[:, : prompts.shape[1]] = torch.where(in_prompt, 0, -1)
    positions[:, : prompts.shape[1]] = torch.where(in_prompt, col, 0)
    rows, t = (torch.arange(responses.shape[1], device=device) < r_len[:, None]).nonzero(as_tuple=True)
    ids[group[rows], start[rows] + t] = responses[rows, t]
    segment[group[rows], start[rows] + t] = rows + 1
    positions[group[rows], start[rows] + t] = p_len[rows] + t
    return ids, segment, positions


def _block_mask(segment: torch.Tensor, mask_dtype: torch.dtype) -> torch.Tensor:
    """(G, L') segments -> (G, 1, L', L') mask: bool (True = attend), or additive (0 / dtype min) if float."""
    width, device = segment.shape[1], segment.device
    q, k = segment[:, :, None], segment[:, None, :]  # (G, L', 1), (G, 1, L')
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    allowed = ((k == 0) | (k == q)) & (k >= 0) & (q >= 0) & causal
    allowed = (allowed | torch.eye(width, dtype=torch.bool, device=device))[:, None]  # (G, 1, L', L')
    if mask_dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=mask_dtype, device=device).masked_fill(
        ~allowed, torch.finfo(mask_dtype).min
    )


def _read_back_maps(
    responses: torch.Tensor,
    p_len: torch.Tensor,
    r_len: torch.Tensor,
    groups: _Groups,
    T: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the N rows' per-token and last-token quantities are read back from the packed rows.

    Args:
        responses: (N, Tm) compacted response ids; p_len, r_len: (N,) prompt and response lengths.
        groups: the rows' :class:`_Groups`. T: the response width of the outputs.
        pad_token_id: the label on padding.

    Returns:
        predict_index (N, T) and last_index (N,) flat indices into (G * L'), labels (N, T) and
        response_mask (N, T) bool: the :class:`SharedPrefixLayout` fields of these names.
    """
    group, _, start, width = groups
    t = torch.arange(T, device=responses.device)  # (T,)
    last_prompt = (p_len - 1)[:, None]  # (N, 1)
    predict = torch.where(t == 0, last_prompt, start[:, None] + t - 1)  # (N, T)
    predict = torch.where(t < r_len[:, None].clamp(min=1), predict, last_prompt)
    labels = torch.full((responses.shape[0], T), pad_token_id, dtype=responses.dtype, device=responses.device)
    w = min(T, responses.shape[1])
    labels[:, :w] = responses[:, :w]
    last = torch.where(r_len > 0, start + r_len - 1, p_len - 1)  # (N,)
    return group[:, None] * width + predict, labels, t < r_len[:, None], group * width + last


def layout_fits(model: nn.Module, layout: SharedPrefixLayout) -> bool:
    """Whether ``layout``'s mask is the one ``model`` takes (a reference may differ from the actor)."""
    return mask_dtype(model) == layout.attention_mask.dtype and unsupported_reason(model) is None


def forward_cost(model: nn.Module, rows: int, width: int, head_positions: int) -> float:
    """Estimated multiply-adds of a forward of (rows, width) tokens (the backward scales alike).

    Per layer and token 12 h^2 for the projections and the MLP, per query-key pair 2 h for dense
    attention (a mask does not skip work), and h V per position of the LM head (Kaplan et al. 2020,
    arXiv 2001.08361, Table 1, without the factor 2 of their forward FLOPs).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    return layers * rows * (12 * h * h * width + 2 * h * width * width) + h * vocab * head_positions


def shared_prefix_layout(
    model: nn.Module,
    mode: str,
    input_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
    padded_head_positions: int,
    response_width: int | None = None,
    order: torch.Tensor | None = None,
    lm_head: bool = True,
) -> SharedPrefixLayout | None:
    """The layout when ``mode`` packs these rows for ``model``, else None (use the padded layout).

    ``on`` always packs (ValueError if the model's attention implementation cannot); ``auto`` packs when
    the mean real prompt is at least as long as the mean real response and :func:`forward_cost` of the
    packed rows is at most ``AUTO_MARGIN`` of the padded (N, L) forward whose
    LM head covers ``padded_head_positions`` positions (``lm_head=False``: a scalar head, not counted);
    ``off`` never packs. ``order``: as in :func:`pack_shared_prefix`.
    """
    if mode == "off":
        return None
    reason = unsupported_reason(model)
    if reason is not None:
        if mode == "on":
            raise ValueError(f"shared_prefix='on' cannot run with {reason}; use 'auto' or 'off'")
        return None
    if mode == "auto" and bool(prompt_mask.sum() < response_mask.sum()):
        return None
    layout = pack_shared_prefix(
        input_ids, prompt_mask, response_mask, pad_token_id, mask_dtype(model), response_width, order
    )
    if mode == "auto":
        G, width = layout.input_ids.shape
        packed = forward_cost(model, G, width, G * layout.logits_to_keep * lm_head)
        padded = forward_cost(model, input_ids.shape[0], input_ids.shape[1], padded_head_positions * lm_head)
        if packed > AUTO_MARGIN * padded:
            return None
    return layout


def pair_layout(
    model: nn.Module,
    mode: str,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    pad_token_id: int,
    lm_head: bool = True,
) -> SharedPrefixLayout | None:
    """:func:`shared_prefix_layout` of a preference batch: (2B, L) rows, the B chosen first, then the B
    rejected of the same pairs (``PreferenceCollator``); each pair becomes ``[prompt | chosen | rejected]``."""
    if mode == "off":
        return None
    n = input_ids.shape[0]
    order = torch.arange(n, device=input_ids.device).view(2, n // 2).t().flatten()  # chosen_i, rejected_i
    response_mask = response_mask.bool() & attention_mask.bool()
    prompt_mask = attention_mask.bool() & ~response_mask
    return shared_prefix_layout(
        model, mode, input_ids, prompt_mask, response_mask, pad_token_id,
        padded_head_positions=input_ids.numel(), order=order, lm_head=lm_head,
    )  # fmt: skip


def packed_token_scores(
    model: nn.Module,
    layout: SharedPrefixLayout,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, T) float32 log-probs of the response labels (and entropy when asked for) of the packed rows.

    With the chunked LM head (``lm_head.chunkable_head``; the plain path would hold the (G, kept, V)
    logits and their (N, T, V) gather) the (G, kept, H) final hidden states are gathered to (N, T, H) and
    the head is applied a chunk of tokens at a time: no (N, T, V) tensor exists. Else the plain path.
    """
    N, T = layout.labels.shape
    G, kept = layout.input_ids.shape[0], layout.logits_to_keep
    head = chunkable_head(model, G * kept + N * T)
    if head is not None:
        real = layout.response_mask  # (N, T): the head runs on real response tokens only
        hidden = final_hidden_states(model, head, layout.forward_kwargs(), kept)  # (G, kept, H)
        hidden = layout.gather(hidden, layout.predict_index[real])  # (n, H)
        scores = head_token_scores(
            head, hidden, layout.labels[real], temperature, entropy, entropy_grad, **head_settings(model)
        )  # (n,)
        entropies = None if scores.entropy is None else scatter_tokens(scores.entropy, real)
        return scatter_tokens(scores.logprobs, real), entropies
    logits = model(**layout.forward_kwargs(), logits_to_keep=kept).logits  # (G, kept, V)
    logits = layout.gather(logits, layout.predict_index)  # (N, T, V)
    logprobs = logprobs_from_logits(logits, layout.labels, temperature=temperature)  # (N, T)
    if not entropy:
        return logprobs, None
    return logprobs, entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)


def packed_policy_forward(
    model: nn.Module, layout: SharedPrefixLayout, temperature: float, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``policy_forward``'s log-probs and entropy (N, T) float32 of the packed rows (no value head)."""
    return packed_token_scores(model, layout, temperature, entropy=True, entropy_grad=entropy_grad)


def packed_response_logprobs(model: nn.Module, layout: SharedPrefixLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``response_logprobs`` of the packed rows: (N,) float32 summed log-probs and (N,) long lengths."""
    token_logps, _ = packed_token_scores(model, layout)  # (N, T)
    return masked_sum(token_logps, layout.response_mask, dim=1), layout.response_mask.sum(1)


def packed_sequence_scores(model: nn.Module, layout: SharedPrefixLayout) -> torch.Tensor:
    """``sequence_scores`` of the packed rows: (N,) float32 head values at each row's last real token."""
    scored = positions_by_row(layout.last_index, *layout.input_ids.shape)  # (G, n), (G, n)
    values = token_values(model, layout.input_ids, layout.attention_mask, layout.position_ids, scored)  # (G, L')
    return layout.gather(values, layout.last_index)  # (N,)


def positions_by_row(index: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) flat indices into (rows * width) -> each row's distinct positions among them, (rows, n) long,
    and which are real, (rows, n) bool (a row with fewer than n repeats position 0 as not real)."""
    flat = torch.unique(index)  # (M,) sorted, so by row
    row, col = flat // width, flat % width  # (M,)
    counts = torch.bincount(row, minlength=rows)  # (rows,)
    slot = torch.arange(flat.numel(), device=index.device) - (counts.cumsum(0) - counts)[row]  # (M,)
    positions = torch.zeros(rows, max(int(counts.max()), 1), dtype=torch.long, device=index.device)
    valid = torch.zeros_like(positions, dtype=torch.bool)
    positions[row, slot], valid[row, slot] = col, True
    return positions, valid

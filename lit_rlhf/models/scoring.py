"""Forward helpers that read logits, per-token values and sequence scores from HF models.

All of them take an explicit ``attention_mask`` (1 = real token) and pass position ids computed from
it, so a row gives the same numbers whether it is left-padded, right-padded or alone in its batch
(HF forwards otherwise number positions with ``arange``, which shifts every left-padded row).
"""

from __future__ import annotations

import torch
from torch import nn

from lit_rlhf.functional import logprobs_from_logits, masked_sum
from lit_rlhf.models.last_layer import scored_last_layer
from lit_rlhf.models.lm_head import chunkable_head, final_hidden_states, head_settings, head_token_scores


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only.

    Args:
        attention_mask: (B, L), 1 for real tokens.

    Returns:
        (B, L) long: ``cumsum(mask) - 1`` clamped at 0, so the first real token is at position 0 and
        padding on either side does not shift the positions of the real tokens.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for any padding side (left, right or none).

    Args:
        attention_mask: (B, L), 1 for real tokens.

    Returns:
        (B,) long; 0 for a row without real tokens. ``arange(L) * mask`` is largest at the last real
        token (positions are distinct, padding scores 0).
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def _forward_kwargs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> dict:
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask) if position_ids is None else position_ids,
        use_cache=False,
    )


def causal_lm_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Next-token logits of a causal LM (plain or peft).

    Args:
        model: an ``*ForCausalLM`` model.
        input_ids: (B, L).
        attention_mask: (B, L), 1 for real tokens.

    Returns:
        (B, L, V) logits in the model's dtype; position ``t`` predicts token ``t + 1``.
    """
    return model(**_forward_kwargs(input_ids, attention_mask)).logits


def causal_lm_logits_and_hidden(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the final hidden state from one forward (for a ``ValueHead`` sharing the backbone).

    Args:
        logits_to_keep: > 0 applies the LM head to the last ``logits_to_keep`` positions only (HF's
            ``logits_to_keep``): PPO needs the response's logits only, and the head's (L, H) x (H, V)
            matmul and its backward over the prompt positions are wasted work (with P = T about half
            the head's FLOPs: ~14% of Qwen2.5-0.5B's, whose head is 27% of its weights).

    Returns:
        logits (B, L, V) (or (B, logits_to_keep, V)) and hidden (B, L, H), the last hidden state (after
        the final norm) that the LM head reads.
    """
    extra = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
    out = model(**_forward_kwargs(input_ids, attention_mask), output_hidden_states=True, **extra)
    return out.logits, out.hidden_states[-1]


def next_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    argmax: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the tokens of (B, L) rows given their prefix, at the positions of ``score_mask``.

    Token ``t + 1`` is scored from the logits at position ``t``. With a large vocabulary the LM head is
    applied in chunks to the scored positions only (``lit_rlhf.models.lm_head``; setting
    ``ModelSpec.logits_chunking``), else the full logits are computed; both give the same numbers.

    Args:
        model: an ``*ForCausalLM`` model (plain or peft).
        input_ids: (B, L), any padding side.
        attention_mask: (B, L), 1 for real tokens.
        score_mask: (B, L-1) bool, True where token ``t + 1`` is to be scored.
        argmax: also return the most likely next token (SFT's token accuracy).

    Returns:
        logprobs (B, L-1) float32, 0 outside ``score_mask``; argmax (B, L-1) long, -1 outside
        ``score_mask`` (or None).
    """
    labels = input_ids[:, 1:]  # (B, L-1): token t+1 is predicted at position t
    head = chunkable_head(model, score_mask.numel())
    if head is None:
        logits = causal_lm_logits(model, input_ids, attention_mask)[:, :-1]  # (B, L-1, V)
        logprobs = torch.where(score_mask, logprobs_from_logits(logits, labels), 0.0)  # (B, L-1)
        predicted = torch.where(score_mask, logits.argmax(-1), -1) if argmax else None  # (B, L-1)
        return logprobs, predicted
    hidden = final_hidden_states(model, head, _forward_kwargs(input_ids, attention_mask))  # (B, L, H)
    scores = head_token_scores(
        head, hidden[:, :-1][score_mask], labels[score_mask], argmax=argmax, **head_settings(model)
    )  # (N,)
    logprobs = scatter_tokens(scores.logprobs, score_mask)
    predicted = labels.new_full(labels.shape, -1).masked_scatter(score_mask, scores.argmax) if argmax else None
    return logprobs, predicted


def response_logprobs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence log-probs of the responses of (prompt + response) rows, from one forward.

    Token ``t`` is scored from the logits at position ``t - 1``; only response tokens count (the EOS
    that ends a response included, prompt and padding excluded), so the result is log pi(y | x).

    Args:
        model: an ``*ForCausalLM`` model (plain or peft).
        input_ids: (N, L) prompt + response ids, any padding side.
        attention_mask: (N, L), 1 for real tokens.
        response_mask: (N, L), 1 on response tokens (a response token is never at position 0).

    Returns:
        logps (N,) float32, the sum of the response tokens' log-probs (with grad when the model has
        it), and n_tokens (N,) long, the response lengths (for length-averaged log-probs).
    """
    mask = response_mask[:, 1:].bool() & attention_mask[:, 1:].bool()  # (N, L-1)
    token_logps, _ = next_token_logprobs(model, input_ids, attention_mask, mask)  # (N, L-1) float32
    return masked_sum(token_logps, mask, dim=1), mask.sum(dim=1)  # (N,), (N,)


def scatter_tokens(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) values of the True positions of a (B, T) ``mask`` -> (B, T), 0 elsewhere (differentiable)."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def score_head(model: nn.Module) -> nn.Module:
    """The ``score`` head of a one-label ``*ForSequenceClassification`` model (plain, peft or FSDP1-wrapped)."""
    # peft keeps the head inside the base model (wrapped for modules_to_save); FSDP1 forwards attribute
    # access to the wrapped module.
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    head = getattr(base, "score", None)
    if not isinstance(head, nn.Module):
        raise TypeError(
            f"token_values: {type(base).__name__} has no `score` head; expected a one-label "
            "*ForSequenceClassification model (build it with build_score_model)"
        )
    return head


def token_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    scored: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """The scalar head of a ``*ForSequenceClassification`` model at every position.

    Used as per-token critic values V(s_t). HF's forward applies the head to every position and then
    keeps only the last non-pad one; a forward hook on the head keeps them all. Going through the
    model's own forward (rather than calling backbone and head separately) keeps peft, FSDP and
    activation-checkpointing hooks of the top-level module in the path.

    Args:
        model: a one-label ``*ForSequenceClassification`` model (plain or peft) whose head is
            ``score`` (Llama, GPT-2, Qwen, Mistral, Gemma, ... all name it so).
        input_ids: (B, L).
        attention_mask: (B, L), 1 for real tokens; or a prepared 4D mask (the shared-prompt layout of
            ``models.shared_prefix``) with its ``position_ids`` (B, L).
        scored: None, or the (B, n) positions that will be read (and a (B, n) bool of the valid ones, or
            None): the last decoder layer then runs at those only where it can (``models.last_layer``), and
            the values elsewhere are meaningless.

    Returns:
        (B, L) float32 values; entries at padding positions are finite but meaningless (mask them).
    """
    head = score_head(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        if scored is None:
            out = model(**_forward_kwargs(input_ids, attention_mask, position_ids))
        else:
            with scored_last_layer(model, *scored):
                out = model(**_forward_kwargs(input_ids, attention_mask, position_ids))
    finally:
        handle.remove()
    values = captured[-1]
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel) and torch.is_grad_enabled():
        # FSDP1 runs the root's pre-backward hook only for gradients that flow through the root's
        # outputs; a zero-weighted use of the returned logits routes one without changing the values.
        values = values + 0.0 * out.logits.sum()
    if values.shape[-1] != 1:
        raise ValueError(
            f"token_values: the score head has {values.shape[-1]} outputs, expected 1 (num_labels=1)"
        )
    return values.squeeze(-1).float()


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence: the head read at the last real token (the EOS when present).

    Args:
        model: a one-label ``*ForSequenceClassification`` model (plain or peft).
        input_ids: (B, L), any padding side.
        attention_mask: (B, L), 1 for real tokens.

    Returns:
        (B,) float32 scores.
    """
    last = last_token_index(attention_mask).unsqueeze(-1)  # (B, 1)
    values = token_values(model, input_ids, attention_mask, scored=(last, None))  # (B, L)
    return values.gather(-1, last).squeeze(-1)


def sequence_scores_and_features(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_scores` and the score head's input there: the last hidden state at the last real token.

    Args:
        model: a one-label ``*ForSequenceClassification`` model (plain or peft) whose head is ``score``.
        input_ids: (B, L), any padding side.
        attention_mask: (B, L), 1 for real tokens.

    Returns:
        (B,) float32 scores and (B, H) float32 features (what ``functional.elliptical_width`` measures).
    """
    head = score_head(model)
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, inputs, _output: captured.append(inputs[0]))
    try:
        scores = sequence_scores(model, input_ids, attention_mask)  # (B,)
    finally:
        handle.remove()
    last = last_token_index(attention_mask)  # (B,)
    hidden = captured[-1]  # (B, L, H); meaningful at the scored (last) positions
    return scores, hidden[torch.arange(hidden.shape[0], device=hidden.device), last].float()  # (B,), (B, H)


class ValueHead(nn.Module):
    """A linear value head on the actor's last hidden state (the "critic shares the backbone" option).

    Zero-initialised so that V = 0 at the start: the first advantages are then the rewards themselves
    instead of rewards minus random noise.
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, L, H) hidden states -> (B, L) float32 values."""
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1).float()

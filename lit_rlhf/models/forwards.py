"""Per-response-token quantities of online RL from one forward: log-probs, entropy and values.

Shapes: B rows, P prompt length (left-padded), T response length (right-padded); ``input_ids`` are the
(B, P+T) prompt-and-response sequences of a rollout.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lit_rlhf.functional import entropy_from_logits, logprobs_from_logits
from lit_rlhf.models.lm_head import chunkable_head, final_hidden_states, head_settings, head_token_scores
from lit_rlhf.models.scoring import (
    _forward_kwargs,
    causal_lm_logits_and_hidden,
    scatter_tokens,
    sequence_scores,
    token_values,
)

__all__ = ["chunked", "critic_values", "policy_forward", "reward_model_scores"]


def policy_forward(
    actor: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    value_head: torch.nn.Module | None = None,
    entropy_grad: bool = True,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs and entropy of the response tokens, and shared-backbone values, from one forward.

    Args:
        actor: causal LM. input_ids, attention_mask: (B, P+T). response_length: T.
        temperature: the sampling temperature (logits are divided by it, as during generation).
        value_head: the critic's head when it shares the actor's backbone, else None.
        entropy_grad: build the entropy's autograd graph (only needed when it is in the loss).
        entropy: compute the entropy at all (False: None, e.g. for reference log-probs).

    Returns:
        logprobs (B, T) float32, entropy (B, T) float32 (or None), values (B, T) float32 or None.
    """
    head = chunkable_head(actor, input_ids.shape[0] * (response_length + 1))
    if head is not None:
        return _chunked_policy_forward(
            actor, head, input_ids, attention_mask, response_length, temperature, value_head, entropy_grad, entropy
        )
    # Position P-1+t predicts response token t: only the last T+1 positions need the LM head.
    logits, hidden = causal_lm_logits_and_hidden(
        actor, input_ids, attention_mask, logits_to_keep=response_length + 1
    )
    logits = logits[:, -response_length - 1 : -1]
    labels = input_ids[:, -response_length:]
    logprobs = logprobs_from_logits(logits, labels, temperature=temperature)
    # With ent_coef = 0 the entropy is only logged: without a graph its float32 softmax is neither kept
    # nor recomputed in backward.
    entropies = None
    if entropy:
        entropies = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature=temperature)
    values = None
    if value_head is not None:
        values = value_head(hidden[:, -response_length - 1 : -1])
    return logprobs, entropies, values


def _chunked_policy_forward(
    actor: torch.nn.Module,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float,
    value_head: torch.nn.Module | None,
    entropy_grad: bool,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`policy_forward` through the LM head route (``lit_rlhf.models.lm_head``): the head runs on
    the real response tokens only (mask 1 in ``attention_mask``'s last T columns); padded positions of
    the (B, T) log-probs and entropy read 0."""
    T = response_length
    kwargs = _forward_kwargs(input_ids, attention_mask)
    hidden = final_hidden_states(actor, head, kwargs, logits_to_keep=T + 1)[:, :-1]  # (B, T, H)
    labels = input_ids[:, -T:] if T else input_ids[:, :0]  # (B, T)
    real = attention_mask[:, attention_mask.shape[1] - T :].bool()  # (B, T)
    scores = head_token_scores(
        head, hidden[real], labels[real], temperature, entropy=entropy, entropy_grad=entropy_grad,
        **head_settings(actor),
    )  # (N,) each, N real tokens
    values = None if value_head is None else value_head(hidden)  # (B, T)
    entropies = None if scores.entropy is None else scatter_tokens(scores.entropy, real)
    return scatter_tokens(scores.logprobs, real), entropies, values


def critic_values(
    critic: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """(B, P+T) sequences -> (B, T) float32 values V(s_t), s_t = prompt + response[:t].

    Only the T positions P-1 .. P+T-2 are read, so the critic's last decoder layer runs at those alone where
    it can (``models.last_layer``): the prompt's positions need only that layer's keys and values.
    """
    B, L = input_ids.shape
    T = response_length
    read = torch.arange(L - T - 1, L - 1, device=input_ids.device).expand(B, -1)  # (B, T)
    scored = (read, None) if 0 < T < L else None
    return token_values(critic, input_ids, attention_mask, scored=scored)[:, L - T - 1 : L - 1]  # (B, T)


def reward_model_scores(
    reward_model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """(B, P+T) sequences -> (B,) float32 scores at the last real token (the EOS when present)."""
    return sequence_scores(reward_model, input_ids, attention_mask)


def chunked(n: int, size: int) -> Iterable[slice]:
    """Row slices of at most ``size`` covering ``range(n)`` (bounds the memory of no-grad forwards)."""
    return (slice(start, min(start + size, n)) for start in range(0, n, size))

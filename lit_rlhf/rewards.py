"""Where sequence scores come from: a reward model or a ``module:function`` rule.

Used by every online-RL module, for the optimised reward and for the monitor reward that is only logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lit_rlhf.batching import MicroBatch, scatter_rows
from lit_rlhf.models import build_score_model, chunked, frozen_copy, load_tokenizer, reward_model_scores
from lit_rlhf.reward_fns import RewardFn, import_reward_fn, reward_scores

__all__ = ["RewardFn", "RewardSource", "import_reward_fn"]


class RewardSource(torch.nn.Module):
    """Sequence scores from a reward model (scalar head at the last real token) or a Python function.

    A reward model that shares the actor's tokenizer scores the token ids directly; one with another
    vocabulary gets the decoded text re-tokenised with its own tokenizer.

    Args:
        reward_model: spec of a reward model (e.g. an exported RewardModelModule folder), or None.
        reward_fn: ``package.module:function`` (prompts, responses) -> scores, or None.
        tokenizer: the actor's tokenizer.
        argument: the config argument that named the scorer (``reward_fn``, ``monitor_reward_fn``), for
            error messages.
    """

    def __init__(
        self, reward_model: Any, reward_fn: str | None, tokenizer: Any, argument: str = "reward_fn"
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.fn = import_reward_fn(reward_fn, argument) if reward_fn is not None else None
        model_name = getattr(reward_model, "name_or_path", None) or "(from config)"
        self.description = f"{argument} {reward_fn}" if reward_fn is not None else f"reward_model {model_name}"
        self.model = None
        self.model_tokenizer = None
        if reward_model is not None:
            model_tokenizer = load_tokenizer(reward_model.tokenizer or reward_model.name_or_path)
            self.model = frozen_copy(build_score_model(reward_model, model_tokenizer))
            if model_tokenizer.get_vocab() != tokenizer.get_vocab():
                self.model_tokenizer = model_tokenizer

    def decode_responses(self, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        return [
            self.tokenizer.decode(row[mask], skip_special_tokens=True)
            for row, mask in zip(responses, response_mask)
        ]

    @torch.no_grad()
    def score(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        chunk_size: int | Sequence[MicroBatch],
    ) -> torch.Tensor:
        """(B, P+T) prompt+response sequences -> (B,) float32 scores.

        ``chunk_size``: rows per reward-model forward, or the (rows, columns, t) micro-batches of
        ``lit_rlhf.batching.rollout_micro_batches`` (length-bucketed and trimmed).
        """
        if self.fn is not None or self.model_tokenizer is not None:
            prompts = self.tokenizer.batch_decode(input_ids[:, :-response_length], skip_special_tokens=True)
            responses = self.decode_responses(
                input_ids[:, -response_length:], attention_mask[:, -response_length:].bool()
            )
        if self.fn is not None:
            return reward_scores(self.description, self.fn(prompts, responses), len(prompts), input_ids.device)
        if self.model_tokenizer is not None:
            texts = [p + r + self.model_tokenizer.eos_token for p, r in zip(prompts, responses)]
            enc = self.model_tokenizer(texts, return_tensors="pt", padding=True).to(input_ids.device)
            input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        n = input_ids.shape[0]
        if isinstance(chunk_size, int):
            batches = [(rows, slice(None)) for rows in chunked(n, chunk_size)]
        else:  # re-tokenised rows have their own columns
            retokenised = self.model_tokenizer is not None
            batches = [(rows, slice(None) if retokenised else columns) for rows, columns, _ in chunk_size]
        parts = [
            reward_model_scores(self.model, input_ids[rows][:, columns], attention_mask[rows][:, columns])
            for rows, columns in batches
        ]
        return scatter_rows(parts, [rows for rows, _ in batches], n)

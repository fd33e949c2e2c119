"""The offline demo world: a synthetic review language and its gold reward (:mod:`.world`), and the
tokenizer and data files built from it (:mod:`.assets`, ``python -m lit_rlhf.demo.assets``)."""

from lit_rlhf.demo.world import (
    gold_reward,
    gold_reward_fn,
    is_grammatical,
    max_response_tokens,
    sample_prompt,
    sample_response,
    sample_review,
    split_review,
)

__all__ = [
    "gold_reward",
    "gold_reward_fn",
    "is_grammatical",
    "max_response_tokens",
    "sample_prompt",
    "sample_response",
    "sample_review",
    "split_review",
]

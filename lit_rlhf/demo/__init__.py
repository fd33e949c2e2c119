"""The offline demo world: a synthetic review language and its gold reward (:mod:`.world`), and the
tokenizer and data files built from it (:mod:`.assets`, ``python -m lit_rlhf.demo.assets``).

The second world, the tool world: arithmetic word problems with an exact-match reward (:mod:`.tool_world`), a
calculator environment (:mod:`.tool_env`), its assets, evaluation, report and pipeline
(``python -m lit_rlhf.demo.tool_pipeline``)."""

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

"""Building, loading, exporting and scoring Hugging Face models (see DESIGN.md, models/)."""

from lit_rlhf.models.forwards import chunked, critic_values, policy_forward, reward_model_scores
from lit_rlhf.models.lm_head import (
    LOGITS_CHUNKING_THRESHOLD,
    chunkable_head,
    final_hidden_states,
    head_token_scores,
    set_logits_chunking,
)
from lit_rlhf.models.loading import (
    build_causal_lm,
    build_score_model,
    disable_dropout,
    export_pretrained,
    frozen_copy,
    reference_logits_context,
)
from lit_rlhf.models.scoring import (
    ValueHead,
    causal_lm_logits,
    causal_lm_logits_and_hidden,
    last_token_index,
    next_token_logprobs,
    position_ids_from_mask,
    response_logprobs,
    sequence_scores,
    token_values,
)
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.models.tokenizer import (
    SIMPLE_CHAT_TEMPLATE,
    ensure_pad_token,
    load_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "LOGITS_CHUNKING_THRESHOLD",
    "SIMPLE_CHAT_TEMPLATE",
    "ModelSpec",
    "ValueHead",
    "build_causal_lm",
    "build_score_model",
    "causal_lm_logits",
    "causal_lm_logits_and_hidden",
    "chunkable_head",
    "chunked",
    "critic_values",
    "disable_dropout",
    "ensure_pad_token",
    "export_pretrained",
    "final_hidden_states",
    "frozen_copy",
    "head_token_scores",
    "last_token_index",
    "next_token_logprobs",
    "load_tokenizer",
    "policy_forward",
    "position_ids_from_mask",
    "reference_logits_context",
    "reward_model_scores",
    "response_logprobs",
    "sequence_scores",
    "set_logits_chunking",
    "token_values",
    "train_bpe_tokenizer",
]

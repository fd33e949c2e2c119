"""Building, loading, exporting and scoring Hugging Face models (see DESIGN.md, models/)."""

from lit_rlhf.models.forwards import chunked, critic_values, policy_forward, reward_model_scores
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
    position_ids_from_mask,
    response_logprobs,
    sequence_scores,
    token_values,
)
from lit_rlhf.models.shared_prefix import (
    SHARED_PREFIX_MODES,
    SharedPrefixLayout,
    check_shared_prefix_mode,
    layout_fits,
    pack_shared_prefix,
    packed_policy_forward,
    packed_response_logprobs,
    packed_sequence_scores,
    pair_layout,
    shared_prefix_layout,
)
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.models.tokenizer import (
    SIMPLE_CHAT_TEMPLATE,
    ensure_pad_token,
    load_tokenizer,
    train_bpe_tokenizer,
)

__all__ = [
    "SHARED_PREFIX_MODES",
    "SIMPLE_CHAT_TEMPLATE",
    "ModelSpec",
    "SharedPrefixLayout",
    "ValueHead",
    "build_causal_lm",
    "build_score_model",
    "causal_lm_logits",
    "causal_lm_logits_and_hidden",
    "check_shared_prefix_mode",
    "chunked",
    "critic_values",
    "disable_dropout",
    "ensure_pad_token",
    "export_pretrained",
    "frozen_copy",
    "last_token_index",
    "layout_fits",
    "load_tokenizer",
    "pack_shared_prefix",
    "packed_policy_forward",
    "packed_response_logprobs",
    "packed_sequence_scores",
    "pair_layout",
    "policy_forward",
    "position_ids_from_mask",
    "reference_logits_context",
    "reward_model_scores",
    "response_logprobs",
    "sequence_scores",
    "shared_prefix_layout",
    "token_values",
    "train_bpe_tokenizer",
]

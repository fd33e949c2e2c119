"""The default rollout engine: Hugging Face ``generate`` on the trainer's own policy.

No second copy of the weights, so :meth:`HFEngine.sync_weights` has nothing to do; the responses, their
behaviour log-probs and the kept mass of a top-k/top-p truncation come from the decoding loop itself
(``lit_rlhf.engines.hf_generate``), without an extra forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lit_rlhf.engines.base import Responses, RolloutEngine
from lit_rlhf.models.sampling import SAMPLERS
from lit_rlhf.settings import Settings

GROUP_PREFILL_CHOICES = ("auto", "always", "never")


@dataclass
class HFOptions(Settings):
    """How :class:`HFEngine` runs ``generate`` (none of these change what is sampled, only how fast).

    Attributes:
        group_prefill: compute each prompt's prefill once for its K samples and repeat its KV cache K times
            (``lit_rlhf.models.prefill``): ``"auto"`` where it pays (K >= 2 and prompts padded to at least
            ``GROUP_PREFILL_MIN_PROMPT_TOKENS``), ``"always"`` whenever K >= 2, ``"never"`` off. Same
            logits up to float rounding, same random draws. Multi-rank runs (``synced_gpus``) and models
            whose KV cache is not a plain ``DynamicCache`` always generate unshared.
        sampler: how a token is drawn from the warped distribution (``lit_rlhf.models.sampling``):
            ``"inverse_cdf"`` (one uniform per row), ``"multinomial"`` (``generate``'s own draw) or
            ``"auto"``: inverse CDF on CPU from ``INVERSE_CDF_MIN_VOCAB``-token vocabularies, multinomial
            elsewhere. Same distribution; the random draws, hence the tokens under a seed, differ.
        transposed_head: on CPU, multiply by a (H, V) copy of the LM head's weight made once per call
            (``lit_rlhf.models.decoding``); only for plain heads of at least 2**20 weights. Logits equal
            to float rounding.
    """

    group: ClassVar[str] = "engine"

    group_prefill: str = "auto"
    sampler: str = "auto"
    transposed_head: bool = True

    def __post_init__(self) -> None:
        self.require_choice("group_prefill", GROUP_PREFILL_CHOICES)
        self.require_choice("sampler", SAMPLERS)


class HFEngine(RolloutEngine):
    """Responses from Hugging Face ``generate`` with the trainer's policy (KV cache on).

    Args:
        group_prefill: ``auto``, ``always`` or ``never`` (see :class:`HFOptions`).
        sampler: ``auto``, ``inverse_cdf`` or ``multinomial`` (see :class:`HFOptions`).
        transposed_head: a transposed copy of a large LM head during CPU generation (see :class:`HFOptions`).
    """

    uses_policy = True

    def __init__(self, group_prefill: str = "auto", sampler: str = "auto", transposed_head: bool = True) -> None:
        self.options = HFOptions(group_prefill, sampler, transposed_head)
        self.model: torch.nn.Module | None = None

    def generate(self, prompt_ids, prompt_mask, settings, *, greedy: bool = False) -> Responses:
        from lit_rlhf.engines.hf_generate import generate_responses

        if self.model is None:
            raise RuntimeError("HFEngine.generate: call setup(model, tokenizer) first")
        return generate_responses(
            self.model, prompt_ids, prompt_mask, settings,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            tokenizer=self.tokenizer, synced_gpus=self.world_size > 1, greedy=greedy,
            group_size=settings.num_samples, options=self.options,
        )  # fmt: skip

    def init_args(self) -> dict[str, Any]:
        return self.options.as_dict()

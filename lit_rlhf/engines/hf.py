"""The default rollout engine: Hugging Face ``generate`` on the trainer's own policy.

No second copy of the weights, so :meth:`HFEngine.sync_weights` has nothing to do; the responses, their
behaviour log-probs and the kept mass of a top-k/top-p truncation come from the decoding loop itself
(``lit_rlhf.engines.hf_generate``), without an extra forward.
"""

from __future__ import annotations

import torch

from lit_rlhf.engines.base import Responses, RolloutEngine


class HFEngine(RolloutEngine):
    """Responses from Hugging Face ``generate`` with the trainer's policy (KV cache on).

    How it runs ``generate`` (the shared prefill of a group, the sampler, the LM head's layout) is set by
    the ``GenerationSettings`` it is given (``group_prefill``, ``sampler``, ``decoding_head``), so
    training and evaluation rollouts can differ; the engine itself takes no arguments.
    """

    uses_policy = True

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None

    def generate(self, prompt_ids, prompt_mask, settings, *, greedy: bool = False) -> Responses:
        from lit_rlhf.engines.hf_generate import generate_responses

        if self.model is None:
            raise RuntimeError("HFEngine.generate: call setup(model, tokenizer) first")
        return generate_responses(
            self.model, prompt_ids, prompt_mask, settings,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
            tokenizer=self.tokenizer, synced_gpus=self.world_size > 1, greedy=greedy,
            group_size=settings.num_samples,
        )  # fmt: skip

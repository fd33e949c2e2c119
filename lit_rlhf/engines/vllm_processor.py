"""The sampling distribution of the vLLM engine, warped as the Hugging Face engine warps it, with its kept mass.

vLLM reports the log-prob of a sampled token under the distribution it drew from, but not the mass a
top-k/top-p truncation or the suppressed pad token removed from the tempered distribution, which the
trainer-vs-engine mismatch needs (``Responses.log_kept_mass``, see ``lit_rlhf.functional.behavior``).
So the engine asks vLLM for plain sampling (temperature 1, no truncation) and warps the logits itself in
:class:`HFWarpProcessor`, a vLLM logits processor: Hugging Face's own warpers in ``generate``'s order
(temperature, the pad token suppressed, top-k, top-p; ``lit_rlhf.models.sampling.BehaviourRecorder`` warps
the same way), recording per step ``logsumexp(kept) - logsumexp(all tempered)``. vLLM then samples from
the warped logits and its ``processed_logprobs`` are those of the warped distribution.

Records are keyed by the request's prompt and the tokens before each step (equal contexts give equal
distributions), so the engine can file them under vLLM's completions afterwards (:func:`kept_mass_lookup`).
The processor runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), writing to :data:`RECORDS`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

__all__ = ["EXTRA_ARGS_KEY", "RECORDS", "HFWarpProcessor", "kept_mass_lookup", "warp_args"]

EXTRA_ARGS_KEY = "lit_rlhf_warp"
# (prompt ids, the live list of output ids, {step: log kept mass}) of every warped request since clear()
RECORDS: list[tuple[tuple[int, ...], list[int], dict[int, float]]] = []


def warp_args(settings: Any, pad_token_id: int) -> dict[str, Any]:
    """The ``SamplingParams.extra_args`` entry that asks :class:`HFWarpProcessor` to warp a request."""
    return {EXTRA_ARGS_KEY: {"temperature": float(settings.temperature), "top_k": int(settings.top_k),
                             "top_p": float(settings.top_p), "suppress": [int(pad_token_id)]}}  # fmt: skip


class HFWarpProcessor(LogitsProcessor):
    """Temperature, suppressed tokens, top-k and top-p as Hugging Face's warpers apply them, on the requests
    whose ``extra_args`` ask for it; records each step's log kept mass in :data:`RECORDS`."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.states: dict[int, tuple[tuple, list[int], dict[int, float]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # the suppressed pad may be the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.states, batch_update, self._new_state)

    @staticmethod
    def _new_state(params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> tuple | None:
        args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        record: dict[int, float] = {}
        RECORDS.append((tuple(prompt_ids or ()), output_ids, record))
        key = (args["temperature"], args["top_k"], args["top_p"], tuple(args["suppress"]))
        return key, output_ids, record

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """(R, V) logits of the running requests -> warped in place for the requests that asked."""
        by_key: dict[tuple, list[int]] = {}
        for row, (key, _, _) in self.states.items():
            by_key.setdefault(key, []).append(row)
        for (temperature, top_k, top_p, suppress), rows in by_key.items():
            index = torch.tensor(rows, device=logits.device)
            scores = logits.index_select(0, index).float()  # (r, V)
            if temperature != 1.0:
                scores = TemperatureLogitsWarper(temperature)(None, scores)
            total = scores.logsumexp(dim=-1)  # (r,) the tempered distribution's normaliser, pad included
            warped = scores.index_fill(1, torch.tensor(suppress, device=logits.device), float("-inf"))
            if top_k:
                warped = TopKLogitsWarper(top_k)(None, warped)
            if top_p < 1.0:
                warped = TopPLogitsWarper(top_p)(None, warped)
            log_kept = (warped.logsumexp(dim=-1) - total).tolist()  # (r,)
            logits.index_copy_(0, index, warped.to(logits.dtype))
            for row, value in zip(rows, log_kept):
                _, output_ids, record = self.states[row]
                record[len(output_ids)] = value  # a step's last write wins (a partial prefill is redone)
        return logits


def kept_mass_lookup() -> dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, float]]:
    """(prompt ids, final response ids) -> {step: log kept mass} of the warped requests since the last
    ``RECORDS.clear()``."""
    return {(prompt, tuple(output)): record for prompt, output, record in RECORDS}

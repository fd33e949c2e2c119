"""The mapping between the rollout's tensors and vLLM's requests: :class:`~lit_rlhf.rollout.GenerationSettings`
-> ``vllm.SamplingParams`` (one request per prompt, ``n = K``), and vLLM's outputs -> :class:`Responses`.

Shapes: B rows (G prompts x K samples, each prompt's K rows contiguous), P prompt length (left-padded),
T response length (right-padded).
"""

from __future__ import annotations

from typing import Any

import torch

from lit_rlhf.engines.base import Responses, truncated_rows
from lit_rlhf.engines.vllm_processor import kept_mass_lookup, warp_args
from lit_rlhf.models.prefill import is_grouped

__all__ = ["PAD_LOGIT_BIAS", "responses_from_outputs", "sampling_requests"]

# greedy decoding: vLLM clamps a logit bias to [-100, 100], enough to keep the pad token from the argmax
# (sampling suppresses it in HFWarpProcessor, with -inf)
PAD_LOGIT_BIAS = -100.0
_SEED_RANGE = 2**31 - 1


def sampling_requests(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, settings: Any, tokenizer: Any, greedy: bool
) -> tuple[list[dict[str, list[int]]], list[Any], int]:
    """vLLM prompts and sampling parameters for (B, P) left-padded rows.

    Rows that come in contiguous groups of K = ``settings.num_samples`` copies of one prompt become one
    request with ``n = K`` (the K samples share the prompt's prefill and cache); other rows one request
    each. Each request gets a seed drawn from torch's global generator (greedy decoding draws none), so a
    seeded run repeats and a resumed one continues the same stream.

    Returns:
        requests: ``[{"prompt_token_ids": [...]}, ...]`` without the padding; params: one
        ``SamplingParams`` per request; n: responses per request (K or 1).
    """
    from vllm import SamplingParams

    K = settings.num_samples
    grouped = K > 1 and prompt_ids.shape[0] % K == 0 and is_grouped(prompt_ids, prompt_mask, K)
    n = K if grouped else 1
    rows = range(0, prompt_ids.shape[0], n)
    requests = [{"prompt_token_ids": prompt_ids[i][prompt_mask[i].bool()].tolist()} for i in rows]
    seeds = [None] * len(requests) if greedy else torch.randint(0, _SEED_RANGE, (len(requests),)).tolist()
    common = dict(
        n=n, max_tokens=settings.max_new_tokens,
        stop_token_ids=[tokenizer.eos_token_id, *settings.stop_token_ids],
        stop=list(settings.stop_strings) or None, detokenize=bool(settings.stop_strings),
    )  # fmt: skip
    if greedy:
        sampling = dict(temperature=0.0, logit_bias={tokenizer.pad_token_id: PAD_LOGIT_BIAS})
    else:  # vLLM samples plainly from the logits HFWarpProcessor warped (see vllm_processor)
        sampling = dict(temperature=1.0, top_k=0, top_p=1.0, logprobs=0,
                        extra_args=warp_args(settings, tokenizer.pad_token_id))  # fmt: skip
    params = [SamplingParams(**common, **sampling, seed=seed) for seed in seeds]
    return requests, params, n


def responses_from_outputs(
    outputs: list[Any],
    requests: list[dict[str, list[int]]],
    n: int,
    settings: Any,
    tokenizer: Any,
    greedy: bool,
    device: torch.device,
) -> Responses:
    """vLLM's ``RequestOutput`` list (one per request of ``requests``, ``n`` completions each, in request
    order) as the Hugging Face engine's ``Responses``: (B, T) ids padded with the pad id after each
    response, the mask of its tokens (up to and including the stop id), truncated = no stop id within
    ``max_new_tokens`` and no stop string completed by the last token (``truncated_rows``), the sampled
    tokens' log-probs under the distribution they were drawn from and the log of the tempered mass that
    distribution kept (from ``vllm_processor.RECORDS``; both None when greedy).

    Raises:
        RuntimeError: vLLM returned fewer completions or log-probs than asked, or a step's kept mass was
            not recorded.
    """
    completions = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
    if len(completions) != len(outputs) * n:
        raise RuntimeError(f"vLLM returned {len(completions)} completions for {len(outputs)} requests of n={n}")
    B = len(completions)
    T = max(1, max(len(c.token_ids) for c in completions))
    ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = None if greedy else torch.zeros(B, T, dtype=torch.float32)
    log_kept_mass = None if greedy else torch.zeros(B, T, dtype=torch.float32)
    kept = {} if greedy else kept_mass_lookup()
    for row, c in enumerate(completions):
        tokens = list(c.token_ids)
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, : len(tokens)] = True
        if logprobs is not None:
            if c.logprobs is None or len(c.logprobs) != len(tokens):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens (logprobs=0 was asked)")
            logprobs[row, : len(tokens)] = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)])
            record = kept.get((tuple(requests[row // n]["prompt_token_ids"]), tuple(tokens)), {})
            if any(t not in record for t in range(len(tokens))):
                raise RuntimeError(f"VLLMEngine: the kept mass of response {row} was not recorded at every step")
            log_kept_mass[row, : len(tokens)] = torch.tensor([record[t] for t in range(len(tokens))])
    stop_ids = torch.tensor([tokenizer.eos_token_id, *settings.stop_token_ids])
    has_stop = (torch.isin(ids, stop_ids) & mask).any(dim=1)  # (B,)
    # a stop string completed by the last allowed token ends a row at full length without a stop id
    truncated = truncated_rows(ids, mask, has_stop, settings.max_new_tokens, settings.stop_strings, tokenizer)
    to = dict(device=device)
    return Responses(
        ids.to(**to), mask.to(**to), truncated.to(**to),
        logprobs=None if logprobs is None else logprobs.to(**to),
        log_kept_mass=None if log_kept_mass is None else log_kept_mass.to(**to),
    )  # fmt: skip

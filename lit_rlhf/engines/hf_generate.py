"""Response generation with Hugging Face ``generate`` (KV cache on), with the behaviour log-probs.

Every sampled token's log-prob under the distribution it was drawn from (temperature, top-k, top-p, as
``generate`` warps) comes from the scores that drew it: the sampler is a logits processor that records it
(``lit_rlhf.models.sampling``), so no forward is added. Greedy decoding has none. Where it can stand in
(``generation.decode_loop``), the lean loop of ``lit_rlhf.engines.lean_decode`` runs ``generate``'s forwards
and draws with less work per step: the same tokens and log-probs under the same seed.

Shapes: B rows (prompts x K samples, each prompt's K rows contiguous), P prompt length (left-padded),
T response length (right-padded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from lit_rlhf.engines.base import Responses, truncated_rows
from lit_rlhf.engines.lean_decode import lean_decode, lean_unsupported
from lit_rlhf.guards import NonFiniteError
from lit_rlhf.models import position_ids_from_mask
from lit_rlhf.models.decoding import cached_autocast_casts, decoding_lm_head, output_vocab_size
from lit_rlhf.models.prefill import cache_argument, is_grouped, prefill_groups
from lit_rlhf.models.sampling import (
    BehaviourRecorder,
    InverseCDFSampler,
    MultinomialRecorder,
    resolve_sampler,
)

if TYPE_CHECKING:  # lit_rlhf.rollout re-exports this module's functions
    from transformers import DynamicCache

    from lit_rlhf.rollout import GenerationSettings

__all__ = ["generate_responses", "generation_kwargs", "response_mask_from_tokens", "rollout_generation_config"]


def response_mask_from_tokens(
    responses: torch.Tensor, stop_token_ids: list[int], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real response tokens: up to and including the first stop token, never padding.

    Args:
        responses: (B, T) generated token ids (``generate`` pads finished rows with ``pad_token_id``).
        stop_token_ids: ids that end a response (EOS and configured stops).
        pad_token_id: the tokenizer's dedicated pad id (it is suppressed during sampling).

    Returns:
        response_mask: (B, T) bool, 1 = real token.
        has_stop: (B,) bool, True where the response contains a stop token.
    """
    is_stop = torch.isin(responses, torch.tensor(stop_token_ids, device=responses.device))
    stops_before = torch.cumsum(is_stop.int(), dim=1) - is_stop.int()
    response_mask = (stops_before == 0) & (responses != pad_token_id)
    return response_mask, is_stop.any(dim=1)


class ResponseStopStrings(StoppingCriteria):
    """``transformers``' ``StopStringCriteria`` on the response columns only.

    ``generate(stop_strings=...)`` matches on the whole sequence, prompt included: a stop string that straddles
    the prompt's end ("\\n\\n" after a prompt ending in "\\n", as chat generation prompts do) ended a response
    after its first token, which holds no match. vLLM matches in the generated text alone; so does this.
    """

    def __init__(self, tokenizer: object, stop_strings: list[str], prompt_length: int) -> None:
        self.inner, self.prompt_length = StopStringCriteria(tokenizer, stop_strings), prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.inner(input_ids[:, self.prompt_length :], scores, **kwargs)  # (B,)

    @classmethod
    def criteria(cls, tokenizer: object | None, stop_strings: list[str], prompt_length: int) -> StoppingCriteriaList | None:
        """The ``stopping_criteria`` of a rollout with ``stop_strings`` (None without them)."""
        if not stop_strings:
            return None
        if tokenizer is None:
            raise ValueError("generation.stop_strings needs the tokenizer that decodes the responses")
        return StoppingCriteriaList([cls(tokenizer, list(stop_strings), prompt_length)])


def generation_kwargs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationSettings,
    stop_ids: list[int],
    pad_token_id: int,
    tokenizer: object | None = None,
    synced_gpus: bool = False,
    greedy: bool = False,
    vocab_size: int | None = None,
) -> dict:
    """Keyword arguments of ``model.generate`` for one rollout (see :func:`generate_responses`).

    Position ids are given explicitly, computed from the mask as the scoring forwards do: some models
    (GPT-2) otherwise generate left-padded rows at shifted positions, so the sampling distribution
    would differ from the one ``old_logprobs`` are computed under. ``greedy`` decodes by argmax (an
    evaluation setting; the sampling fields of ``settings`` are then not passed).

    Sampling warps the scores in the last logits processor, a ``BehaviourRecorder`` that records each
    drawn token's log-prob: by inverse CDF (``settings.sampler``; ``vocab_size``: the model's, for the
    ``"auto"`` sampler) an ``InverseCDFSampler`` in a greedy ``generate``, whose argmax takes the token it
    drew; by multinomial a ``MultinomialRecorder`` in ``generate(do_sample=True)`` with ``generate``'s own
    warpers off, whose scores are those ``generate(do_sample=True, temperature=..., top_k=..., top_p=...)``
    would sample (same warpers, same order, after the same processors), so the same tokens are drawn.
    """
    off = dict(temperature=None, top_k=None, top_p=None)
    if greedy:
        sampling = dict(do_sample=False, **off)
    else:
        # drawn from the last logits processor's scores, after generate's own ones (the suppressed pad, ...)
        inverse_cdf = resolve_sampler(settings.sampler, input_ids.device, vocab_size) == "inverse_cdf"
        # the recorder suppresses the pad token itself (generate would, before it): see BehaviourRecorder
        recorder = (InverseCDFSampler if inverse_cdf else MultinomialRecorder)(
            settings.temperature, settings.top_k, settings.top_p, suppress_ids=[pad_token_id],
            entropy=settings.record_entropy,
        )
        sampling = dict(do_sample=not inverse_cdf, **off, logits_processor=LogitsProcessorList([recorder]))
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        max_new_tokens=settings.max_new_tokens,
        **sampling,
        eos_token_id=stop_ids,
        pad_token_id=pad_token_id,
        suppress_tokens=[pad_token_id] if greedy else None,
        stopping_criteria=ResponseStopStrings.criteria(tokenizer, settings.stop_strings, input_ids.shape[1]),
        use_cache=True,
        synced_gpus=synced_gpus,
    )


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: GenerationSettings,
    *,
    eos_token_id: int,
    pad_token_id: int,
    tokenizer: object | None = None,
    synced_gpus: bool = False,
    greedy: bool = False,
    group_size: int = 1,
) -> Responses:
    """Sample one response per row of left-padded prompts (the caller repeats a prompt for K samples).

    Args:
        model: causal LM (or peft model) with ``generate``.
        input_ids: (B, P) left-padded prompts; attention_mask: (B, P).
        settings: sampling settings.
        eos_token_id, pad_token_id: the tokenizer's ids; pad is never sampled.
        tokenizer: needed by ``generate`` only when ``settings.stop_strings`` is set.
        synced_gpus: keep every rank generating until all are done (sharded models hang otherwise).
        greedy: argmax decoding instead of sampling (evaluation only: a rollout must be sampled).
        group_size: K when the rows come in contiguous groups of K copies of one prompt (what
            ``expand_prompts`` of the online modules builds); the prefill is then shared per group where
            ``settings.shares_prefill`` says so.

    Returns:
        ``Responses`` (``lit_rlhf.engines.base``), T <= max_new_tokens; logprobs and log_kept_mass None when
        greedy, entropy None unless ``settings.record_entropy`` (and greedy), loss_mask None. The pad token is never sampled (probability 0): its tempered mass counts as
        not kept, like a truncation's, so ``logprobs + log_kept_mass`` is still the token's log-prob under
        the whole tempered distribution, the one a scoring forward computes.

    Raises:
        ValueError: ``group_size`` does not describe the rows (when the prefill is shared), or
            ``settings.decode_loop="lean"`` where the lean loop is not supported.
    """
    stop_ids = [eos_token_id, *settings.stop_token_ids]
    kwargs = generation_kwargs(
        input_ids, attention_mask, settings, stop_ids, pad_token_id, tokenizer, synced_gpus, greedy,
        vocab_size=output_vocab_size(model),
    )  # fmt: skip
    recorder = next((p for p in kwargs.get("logits_processor", ()) if isinstance(p, BehaviourRecorder)), None)
    cache = None
    if settings.shares_prefill(group_size, input_ids.shape[1], synced_gpus):
        cache = _shared_prefill(model, input_ids, attention_mask, group_size)
        if cache is not None:
            # generate continues from it: only the last prompt column is run
            kwargs[cache_argument(model)] = cache
    with rollout_generation_config(model):  # the model file's processors (repetition_penalty, ...) stay out
        lean = _uses_lean_loop(model, kwargs, settings.decode_loop)
        head = decoding_lm_head(model, settings.decoding_head, rows=input_ids.shape[0])
        with head, cached_autocast_casts(model), _named_nonfinite_draws():
            if lean:
                responses = lean_decode(
                    model, input_ids, attention_mask, max_new_tokens=settings.max_new_tokens, stop_ids=stop_ids,
                    pad_token_id=pad_token_id, recorder=recorder, cache=cache,
                    drop_finished=settings.drops_finished(input_ids.device),
                )  # fmt: skip
            else:
                responses = model.generate(**kwargs)[:, input_ids.shape[1] :]
    return _responses(responses, stop_ids, pad_token_id, settings, recorder, tokenizer)


@contextmanager
def _named_nonfinite_draws() -> Iterator[None]:
    """``torch.multinomial``'s error on a NaN/inf distribution as the inverse-CDF sampler's ``NonFiniteError``."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        raise NonFiniteError(
            f"sampling: the next-token distribution is not finite ({err}): the policy's logits hold NaN or inf;"
            " are its weights finite?"
        ) from err


# the model generation_config fields a rollout keeps: token ids (generate's eos_token_id is set per call to the
# rollout's stop ids, which include the config's further stops: online_generation.with_model_stops)
_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@contextmanager
def rollout_generation_config(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model``'s ``generation_config`` holds its token ids only (:data:`_ID_FIELDS`).

    ``generate`` fills every field a call leaves unset from the model's ``generation_config``, even into a
    ``generation_config`` argument (``GenerationMixin._prepare_generation_config``, ``defaults_only``): a model
    file's ``repetition_penalty`` (Qwen2.5-Instruct ships 1.05), ``no_repeat_ngram_size``, ``min_new_tokens``,
    ``bad_words_ids``, ... would add logits processors, and the rollout would not be sampled from the policy
    the trainer scores. The rollout's own settings come as ``generate``'s arguments (:func:`generation_kwargs`);
    the model keeps its file for evaluation and export. The config is swapped on the module that holds it (the
    base model under peft or an FSDP1 wrapper).
    """
    owner = next((m for m in model.modules() if "generation_config" in vars(m)), None)
    original = None if owner is None else owner.generation_config
    if original is None:
        yield
        return
    owner.generation_config = GenerationConfig(**{k: getattr(original, k, None) for k in _ID_FIELDS})
    try:
        yield
    finally:
        owner.generation_config = original


def _uses_lean_loop(model: torch.nn.Module, kwargs: dict, decode_loop: str) -> bool:
    """Whether ``settings.decode_loop`` runs the lean loop for ``model.generate(**kwargs)``.

    Raises:
        ValueError: ``decode_loop="lean"`` where the lean loop cannot stand in for ``generate``.
    """
    if decode_loop == "generate":
        return False
    reason = lean_unsupported(model, kwargs)
    if reason is not None and decode_loop == "lean":
        raise ValueError(f"generation.decode_loop='lean' cannot run here: {reason}; use 'auto' or 'generate'")
    return reason is None


def _responses(
    responses: torch.Tensor,
    stop_ids: list[int],
    pad_token_id: int,
    settings: GenerationSettings,
    recorder: BehaviourRecorder | None,
    tokenizer: object | None,
) -> Responses:
    """(B, T) generated ids -> the ``Responses`` of :func:`generate_responses`, with the behaviour
    log-probs of the sampling ``recorder`` (None: greedy decoding, no log-probs)."""
    response_mask, has_stop = response_mask_from_tokens(responses, stop_ids, pad_token_id)
    # A row without a stop id that ended early was stopped by a stop string; one at full length may have
    # been too (on its last allowed token): truncated_rows decodes those.
    truncated = truncated_rows(
        responses, response_mask, has_stop, settings.max_new_tokens, settings.stop_strings, tokenizer
    )
    if recorder is None:
        return Responses(responses, response_mask, truncated)
    logprobs, log_kept_mass, entropy = recorder.behaviour(responses)  # (B, T) each (entropy or None)
    zero = logprobs.new_zeros(())
    return Responses(
        responses, response_mask, truncated,
        logprobs=torch.where(response_mask, logprobs, zero),
        log_kept_mass=torch.where(response_mask, log_kept_mass, zero),
        entropy=None if entropy is None else torch.where(response_mask, entropy, zero),
    )  # fmt: skip


def _shared_prefill(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int
) -> DynamicCache | None:
    """The KV cache of each group's prompt prefilled once and repeated for its ``group_size`` rows
    (``lit_rlhf.models.prefill.prefill_groups``; None where the model's cache cannot be shared).

    Raises:
        ValueError: the rows are not contiguous groups of ``group_size`` copies of one prompt.
    """
    if not is_grouped(input_ids, attention_mask, group_size):
        raise ValueError(
            f"generate_responses: group_size={group_size}, but the {input_ids.shape[0]} prompt rows are "
            f"not contiguous groups of {group_size} copies of one prompt"
        )
    return prefill_groups(model, input_ids, attention_mask, group_size)

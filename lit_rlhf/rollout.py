"""The experience of one online-RL rollout (``Rollout``) and the generation settings of a rollout.

The replay buffer over it is ``lit_rlhf.replay``; response generation lives in ``lit_rlhf.engines``
(``hf_generate``'s functions are re-exported here).

Shapes: B rollout rows, P prompt length (left-padded), T response length (right-padded).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from lit_rlhf.batching import trim_prompt_response
from lit_rlhf.models.decoding import DECODING_HEADS
from lit_rlhf.models.sampling import SAMPLERS
from lit_rlhf.settings import Settings

GROUP_PREFILL_CHOICES = ("auto", "always", "never")
DECODE_LOOP_CHOICES = ("auto", "lean", "generate")
DROP_FINISHED_CHOICES = ("auto", "always", "never")
# "auto" shares the prefill from this padded prompt width on (measured with scripts/bench/prefill_bench.py)
GROUP_PREFILL_MIN_PROMPT_TOKENS = 32


@dataclass
class GenerationSettings(Settings):
    """Sampling settings of the rollout (Hugging Face ``generate``, KV cache on).

    Attributes:
        max_new_tokens: response length limit T; a response that reaches it without a stop token is
            "truncated" (see ``missing_eos_penalty`` of the PPO module).
        temperature: softmax temperature of sampling; the PPO update divides logits by the same value so
            ``old_logprobs`` and the new log-probs describe the same distribution.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
        stop_token_ids: extra token ids that end a response besides the tokenizer's EOS.
        stop_strings: strings that end a response (matched on decoded text by ``generate``); a response
            that one ends on its last allowed token is not truncated.
        num_samples: K responses sampled per prompt (K >= 1); the rollout holds prompts x K rows, each
            prompt's K rows contiguous. Group estimators (GRPO, RLOO, ...) need K >= 2. None (default, or
            left out of a dict or config) = the module's default K (:meth:`with_default_samples`): 4 for
            ``CriticFreeModule``, 2 for ``OnlineDPOModule``, 1 for ``PPOModule`` and wherever the settings
            are used outside a module (``num_samples`` reads 1 then); a value given, 1 included, is kept.
        group_prefill: compute each prompt's prefill once for its K samples and repeat its KV cache K times
            (``lit_rlhf.models.prefill``): ``"auto"`` (default) where it pays, K >= 2 and prompts padded to
            at least ``GROUP_PREFILL_MIN_PROMPT_TOKENS``; ``"always"`` whenever K >= 2; ``"never"`` off. The
            responses are those of the unshared generation (same logits up to float rounding, same random
            draws). Multi-rank runs (``synced_gpus``) and models whose KV cache is not a plain
            ``DynamicCache`` always generate unshared.
        sampler: how a token is drawn from the warped distribution (``lit_rlhf.models.sampling``):
            ``"inverse_cdf"`` one uniform per row, the first token whose cumulative probability reaches it
            (``InverseCDFSampler`` as the last logits processor of a greedy ``generate``); ``"multinomial"``
            ``generate``'s own ``torch.multinomial`` (one exponential variate per vocabulary entry on CPU);
            ``"auto"`` (default) inverse CDF on CPU for vocabularies of at least ``INVERSE_CDF_MIN_VOCAB``
            (8,192) entries, where it is faster (~5 ms less per decoding step of 8 rows x 32,000 tokens),
            multinomial below that and on other devices. Both draw from the same distribution; the
            random draws, hence the tokens under a seed, differ.
        decoding_head: the layout of the LM head's weight during generation on CPU, made once per call
            (``lit_rlhf.models.decoding``: the BLAS otherwise repacks the (V, H) weight at every decoding
            step, as long as the product itself): ``"packed"`` oneDNN's blocked layout for few-row products
            (float32 on x86-64; 1.7-3x faster than the transposed copy at 3-8 rows, 1.3-1.5x at 32-64;
            logits equal to float rounding, <= 8.1e-6 in the measured cases), ``"transposed"`` a (H, V) copy
            (the same products as ``nn.Linear``), ``"auto"`` (default) packed where oneDNN can pack the head
            and the call has at least 3 rows, transposed otherwise (and always under autocast, cast to its
            dtype once),
            ``"plain"`` the head as it is. Only for plain heads of at least 2**20 weights; ``generate`` and
            the lean loop multiply by the same layout, so they draw the same tokens. Replaces the earlier
            ``transposed_head`` (true: ``"transposed"``, false: ``"plain"``; mapped when a config or
            checkpoint still has it).
        decode_loop: which loop decodes (``lit_rlhf.engines.lean_decode``): ``"auto"`` (default) the lean
            loop where it can stand in for ``generate`` (the same forwards and random draws, hence the same
            tokens and behaviour log-probs, without ``generate``'s per-step cache concatenation, copies and
            processor lists), else ``generate``; ``"lean"`` the lean loop or an error saying why not (stop
            strings, multi-rank ``synced_gpus``, ...; a model ``generation_config``'s processors never apply to
            a rollout: ``engines.hf_generate.rollout_generation_config``);
            ``"generate"`` Hugging Face ``generate`` always.
        drop_finished: in the lean loop, drop rows that have stopped from the batch the decoding forwards
            run (their KV cache too), where a row's logits do not depend on which other rows share the
            batch: ``"auto"`` (default) on CPU, where a decoding step's cost grows with its rows (W1:
            ~10 ms at 8 rows, ~7 at 4); ``"always"`` on any device; ``"never"`` every row runs until all
            have stopped, as in ``generate``. The same tokens and random draws (a dropped row would only
            have drawn tokens replaced by pad); greedy decoding and the inverse-CDF sampler only
            (``torch.multinomial``'s draws depend on the batch's shape); the batch keeps at least the rows
            from which a probe of the model's products on this machine finds each row rounded as in the
            whole batch (``engines.lean_decode.min_rows``: 2 or more).
        record_entropy: the sampler also records each step's entropy of the whole tempered distribution
            (``Responses.entropy``; one more softmax over the vocabulary a step). The online modules set it
            for the rollouts whose old log-probs come from the sampler (``scoring.old_logprobs``); engines
            that cannot tell leave ``Responses.entropy`` None.
    """

    group: ClassVar[str] = "generation"

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    num_samples: int | None = None
    group_prefill: str = "auto"
    sampler: str = "auto"
    decoding_head: str = "auto"
    decode_loop: str = "auto"
    drop_finished: str = "auto"
    record_entropy: bool = False

    def __post_init__(self) -> None:
        self.check_types()  # max_new_tokens 4.0 from a computed value would fail late
        # not a field (no config or checkpoint holds it): whether a module may put its own default K here
        self._num_samples_unset = self.num_samples is None
        if self.num_samples is None:
            self.num_samples = 1
        self.require_finite("temperature")  # NaN passes every comparison below; inf samples uniformly
        # a bare string would be read character by character, and "" ends every response at once
        ok = isinstance(self.stop_strings, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop_strings)
        self.require("stop_strings", ok, "a list of non-empty strings")
        ok = isinstance(self.stop_token_ids, (list, tuple)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        )
        self.require("stop_token_ids", ok, "a list of token ids (integers >= 0)")
        self.stop_strings, self.stop_token_ids = list(self.stop_strings), [int(t) for t in self.stop_token_ids]
        if self.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"generation.temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generation.top_k must be >= 0, got {self.top_k}")
        if self.num_samples < 1:
            raise ValueError(f"generation.num_samples must be >= 1, got {self.num_samples}")
        if self.group_prefill not in GROUP_PREFILL_CHOICES:
            raise ValueError(
                f"generation.group_prefill must be one of {list(GROUP_PREFILL_CHOICES)}, got {self.group_prefill!r}"
            )
        if self.decode_loop not in DECODE_LOOP_CHOICES:
            raise ValueError(
                f"generation.decode_loop must be one of {list(DECODE_LOOP_CHOICES)}, got {self.decode_loop!r}"
            )
        if self.drop_finished not in DROP_FINISHED_CHOICES:
            raise ValueError(
                f"generation.drop_finished must be one of {list(DROP_FINISHED_CHOICES)}, got {self.drop_finished!r}"
            )
        if self.decoding_head not in DECODING_HEADS:
            raise ValueError(
                f"generation.decoding_head must be one of {list(DECODING_HEADS)}, got {self.decoding_head!r}"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(f"generation.sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")

    @property
    def num_samples_unset(self) -> bool:
        """Whether ``num_samples`` was left unset (None), so that it reads 1 until a module puts its default K."""
        return getattr(self, "_num_samples_unset", False)  # False: unpickled from before the attribute

    def with_default_samples(self, k: int) -> GenerationSettings:
        """These settings with ``num_samples`` = ``k`` where it was left unset, else themselves (a given K is
        kept). ``dataclasses.replace`` of unset settings gives settings with K = 1 given: resolve first."""
        return replace(self, num_samples=k) if self.num_samples_unset else self

    @classmethod
    def default_samples(cls, value: Any, k: int) -> Any:
        """The ``generation`` argument of a module whose default K is ``k``, as a user passes it (None, a dict
        of fields or an instance), with ``num_samples`` = ``k`` where it leaves that unset (missing or None);
        other values unchanged (:meth:`coerce` names what is wrong with them)."""
        if value is None:
            return cls(num_samples=k)
        if isinstance(value, Mapping) and value.get("num_samples") is None:
            return {**value, "num_samples": k}
        if isinstance(value, cls):
            return value.with_default_samples(k)
        return value

    @classmethod
    def migrate(cls, values: dict) -> dict:
        """``transposed_head`` (a bool, before ``decoding_head``): true the transposed copy, false the plain
        head, as it multiplied then (so a resumed run draws as before); ``decoding_head`` wins if both."""
        if "transposed_head" in values:
            values = dict(values)
            values.setdefault("decoding_head", "transposed" if values.pop("transposed_head") else "plain")
        return values

    def drops_finished(self, device: torch.device | str) -> bool:
        """Whether the lean loop drops finished rows on ``device`` (see ``drop_finished``)."""
        return self.drop_finished == "always" or (
            self.drop_finished == "auto" and torch.device(device).type == "cpu"
        )

    def shares_prefill(self, group_size: int, prompt_length: int, synced_gpus: bool = False) -> bool:
        """Whether rows in groups of ``group_size`` prompt copies of padded width ``prompt_length`` are
        generated from one prefill per group (see ``group_prefill``).

        Never under ``synced_gpus``: ranks whose prompts differ in width could take different paths and
        run different numbers of sharded forwards.
        """
        if self.group_prefill == "never" or synced_gpus or group_size < 2 or prompt_length < 2:
            return False
        return self.group_prefill == "always" or prompt_length >= GROUP_PREFILL_MIN_PROMPT_TOKENS


@dataclass
class Rollout:
    """One rollout's experience (the PPO batch of Ouyang et al. 2022, arXiv:2203.02155), detached, on one device.

    A critic-free rollout has no ``old_values`` and ``returns`` (None), and ``rewards`` only where the
    estimator shapes per-token rewards (REINFORCE++).

    Two masks: ``response_mask`` says which response tokens exist (the attention, with the prompt's part in
    ``attention_mask``), ``loss_mask`` which of them the policy emitted and learns from. In a single-turn
    rollout they are equal; a multi-turn one has holes in ``loss_mask`` where tool or environment tokens
    are, which are attended to but get no ratio, KL, entropy or advantage. Every loss, KL, advantage,
    whitening and metric uses ``loss_mask``.

    Attributes:
        input_ids: (B, P+T) prompt (left-padded) followed by the response (right-padded).
        attention_mask: (B, P+T) 1 on real prompt and response tokens.
        response_mask: (B, T) 1 on real response tokens (up to and including the stop token).
        old_logprobs: (B, T) float32 log pi_old(a_t | s_t) of the rollout policy (used by the ratio).
        ref_logprobs: (B, T) float32 log pi_ref(a_t | s_t) (used only by the KL penalty).
        old_values: (B, T) float32 critic values V(s_t) at rollout time.
        rewards: (B, T) float32 KL-shaped per-token rewards (score at the last real token).
        advantages: (B, T) float32 GAE advantages (whitened when configured).
        returns: (B, T) float32 GAE returns = advantages (before whitening) + old_values.
        scores: (B,) float32 sequence-level reward-model / reward-function scores.
        rows: (B,) long, the rows of the buffered rollout these rows are (set by
            ``ReplayBuffer.minibatches``, so a loss can write per-row outputs back; None as built).
        loss_mask: (B, T) bool, the tokens learned from (None as built = ``response_mask``).
        behavior_logprobs: (B, T) float32 log-probs of the tokens under the distribution the engine
            sampled them from (``lit_rlhf.engines.Responses.logprobs``; None when the engine gives none).
        is_weights: (B, T) float32 weights of the engine/trainer importance-sampling correction of each
            learned token's policy-gradient loss, 0 off ``loss_mask`` (``functional.is_correction_weights``,
            computed once per rollout; None = no correction).

    ``old_logprobs`` is None when the update computes them: one on-policy optimiser step per rollout,
    see :class:`UpdateRecord`.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor | None
    rewards: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    scores: torch.Tensor
    rows: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    behavior_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.bool()

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        """P: the response starts at this column of ``input_ids``."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    def select(self, index: torch.Tensor | slice) -> Rollout:
        """The rows ``index`` of every field."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{name: v[index] for name, v in values.items() if v is not None})

    def trim(self) -> Rollout:
        """The rollout without the columns that are padding in every row (leading prompt padding,
        trailing response padding). Log-probs, values and losses are unchanged: positions come from the
        mask, and the dropped columns are masked out of every row."""
        return self.crop(*trim_prompt_response(self.attention_mask, self.response_mask.shape[1]))

    def crop(self, columns: slice, t: int) -> Rollout:
        """The ``columns`` of the (B, P+T) fields, which end with the first ``t`` response columns, and
        those ``t`` columns of the (B, T) fields."""
        trimmed = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value.dim() == 1:
                continue
            trimmed[f.name] = value[:, columns] if f.name in ("input_ids", "attention_mask") else value[:, :t]
        return replace(self, **trimmed)


# Re-exported from their new home, imported last: lit_rlhf.engines may import this module's classes.
from lit_rlhf.engines.hf_generate import (  # noqa: E402
    generate_responses,
    generation_kwargs,
    response_mask_from_tokens,
)

__all__ = [
    "DECODE_LOOP_CHOICES",
    "DROP_FINISHED_CHOICES",
    "GROUP_PREFILL_CHOICES",
    "GROUP_PREFILL_MIN_PROMPT_TOKENS",
    "GenerationSettings",
    "Rollout",
    "generate_responses",
    "generation_kwargs",
    "response_mask_from_tokens",
]

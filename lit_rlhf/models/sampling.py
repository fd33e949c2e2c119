"""Token sampling inside Hugging Face ``generate``, and the behaviour log-prob of every drawn token.

``generate(do_sample=True)`` draws each token with ``torch.multinomial``, which on CPU draws one
exponential variate per vocabulary entry (``argmax(probs / Exponential(1))``): ~5 ms per decoding step
for 8 rows of a 32,000-token vocabulary, a fifth of a small model's generation time. Inverse-CDF sampling
needs one uniform per row: the first token whose cumulative probability reaches ``u ~ U(0, total]``
(~0.3 ms for the same rows). It runs inside greedy ``generate`` (``do_sample=False``):
:class:`InverseCDFSampler` warps the scores with Hugging Face's own warpers (temperature, top-k, top-p, in
``generate``'s order), draws the token and returns scores whose argmax is that token, which the greedy
step then takes. Every other processor of ``generate`` (the suppressed pad token, minimum lengths, ...)
runs before it, as it runs before the warpers when sampling.

Both samplers record, per decoding step, the log-prob of the drawn token under the distribution it was
drawn from (the warped one: tempered, truncated, renormalised over the kept tokens) and the log of the
mass the truncation kept of the tempered distribution, from the scores that drew the token (no extra
forward). :class:`MultinomialRecorder` does it for ``generate``'s own multinomial draw: it applies the
warpers itself as the last processor of ``generate(do_sample=True)`` (with ``generate``'s own warpers
off), so it sees the scores ``torch.multinomial`` draws from, and reads each drawn token from
``input_ids`` at the next step. :meth:`BehaviourRecorder.behaviour` stacks the record after ``generate``.

With ``entropy=True`` they also record each step's entropy of the whole tempered distribution (before the
pad's suppression and any truncation): what a scoring forward's entropy is, so an online module whose old
log-probs come from the sampler (``scoring.old_logprobs``) needs no actor forward for its rollout entropy.

Shapes: B rows, V vocabulary entries, N decoding steps, T response length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from lit_rlhf.functional import entropy_from_logits
from lit_rlhf.guards import NonFiniteError

SAMPLERS = ("auto", "inverse_cdf", "multinomial")
# "auto" samples by inverse CDF from this vocabulary size on (CPU): 8 rows x 32,000 entries cost 5.3 ms
# per step with torch.multinomial, 0.3 ms by inverse CDF; below it the gap is a small share of a step.
INVERSE_CDF_MIN_VOCAB = 8192


def inverse_cdf_sample(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row, drawn with probability ``probs[b, i] / probs[b].sum()``.

    The first index whose cumulative probability reaches ``u``, with ``u`` uniform on ``(0, total]``. A
    zero-probability token ``i`` has ``cdf[i] == cdf[i - 1]``, so it is never the first to reach ``u``;
    ``u > 0`` skips leading zeros and ``u <= total`` always finds a token. On CPU the float32 cumulative
    sum accumulates in float64 in order, so ``cdf`` is exactly non-decreasing and flat over zeros: each
    token's probability is exact up to the float32 rounding of the CDF (a resolution of ~6e-8 of the row's
    mass, as a float32 uniform has). Other devices scan in parallel, so there the CDF is made non-decreasing
    and flat over zeros explicitly (a running maximum over the positive entries).

    Args:
        probs: (B, V) non-negative float weights, each row with a positive sum (normalised or not).
        generator: random generator of the uniforms (the global one by default).
        uniform: (B, 1) uniforms on [0, 1) already drawn (e.g. for a larger batch, of which these rows
            are some); None draws them here.

    Returns:
        (B,) int64 token ids.

    Raises:
        NonFiniteError: a row of ``probs`` holds NaN (the policy's logits were not finite), where
            ``torch.multinomial`` raises too.
    """
    cdf = probs.cumsum(dim=-1)  # (B, V)
    if probs.device.type != "cpu":
        cdf = torch.where(probs > 0, cdf, 0).cummax(dim=-1).values  # (B, V)
    if uniform is None:
        uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    u = (1 - uniform.to(cdf.dtype)) * cdf[:, -1:]  # (B, 1) in (0, total]
    tokens = torch.searchsorted(cdf, u).squeeze(1)  # (B,) first i with cdf[i] >= u
    if bool((tokens >= probs.shape[-1]).any()):  # a NaN weight: no cumulative sum reaches u
        rows = (tokens >= probs.shape[-1]).nonzero().flatten().tolist()
        raise NonFiniteError(
            f"sampling: the next-token distribution of {len(rows)} of {len(tokens)} rows is not finite (rows"
            f" {rows[:8]}{' ...' if len(rows) > 8 else ''}): the policy's logits hold NaN or inf; are its weights finite?"
        )
    return tokens


def log_normaliser(scores: torch.Tensor) -> torch.Tensor:
    """(B, V) scores -> (B,) ``logsumexp`` over V, from the fused softmax: ``max - log(max softmax)``.

    On CPU ``torch.logsumexp`` of 8 x 32,000 float32 scores takes ~0.2 ms, and ~0.75 ms when most of them are
    -inf (a top-k/top-p truncation: its ``exp`` is slow on -inf), against ~0.13 ms for this either way. The
    largest probability is at least 1/V, so its log is as exact as float32 allows (the result agrees with a
    float64 ``logsumexp`` to ~1e-6 at |scores| ~ 20). Each row needs a finite score.
    """
    return scores.amax(dim=-1) - scores.softmax(dim=-1).amax(dim=-1).log()


class BehaviourRecorder(LogitsProcessor):
    """The warpers of ``generate(do_sample=True)`` and a record of each drawn token's behaviour log-prob.

    The scores are warped as ``generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` warps them:
    its warper classes, in its order (temperature, then top-k, then top-p), on the scores every other
    processor of ``generate`` has processed (the suppressed pad token, ...). A subclass draws (or lets
    ``generate`` draw) the token from their softmax and records, per step, the drawn token's log-prob under
    it and, where a truncation is on, ``logsumexp`` of the kept tempered scores minus ``logsumexp`` of all
    of them. Per step this costs at most one reduction over (B, V) (:func:`log_normaliser`) for each
    normaliser the draw does not already give (see the subclasses): none for inverse-CDF sampling without a
    truncation, one with it or for multinomial sampling, two for truncated multinomial sampling. Only (B,)
    values are kept, and no scores beyond one step's.

    The tokens of ``suppress_ids`` (the pad token) are suppressed here rather than by ``generate`` (the same
    scores: -inf there, before the warpers), so that the kept mass also counts what they held: then
    ``logprob + log_kept_mass`` is the drawn token's log-prob under the whole tempered distribution, the one
    a scoring forward computes.

    Args:
        temperature: softmax temperature (> 0; 1.0 = off).
        top_k: keep only the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
        suppress_ids: token ids never drawn (probability 0), whose mass is counted as not kept.
        entropy: also record each step's (B,) entropy of the whole tempered distribution (one more softmax
            and reduction over (B, V) a step; :func:`lit_rlhf.functional.entropy_from_logits`).
    """

    def __init__(
        self,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        suppress_ids: Sequence[int] = (),
        entropy: bool = False,
    ) -> None:
        self.suppress_ids = list(suppress_ids)
        self.records_entropy = entropy
        if temperature <= 0:
            raise ValueError(f"{type(self).__name__}: temperature must be > 0, got {temperature}")
        self.temperature = None if temperature == 1.0 else TemperatureLogitsWarper(float(temperature))
        self.truncation = LogitsProcessorList()
        if top_k:
            self.truncation.append(TopKLogitsWarper(int(top_k)))
        if top_p < 1.0:
            self.truncation.append(TopPLogitsWarper(top_p))
        tempering = [self.temperature] if self.temperature is not None else []
        self.warpers = LogitsProcessorList([*tempering, *self.truncation])  # generate's order
        self._logprobs: list[torch.Tensor] = []  # per step: (B,) log-prob of the drawn token
        self._log_kept_mass: list[torch.Tensor] = []  # per step: (B,), only with a truncation
        self._entropy: list[torch.Tensor] = []  # per step: (B,), only with entropy=True
        self._step_entropy: torch.Tensor | None = None  # the last _warp's (b,) entropy

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p is on."""
        return len(self.truncation) > 0

    @property
    def keeps_less(self) -> bool:
        """Whether some mass is not kept (a truncation or suppressed tokens; else the kept mass is 1)."""
        return self.truncates or bool(self.suppress_ids)

    def _warp(
        self, input_ids: torch.LongTensor | None, scores: torch.Tensor, inplace: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(B, V) processed scores -> (B, V) warped scores, (B,) logsumexp of the tempered scores after the
        suppression (None without a truncation: the warped scores are then those), and (B,) logsumexp of
        the suppressed tokens' tempered scores (None without ``suppress_ids``). ``inplace``: ``scores`` may
        be overwritten by the suppression (the same values as a copy's; the lean decoding loop's logits)."""
        if self.temperature is not None:
            scores = self.temperature(input_ids, scores)
            inplace = True  # a new tensor
        if self.records_entropy:  # of the whole tempered distribution, before the suppression
            self._step_entropy = entropy_from_logits(scores[:, None])[:, 0]  # (B,)
        suppressed = None
        if self.suppress_ids:  # as generate's SuppressTokensLogitsProcessor, after tempering (same scores)
            ids = torch.tensor(self.suppress_ids, device=scores.device)
            suppressed = scores.index_select(1, ids).logsumexp(dim=1)  # (B,)
            scores = (scores.index_fill_ if inplace else scores.index_fill)(1, ids, float("-inf"))  # (B, V)
        if not self.truncates:
            return scores, None, suppressed
        warped = scores
        for warper in self.truncation:  # what LogitsProcessorList runs, without its per-call signature checks
            warped = warper(input_ids, warped)
        return warped, log_normaliser(scores), suppressed

    def _record_kept_mass(
        self, log_kept: torch.Tensor, log_total: torch.Tensor | None, suppressed: torch.Tensor | None
    ) -> None:
        """Record log(kept mass) = logsumexp(kept) - logsumexp(all tempered scores, suppressed ones included)."""
        total = log_kept if log_total is None else log_total  # (B,) over the unsuppressed tokens
        if suppressed is not None:
            total = torch.logaddexp(total, suppressed)  # (B,)
        self._log_kept_mass.append(log_kept - total)

    def behaviour(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The record of one ``generate`` call, stacked, for its T response tokens; the record is cleared.

        Steps past the T columns (a deferred stop check that ``generate`` undid) are dropped.

        Args:
            tokens: (B, T) the tokens ``generate`` returned after the prompt.

        Returns:
            logprobs: (B, T) float32 log-prob of each token under the warped distribution it was drawn
                from (-inf where ``generate`` put a pad token after a row finished, as pad is suppressed).
            log_kept_mass: (B, T) float32 log of the tempered mass the truncation kept (0 without one).
            entropy: (B, T) float32 entropy of the whole tempered distribution at each step (None unless
                the recorder was built with ``entropy=True``).
        """
        t = tokens.shape[1]
        self._finish(tokens)
        if not 0 < t <= len(self._logprobs):
            raise RuntimeError(f"{type(self).__name__}: recorded {len(self._logprobs)} steps for {t} tokens")
        logprobs = torch.stack(self._logprobs[:t], dim=1).float()  # (B, T)
        if self.keeps_less:
            log_kept_mass = torch.stack(self._log_kept_mass[:t], dim=1).float()  # (B, T)
        else:
            log_kept_mass = torch.zeros_like(logprobs)
        entropy = torch.stack(self._entropy[:t], dim=1).float() if self.records_entropy else None  # (B, T)
        self._logprobs, self._log_kept_mass, self._entropy = [], [], []
        return logprobs, log_kept_mass, entropy

    def _finish(self, tokens: torch.Tensor) -> None:
        """Complete the record from the returned tokens (a subclass that learns its tokens late)."""


class InverseCDFSampler(BehaviourRecorder):
    """The last processor of a greedy ``generate``: samples the next token by inverse CDF.

    The scores are warped as ``generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` warps them
    (its warper classes, in its order: temperature, top-k, top-p), the token is drawn from their softmax
    with :func:`inverse_cdf_sample`, and the returned scores are the log of that draw's one-hot
    distribution (0 at the drawn token, -inf elsewhere), so the greedy argmax takes it.

    The behaviour log-prob is the log of the drawn token's softmax probability, and with a truncation the
    warped scores' normaliser is ``warped[token] - log p[token]``: no reduction over V beyond the softmax
    the draw needs, except the normaliser of the tempered scores when a truncation is on.

    Args:
        temperature: softmax temperature (> 0; 1.0 = off).
        top_k: keep only the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
    """

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) processed scores -> (B, V) 0 at each row's drawn token, -inf elsewhere."""
        tokens = self.draw(scores)  # (B,)
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens[:, None], 0.0)

    def draw(
        self,
        scores: torch.Tensor,
        inplace: bool = False,
        rows: torch.Tensor | None = None,
        batch_size: int | None = None,
    ) -> torch.Tensor:
        """(b, V) processed scores -> (b,) the drawn tokens, recorded (what :meth:`__call__` returns as
        one-hot scores; the lean decoding loop takes the tokens directly). ``inplace``: see ``_warp``.

        ``rows``: (b,) which rows of a batch of ``batch_size`` the scores are (the lean loop's unfinished
        rows, once it has dropped finished ones). The uniforms are then drawn for the whole batch, as they
        would be without the drop (the same random numbers for these rows, the same number consumed), and
        the record holds (batch_size,) values, 0 at the other rows."""
        warped, log_total, suppressed = self._warp(None, scores, inplace)  # (b, V), (b,) or None, (b,) or None
        probs = warped.softmax(dim=-1)  # (b, V)
        uniform = None
        if rows is not None:
            uniform = torch.rand(batch_size, 1, device=probs.device, dtype=probs.dtype)[rows]  # (b, 1)
        tokens = inverse_cdf_sample(probs, uniform=uniform)  # (b,)
        logprob = probs.gather(1, tokens[:, None]).squeeze(1).log()  # (b,)
        self._logprobs.append(_to_batch(logprob, rows, batch_size))
        if self.records_entropy:
            self._entropy.append(_to_batch(self._step_entropy, rows, batch_size))
        if self.keeps_less:
            log_kept = warped.gather(1, tokens[:, None]).squeeze(1) - logprob  # (b,) logsumexp(warped)
            self._record_kept_mass(log_kept, log_total, suppressed)
            self._log_kept_mass[-1] = _to_batch(self._log_kept_mass[-1], rows, batch_size)
        return tokens


def _to_batch(values: torch.Tensor, rows: torch.Tensor | None, batch_size: int | None) -> torch.Tensor:
    """(b,) values of ``rows`` -> (batch_size,) with 0 at the other rows (``values`` itself when rows is None)."""
    if rows is None:
        return values
    return values.new_zeros(batch_size).index_copy_(0, rows, values)  # (batch_size,)


class MultinomialRecorder(BehaviourRecorder):
    """The last processor of ``generate(do_sample=True)`` with ``generate``'s own warpers off: warps the
    scores that ``torch.multinomial`` then draws from, and records the drawn tokens' log-probs.

    ``generate`` applies its warpers after every user processor, so a recorder after them must be these
    warpers: with ``temperature``, ``top_k`` and ``top_p`` of ``generate`` left off, the scores sampled
    are exactly the ones ``generate(do_sample=True, temperature=..., top_k=..., top_p=...)`` samples
    (same classes, order and arguments), hence the same tokens under a seed. Per step: the normaliser
    (:func:`log_normaliser`) of the warped scores, for the token's log-prob, and with a truncation that of
    the tempered ones. The warped scores of the last step are kept until the next call, which reads the
    token drawn from them in ``input_ids[:, -1]`` (:meth:`behaviour` takes the last step's token from the
    output), so an instance serves one ``generate`` call at a time.

    Args:
        temperature: softmax temperature (> 0; 1.0 = off).
        top_k: keep only the k most likely tokens (0 = off).
        top_p: nucleus sampling mass (1.0 = off).
    """

    _pending: tuple[torch.Tensor, torch.Tensor] | None = None  # last step's (B, V) warped scores, (B,) lse

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        """(B, V) processed scores -> (B, V) warped scores (generate samples their softmax)."""
        self._take_pending(input_ids[:, -1])
        warped, log_total, suppressed = self._warp(input_ids, scores)  # (B, V), (B,) or None, (B,) or None
        if self.records_entropy:
            self._entropy.append(self._step_entropy)
        log_kept = log_normaliser(warped)  # (B,)
        if self.keeps_less:
            self._record_kept_mass(log_kept, log_total, suppressed)
        self._pending = (warped, log_kept)
        return warped

    def _take_pending(self, tokens: torch.Tensor) -> None:
        """Record the last step's log-prob of ``tokens`` (B,), the tokens drawn from its scores."""
        if self._pending is not None:
            warped, log_kept = self._pending
            self._logprobs.append(warped.gather(1, tokens[:, None]).squeeze(1) - log_kept)
            self._pending = None

    def _finish(self, tokens: torch.Tensor) -> None:
        if self._pending is not None and len(self._logprobs) < tokens.shape[1]:
            self._take_pending(tokens[:, len(self._logprobs)])
        self._pending = None


def resolve_sampler(sampler: str, device: torch.device, vocab_size: int | None = None) -> str:
    """The sampler ``"auto"`` stands for: ``"inverse_cdf"`` on CPU with a vocabulary of at least
    ``INVERSE_CDF_MIN_VOCAB`` entries (None: unknown, taken as large), where ``torch.multinomial``'s
    per-entry variates cost milliseconds a step; ``"multinomial"`` below it (a small share of a step, and
    runs keep transformers' own random draws) and on other devices (one fused kernel on CUDA; not
    measured against the inverse CDF there). Other names are returned as they are."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {sampler!r}")
    if sampler != "auto":
        return sampler
    large = vocab_size is None or vocab_size >= INVERSE_CDF_MIN_VOCAB
    return "inverse_cdf" if torch.device(device).type == "cpu" and large else "multinomial"

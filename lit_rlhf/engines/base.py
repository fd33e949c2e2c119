"""The rollout-engine protocol: what an online module asks of whatever generates its responses.

Shapes: B rows (prompts x K samples, each prompt's K rows contiguous), P prompt length (left-padded),
T response length (right-padded).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

# what RolloutEngine.stats may report (logged as rollout/engine_<name>)
ENGINE_STATS = ("generate_s", "sync_s")


class Responses(NamedTuple):
    """What an engine returns for a batch of prompt rows.

    Attributes:
        ids: (B, T) long sampled token ids, padded after the end of each response.
        mask: (B, T) bool, the response tokens that exist (up to and including the stop token): what
            the trainer's forwards attend to.
        truncated: (B,) bool, no stop token within the length limit.
        logprobs: (B, T) float32 behaviour log-probs: the log-prob of each sampled token under the
            distribution it was sampled from (temperature, top-k and top-p applied, renormalised over the
            kept tokens); 0 where ``mask`` is 0. None when the engine cannot tell (greedy decoding).
        log_kept_mass: (B, T) float32 log of the probability mass the top-k/top-p truncation kept of the
            tempered distribution at each step (0 without truncation and where ``mask`` is 0), so
            ``logprobs + log_kept_mass`` is the sampled token's log-prob under the untruncated tempered
            distribution, the one the trainer scores. None when ``logprobs`` is None or the engine cannot
            tell (vLLM: the trainer-vs-engine ratio then includes the dropped mass).
        loss_mask: (B, T) bool, the tokens the policy emitted and learns from (None = ``mask``: a
            single-turn response; a multi-turn one has holes where tool or environment tokens are).
        entropy: (B, T) float32 entropy of the whole tempered distribution each token was drawn at (no
            truncation, nothing suppressed: a scoring forward's entropy); 0 where ``mask`` is 0. Only when
            ``GenerationSettings.record_entropy`` asked for it and the engine can tell; else None.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    logprobs: torch.Tensor | None = None
    log_kept_mass: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def truncated_rows(
    ids: torch.Tensor,
    mask: torch.Tensor,
    has_stop: torch.Tensor,
    max_new_tokens: int,
    stop_strings: list[str] | tuple[str, ...] = (),
    tokenizer: Any = None,
) -> torch.Tensor:
    """(B,) bool ``Responses.truncated``: no stop id within ``max_new_tokens`` tokens, nor a stop string's end.

    A stop string that a row's last allowed token completes ends it at full length with no stop id, as a cut
    row ends. Such a row is not truncated: the decoded text has a stop-string match that overlaps its last
    token, the match ``generate`` stops at (``transformers`` ``StopStringCriteria``; vLLM looks at the newly
    decoded text the same way).

    Args:
        ids: (B, T) response ids; mask: (B, T) bool, the real tokens; has_stop: (B,) bool, a stop id among them.
        stop_strings, tokenizer: the rollout's stop strings and the tokenizer that decodes them (a row at full
            length is decoded only when both are given).
    """
    truncated = ~has_stop & (mask.sum(dim=1) >= max_new_tokens)  # (B,)
    if not stop_strings or tokenizer is None or not bool(truncated.any()):
        return truncated
    for row in truncated.nonzero().flatten().tolist():
        tokens = ids[row][mask[row]].tolist()
        text, before = tokenizer.decode(tokens), tokenizer.decode(tokens[:-1])
        # a match that ends inside the last token's text (one ending before it would have stopped the row earlier)
        if any(text.find(s, max(0, len(before) - len(s) + 1)) >= 0 for s in stop_strings):
            truncated[row] = False
    return truncated


class RolloutEngine(ABC):
    """What generates an online module's responses: Hugging Face ``generate`` on the trainer's own policy
    (:class:`~lit_rlhf.engines.HFEngine`, the default) or another engine (vLLM, a server, a recording).

    The module drives the lifecycle, and nothing above the engine knows which one it has:

    1. :meth:`setup` once the module's models exist (first use; again if the policy object changes);
    2. per rollout :meth:`generate` (training and evaluation rollouts alike), then :meth:`sleep` while the
       update runs, :meth:`wake_up` after it;
    3. :meth:`sync_weights` after every rollout's update that stepped the actor's optimiser (an engine
       with its own copy of the weights loads the new ones; one that generates with the live policy
       does nothing);
    4. :meth:`close` when fitting, validating or testing ends.

    Attributes:
        uses_policy: the engine generates with the trainer's own policy module, so the module runs it in
            eval mode and under the strategy's generation context (FSDP's full parameters).

    Example::

        class Replay(RolloutEngine):
            def generate(self, prompt_ids, prompt_mask, settings, *, greedy=False):
                return Responses(ids, mask, truncated, logprobs)
    """

    uses_policy: bool = False

    def setup(self, model: torch.nn.Module, tokenizer: Any, *, world_size: int = 1) -> None:
        """Bind the policy (``model``), its tokenizer and the data-parallel world size."""
        self.model, self.tokenizer, self.world_size = model, tokenizer, world_size

    @abstractmethod
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        settings: Any,
        *,
        greedy: bool = False,
    ) -> Responses:
        """One response per row of (B, P) left-padded prompts, sampled under ``settings``
        (``lit_rlhf.rollout.GenerationSettings``; its ``num_samples`` K tells the rows come in contiguous
        groups of K copies of one prompt), or greedy (evaluation only)."""

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine generate from ``model``'s current weights (called after each update)."""
        return None

    def sleep(self) -> None:
        """Free what the engine holds while the update runs (e.g. a KV cache); optional."""
        return None

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next generation; optional."""
        return None

    def close(self) -> None:
        """Release the engine's resources; optional."""
        return None

    def stats(self) -> dict[str, float]:
        """Figures of the last rollout the module logs as ``rollout/engine_<name>`` (names from
        :data:`ENGINE_STATS`: ``generate_s``, the last generation's seconds; ``sync_s``, the last weight
        sync's, i.e. the one after the previous update); none by default."""
        return {}

    def init_args(self) -> dict[str, Any]:
        """The engine's constructor arguments as plain values (stored in ``hparams.yaml``)."""
        return {}


def check_responses(out: Responses, prompts: torch.Tensor, settings: Any) -> Responses:
    """What an engine returned, checked against the protocol (shapes, dtypes, the length limit)."""
    if not isinstance(out, Responses):
        raise TypeError(f"rollout engine: generate must return lit_rlhf.engines.Responses, got {type(out).__name__}")
    B = prompts.shape[0]
    if out.ids.dim() != 2 or out.ids.shape[0] != B or out.ids.shape[1] > settings.max_new_tokens:
        raise ValueError(
            f"rollout engine: responses of shape {tuple(out.ids.shape)} for {B} prompt rows and "
            f"max_new_tokens={settings.max_new_tokens}; expected (B, T) with T <= max_new_tokens"
        )
    for name in ("mask", "logprobs", "log_kept_mass", "loss_mask", "entropy"):
        value = getattr(out, name)
        if value is not None and tuple(value.shape) != tuple(out.ids.shape):
            raise ValueError(f"rollout engine: Responses.{name} has shape {tuple(value.shape)}, ids {tuple(out.ids.shape)}")
    if out.truncated.shape != (B,):
        raise ValueError(f"rollout engine: Responses.truncated has shape {tuple(out.truncated.shape)}, expected ({B},)")
    return out

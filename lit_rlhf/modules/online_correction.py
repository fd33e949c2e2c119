"""The engine/trainer importance-sampling correction of the online modules: its settings
(``update.is_correction``) and which mode a rollout gets.

The math is :func:`lit_rlhf.functional.is_correction_weights`; the weights are computed once per rollout,
from the old log-probs and the engine's behaviour log-probs (both fixed over the update epochs), stored in
``Rollout.is_weights`` and multiplied into the per-token policy-gradient loss of PPO and of the
critic-free estimators (``weights`` of ``ppo_policy_loss`` / ``kl_penalty_policy_loss``). Their statistics
are logged per rollout as ``rollout/is_weight_mean``, ``rollout/is_weight_max``, ``rollout/is_clipped_frac``
or ``rollout/is_masked_frac``, ``rollout/is_ess`` (and ``rollout/is_seq_ratio_mean/max`` in the sequence
modes), beside the raw token-ratio statistics ``rollout/is_ratio_*`` that every engine with behaviour
log-probs gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from lightning.pytorch.utilities import rank_zero_warn

from lit_rlhf.functional.registry import IS_CORRECTION_MODES, IS_SEQUENCE_RATIOS
from lit_rlhf.settings import Settings

__all__ = ["AUTO_IS_CORRECTION_MODE", "ISCorrectionMode", "ISCorrectionSettings"]

ISCorrectionMode = Literal[
    "auto", "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]
# what "auto" means for an engine that is not the trainer's own policy: TIS with C = 2 (Yao et al. 2025)
AUTO_IS_CORRECTION_MODE = "token_truncate"


@dataclass
class ISCorrectionSettings(Settings):
    """The importance-sampling correction of the engine/trainer mismatch (``update.is_correction``).

    Each learned token's policy-gradient loss is weighted by w = pi_old / mu (the trainer's old log-probs
    against the engine's behaviour log-probs on the trainer's untruncated support; the top-k/top-p kept
    mass is not a policy change: see :mod:`lit_rlhf.functional.is_correction`). This is not
    ``update.importance_sampling_level``, which is about the ratio pi_theta / pi_old of the update itself.

    Attributes:
        mode: ``auto`` (default): ``token_truncate`` when the engine is not the trainer's own policy
            (``RolloutEngine.uses_policy`` False, e.g. vLLM) and gives behaviour log-probs, off otherwise
            (the Hugging Face engine samples from the trainer's policy: its weights are 1 to float
            rounding); ``none``: off; ``token_truncate``: w_t = min(rho_t, cap) (TIS, Yao et al. 2025);
            ``token_mask``: rho_t inside [low, cap], else 0 (MIS); ``sequence_truncate`` /
            ``sequence_mask``: the same with one ratio per response (see ``sequence_ratio``). Names as
            TRL's ``vllm_importance_sampling_mode``.
        cap: C >= 1: the truncation bound, and the band's upper end in the mask modes (2, as TIS).
        low: the band's lower end in [0, 1] in the mask modes (0 = none, as TRL; verl's IcePop-style
            bands set e.g. 0.5).
        sequence_ratio: the sequence modes' ratio: ``product`` exp(sum_t log rho_t), the whole response's
            likelihood ratio (TRL), or ``geometric_mean`` exp(mean_t log rho_t), which does not compound
            with length (verl's ``geometric``; its bands are narrow, e.g. low 0.999, cap 1.001).

    An explicit mode with an engine that returns no behaviour log-probs, or none of the mass its
    top-k/top-p truncation kept (``Responses.log_kept_mass``), fails at the first rollout (``auto`` stays
    off then, warning in the second case: see :meth:`resolve`). A
    corrected rollout always runs the actor's scoring forward for the old log-probs (the critic-free
    ``update.old_logprobs_from_update`` shortcut is skipped: the weights must exist before the update).
    """

    group: ClassVar[str] = "update.is_correction"

    mode: ISCorrectionMode = "auto"
    cap: float = 2.0
    low: float = 0.0
    sequence_ratio: Literal["product", "geometric_mean"] = "product"

    def __post_init__(self) -> None:
        self.require_finite("cap", "low")
        self.require_choice("mode", ("auto", "none", *IS_CORRECTION_MODES))
        self.require_choice("sequence_ratio", IS_SEQUENCE_RATIOS)
        self.require("cap", self.cap >= 1.0, ">= 1 (a ratio of 1, no mismatch, must keep weight 1)")
        self.require("low", 0.0 <= self.low <= 1.0, "in [0, 1]")
        if self.low > 0:
            self.require("low", self.mode.endswith("_mask"),
                         "0 unless mode is token_mask or sequence_mask (the band's lower end)")  # fmt: skip
        if self.sequence_ratio != "product":
            self.require("sequence_ratio", self.mode.startswith("sequence_"),
                         "'product' unless mode is sequence_truncate or sequence_mask")  # fmt: skip

    def resolve(self, engine: Any, responses: Any, where: str, truncates: bool = False) -> str | None:
        """The mode of one rollout, or None for no correction.

        Weights need the engine's log-probs on the trainer's support, so under a top-k/top-p truncation
        (``truncates``) the engine must report its ``log_kept_mass``: without it the ratio would hold the
        kept mass Z_t <= 1 (no policy change: every token's gradient shrunk by it, and a sequence ratio,
        their product, masking every long response). ``auto`` then stays off, with a warning; an explicit
        mode refuses.

        Args:
            engine: the module's ``RolloutEngine`` (its ``uses_policy`` decides ``auto``).
            responses: the rollout's ``lit_rlhf.engines.Responses`` (its ``logprobs`` must exist for an
                explicit mode).
            where: the module's name, for the messages.
            truncates: the rollout's sampling truncates (``generation.top_k`` > 0 or ``top_p`` < 1).

        Raises:
            ValueError: an explicit mode, and the engine returned no behaviour log-probs, or none of the
                kept mass of its truncation.
        """
        if self.mode == "none" or (self.mode == "auto" and getattr(engine, "uses_policy", False)):
            return None
        name = type(engine).__name__
        if responses.logprobs is None:
            if self.mode == "auto":
                return None
            raise ValueError(
                f"{where}: update.is_correction.mode={self.mode!r} needs the engine's behaviour log-probs, "
                f"and {name}.generate returned none (Responses.logprobs is None); use mode 'auto' or 'none', "
                "or an engine that records them"
            )
        if truncates and responses.log_kept_mass is None:
            problem = (
                f"{name} samples with top-k/top-p truncation but returned no Responses.log_kept_mass, so "
                "pi_old / mu would include the kept mass (not a policy change)"
            )
            if self.mode == "auto":
                rank_zero_warn(f"{where}: update.is_correction 'auto' is off: {problem}")
                return None
            raise ValueError(
                f"{where}: update.is_correction.mode={self.mode!r}: {problem}; use an engine that reports "
                "it, sampling without top_k/top_p, or mode 'none'"
            )
        return AUTO_IS_CORRECTION_MODE if self.mode == "auto" else self.mode

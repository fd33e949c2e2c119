"""Where a rollout's old log-probs come from (``scoring.old_logprobs``): the actor's scoring forward, or the
sampler that drew the tokens.

PPO's ratio pi_theta / pi_old needs log pi_old(a_t | s_t) of every sampled token under the policy that
sampled it (Schulman et al. 2017, arXiv:1707.06347 eq. 6). When the engine samples from the trainer's own
policy module (``RolloutEngine.uses_policy``, the Hugging Face engine) in float32, the sampler already holds
that number: the behaviour log-prob of the token under the tempered, truncated distribution it was drawn
from, plus the log of the mass the truncation kept (``Responses.logprobs + Responses.log_kept_mass``, see
:mod:`lit_rlhf.models.sampling`), is its log-prob under the whole tempered distribution, which is what the
scoring forward computes. The two differ by float rounding only (a decoding step with a KV cache against
one forward of the whole row: ~1e-6 here), so the rollout can skip the actor's no-grad forward, one of the
scoring phase's three or four (PPO: actor, reference, critic, reward model), and log the rollout entropy the
sampler recorded (``GenerationSettings.record_entropy``).

Where the sampler's figures are not the trainer's (another engine, such as vLLM with its own weights and
kernels; a reduced-precision run; multi-turn episodes, whose tool tokens were never sampled; an
engine/trainer correction, which needs both), the scoring forward runs, as it always did with
``scoring.old_logprobs: forward``.

Shapes: B rollout rows, T response length.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from lightning.pytorch import LightningModule

from lit_rlhf.modules.base import internal_base
from lit_rlhf.rollout import GenerationSettings

# Lightning precisions whose forwards run in the parameters' own float32/float64 (no autocast)
FULL_PRECISIONS = ("32-true", "32", "64-true", "64")


@internal_base
class OldLogprobSource(LightningModule):
    """Mixin of OnlineRLModule (it relies on the base's ``scoring``, ``engine``, ``environment``, ``update``,
    ``actor``, ``generation``, ``correction_mode``)."""

    def wants_rollout_policy_terms(self) -> bool:
        """Whether the rollout's scoring needs the actor's old log-probs and entropy at all (a critic-free
        on-policy update computes them in its own forward: False there)."""
        return True

    def policy_forward_needed(self) -> str | None:
        """Why the actor's scoring forward must run whatever the sampler recorded (a value head on the
        actor's hidden states, ...), or None. Subclasses add their own reasons."""
        return None

    def sampler_unsupported(self) -> str | None:
        """Why the sampler's record cannot stand in for the actor's scoring forward in this run, or None."""
        if not getattr(self.engine, "uses_policy", False):
            return f"the engine ({type(self.engine).__name__}) does not sample from the trainer's policy module"
        if self.environment.enabled:
            return "multi-turn episodes hold tokens the policy did not sample (tool and environment tokens)"
        precision = str(getattr(self.trainer, "precision", "32-true")) if self._trainer is not None else "32-true"
        if precision not in FULL_PRECISIONS:
            return f"precision {precision!r} samples and scores in reduced precision, with different roundings"
        dtypes = {p.dtype for p in self.actor.parameters()}
        if not dtypes <= {torch.float32, torch.float64}:
            return f"the actor's parameters are {sorted(map(str, dtypes))}, not float32"
        return self.policy_forward_needed()

    def rollout_generation(self) -> GenerationSettings:
        """The training rollouts' generation settings: ``generation``, with the sampler's entropy record on
        where the old log-probs will come from the sampler.

        Raises:
            ValueError: ``scoring.old_logprobs='sampler'`` where the sampler cannot stand in.
        """
        mode = self.scoring.old_logprobs
        if mode == "forward" or not self.wants_rollout_policy_terms():
            return self.generation
        reason = self.sampler_unsupported()
        if reason is None:
            return replace(self.generation, record_entropy=True)
        if mode == "sampler":
            raise ValueError(
                f"{type(self).__name__}: scoring.old_logprobs='sampler' cannot be used here: {reason}; "
                "use 'auto' or 'forward'"
            )
        return self.generation

    def sampled_policy_terms(self, responses) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B, T) old log-probs and entropy of a rollout's ``Responses`` from its sampler (0 off the response
        mask), or None where the actor's scoring forward computes them.

        Raises:
            ValueError: ``scoring.old_logprobs='sampler'`` and the engine returned no behaviour log-probs,
                kept masses or entropies (or the rollout is corrected: the correction needs both).
        """
        if self.scoring.old_logprobs == "forward" or self.sampler_unsupported() is not None:
            return None
        missing = [name for name in ("logprobs", "log_kept_mass", "entropy") if getattr(responses, name) is None]
        reason = f"the engine returned no Responses.{', '.join(missing)}" if missing else None
        if reason is None and self.correction_mode(responses) is not None:
            reason = "update.is_correction weights the rollout by pi_old / mu, which needs the scoring forward"
        if reason is not None:
            if self.scoring.old_logprobs == "sampler":
                raise ValueError(
                    f"{type(self).__name__}: scoring.old_logprobs='sampler' cannot be used here: {reason}; "
                    "use 'auto' or 'forward'"
                )
            return None
        mask = responses.mask
        old_logprobs = torch.where(mask, responses.logprobs + responses.log_kept_mass, 0.0)  # (B, T)
        entropy = torch.where(mask, responses.entropy, 0.0)  # (B, T)
        return old_logprobs.float(), entropy.float()

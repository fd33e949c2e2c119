"""Rollout scoring of :class:`~lit_rlhf.modules.online.OnlineRLModule`: the no-grad forwards of a rollout
(old and reference log-probs, entropy, critic values), its sequence scores and their screening, in
length-bucketed micro-batches and, where it pays, the shared-prompt layout of a prompt's K responses.

Shapes: B rollout rows, P prompt length (left-padded), T response length (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from lightning.pytorch import LightningModule

from lit_rlhf import functional as F
from lit_rlhf.batching import MicroBatch, rollout_micro_batches, scatter_rows
from lit_rlhf.engines import Responses
from lit_rlhf.guards import NonFiniteError, screen_scores
from lit_rlhf.models import (
    SharedPrefixLayout,
    layout_fits,
    packed_token_scores,
    policy_forward,
    reference_logits_context,
    shared_prefix_layout,
)
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.distributed import unwrap
from lit_rlhf.rewards import RewardSource
from lit_rlhf.rollout import Rollout


@internal_base
class RolloutScoring(LightningModule):
    """Scoring half of the online base (a mixin: the module's ``__init__`` sets what it reads: ``actor``,
    ``reference``, ``rewards``, ``monitor``, ``scoring``, ``shared_prefix``, ``generation``)."""

    def shared_prefix_layout(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int
    ) -> SharedPrefixLayout | None:
        """The one-row-per-prompt layout of these (B, P+T) rollout rows when ``shared_prefix`` packs them
        (consecutive rows with the same prompt share one row), else None: the padded layout."""
        if self.shared_prefix == "off":
            return None
        P = input_ids.shape[1] - T
        prompt_mask, response_mask = attention_mask.clone(), attention_mask.clone()
        prompt_mask[:, P:], response_mask[:, :P] = 0, 0
        return shared_prefix_layout(
            self.actor, self.shared_prefix, input_ids, prompt_mask, response_mask, self.tokenizer.pad_token_id,
            padded_head_positions=input_ids.shape[0] * (T + 1), response_width=T,
        )  # fmt: skip

    def packs_groups(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> bool:
        """Whether the update should keep each prompt's K rows together: the shared-prompt layout packs a
        micro-batch of ``forward_batch_size`` rollout rows, and the rollout has at least
        ``update.num_minibatches`` groups to split (else its rows are shuffled one by one, as unpacked: a
        layout that pays must never make a valid configuration fail)."""
        groups = input_ids.shape[0] // self.num_samples
        if self.num_samples < 2 or groups < self.update.num_minibatches:
            return False
        rows = slice(0, self.scoring.forward_batch_size)
        return self.shared_prefix_layout(input_ids[rows], attention_mask[rows], T) is not None

    def actor_forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        temperature: float,
        layout: SharedPrefixLayout | None = None,
        entropy_grad: bool = True,
        entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T) log-probs and entropy (None unless ``entropy``) of a policy ``model``, from ``layout``
        when given and the model takes its mask, else from the padded rows (equal to float rounding)."""
        if layout is not None and layout_fits(model, layout):
            return packed_token_scores(model, layout, temperature, entropy, entropy_grad)
        logprobs, entropies, _ = policy_forward(
            model, input_ids, attention_mask, T, temperature, entropy_grad=entropy_grad, entropy=entropy
        )
        return logprobs, entropies

    def policy_and_values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, layout: SharedPrefixLayout | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Actor log-probs and entropy (B, T), and critic values (B, T) (None here: no critic)."""
        logprobs, entropy = self.actor_forward(
            self.actor, input_ids, attention_mask, T, self.generation.temperature, layout
        )
        return logprobs, entropy, None

    def reference_logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        temperature: float | None = None,
        layout: SharedPrefixLayout | None = None,
    ) -> torch.Tensor:
        """(B, T) log-probs of the reference policy (the actor with its LoRA adapters disabled if none),
        at ``temperature`` (default: the rollout's)."""
        temperature = self.generation.temperature if temperature is None else temperature
        with reference_logits_context(unwrap(self.actor)):
            ref_model = self.reference if self.reference is not None else self.actor
            ref_logprobs, _ = self.actor_forward(
                ref_model, input_ids, attention_mask, T, temperature, layout, entropy=False
            )
        return ref_logprobs

    @torch.no_grad()
    def score_rollout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        policy: bool = True,
        responses: Responses | None = None,
    ):
        """(B, P+T) sequences -> old log-probs, reference log-probs, old values (or None), entropy, each (B, T).

        ``policy=False`` runs the reference forward only (old log-probs, values and entropy are None): for
        an update whose one optimiser step takes them from its own forward (``old_logprobs_from_update``).
        ``responses``: the rollout's ``Responses``; where its sampler's record stands in for the actor's
        forward (``scoring.old_logprobs``, :meth:`sampled_policy_terms`), the old log-probs and entropy are
        that record and the actor's forward is skipped (the critic's values, if any, still run); it sets
        ``old_logprobs_sampled`` to say which (the engine-vs-trainer mismatch is then not measured).

        Runs in micro-batches of at most ``forward_batch_size`` rows (length-bucketed, see
        :meth:`micro_batches`) so memory does not grow with the rollout, and keeps no (B, T, V) logits;
        columns trimmed from a micro-batch (padding in all its rows) read 0. A micro-batch's actor and
        reference forwards share one shared-prompt layout when ``shared_prefix`` packs it (each prompt's
        K rows are then kept in one micro-batch).
        """
        sampled = self.sampled_policy_terms(responses) if policy and responses is not None else None
        self.old_logprobs_sampled = sampled is not None  # no trainer forward to compare the engine with
        parts: dict[str, list[torch.Tensor]] = {"old": [], "ref": [], "values": [], "entropy": []}
        group_size = 1 if self.shared_prefix == "off" else self.num_samples
        batches = self.micro_batches(attention_mask, T, group_size)
        for rows, columns, t in batches:
            ids, mask = input_ids[rows][:, columns], attention_mask[rows][:, columns]
            layout = self.shared_prefix_layout(ids, mask, t)
            # (a subclass whose forwards have no packed form keeps shared_prefix off: layout is None)
            extra = {} if layout is None else {"layout": layout}
            if policy and sampled is None:
                logprobs, entropy, values = self.policy_and_values(ids, mask, t, **extra)
            else:
                logprobs, entropy, values = None, None, self.rollout_values(ids, mask, t) if policy else None
            ref_logprobs = self.reference_logprobs(ids, mask, t, layout=layout)
            for key, value in zip(parts, (logprobs, ref_logprobs, values, entropy)):
                parts[key].append(value)
        n, rows = input_ids.shape[0], [b[0] for b in batches]
        old, ref, values, entropy = (None if v[0] is None else scatter_rows(v, rows, n, T) for v in parts.values())
        return (old, ref, values, entropy) if sampled is None else (sampled[0], ref, values, sampled[1])

    def rollout_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> torch.Tensor | None:
        """(B, T) the critic's values of a scoring micro-batch when the actor's forward is skipped (None here:
        no critic; a module whose values need the actor's forward says so in ``policy_forward_needed``)."""
        return None

    def micro_batches(self, attention_mask: torch.Tensor, T: int, group_size: int = 1) -> list[MicroBatch]:
        """(rows, columns, t) of the forwards over (B, P+T) rollout rows: at most ``forward_batch_size``
        rows each, length-bucketed and trimmed under ``bucketing`` where that saves compute, else
        consecutive rows at the full width; ``group_size`` consecutive rows stay together."""
        return rollout_micro_batches(
            attention_mask, T, self.scoring.bucketing.resolved(self.actor), self.scoring.forward_batch_size, group_size
        )

    @torch.no_grad()
    def score_responses(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        truncated: torch.Tensor,
        columns: dict[str, list] | None = None,
        env_scores: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) adjusted sequence scores of the rollout and the (B,) bool mask of the rows to learn from.

        ``env_scores``: (B,) the environment's episode rewards (``Sample.env_scores``), added to the reward
        source's scores (which are 0 when the module has only an environment).

        ``columns``: the prompt rows' other columns for the reward functions, one value per rollout row
        (``Sample.columns``). A ``reward_fn`` list's raw score of each function (an ensemble's of each
        member) is logged as ``rollout/reward/<name>`` (the mean of its finite scores) and
        ``rollout/reward_nonfinite/<name>`` (its NaN/inf scores over all ranks, e.g. unparseable gold
        answers; not the rows it returned None for, which it does not score); an ensemble's spread as
        ``rollout/ensemble_std`` (the mean over responses of the members' standard deviation,
        ``functional.ensemble_std``).

        Every score (reward model or function, and the monitor) is screened by ``on_nonfinite``: under
        ``"raise"`` a non-finite score on any rank stops the fit naming the rollout, the source and the
        prompt/response; under ``"drop"`` such rows are False in the mask (the caller gives them no
        gradient with :meth:`drop_rows`), their scores are replaced by the mean of the kept scores of
        their group (of the rollout when K = 1 or the whole group is dropped) so that every statistic stays
        finite, the estimators are given the mask (their baselines and whitening use the kept rows only),
        and ``rollout/nonfinite_scores`` counts them over all ranks. The monitor is only
        logged: its non-finite rows are left out of ``rollout/monitor_score`` under ``"drop"``.
        """
        batches = self.micro_batches(attention_mask, T)
        # (B,) scores, and each function's (B,) raw scores for a reward_fn list and the rows it scored
        scores, terms, scored = self.rewards.score_terms(input_ids, attention_mask, T, batches, columns)
        if env_scores is not None:
            scores = scores + env_scores  # (B,)
        self.log_reward_terms(terms, scored)
        if self.rewards.members is not None:
            spread, count = ensemble_spread(terms, self.rewards.common_scale)
            self.rollout_metrics.update({"ensemble_std": spread}, weight=count)
        keep = self.screen(scores, self.rewards, input_ids, attention_mask, T)  # (B,)
        scores = self.adjust_scores(F.fill_dropped_scores(scores, keep, self.num_samples), truncated)  # (B,)
        if self.monitor is not None:
            monitor = self.monitor.score(input_ids, attention_mask, T, batches, columns)  # (B,)
            monitor_keep = self.screen(monitor, self.monitor, input_ids, attention_mask, T, counted=False)
            self.rollout_metrics.update({"monitor_score": monitor[monitor_keep].mean()})
        return scores, keep

    def reward_term_metrics(self) -> list[str]:
        """The rollout metrics of a ``reward_fn`` list's functions or an ensemble's members (none for one
        function or one reward model)."""
        names = self.rewards.part_names
        return [f"reward/{n}" for n in names] + [f"reward_nonfinite/{n}" for n in names]

    def log_reward_terms(self, terms: dict[str, torch.Tensor], scored: dict[str, torch.Tensor] | None = None) -> None:
        """Per-rollout metrics of each function's (B,) raw scores: the mean of the finite ones (weighted by
        their count across ranks) and the count of non-finite ones over all ranks, of the rows it scored
        (``scored``: (B,) bool by name, False where it returned None; None: every row)."""
        if not terms:
            return
        scored = scored or {}
        finite = {name: torch.isfinite(raw) for name, raw in terms.items()}  # each (B,)
        bad = torch.stack(
            [(~ok & scored.get(name, torch.ones_like(ok))).sum() for name, ok in finite.items()]
        ).float()  # (N,)
        bad = self.trainer.strategy.reduce(bad, reduce_op="sum")  # (N,) every rank's
        for (name, raw), count in zip(terms.items(), bad):
            ok = finite[name]
            mean = torch.where(ok, raw, 0.0).sum() / ok.sum().clamp(min=1)
            self.rollout_metrics.update({f"reward/{name}": mean}, weight=float(ok.sum()))
            self.rollout_metrics.update({f"reward_nonfinite/{name}": count})

    def screen(
        self,
        scores: torch.Tensor,
        source: RewardSource,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        counted: bool = True,
        where: str | None = None,
        evaluation: bool = False,
    ) -> torch.Tensor:
        """``guards.screen_scores`` under ``scoring.on_nonfinite``, decided the same on every rank: (B,) keep
        mask. ``where`` names the rollout in messages (default ``rollout N``, the one being made).
        ``evaluation``: under ``"drop"`` a batch without a finite row is no error, it adds no rows to the
        means (nothing is learned from it); in training it stops the fit (nothing to learn from)."""
        bad = ~torch.isfinite(scores)  # (B,)
        totals = self.trainer.strategy.reduce(  # non-finite and finite rows of every rank
            torch.stack([bad.sum(), (~bad).sum()]).float(), reduce_op="sum"
        )
        if counted:
            self.rollout_metrics.update({"nonfinite_scores": totals[0]})
        policy = self.scoring.on_nonfinite
        if totals[0] == 0 or (evaluation and policy == "drop"):
            return ~bad
        rollout = where or self.rollouts_done + 1
        if not bad.any():
            if policy == "raise" or totals[1] == 0:
                advice = (
                    "set scoring.on_nonfinite='drop' to drop such rows" if policy == "raise"
                    else "every row of the rollout is non-finite; nothing to learn from"
                )  # fmt: skip
                raise NonFiniteError(
                    f"{where or f'rollout {rollout}'}: {source.description} returned {int(totals[0])} non-finite scores on "
                    f"another rank (its error names them); {advice}"
                )
            return ~bad
        prompts = self.tokenizer.batch_decode(input_ids[:, :-T], skip_special_tokens=True)
        responses = source.decode_responses(input_ids[:, -T:], attention_mask[:, -T:].bool())
        return screen_scores(
            scores, policy, rollout=rollout, source=source.description, prompts=prompts, responses=responses,
            allow_empty=bool(totals[1] > 0),
        )  # fmt: skip

    def drop_rows(self, rollout: Rollout, keep: torch.Tensor) -> Rollout:
        """The rollout with dropped rows (``keep`` False) carrying no policy or value gradient.

        Their advantages are 0 (so the clipped surrogate has neither value nor gradient for them) and
        their value targets are their own old values; shapes stay equal on every rank (a sharded
        forward is collective). Regularisers that do not use the score (entropy bonus, KL-to-reference
        loss) still see them, as they see every sampled response.
        """
        if bool(keep.all()):
            return rollout
        row = keep[:, None]  # (B, 1)
        advantages = torch.where(row, rollout.advantages, 0.0)  # (B, T)
        returns = None if rollout.returns is None else torch.where(row, rollout.returns, rollout.old_values)
        return replace(rollout, advantages=advantages, returns=returns)

    def adjust_scores(self, scores: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """Missing-EOS penalty, then optional clipping of the sequence scores (``scoring``)."""
        scoring = self.scoring
        if scoring.missing_eos_penalty is not None:
            scores = scores - scoring.missing_eos_penalty * truncated.float()
        if scoring.score_clip is not None:
            scores = scores.clamp(-scoring.score_clip, scoring.score_clip)
        return scores


def ensemble_spread(
    members: dict[str, torch.Tensor], scale: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[torch.Tensor, float]:
    """The mean over responses of an ensemble's spread (``functional.ensemble_std`` of the members' (B,)
    scores by name, put on the scale the aggregation uses by ``scale``, e.g. ``RewardSource.common_scale``),
    over the responses every member scored finitely, and their count."""
    scores = torch.stack(list(members.values()))  # (K, B)
    scores = scores if scale is None else scale(scores)  # (K, B)
    finite = torch.isfinite(scores).all(dim=0)  # (B,)
    spread = F.ensemble_std(torch.where(finite, scores, 0.0))  # (B,)
    count = finite.sum()
    return torch.where(finite, spread, 0.0).sum() / count.clamp(min=1), float(count)

"""The online-RL base: what every on-policy algorithm (PPO, GRPO, RLOO, REINFORCE++) shares.

:class:`OnlineRLModule` owns the actor, the reference (or the LoRA-disabled actor), the reward source and
the monitor reward, generation with K samples per prompt, the old/reference log-prob scoring, the score
adjustments, the rollout metrics and sample tables, the minibatch update loop, the KL controller, the
checkpoint state of an exact resume and the Hugging Face export. A subclass writes its own numbered
``training_step`` over these parts, its loss and its optimisers.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass, replace
from functools import partial

import torch
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing, MicroBatch, rollout_micro_batches, scatter_rows
from lit_rlhf.data.base import resolve_seed
from lit_rlhf.data.contract import check_batch, left_pad_prompts
from lit_rlhf.guards import NonFiniteError, NonFinitePolicy, StepGuard, check_finite_weights, screen_scores
from lit_rlhf.models import (
    ModelSpec,
    SharedPrefixLayout,
    build_causal_lm,
    check_shared_prefix_mode,
    disable_dropout,
    frozen_copy,
    layout_fits,
    load_tokenizer,
    packed_policy_forward,
    policy_forward,
    reference_logits_context,
    shared_prefix_layout,
)
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.distributed import clip_grad_norm, generation_context, shard_models, unwrap
from lit_rlhf.modules.metrics import MetricGroup, accumulate_stats
from lit_rlhf.modules.online_bookkeeping import OnlineBookkeeping
from lit_rlhf.modules.online_eval import OnlineEvaluation, evaluation_settings
from lit_rlhf.rewards import RewardSource
from lit_rlhf.rollout import GenerationSettings, ReplayBuffer, Rollout, generate_responses

ROLLOUT_METRICS = (
    "score", "reward", "kl_ref", "response_length", "eos_rate", "entropy", "monitor_score",
    "group_score_std", "group_all_equal_frac", "nonfinite_scores",
)  # fmt: skip
LossFn = Callable[[Rollout], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@internal_base
class OnlineRLModule(OnlineEvaluation, OnlineBookkeeping):
    """Shared parts of the on-policy RLHF modules (manual optimisation, one rollout per ``training_step``).

    The subclass documents and validates the arguments it passes on (its ``__init__`` is the config
    schema), then calls :meth:`save_plain_hyperparameters` and builds its own models inside
    :meth:`seeded_init`, which continues the seeded stream the shared models were initialised from.

    Args:
        actor, reward_model, reward_fn, monitor_reward_fn, reference, generation, forward_batch_size,
        bucketing, num_minibatches, kl_coef, kl_target, kl_horizon, score_clip, missing_eos_penalty, max_rollouts,
        log_samples_every, num_log_samples, eval_generation, eval_greedy, rng_seed, on_nonfinite: as documented by the
        subclass (``rng_seed=None`` follows ``seed_everything``; the resolved value is stored in the
        hyper-parameters and the checkpoint, so a resumed or reloaded module rebuilds the same weights).
        metric_prefix: namespace of the update metrics (``ppo``, ``policy``).
        update_metrics: names of the update metrics (``*_max`` ones are maxima, the others means).
        shared_prefix: ``auto``/``on``/``off``, the shared-prompt layout of the actor and reference
            forwards (``models.shared_prefix``; documented by the subclass that offers it, ``off`` else).
    """

    # models sharded by ``configure_model`` (dotted attribute paths; missing or None ones are skipped)
    sharded_models: tuple[str, ...] = ("actor", "reference", "rewards.model", "monitor.model")

    def __init__(
        self,
        *,
        actor: ModelSpec | dict | str,
        reward_model: ModelSpec | dict | str | None,
        reward_fn: str | None,
        monitor_reward_fn: str | None,
        reference: ModelSpec | dict | str | None,
        generation: GenerationSettings | dict | None,
        forward_batch_size: int,
        bucketing: Bucketing | dict | None,
        num_minibatches: int,
        kl_coef: float,
        kl_target: float | None,
        kl_horizon: int,
        score_clip: float | None,
        missing_eos_penalty: float | None,
        max_rollouts: int | None,
        log_samples_every: int,
        num_log_samples: int,
        eval_generation: GenerationSettings | dict | None,
        eval_greedy: bool,
        rng_seed: int | None,
        on_nonfinite: NonFinitePolicy,
        metric_prefix: str,
        update_metrics: Sequence[str],
        shared_prefix: str = "off",
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        name = type(self).__name__
        actor = ModelSpec.coerce(actor, "actor")
        reward_model = None if reward_model is None else ModelSpec.coerce(reward_model, "reward_model")
        reference = None if reference is None else ModelSpec.coerce(reference, "reference")
        self.generation = GenerationSettings.coerce(generation, "generation")
        self.eval_generation = evaluation_settings(self.generation, eval_generation)
        self.bucketing = Bucketing.coerce(bucketing, f"{name}: bucketing")
        rng_seed = self.rng_seed = resolve_seed(rng_seed)
        check_online_args(
            name, reward_model, reward_fn, forward_batch_size, kl_coef, max_rollouts, log_samples_every,
            on_nonfinite,
        )  # fmt: skip
        self.metric_prefix = metric_prefix
        self.shared_prefix = check_shared_prefix_mode(shared_prefix, f"{name}: shared_prefix")
        self.actor_lora = actor.lora is not None
        self.tokenizer = load_tokenizer(actor.tokenizer or actor.name_or_path, padding_side="left")
        self._init_seed, self._init_rng_state = rng_seed, None
        with self.seeded_init():  # seeded, so a resumed run rebuilds identical frozen models
            self.actor = build_causal_lm(actor, self.tokenizer)
            disable_dropout(self.actor)
            if reference is not None:
                self.reference = frozen_copy(build_causal_lm(reference, self.tokenizer))
            else:  # a LoRA actor with disabled adapters is its own reference (no second copy)
                self.reference = None if actor.lora else frozen_copy(self.actor)
            self.rewards = RewardSource(reward_model, reward_fn, self.tokenizer)
            self.monitor = (
                None
                if monitor_reward_fn is None
                else RewardSource(None, monitor_reward_fn, self.tokenizer, "monitor_reward_fn")
            )
        self.kl_ctl = (
            F.FixedKLController(kl_coef)
            if kl_target is None
            else F.AdaptiveKLController(kl_coef, kl_target, kl_horizon)
        )
        self.buffer = ReplayBuffer(num_minibatches, rng_seed)
        self.rollout_metrics, self.update_metrics = MetricGroup(ROLLOUT_METRICS), MetricGroup(update_metrics)
        self.rollouts_done = 0
        self.step_guard = StepGuard()  # skips (and counts) minibatches with a non-finite loss or gradient
        self._rng_to_restore: tuple[torch.Tensor, list] | None = None
        self.strict_loading = False  # frozen weights are rebuilt in __init__, not checkpointed

    @contextmanager
    def seeded_init(self) -> Iterator[None]:
        """Run model initialisations on the module's own CPU RNG stream seeded by ``rng_seed``.

        Successive blocks continue one stream, and the global (training) RNG is left untouched, so a
        resumed run rebuilds the same frozen and freshly initialised weights.
        """
        with torch.random.fork_rng():
            if self._init_rng_state is None:
                torch.manual_seed(self._init_seed)
            else:
                torch.set_rng_state(self._init_rng_state)
            yield
            self._init_rng_state = torch.get_rng_state()

    def save_plain_hyperparameters(self, ignore: Sequence[str]) -> None:
        """``save_hyperparameters`` of the subclass's ``__init__`` arguments, with dataclasses (ModelSpec,
        GenerationSettings) stored as plain dicts, so ``hparams.yaml`` holds no ``!!python/object`` tags
        and a checkpoint loads without unpickling library classes; ``rng_seed`` as resolved."""
        self.save_hyperparameters(ignore=list(ignore), frame=inspect.currentframe().f_back)
        for store in (self._hparams, self._hparams_initial):
            store["rng_seed"] = self.rng_seed
            for key, value in store.items():
                if is_dataclass(value) and not isinstance(value, type):
                    store[key] = asdict(value)

    # -- rollout: generation and scoring --------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """K, the responses sampled per prompt."""
        return self.generation.num_samples

    def expand_prompts(
        self, batch: dict[str, torch.Tensor], num_samples: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(G, P) prompts -> (G*K, P), checked, LEFT-padded, each prompt's K copies contiguous.

        The batch must have the ``prompt`` layout (``lit_rlhf.data.contract``); right-padded rows are
        left-padded here, so generation continues every prompt from its last real token (K defaults to
        ``generation.num_samples``).
        """
        check_batch(batch, "prompt", type(self).__name__)
        ids, mask = left_pad_prompts(batch["input_ids"], batch["attention_mask"], self.tokenizer.pad_token_id)
        k = self.num_samples if num_samples is None else num_samples
        if k == 1:
            return ids, mask
        return ids.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)

    @torch.no_grad()
    def generate(
        self,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        settings: GenerationSettings | None = None,
        greedy: bool = False,
    ):
        """One response per row (sampled with ``settings``, default ``generation``, or greedy):
        (responses (B, T), response_mask (B, T), truncated (B,)). The rows are ``expand_prompts``'s, in
        groups of ``settings.num_samples`` copies, whose prefill is shared (``group_prefill``)."""
        settings = settings or self.generation
        was_training = self.actor.training
        self.actor.eval()
        with generation_context(self, self.actor):
            out = generate_responses(
                self.actor, prompts, prompt_mask, settings,
                eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id,
                tokenizer=self.tokenizer, synced_gpus=self.trainer.world_size > 1, greedy=greedy,
                group_size=settings.num_samples,
            )  # fmt: skip
        self.actor.train(was_training)
        return out

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
        """Whether the update should keep each prompt's K rows together (the shared-prompt layout packs
        a micro-batch of ``forward_batch_size`` rollout rows)."""
        rows = slice(0, self.hparams.forward_batch_size)
        return self.num_samples > 1 and self.shared_prefix_layout(input_ids[rows], attention_mask[rows], T) is not None

    def actor_forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        temperature: float,
        layout: SharedPrefixLayout | None = None,
        entropy_grad: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) log-probs and entropy of a policy ``model``, from ``layout`` when given and the model
        takes its mask, else from the padded rows (the two agree to float rounding)."""
        if layout is not None and layout_fits(model, layout):
            return packed_policy_forward(model, layout, temperature, entropy_grad)
        logprobs, entropy, _ = policy_forward(
            model, input_ids, attention_mask, T, temperature, entropy_grad=entropy_grad
        )
        return logprobs, entropy

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
            ref_logprobs, _ = self.actor_forward(ref_model, input_ids, attention_mask, T, temperature, layout)
        return ref_logprobs

    @torch.no_grad()
    def score_rollout(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int):
        """(B, P+T) sequences -> old log-probs, reference log-probs, old values (or None), entropy, each (B, T).

        Runs in micro-batches of at most ``forward_batch_size`` rows (length-bucketed, see
        :meth:`micro_batches`) so memory does not grow with the rollout, and keeps no (B, T, V) logits;
        columns trimmed from a micro-batch (padding in all its rows) read 0. A micro-batch's actor and
        reference forwards share one shared-prompt layout when ``shared_prefix`` packs it (each prompt's
        K rows are then kept in one micro-batch).
        """
        parts: dict[str, list[torch.Tensor]] = {"old": [], "ref": [], "values": [], "entropy": []}
        group_size = 1 if self.shared_prefix == "off" else self.num_samples
        batches = self.micro_batches(attention_mask, T, group_size)
        for rows, columns, t in batches:
            ids, mask = input_ids[rows][:, columns], attention_mask[rows][:, columns]
            layout = self.shared_prefix_layout(ids, mask, t)
            # (a subclass whose forwards have no packed form keeps shared_prefix off: layout is None)
            extra = {} if layout is None else {"layout": layout}
            logprobs, entropy, values = self.policy_and_values(ids, mask, t, **extra)
            ref_logprobs = self.reference_logprobs(ids, mask, t, layout=layout)
            for key, value in zip(parts, (logprobs, ref_logprobs, values, entropy)):
                parts[key].append(value)
        n, rows = input_ids.shape[0], [b[0] for b in batches]
        return tuple(None if v[0] is None else scatter_rows(v, rows, n, T) for v in parts.values())

    def micro_batches(self, attention_mask: torch.Tensor, T: int, group_size: int = 1) -> list[MicroBatch]:
        """(rows, columns, t) of the forwards over (B, P+T) rollout rows: at most ``forward_batch_size``
        rows each, length-bucketed and trimmed under ``bucketing`` where that saves compute, else
        consecutive rows at the full width; ``group_size`` consecutive rows stay together."""
        return rollout_micro_batches(
            attention_mask, T, self.bucketing, self.hparams.forward_batch_size, group_size
        )

    @torch.no_grad()
    def score_responses(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        truncated: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) adjusted sequence scores of the rollout and the (B,) bool mask of the rows to learn from.

        Every score (reward model or function, and the monitor) is screened by ``on_nonfinite``: under
        ``"raise"`` a non-finite score on any rank stops the fit naming the rollout, the source and the
        prompt/response; under ``"drop"`` such rows are False in the mask (the caller gives them no
        gradient with :meth:`drop_rows`), their scores are replaced by the mean of the kept scores of
        their group (of the rollout when K = 1 or the whole group is dropped), so group baselines see only
        kept scores, and ``rollout/nonfinite_scores`` counts them over all ranks. The monitor is only
        logged: its non-finite rows are left out of ``rollout/monitor_score`` under ``"drop"``.
        """
        batches = self.micro_batches(attention_mask, T)
        scores = self.rewards.score(input_ids, attention_mask, T, batches)  # (B,)
        keep = self.screen(scores, self.rewards, input_ids, attention_mask, T)  # (B,)
        scores = self.adjust_scores(F.fill_dropped_scores(scores, keep, self.num_samples), truncated)  # (B,)
        if self.monitor is not None:
            monitor = self.monitor.score(input_ids, attention_mask, T, batches)  # (B,)
            monitor_keep = self.screen(monitor, self.monitor, input_ids, attention_mask, T, counted=False)
            self.rollout_metrics.update({"monitor_score": monitor[monitor_keep].mean()})
        return scores, keep

    def screen(
        self,
        scores: torch.Tensor,
        source: RewardSource,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        T: int,
        counted: bool = True,
    ) -> torch.Tensor:
        """``guards.screen_scores`` under ``on_nonfinite``, decided the same on every rank: (B,) keep mask."""
        bad = ~torch.isfinite(scores)  # (B,)
        totals = self.trainer.strategy.reduce(  # non-finite and finite rows of every rank
            torch.stack([bad.sum(), (~bad).sum()]).float(), reduce_op="sum"
        )
        if counted:
            self.rollout_metrics.update({"nonfinite_scores": totals[0]})
        if totals[0] == 0:
            return ~bad
        policy = self.hparams.on_nonfinite if totals[1] > 0 else "raise"  # nothing left to learn from
        rollout = self.rollouts_done + 1
        if not bad.any():
            if policy == "raise":
                raise NonFiniteError(
                    f"rollout {rollout}: {source.description} returned {int(totals[0])} non-finite scores on "
                    "another rank (its error names them); set on_nonfinite='drop' to drop such rows"
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
        """Missing-EOS penalty, then optional clipping of the sequence scores (seeds/000)."""
        if self.hparams.missing_eos_penalty is not None:
            scores = scores - self.hparams.missing_eos_penalty * truncated.float()
        if self.hparams.score_clip is not None:
            scores = scores.clamp(-self.hparams.score_clip, self.hparams.score_clip)
        return scores

    def whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """``masked_whiten`` of this rank's rows with the mean and variance of every data-parallel rank's rows.

        One all-reduce of three numbers (count, sum, sum of squares), so a run on N ranks whitens like one
        process holding the N rollouts; ``strategy.reduce`` is the identity on a single device.
        """
        moments = self.trainer.strategy.reduce(F.masked_moments(x, mask), reduce_op="sum")
        return F.whiten_from_moments(x, mask, moments, shift_mean)

    # -- update ---------------------------------------------------------------------------------------
    def run_update_epochs(
        self,
        loss_fn: LossFn,
        optimized: Sequence[tuple[torch.optim.Optimizer, torch.nn.Module]],
        epochs: int,
        loss_aggregation: str = "token_mean",
    ) -> float:
        """``epochs`` passes over shuffled minibatches of the buffered rollout, one optimiser step each.

        Each minibatch is processed in micro-batches of at most ``forward_batch_size`` rows (length-bucketed
        and trimmed under ``bucketing``, see :meth:`micro_batches`) whose losses are weighted by their share
        of the minibatch (real tokens, or rows for the sequence-mean aggregations), so the accumulated
        gradient equals the minibatch's loss (trimming keeps every real token and row). A minibatch whose mean
        ratio exceeds ``ratio_threshold`` is skipped (``skipped_minibatches``); one whose loss or gradient
        is not finite on any rank is never stepped, on any optimiser (``nonfinite_steps``, counted in
        the checkpoint by ``step_guard``). Afterwards every trained model is checked for non-finite
        weights. Returns the mean KL(old || new) of the last epoch.
        """
        hp = self.hparams
        params = [p for opt, _ in optimized for group in opt.param_groups for p in group["params"]]
        reduce = partial(self.trainer.strategy.reduce_boolean_decision, all=True)
        for _ in range(epochs):
            epoch_kl = []
            for mb in self.buffer.minibatches():
                stats: dict[str, torch.Tensor] = {}
                # a prompt's K rows stay in one micro-batch when the buffer keeps groups (shared-prompt layout)
                T, K = mb.response_mask.shape[1], self.buffer.group_size
                for rows, columns, t in self.micro_batches(mb.attention_mask, T, K):
                    part = mb.select(rows).crop(columns, t)
                    weight = F.aggregation_weight(part.response_mask, mb.response_mask, loss_aggregation)
                    loss, part_stats = loss_fn(part)
                    self.step_guard.observe_loss(loss)
                    self.manual_backward(loss * weight)
                    accumulate_stats(stats, part_stats, weight)
                skip = hp.ratio_threshold is not None and bool(stats["ratio_mean"] > hp.ratio_threshold)
                finite = self.step_guard.allow_step(params, reduce)  # removes the gradients if not
                if finite and not skip:
                    for opt, model in optimized:
                        if hp.max_grad_norm is not None:
                            clip_grad_norm(self, opt, model, hp.max_grad_norm)
                        opt.step()
                for opt, _ in optimized:
                    opt.zero_grad(set_to_none=True)
                self.update_metrics.update(
                    {**stats, "skipped_minibatches": float(skip), "nonfinite_steps": float(not finite)}
                )
                epoch_kl.append(stats["policy_kl"])
        for _, model in optimized:
            what = f"rollout {self.rollouts_done + 1}: {type(model).__name__} after the update"
            check_finite_weights(model, what)
        return torch.stack(epoch_kl).mean().item()

    def update_kl_controller(self, kl: torch.Tensor, response_mask: torch.Tensor) -> None:
        """Advance the KL controller with the mean sequence KL of every rank's rows."""
        global_kl = self.all_gather(F.masked_row_sum(kl, response_mask).mean()).mean().item()
        self.kl_ctl.update(global_kl, n_steps=response_mask.shape[0] * self.trainer.world_size)

    def lr_schedulers_list(self) -> list:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return schedulers if isinstance(schedulers, list) else [schedulers]

    # -- sharding --------------------------------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        shard_models(self, self.sharded_models)


def check_online_args(
    name: str,
    reward_model: ModelSpec | None,
    reward_fn: str | None,
    forward_batch_size: int,
    kl_coef: float,
    max_rollouts: int | None,
    log_samples_every: int,
    on_nonfinite: str,
) -> None:
    """Check the shared arguments early, with messages naming the module and the argument."""
    if on_nonfinite not in ("raise", "drop"):
        raise ValueError(f"{name}: on_nonfinite must be 'raise' or 'drop', got {on_nonfinite!r}")
    if (reward_model is None) == (reward_fn is None):
        raise ValueError(
            f"{name}: give exactly one of reward_model (a ModelSpec) or reward_fn ('module:function')"
        )
    if forward_batch_size <= 0:
        raise ValueError(f"{name}: forward_batch_size must be > 0, got {forward_batch_size}")
    if kl_coef < 0:
        raise ValueError(f"{name}: kl_coef must be >= 0, got {kl_coef}")
    if max_rollouts is not None and max_rollouts < 1:
        raise ValueError(f"{name}: max_rollouts must be >= 1 or None, got {max_rollouts}")
    if log_samples_every < 0:
        raise ValueError(f"{name}: log_samples_every must be >= 0, got {log_samples_every}")


def check_finite_floats(name: str, args: dict) -> None:
    """Refuse NaN and infinite float arguments (``clip_coef: nan`` would pass every ``<= 0`` check)."""
    for key, value in args.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}: {key} must be a finite number, got {value}")


"""The online-RL base: what every on-policy algorithm (PPO, GRPO, RLOO, REINFORCE++) shares.

:class:`OnlineRLModule` owns the actor, the reference (or the LoRA-disabled actor), the reward source and
the monitor reward, generation with K samples per prompt, the old/reference log-prob scoring, the score
adjustments, the rollout metrics and sample tables, the minibatch update loop, the KL controller, the
checkpoint state of an exact resume and the Hugging Face export. A subclass writes its own numbered
``training_step`` over these parts, its loss and its optimisers. The scoring of a rollout lives in
:mod:`~lit_rlhf.modules.online_scoring`, evaluation rollouts in :mod:`~lit_rlhf.modules.online_eval`,
metrics, resume state and export in :mod:`~lit_rlhf.modules.online_bookkeeping` (mixins of this class).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from functools import partial

import torch
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.batching import Bucketing
from lit_rlhf.data.base import resolve_seed
from lit_rlhf.data.contract import check_batch, left_pad_prompts
from lit_rlhf.guards import NonFinitePolicy, StepGuard, check_finite_weights
from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    check_shared_prefix_mode,
    disable_dropout,
    frozen_copy,
    load_tokenizer,
)
from lit_rlhf.modules.base import internal_base
from lit_rlhf.modules.distributed import clip_grad_norm, generation_context, shard_models
from lit_rlhf.modules.metrics import MetricGroup, accumulate_stats
from lit_rlhf.modules.online_bookkeeping import OnlineBookkeeping
from lit_rlhf.modules.online_checks import check_online_args
from lit_rlhf.modules.online_eval import OnlineEvaluation, evaluation_settings
from lit_rlhf.modules.online_scoring import RolloutScoring
from lit_rlhf.replay import ReplayBuffer
from lit_rlhf.rewards import RewardSource
from lit_rlhf.rollout import GenerationSettings, Rollout, generate_responses

ROLLOUT_METRICS = (
    "score", "reward", "kl_ref", "response_length", "eos_rate", "entropy", "monitor_score",
    "group_score_std", "group_all_equal_frac", "nonfinite_scores",
)  # fmt: skip
LossFn = Callable[[Rollout], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@internal_base
class OnlineRLModule(OnlineEvaluation, RolloutScoring, OnlineBookkeeping):
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

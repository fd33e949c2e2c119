"""The online-RL base: what every on-policy algorithm (PPO, GRPO, RLOO, REINFORCE++) shares.

:class:`OnlineRLModule` owns the actor, the reference (or the LoRA-disabled actor), the reward source and
the monitor reward, the rollout engine, the old/reference log-prob scoring, the score adjustments, the
rollout metrics and sample tables, the minibatch update loop, the KL controller, the checkpoint state of an
exact resume and the Hugging Face export. A subclass declares its settings and its loss, and writes its own
numbered ``training_step`` over these parts (see :class:`OnlineRLModule` for the contract). The scoring of a
rollout lives in :mod:`~lit_rlhf.modules.online_scoring`, evaluation rollouts in
:mod:`~lit_rlhf.modules.online_eval`, metrics, resume state and export in
:mod:`~lit_rlhf.modules.online_bookkeeping` (mixins of this class), the settings groups in
:mod:`~lit_rlhf.modules.online_settings`, the engines in :mod:`lit_rlhf.engines`.

Shapes: B rollout rows, P prompt length (left-padded), T response length (right-padded).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_rlhf import functional as F
from lit_rlhf.data.base import resolve_seed
from lit_rlhf.engines import ENGINE_STATS, RolloutEngine, build_engine, engine_hparams
from lit_rlhf.ensembles import coerce_reward_model
from lit_rlhf.environments import EPISODE_METRICS, EnvironmentSettings, import_environment
from lit_rlhf.guards import StepGuard
from lit_rlhf.models import (
    ModelSpec,
    build_causal_lm,
    check_shared_prefix_mode,
    check_shared_tokenizer,
    disable_dropout,
    frozen_copy,
    load_tokenizer,
    refuse_unsupported_shared_prefix,
)
from lit_rlhf.modules.base import check_data_tokenizer, internal_base, plain_value
from lit_rlhf.modules.distributed import shard_models
from lit_rlhf.modules.metrics import MetricGroup
from lit_rlhf.modules.online_bookkeeping import OnlineBookkeeping
from lit_rlhf.modules.online_eval import OnlineEvaluation
from lit_rlhf.modules.online_generation import OnlineGeneration, set_engine_model
from lit_rlhf.modules.online_migration import migrate_checkpoint_hparams, moved_hint
from lit_rlhf.modules.online_old_logprobs import OldLogprobSource
from lit_rlhf.modules.online_scoring import RolloutScoring
from lit_rlhf.modules.online_settings import (
    EvaluationSettings,
    KLSettings,
    SampleSettings,
    ScoringSettings,
    UpdateSettings,
)
from lit_rlhf.modules.online_update import OnlineUpdate
from lit_rlhf.replay import ReplayBuffer
from lit_rlhf.rewards import RewardSource, RewardTerm
from lit_rlhf.rollout import GenerationSettings
from lit_rlhf.settings import Settings

ROLLOUT_METRICS = (
    "score", "reward", "kl_ref", "response_length", "eos_rate", "entropy", "monitor_score",
    "group_score_std", "group_all_equal_frac", "nonfinite_scores", "ensemble_std", *F.BEHAVIOR_MISMATCH_STATS,
    *(f"engine_{name}" for name in ENGINE_STATS),
    *F.IS_CORRECTION_STATS, *EPISODE_METRICS,
)  # fmt: skip
# set while load_from_checkpoint constructs a module: flat hyper-parameters of old checkpoints are mapped
_LOADING_CHECKPOINT: ContextVar[bool] = ContextVar("lit_rlhf_loading_checkpoint", default=False)


@internal_base
class OnlineRLModule(
    OnlineGeneration, OnlineUpdate, OnlineEvaluation, RolloutScoring, OldLogprobSource, OnlineBookkeeping
):
    """Shared parts of the on-policy RLHF modules (manual optimisation, one rollout per ``training_step``).

    The contract with an algorithm (a subclass):

    - its ``__init__`` declares its own arguments (the config schema), takes ``**kwargs`` for these shared
      ones and calls ``super().__init__(**kwargs)`` first, passing on the groups it types itself (e.g.
      ``update=update``); it then builds its own models inside :meth:`seeded_init`;
    - class attributes: ``metric_prefix`` (namespace of its update metrics), ``loss_stats`` (the names of
      the stats its loss returns; ``policy_kl`` always, ``ratio_mean`` for ``update.ratio_threshold``),
      ``extra_metrics`` (other per-rollout metrics it logs under its prefix), ``settings_groups`` (the group
      class of each settings argument), ``packed_forwards`` (whether its forwards have a shared-prompt form);
    - ``training_step`` (numbered steps over :meth:`sample`, :meth:`score_rollout`,
      :meth:`score_responses`, :meth:`run_update_epochs`, :meth:`finish_rollout`) and
      ``configure_optimizers``; it passes the sample's ``responses`` to :meth:`score_rollout`, so the
      sampler's record can stand in for the actor's scoring forward (``scoring.old_logprobs``), and says
      in ``policy_forward_needed`` / ``rollout_values`` what else its scoring needs (PPO: the critic).

    The contract is checked when the module is constructed, and each loss's stats when it returns them.

    Args:
        actor: the policy to train (usually the SFT export); a ModelSpec, a dict of its fields or a path.
        reference: the reference policy of the KL; None = the initial actor (a frozen copy, or for a LoRA
            actor the actor with its adapters disabled: no second copy).
        reward_model: reward model spec or exported folder (``name_or_path``), or a reward-model ensemble:
            an exported ensemble folder or ``{ensemble: [...] | folder, aggregation, coef}``
            (``lit_rlhf.ensembles``; each member's score logged as ``rollout/reward/member_<k>``, their
            spread as ``rollout/ensemble_std``), or a reward model's last-layer posterior ``{posterior: folder,
            coef}`` (``lit_rlhf.posterior``); exclusive with reward_fn (with an ``environment`` both may be
            None: its rewards are the score). Dicts are read by ``lit_rlhf.ensembles.coerce_reward_model``.
        reward_fn: ``package.module:function`` scoring the responses (this project's ``fn(prompts, responses,
            **columns)`` or TRL's ``fn(completions, **kwargs)``, see ``lit_rlhf.reward_fns``), or a list of
            ``{fn, weight, name, kwargs}`` (``lit_rlhf.rewards.RewardTerm``; a plain ``module:function`` has
            weight 1) whose weighted sum is the score, each function's raw score logged as
            ``rollout/reward/<name>``.
        monitor_reward_fn: a second ``module:function`` scorer that is only logged
            (``rollout/monitor_score``), never optimised: e.g. a gold reward beside a proxy reward model.
        engine: the rollout engine (``lit_rlhf.engines``): None = Hugging Face ``generate`` on the actor
            (``HFEngine``); a name (``hf``), a ``{class_path, init_args}`` dict or an engine instance.
        generation: sampling settings of the rollout (``GenerationSettings`` or a dict of its fields);
            ``num_samples`` is K, the responses per prompt.
        update: the update phase (``UpdateSettings``: epochs, minibatches, clip ranges, loss aggregation, ...,
            and ``is_correction``, the importance-sampling correction of the engine/trainer mismatch).
        kl: the KL to the reference (``KLSettings``: in the reward, adaptive or fixed, and in the loss).
        scoring: the rollout's no-grad forwards and its scores (``ScoringSettings``: forward batch size,
            bucketing, shared prefix, score clip, missing-EOS penalty, non-finite scores).
        samples: the sample tables (``SampleSettings``: every, rows).
        evaluation: the evaluation rollouts of ``validate``/``test`` (``EvaluationSettings``: generation
            overrides, greedy).
        environment: multi-turn episodes instead of one response per row (``EnvironmentSettings``: the
            ``package.module:Class`` of a ``lit_rlhf.environments.Environment``, its kwargs, ``max_turns``,
            ``max_total_tokens``, ``stop_strings``; a plain ``module:Class`` string is its ``env``). The score
            is the sum of the episode's step rewards plus the reward source's score of the transcript.
        max_rollouts: stop fitting after this many rollouts (None = the trainer's limits decide).
        rng_seed: seed of the model initialisations, the minibatch shuffling and the evaluation sampling
            (named apart from the DataModule's ``seed``); None follows ``seed_everything`` (the value used is
            stored in the hyper-parameters and checkpoints).
    """

    # the algorithm's contract (see the class docstring)
    metric_prefix: ClassVar[str] = "policy"
    loss_stats: ClassVar[tuple[str, ...]] = ()
    extra_metrics: ClassVar[tuple[str, ...]] = ()
    settings_groups: ClassVar[dict[str, type[Settings]]] = {
        "generation": GenerationSettings, "update": UpdateSettings, "kl": KLSettings,
        "scoring": ScoringSettings, "samples": SampleSettings, "evaluation": EvaluationSettings,
        "environment": EnvironmentSettings,
    }  # fmt: skip
    packed_forwards: ClassVar[bool] = True
    # models sharded by ``configure_model`` (dotted attribute paths; missing or None ones are skipped)
    sharded_models: tuple[str, ...] = ("actor", "reference", "rewards.model", "monitor.model")

    def __init__(
        self,
        *,
        actor: ModelSpec | dict | str,
        reference: ModelSpec | dict | str | None = None,
        reward_model: ModelSpec | dict | str | None = None,
        reward_fn: str | list[RewardTerm | dict | str] | None = None,
        monitor_reward_fn: str | None = None,
        engine: RolloutEngine | dict | str | None = None,
        generation: GenerationSettings | None = None,
        update: UpdateSettings | None = None,
        kl: KLSettings | None = None,
        scoring: ScoringSettings | None = None,
        samples: SampleSettings | None = None,
        evaluation: EvaluationSettings | None = None,
        environment: EnvironmentSettings | dict | str | None = None,
        max_rollouts: int | None = None,
        rng_seed: int | None = None,
        **groups: Any,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        groups = dict(generation=generation, update=update, kl=kl, scoring=scoring, samples=samples,
                      evaluation=evaluation, environment=environment, **groups)  # fmt: skip
        engine = self.configure_settings(groups, engine, reward_model, reward_fn, max_rollouts)
        self.engine = build_engine(engine, f"{type(self).__name__}: engine")
        self._engine_model: torch.nn.Module | None = None
        self.old_logprobs_sampled = False  # the last score_rollout took old_logprobs from the sampler's record
        self.max_rollouts = max_rollouts
        self.rng_seed = resolve_seed(rng_seed)
        self.build_shared_models(actor, reference, reward_model, reward_fn, monitor_reward_fn)
        refuse_unsupported_shared_prefix(
            f"{type(self).__name__}: scoring.shared_prefix", self.shared_prefix, actor=self.actor, reference=self.reference
        )
        self.kl_ctl = self.build_kl_controller(self.kl.coef)
        self.buffer = ReplayBuffer(self.update.num_minibatches, self.rng_seed)
        update_names = (*self.loss_stats, *self.extra_metrics, "skipped_minibatches", "nonfinite_steps")
        self.rollout_metrics = MetricGroup((*ROLLOUT_METRICS, *self.reward_term_metrics()))
        self.update_metrics = MetricGroup(update_names)
        self.rollouts_done = 0
        self.step_guard = StepGuard()  # skips (and counts) minibatches with a non-finite loss or gradient
        self._rng_to_restore: dict[str, Any] | None = None
        self.strict_loading = False  # frozen weights are rebuilt in __init__, not checkpointed
        shared = dict(reference=reference, reward_model=reward_model, reward_fn=self.rewards.config_value,
                      monitor_reward_fn=monitor_reward_fn)  # fmt: skip
        self.save_plain_hyperparameters(inspect.currentframe().f_back, shared)

    def configure_settings(self, groups: dict, engine: Any, reward_model, reward_fn, max_rollouts) -> Any:
        """Check the arguments and set the checked settings groups (``self.update``, ``self.kl``, ...);
        returns the engine argument (from an old flat checkpoint's ``generation``, when it had one)."""
        name = type(self).__name__
        if _LOADING_CHECKPOINT.get() and set(groups) - set(self.settings_groups):  # an old flat checkpoint
            rank_zero_warn(f"{name}: the checkpoint's flat hyper-parameters were mapped into settings groups")
            groups = migrate_checkpoint_hparams(type(self), {k: v for k, v in groups.items() if v is not None})
            engine = groups.pop("engine", engine)
        self.check_arguments(groups, reward_model, reward_fn, max_rollouts)
        for key, cls in self.settings_groups.items():
            setattr(self, key, coerce_group(cls, groups.get(key), f"{name}: {key}"))
        self.check_loss_contract()
        self.eval_generation = self.evaluation.resolve(self.generation)
        env = self.environment
        self.env_cls = import_environment(env.env, f"{name}: environment.env") if env.enabled else None
        self.shared_prefix = self.resolve_shared_prefix(self.scoring.shared_prefix)
        return engine

    def build_shared_models(self, actor, reference, reward_model, reward_fn, monitor_reward_fn) -> None:
        """The tokenizer, actor, reference, reward source and monitor, on the seeded initialisation stream."""
        actor = ModelSpec.coerce(actor, "actor")
        reward_model = coerce_reward_model(reward_model)  # its settings checked before any model loads
        self.actor_lora = actor.lora is not None
        self.tokenizer_source = actor.tokenizer or actor.name_or_path
        self.tokenizer = load_tokenizer(
            self.tokenizer_source, padding_side="left", trust_remote_code=actor.trust_remote_code
        )
        self._init_seed, self._init_rng_state = self.rng_seed, None
        with self.seeded_init():  # seeded, so a resumed run rebuilds identical frozen models
            self.actor = build_causal_lm(actor, self.tokenizer)
            disable_dropout(self.actor)
            if reference is not None:
                self.reference = frozen_copy(build_causal_lm(self.shares_tokenizer(reference, "reference"), self.tokenizer))
            else:  # a LoRA actor with disabled adapters is its own reference (no second copy)
                self.reference = None if actor.lora else frozen_copy(self.actor)
            self.rewards = RewardSource(reward_model, reward_fn, self.tokenizer)
            self.monitor = (
                None
                if monitor_reward_fn is None
                else RewardSource(None, monitor_reward_fn, self.tokenizer, "monitor_reward_fn")
            )

    def shares_tokenizer(self, spec: Any, role: str) -> ModelSpec:
        """``spec`` as a ModelSpec, refused when its own tokenizer is not the actor's (it reads the actor's ids)."""
        spec = ModelSpec.coerce(spec, role)
        own = spec.tokenizer or spec.name_or_path
        check_shared_tokenizer(
            own, role, self.tokenizer, self.tokenizer_source, owner=type(self).__name__,
            trust_remote_code=spec.trust_remote_code,
        )  # fmt: skip
        return spec

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> OnlineRLModule:
        """Lightning's ``load_from_checkpoint``; a checkpoint written with the earlier flat arguments
        (``ppo_epochs``, ``kl_coef``, ...) has them mapped into their settings groups."""
        token = _LOADING_CHECKPOINT.set(True)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            _LOADING_CHECKPOINT.reset(token)

    def check_arguments(self, groups: dict, reward_model, reward_fn, max_rollouts) -> None:
        """Refuse unknown arguments (naming the settings group an old flat one moved to) and the
        cross-argument mistakes no single group can see."""
        name = type(self).__name__
        unknown = sorted(set(groups) - set(self.settings_groups))
        if unknown:
            hints = [moved_hint(key, type(self)) or f"{key}: no such argument" for key in unknown]
            raise TypeError(f"{name}: unexpected argument(s) {unknown}: " + "; ".join(hints))
        with_env = EnvironmentSettings.coerce(groups.get("environment"), f"{name}: environment").enabled
        if reward_model is not None and reward_fn is not None or (reward_model is None and reward_fn is None and not with_env):
            raise ValueError(
                f"{name}: give exactly one of reward_model (a ModelSpec) or reward_fn ('module:function' or "
                "a list of {fn, weight}), or an environment whose rewards score the episodes"
            )
        if max_rollouts is not None and max_rollouts < 1:
            raise ValueError(f"{name}: max_rollouts must be >= 1 or None, got {max_rollouts}")

    @classmethod
    def required_stats(cls, update: UpdateSettings) -> tuple[str, ...]:
        """The stats every loss must return: ``policy_kl`` (the last epoch's KL), and ``ratio_mean``
        when minibatches are skipped by ``update.ratio_threshold``."""
        return ("policy_kl",) + (("ratio_mean",) if update.ratio_threshold is not None else ())

    def check_loss_contract(self) -> None:
        """The algorithm declares every stat the update loop reads from its loss (``loss_stats``)."""
        missing = [s for s in self.required_stats(self.update) if s not in self.loss_stats]
        if missing:
            raise TypeError(
                f"{type(self).__name__}: its loss must return the stat(s) {missing} (the update loop reads "
                f"them); declare them in `loss_stats` (now {list(self.loss_stats)}) and return them"
            )

    def resolve_shared_prefix(self, mode: str) -> str:
        """``scoring.shared_prefix`` for this module: ``auto`` is ``off`` where the forwards have no packed
        form (``packed_forwards``), where ``on`` is refused."""
        name = type(self).__name__
        mode = check_shared_prefix_mode(mode, f"{name}: scoring.shared_prefix")
        if not self.packed_forwards:
            if mode == "on":
                raise ValueError(
                    f"{name}: scoring.shared_prefix='on' needs forwards with a shared-prompt form, which this "
                    "module's (e.g. its critic's) have not; use 'off' or 'auto'"
                )
            return "off"
        return mode

    def save_plain_hyperparameters(self, frame, shared: dict[str, Any]) -> None:
        """``save_hyperparameters`` of every ``__init__`` argument of the module's classes, with the settings
        groups, model specs and the engine stored as plain dicts (``hparams.yaml`` holds no
        ``!!python/object`` tags, and a checkpoint loads without unpickling library classes), ``rng_seed``
        as resolved; optimiser and scheduler factories are left out."""
        self.save_hyperparameters(frame=frame)
        plain = {key: getattr(self, key).as_dict() for key in self.settings_groups}
        plain.update(shared, engine=engine_hparams(self.engine), rng_seed=self.rng_seed, max_rollouts=self.max_rollouts)
        for store in (self._hparams, self._hparams_initial):
            for key in [k for k in store if k.endswith(("_optimizer", "_scheduler"))]:
                del store[key]
            store.update(plain)
            for key, value in store.items():  # ModelSpec, also inside an ensemble's list of members
                store[key] = plain_value(value)

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

    def whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """``masked_whiten`` of this rank's rows with the mean and variance of every data-parallel rank's rows.

        One all-reduce of three numbers (count, sum, sum of squares), so a run on N ranks whitens like one
        process holding the N rollouts; ``strategy.reduce`` is the identity on a single device. With a single
        learned token on all ranks (one prompt, K = 1, a one-token response) there is no spread to whiten by:
        the limit of ``(x - mean) / sqrt(var + eps)`` at var 0 is taken, 0 (``shift_mean``) or ``x`` itself.
        """
        moments = self.trainer.strategy.reduce(F.masked_moments(x, mask), reduce_op="sum")
        if int(moments[0]) < 2:
            x = x.to(torch.promote_types(x.dtype, torch.float32))
            return torch.where(mask.bool(), x, 0.0) if not shift_mean else torch.zeros_like(x)
        return F.whiten_from_moments(x, mask, moments, shift_mean)

    def build_kl_controller(self, coef: float, floor: float = 0.0) -> F.KLController:
        """The controller of the KL coefficient starting at ``coef``: fixed, or adaptive towards ``kl.target``
        (never below ``floor``)."""
        if self.kl.target is None:
            return F.FixedKLController(coef)
        return F.AdaptiveKLController(coef, self.kl.target, self.kl.horizon, floor=floor)

    def update_kl_controller(self, kl: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """Advance the KL controller with the mean sequence KL of every rank's rows."""
        global_kl = self.all_gather(F.masked_row_sum(kl, loss_mask).mean()).mean().item()
        self.kl_ctl.update(global_kl, n_steps=loss_mask.shape[0] * self.trainer.world_size)

    def lr_schedulers_list(self) -> list:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return schedulers if isinstance(schedulers, list) else [schedulers]

    @override
    def setup(self, stage: str) -> None:
        check_data_tokenizer(self, self.tokenizer_source)
        if stage == "fit":
            self.check_precision_fit()
            self.check_minibatches_fit()

    # -- sharding and the engine's lifecycle ------------------------------------------------------------
    @override
    def configure_model(self) -> None:
        shard_models(self, self.sharded_models)

    @override
    def teardown(self, stage: str) -> None:
        self.engine.close()
        set_engine_model(self, None)


def coerce_group(cls: type[Settings], value: Any, argument: str) -> Settings:
    """``cls.coerce(value)``, its messages prefixed with the module's name."""
    try:
        return cls.coerce(value, argument)
    except (TypeError, ValueError) as err:
        message = str(err)
        if not message.startswith(argument.split(":")[0] + ":"):
            message = f"{argument.split(':')[0]}: {message}"
        raise type(err)(message) from err

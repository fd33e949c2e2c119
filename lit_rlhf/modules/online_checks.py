"""Early checks of the online modules' constructor arguments, with messages naming the module and the
argument (the ``__init__`` signatures are the config schema; these run before any model is built)."""

from __future__ import annotations

import math

from lit_rlhf import functional as F
from lit_rlhf.models import ModelSpec
from lit_rlhf.rollout import GenerationSettings


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


def check_critic_free_args(args: dict) -> None:
    """Check CriticFreeModule's own arguments early, with messages naming the argument."""
    name, estimator = "CriticFreeModule", args["advantage_estimator"]
    check_finite_floats(name, args)
    if estimator == "gae":
        raise ValueError(
            f"{name}: advantage_estimator='gae' needs a critic; use lit_rlhf.modules.PPOModule for GAE"
        )
    if estimator not in F.SEQUENCE_ESTIMATORS:
        raise ValueError(
            f"{name}: advantage_estimator must be one of {F.SEQUENCE_ESTIMATORS}, got {estimator!r}"
        )
    generation = GenerationSettings.coerce(args["generation"], "generation")
    if estimator in F.GROUP_ESTIMATORS and generation.num_samples < 2:
        raise ValueError(
            f"{name}: advantage_estimator={estimator!r} needs generation.num_samples >= 2 (its baseline is "
            f"the other responses to the same prompt), got num_samples={generation.num_samples}"
        )
    for key in ("ppo_epochs", "num_minibatches", "forward_batch_size", "clip_coef"):
        if args[key] <= 0:
            raise ValueError(f"{name}: {key} must be > 0, got {args[key]}")
    if args["clip_coef_high"] is not None and args["clip_coef_high"] <= 0:
        raise ValueError(f"{name}: clip_coef_high must be > 0 or None, got {args['clip_coef_high']}")
    for key in ("ent_coef", "kl_coef", "kl_loss_coef"):
        if args[key] < 0:
            raise ValueError(f"{name}: {key} must be >= 0, got {args[key]}")
    if not 0.0 <= args["gamma"] <= 1.0:
        raise ValueError(f"{name}: gamma must be in [0, 1], got {args['gamma']}")
    if args["loss_aggregation"] not in F.LOSS_AGGREGATIONS:
        raise ValueError(
            f"{name}: loss_aggregation must be one of {F.LOSS_AGGREGATIONS}, got {args['loss_aggregation']!r}"
        )
    if args["importance_sampling_level"] not in F.IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"{name}: importance_sampling_level must be 'token' or 'sequence', "
            f"got {args['importance_sampling_level']!r}"
        )
    for key in ("kl_estimator", "kl_loss_estimator"):
        if args[key] not in F.KL_ESTIMATORS:
            raise ValueError(f"{name}: {key} must be one of {F.KL_ESTIMATORS}, got {args[key]!r}")


def check_ppo_args(args: dict) -> None:
    """Check PPOModule's own arguments early, with messages naming the argument."""
    check_finite_floats("PPOModule", args)
    if (args["reward_model"] is None) == (args["reward_fn"] is None):
        raise ValueError(
            "PPOModule: give exactly one of reward_model (a ModelSpec) or reward_fn ('module:function')"
        )
    if args["share_critic_backbone"] and args["critic"] is not None:
        raise ValueError(
            "PPOModule: share_critic_backbone=True uses a value head on the actor; do not also set critic"
        )
    for name in (
        "ppo_epochs",
        "num_minibatches",
        "forward_batch_size",
        "clip_coef",
        "init_beta",
        "beta_target",
    ):
        if args[name] <= 0:
            raise ValueError(f"PPOModule: {name} must be > 0, got {args[name]}")
    if args["clip_coef_high"] is not None and args["clip_coef_high"] <= 0:
        raise ValueError(f"PPOModule: clip_coef_high must be > 0 or None, got {args['clip_coef_high']}")
    if args["clip_coef_value"] <= 0:  # 0 would pin the values to the old ones: the critic could not learn
        raise ValueError(f"PPOModule: clip_coef_value must be > 0, got {args['clip_coef_value']}")
    for name in ("vf_coef", "ent_coef", "kl_coef"):
        if args[name] < 0:
            raise ValueError(f"PPOModule: {name} must be >= 0, got {args[name]}")
    for name in ("gamma", "gae_lambda"):
        if not 0.0 <= args[name] <= 1.0:
            raise ValueError(f"PPOModule: {name} must be in [0, 1], got {args[name]}")
    if args["loss_aggregation"] not in F.LOSS_AGGREGATIONS:
        raise ValueError(
            f"PPOModule: loss_aggregation must be one of {F.LOSS_AGGREGATIONS}, got {args['loss_aggregation']!r}"
        )
    if args["policy_loss"] not in ("clip", "kl_penalty"):
        raise ValueError(
            f"PPOModule: policy_loss must be 'clip' or 'kl_penalty', got {args['policy_loss']!r}"
        )

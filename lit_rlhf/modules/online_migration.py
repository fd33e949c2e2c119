"""Where the online modules' flat arguments of the earlier layout went, and the rewrite into groups.

:data:`MOVED` maps every flat argument (``ppo_epochs``, ``kl_coef``, ...) to its settings group and field;
:func:`migrate_flat_kwargs` rewrites such arguments (a Python call, an old checkpoint's hyper-parameters)
into groups; :func:`moved_hint` says where one went, for error messages (the modules, the CLI).
"""

from __future__ import annotations

import importlib
from typing import Any

from lit_rlhf.settings import Settings

__all__ = ["MOVED", "migrate_checkpoint_hparams", "migrate_flat_kwargs", "moved_hint"]

_SHARED = {
    "ppo_epochs": "update.epochs", "num_minibatches": "update.num_minibatches",
    "clip_coef": "update.clip_coef", "clip_coef_high": "update.clip_coef_high",
    "loss_aggregation": "update.loss_aggregation", "ent_coef": "update.ent_coef",
    "max_grad_norm": "update.max_grad_norm", "ratio_threshold": "update.ratio_threshold",
    "importance_sampling_level": "update.importance_sampling_level",
    "kl_coef": "kl.coef", "kl_target": "kl.target", "kl_horizon": "kl.horizon", "kl_estimator": "kl.estimator",
    "kl_loss_coef": "kl.loss_coef", "kl_loss_estimator": "kl.loss_estimator",
    "forward_batch_size": "scoring.forward_batch_size", "bucketing": "scoring.bucketing",
    "shared_prefix": "scoring.shared_prefix", "score_clip": "scoring.score_clip",
    "missing_eos_penalty": "scoring.missing_eos_penalty", "on_nonfinite": "scoring.on_nonfinite",
    "log_samples_every": "samples.every", "num_log_samples": "samples.rows",
    "eval_generation": "evaluation.generation", "eval_greedy": "evaluation.greedy",
    "gamma": "advantage.gamma",
}  # fmt: skip
MOVED: dict[str, dict[str, str]] = {
    "PPOModule": {
        **_SHARED, "policy_loss": "update.policy_loss", "init_beta": "update.init_beta",
        "beta_target": "update.beta_target", "vf_coef": "update.vf_coef", "clip_coef_value": "update.clip_coef_value",
        "gae_lambda": "advantage.gae_lambda", "whiten_advantages": "advantage.whiten",
        "whiten_rewards": "advantage.whiten_rewards",
    },
    "CriticFreeModule": {
        **_SHARED, "advantage_estimator": "advantage.estimator",
        "old_logprobs_from_update": "update.old_logprobs_from_update",
    },
}  # fmt: skip
def moved_hint(key: str, module: str | None = None) -> str | None:
    """Where an old flat argument went, as a sentence; None if unknown.

    ``module`` (a class name) names that module's place only; None names each module's.
    """
    name = key.rsplit(".", 1)[-1]
    modules = [_module_name(module)] if module is not None and _module_name(module) in MOVED else list(MOVED)
    places = sorted({MOVED[m][name] for m in modules if name in MOVED[m]})
    if not places:
        return None
    return f"{name!r} is now {' / '.join(repr(p) for p in places)}"


def _module_name(cls: type | str) -> str:
    """The name of ``cls``'s online module class of :data:`MOVED` (a user's subclass maps to its base)."""
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1]
    for base in cls.__mro__:
        if base.__name__ in MOVED:
            return base.__name__
    return cls.__name__


def migrate_flat_kwargs(cls: type | str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of the earlier flat layout of ``cls`` (a module class or its name) rewritten into groups.

    Flat keys go into their group's dict (merged with a group already given as a dict). Keys of the new
    layout pass through unchanged, so the result of a new-layout call is that call.
    """
    moved = MOVED.get(_module_name(cls), {})
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        if key in moved:
            group, name = moved[key].split(".")
            groups.setdefault(group, {})[name] = value
        else:
            out[key] = value
    for group, values in groups.items():
        given = out.get(group)
        given = given.as_dict() if isinstance(given, Settings) else dict(given or {})
        out[group] = {**given, **values}
    return out



def migrate_checkpoint_hparams(cls: type | str, hparams: dict[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """The hyper-parameters of a checkpoint written with the earlier flat layout, in groups (unchanged when
    they are in the current layout or belong to another module).

    ``metric_prefix`` and ``update_metrics`` (stored by the earliest versions) are dropped; a key that is
    neither a current argument nor a known flat one is left for the loader to refuse.
    """
    name = _module_name(cls)
    if name in MOVED and any(k in MOVED[name] for k in hparams):
        hparams = {k: v for k, v in hparams.items() if k not in ("metric_prefix", "update_metrics")}
        hparams = migrate_flat_kwargs(name, hparams)
    return _migrate_group_fields(cls, hparams)


def _migrate_group_fields(cls: type | str, hparams: dict[str, Any]) -> dict[str, Any]:
    """Each settings group given as a dict with its fields of earlier versions rewritten (``Settings.migrate``,
    e.g. ``generation.transposed_head``), so that a parser that checks the group's fields takes it."""
    if isinstance(cls, str):
        module, _, attr = cls.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError):
            return hparams
    groups = getattr(cls, "settings_groups", None) or {}
    changed = {
        key: group.migrate(dict(hparams[key])) for key, group in groups.items() if isinstance(hparams.get(key), dict)
    }
    return {**hparams, **changed} if any(changed[k] != hparams[k] for k in changed) else hparams

"""Reward-model ensembles as one reward source: how an online module's ``reward_model`` names one, and the
folder an ensemble is exported to.

An online module's ``reward_model`` is an ensemble when it is

- the folder of an ensemble (``reward_model: runs/rm_ensemble/export``, or ``{name_or_path: ...}`` with the
  other ModelSpec fields, e.g. ``dtype``, applied to every member): a folder holding ``ensemble.json``, as
  :class:`~lit_rlhf.modules.RewardEnsembleModule` exports (``HFExport``) or :func:`write_ensemble_manifest`
  writes beside reward models trained apart;
- or a :class:`RewardEnsemble`: ``{ensemble: [member specs or folders] | folder, aggregation: mean_minus_std,
  coef: 1.0}``.

Every member scores every response; the score is their aggregate (``functional.aggregate_ensemble``: mean,
mean_minus_std, mean_minus_var, min) and each member's raw score is logged as ``rollout/reward/member_<k>``
with their spread as ``rollout/ensemble_std`` (see ``lit_rlhf.rewards.RewardSource``).

``ensemble.json``::

    {"format": "lit_rlhf.reward_ensemble", "version": 1, "members": ["member_0", "member_1", "member_2"],
     "aggregation": "mean_minus_std", "coef": 1.0}

``members`` are folders relative to the manifest's (or absolute); ``aggregation`` and ``coef`` are the
defaults a ``RewardEnsemble`` may override. An optional ``member_stats``, ``[{"mean": m, "std": s}, ...]`` (one
per member: its scores' mean and standard deviation on a reference set such as held-out pairs), puts the
members on one scale before they are aggregated (``functional.standardize_members``; ``normalize``). Other keys
(``seeds``, ``bootstrap``) record how it was trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

import yaml

from lit_rlhf.functional.ensembles import ENSEMBLE_AGGREGATIONS
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.posterior import PosteriorReward
from lit_rlhf.settings import Settings

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENSEMBLE_MANIFEST",
    "EnsembleMembers",
    "RewardEnsemble",
    "check_member_tokenizers",
    "coerce_reward_model",
    "is_ensemble_folder",
    "read_ensemble_manifest",
    "write_ensemble_manifest",
]

ENSEMBLE_MANIFEST = "ensemble.json"
MANIFEST_FORMAT = "lit_rlhf.reward_ensemble"
Aggregation = Literal["mean", "mean_minus_std", "mean_minus_var", "min"]


class EnsembleMembers(NamedTuple):
    """An ensemble resolved for building: the members' specs, the aggregation and its coefficient, where it
    came from (for messages), and the members' (mean, std) reference statistics when they are standardised
    before the aggregation (None: raw scores)."""

    members: list[ModelSpec]
    aggregation: str
    coef: float
    source: str
    stats: list[tuple[float, float]] | None = None


def check_member_stats(stats: Any, n_members: int, where: str) -> list[tuple[float, float]]:
    """``[{"mean": m, "std": s}, ...]`` (one per member, finite, std > 0) as (mean, std) pairs."""
    if not isinstance(stats, (list, tuple)) or len(stats) != n_members:
        raise ValueError(
            f"{where}: member_stats must be a list of {n_members} {{mean, std}} entries (one per member), "
            f"got {stats!r:.200}"
        )
    out = []
    for k, entry in enumerate(stats):
        mean, std = (entry.get("mean"), entry.get("std")) if isinstance(entry, dict) else (None, None)
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (mean, std))
        if not ok or std <= 0:
            raise ValueError(f"{where}: member_stats[{k}] must be {{mean: finite, std: finite > 0}}, got {entry!r}")
        out.append((float(mean), float(std)))
    return out


@dataclass
class RewardEnsemble(Settings):
    """A reward-model ensemble as an online module's ``reward_model``.

    Attributes:
        ensemble: the members: a list of reward-model specs (``ModelSpec``, dicts of its fields or folders;
            at least 2, one tokenizer for all), or the folder of an exported ensemble (its ``ensemble.json``).
        aggregation: how the members' scores become one (``functional.aggregate_ensemble``): ``mean``,
            ``mean_minus_std`` (UWO with the standard deviation), ``mean_minus_var`` (UWO as Coste et al.
            2024, arXiv:2310.02743, sec. 3) or ``min`` (WCO); None = the folder's manifest's, or ``mean``.
        coef: lambda >= 0 of the ``mean_minus_*`` aggregations; None = the manifest's, or 1.0.
        member_stats: each member's ``{mean, std}`` on a reference set (held-out pairs): None = the
            manifest's, if any.
        normalize: standardise the members with ``member_stats`` before aggregating
            (``functional.standardize_members``: Bradley-Terry scores have arbitrary offsets, so raw members'
            spread measures their offsets as much as their disagreement); None = whenever statistics are known.
    """

    group: ClassVar[str] = "reward_model"

    ensemble: str | list[ModelSpec | dict | str]
    aggregation: Aggregation | None = None
    coef: float | None = None
    member_stats: list[dict] | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        members = self.ensemble
        if isinstance(members, (list, tuple)):
            self.require(
                "ensemble",
                len(members) >= 2,
                "at least 2 members (one reward model: reward_model: {name_or_path: ...})",
            )
            self.ensemble = [
                ModelSpec.coerce(m, f"reward_model.ensemble[{i}]") for i, m in enumerate(members)
            ]
        else:
            self.require(
                "ensemble", isinstance(members, str) and bool(members), "a folder or a list of member specs"
            )
        if self.aggregation is not None:
            self.require_choice("aggregation", ENSEMBLE_AGGREGATIONS)
        if self.coef is not None:
            ok = (
                isinstance(self.coef, (int, float))
                and not isinstance(self.coef, bool)
                and math.isfinite(self.coef)
            )
            self.require("coef", ok and self.coef >= 0, "a finite number >= 0 or None")
            self.coef = float(self.coef)
        if self.normalize is not None:
            self.require("normalize", isinstance(self.normalize, bool), "true, false or None")
        if self.member_stats is not None and isinstance(self.ensemble, list):
            check_member_stats(self.member_stats, len(self.ensemble), "reward_model")

    def _stats(self, manifest_stats: Any, n_members: int, where: str) -> list[tuple[float, float]] | None:
        """The (mean, std) of each member to standardise with, or None (raw scores)."""
        given = self.member_stats if self.member_stats is not None else manifest_stats
        if self.normalize is False:
            return None
        if given is None:
            if self.normalize:
                raise ValueError(
                    f"reward_model.normalize: true needs each member's reference statistics, and {where} has "
                    "none: give reward_model.member_stats [{mean, std}, ...] or write them into ensemble.json"
                )
            return None
        return check_member_stats(given, n_members, where)

    def resolve(self) -> EnsembleMembers:
        """The members' specs (a folder's read from its manifest; each member takes the other fields of the
        ModelSpec the folder was given as, see :func:`coerce_reward_model`), the aggregation and the
        coefficient (given, else the manifest's, else ``mean`` and 1.0)."""
        if isinstance(self.ensemble, str):
            manifest = read_ensemble_manifest(self.ensemble)
            base = getattr(self, "member_template", None) or ModelSpec(name_or_path=self.ensemble)
            members = [dataclasses.replace(base, name_or_path=str(path)) for path in manifest["member_paths"]]
            aggregation = self.aggregation or manifest.get("aggregation", "mean")
            coef = self.coef if self.coef is not None else float(manifest.get("coef", 1.0))
            where = str(Path(self.ensemble) / ENSEMBLE_MANIFEST)
            stats = self._stats(manifest.get("member_stats"), len(members), where)
            return EnsembleMembers(members, aggregation, coef, str(self.ensemble), stats)
        names = ", ".join(m.name_or_path or "(config)" for m in self.ensemble)
        coef = 1.0 if self.coef is None else self.coef
        stats = self._stats(None, len(self.ensemble), "reward_model")
        return EnsembleMembers(list(self.ensemble), self.aggregation or "mean", coef, f"[{names}]", stats)


def is_ensemble_folder(path: str | Path | None) -> bool:
    """Whether ``path`` is a local folder holding an ``ensemble.json``."""
    return path is not None and (Path(path) / ENSEMBLE_MANIFEST).is_file()


def _typed_overrides(value: dict) -> dict:
    """``value`` with a command-line override's text read as YAML would read it (``--model.init_args.reward_model.
    coef=0`` reaches the dict as the string ``"0"``: ``reward_model`` is a dict argument, whose fields jsonargparse
    does not type): ``coef`` a number, ``normalize`` a bool, where the text is one; other text is left to the checks."""
    out = dict(value)
    for key, kinds in (("coef", (int, float)), ("normalize", (bool,))):
        if isinstance(out.get(key), str):
            try:
                parsed = yaml.safe_load(out[key])
            except yaml.YAMLError:
                continue
            if isinstance(parsed, kinds) and (bool in kinds or not isinstance(parsed, bool)):
                out[key] = parsed
    return out


def coerce_reward_model(
    value: Any, argument: str = "reward_model"
) -> ModelSpec | RewardEnsemble | PosteriorReward | None:
    """An online module's ``reward_model`` as a ``ModelSpec`` (one reward model), a ``RewardEnsemble``, or a
    ``PosteriorReward`` (a dict with a ``posterior`` key: :mod:`lit_rlhf.posterior`).

    A ``RewardEnsemble``, a dict with an ``ensemble`` key, or a ModelSpec / dict / path whose ``name_or_path``
    is an ensemble folder is an ensemble; anything else goes through ``ModelSpec.coerce``.
    """
    if value is None or isinstance(value, (RewardEnsemble, PosteriorReward)):
        return value
    if isinstance(value, dict):
        value = _typed_overrides(value)
    if isinstance(value, dict) and "posterior" in value:  # a reward model's last-layer posterior
        return PosteriorReward.coerce(value, argument)
    if isinstance(value, dict) and {"ensemble", "aggregation", "coef"} & set(value):
        if "ensemble" not in value:  # e.g. a command-line override that jsonargparse could not merge
            aggregation = value.get("aggregation")
            if aggregation is not None and aggregation not in ENSEMBLE_AGGREGATIONS:
                raise ValueError(
                    f"{argument}.aggregation must be one of {list(ENSEMBLE_AGGREGATIONS)}, got {aggregation!r}"
                )
            raise ValueError(
                f"{argument}: `aggregation` and `coef` are settings of an ensemble, which needs `ensemble` (a folder "
                f"or a list of member specs) too; got {value!r:.200}"
            )
        return RewardEnsemble.coerce(value, argument)
    spec = ModelSpec.coerce(value, argument)
    if spec.config is None and is_ensemble_folder(spec.name_or_path):
        ensemble = RewardEnsemble(ensemble=spec.name_or_path)
        ensemble.member_template = spec  # its dtype etc. for every member (not a field: not stored)
        return ensemble
    return spec


def read_ensemble_manifest(folder: str | Path) -> dict[str, Any]:
    """The checked ``ensemble.json`` of ``folder``, with ``member_paths`` (the member folders, resolved).

    Raises:
        FileNotFoundError: no such folder, no manifest, or a member folder that is not there.
        ValueError: a manifest that is not the ensemble format.
    """
    folder = Path(folder)
    where = f"reward_model.ensemble: {folder}"
    if not folder.is_dir():
        raise FileNotFoundError(f"{where}: no such folder ({folder.absolute()})")
    path = folder / ENSEMBLE_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{where} has no {ENSEMBLE_MANIFEST}: export the ensemble with RewardEnsembleModule (HFExport), write "
            "one with lit_rlhf.ensembles.write_ensemble_manifest, or list the members: reward_model: {ensemble: [...]}"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err
    members = manifest.get("members") if isinstance(manifest, dict) else None
    if not isinstance(members, list) or len(members) < 2 or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(
            f"{path}: expected {{format: {MANIFEST_FORMAT!r}, members: [at least 2 folders], ...}}, got {manifest!r:.200}"
        )
    aggregation = manifest.get("aggregation", "mean")
    if aggregation not in ENSEMBLE_AGGREGATIONS:
        raise ValueError(
            f"{path}: aggregation must be one of {list(ENSEMBLE_AGGREGATIONS)}, got {aggregation!r}"
        )
    paths = [folder / member for member in members]
    for member, member_path in zip(members, paths):
        if not member_path.is_dir():
            raise FileNotFoundError(f"{path}: member {member!r} is not a folder ({member_path.absolute()})")
    return {**manifest, "member_paths": paths}


def write_ensemble_manifest(
    folder: str | Path, members: list[str], aggregation: str = "mean", coef: float = 1.0, **extra: Any
) -> Path:
    """Write ``folder/ensemble.json`` naming the member folders (relative to ``folder``, or absolute: reward
    models exported elsewhere) and the default aggregation; ``extra`` keys are recorded as given."""
    if aggregation not in ENSEMBLE_AGGREGATIONS:
        raise ValueError(
            f"write_ensemble_manifest: aggregation must be one of {list(ENSEMBLE_AGGREGATIONS)}, got {aggregation!r}"
        )
    if len(members) < 2:
        raise ValueError(f"write_ensemble_manifest: an ensemble needs at least 2 members, got {members!r}")
    path = Path(folder) / ENSEMBLE_MANIFEST
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "members": [str(m) for m in members],
                "aggregation": aggregation, "coef": float(coef), **extra}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def check_member_tokenizers(tokenizers: list[Any], members: list[ModelSpec]) -> None:
    """Every member's tokenizer is the first member's (same vocabulary and special tokens): the members
    score the same token ids. Raises ``ValueError`` naming the first member that differs."""
    first = tokenizers[0]
    reference = (first.get_vocab(), first.eos_token_id, first.pad_token_id)
    for i, tok in enumerate(tokenizers[1:], start=1):
        if (tok.get_vocab(), tok.eos_token_id, tok.pad_token_id) != reference:
            raise ValueError(
                f"reward_model.ensemble[{i}] ({members[i].tokenizer_name_or_path}): its tokenizer differs from member"
                f" 0's ({members[0].tokenizer_name_or_path}); an ensemble's members must share one tokenizer"
            )


def member_scores(members: list[str | Path], texts: list[str], batch_size: int = 64) -> torch.Tensor:
    """(K, N) float32 scores of the N ``texts`` (whole sequences, as the members score rollouts) by each of the
    K member folders, in ``batch_size`` chunks."""
    import torch

    from lit_rlhf.models import build_score_model, load_tokenizer, sequence_scores

    rows = []
    for member in members:
        tokenizer = load_tokenizer(str(member))
        model = build_score_model(ModelSpec(name_or_path=str(member)), tokenizer).eval()
        parts = []
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
                parts.append(sequence_scores(model, enc["input_ids"], enc["attention_mask"]))  # (b,)
        rows.append(torch.cat(parts))  # (N,)
    return torch.stack(rows)  # (K, N)


def reference_stats(members: list[str | Path], texts: list[str], batch_size: int = 64) -> list[dict[str, float]]:
    """Each member's ``{mean, std}`` (population std) of its scores of ``texts`` (whole sequences, e.g. prompt +
    response + EOS of held-out pairs, as the members score rollouts): the ``member_stats`` of ``ensemble.json``.

    Raises:
        ValueError: fewer than 2 texts, or a member whose scores are not finite or all equal.
    """
    if len(texts) < 2:
        raise ValueError(f"reference_stats: needs at least 2 texts, got {len(texts)}")
    stats = []
    for member, scores in zip(members, member_scores(members, texts, batch_size)):  # (N,) each
        mean, std = scores.mean().item(), scores.std(correction=0).item()
        if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
            raise ValueError(f"reference_stats: member {member}: scores with mean {mean} and std {std}")
        stats.append({"mean": mean, "std": std})
    return stats

"""A reward model's last-layer posterior as a reward source: its score less a multiple of its uncertainty.

The uncertainty is the elliptical width of the reward model's last hidden state at the scored token against the
hidden states of the texts it was trained on (``functional.elliptical_width``; Zhang et al. 2024,
arXiv:2403.05171, sec. 3): the spread of infinitely many heads on the one backbone, drawn from the head's
Gaussian posterior. Unlike an ensemble of reward models trained on the same pairs, which share the data's blind
spots and agree there, it is large wherever the features leave the span the training texts gave them.

Fit once, after the reward model::

    python -m lit_rlhf.posterior --reward_model runs/rm --pairs data/prefs.jsonl --out runs/rm_posterior

reads the preference pairs the reward model was trained on (``.jsonl`` rows with string ``prompt``, ``chosen``
and ``rejected``; ``--max_pairs N`` for its first N), scores each prompt + response + EOS, and writes
``OUT/posterior.json`` and ``OUT/covariance.safetensors``. An online module then takes
``reward_model: {posterior: runs/rm_posterior, coef: 2.0}``; every response's score is

    r(x) - coef * s * u(x) / mean_train(u)                                                        (B,)

with ``u`` the width and ``s`` the standard deviation of the reward model's scores on the training texts: the
penalty is in score units, ``coef * s`` for a text as familiar as the training texts on average. The raw score
and the penalty's spread ``s * u / mean_train(u)`` are logged as ``rollout/reward/score`` and
``rollout/reward/uncertainty``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from lit_rlhf import functional as F
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.settings import Settings

__all__ = ["POSTERIOR_MANIFEST", "PosteriorReward", "fit_posterior", "read_posterior", "read_pairs"]

POSTERIOR_MANIFEST = "posterior.json"
COVARIANCE_FILE = "covariance.safetensors"
MANIFEST_FORMAT = "lit_rlhf.last_layer_posterior"


@dataclass
class PosteriorReward(Settings):
    """A last-layer posterior (:func:`fit_posterior`'s folder) as an online module's ``reward_model``.

    Attributes:
        posterior: the folder :func:`fit_posterior` wrote (``posterior.json``, ``covariance.safetensors``).
        coef: how many spreads to take off the score (>= 0; 0 is the reward model alone).
    """

    group: ClassVar[str] = "reward_model"

    posterior: str
    coef: float = 1.0

    def __post_init__(self) -> None:
        self.check_types()
        self.require("posterior", bool(self.posterior.strip()), "a folder written by lit_rlhf.posterior")
        self.require("coef", math.isfinite(self.coef) and self.coef >= 0, "a finite number >= 0")
        self.coef = float(self.coef)


@dataclass
class Posterior:
    """A read posterior folder: the reward model's spec, the (H, H) covariance, and the width's scale."""

    reward_model: ModelSpec
    covariance: torch.Tensor
    score_std: float
    width_mean: float
    folder: Path

    def spread(self, features: torch.Tensor) -> torch.Tensor:
        """(B, H) features -> (B,) ``s * u / mean_train(u)``, in score units."""
        if self.covariance.device != features.device:  # moved once, to the reward model's device
            self.covariance = self.covariance.to(features.device)
        width = F.elliptical_width(features, self.covariance)  # (B,)
        return width * (self.score_std / self.width_mean)  # (B,)


def read_pairs(path: str | Path, max_pairs: int | None = None) -> list[dict[str, str]]:
    """The first ``max_pairs`` rows of a ``.jsonl`` of preference pairs, each with a string ``prompt`` (may be
    empty) and non-empty strings ``chosen`` and ``rejected``; errors name the file, the row (0-based) and the field."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the preference pairs: {err}") from err
    rows: list[dict[str, str]] = []
    for i, line in enumerate(lines):
        if max_pairs is not None and len(rows) >= max_pairs:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}, row {i}: malformed JSON ({err})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}, row {i}: expected a JSON object, got {type(row).__name__}")
        for field in ("prompt", "chosen", "rejected"):
            value = row.get(field)
            if not isinstance(value, str) or (field != "prompt" and not value.strip()):
                raise ValueError(f"{path}, row {i}, field {field!r}: expected a non-empty string, got {value!r:.80}")
        rows.append({field: row[field] for field in ("prompt", "chosen", "rejected")})
    if not rows:
        raise ValueError(f"{path}: no preference pairs")
    return rows


@torch.no_grad()
def fit_posterior(
    reward_model: str | Path | ModelSpec, pairs: str | Path, out: str | Path, max_pairs: int | None = None,
    ridge: float = 1e-3, batch_size: int = 64,
) -> Path:  # fmt: skip
    """Measure ``reward_model``'s last hidden states on its training pairs and write the posterior folder ``out``.

    Args:
        reward_model: the reward model (an exported folder, or a ``ModelSpec``).
        pairs: the ``.jsonl`` preference pairs it was trained on (see :func:`read_pairs`).
        out: the folder to write (``posterior.json``, ``covariance.safetensors``).
        max_pairs: the first ``max_pairs`` rows only (None: all).
        ridge: the prior precision of ``functional.feature_precision`` (> 0).
        batch_size: texts per forward.

    Returns:
        The path of ``posterior.json``.
    """
    from safetensors.torch import save_file

    from lit_rlhf.models import build_score_model, load_tokenizer, sequence_scores_and_features

    spec = ModelSpec.coerce(str(reward_model) if isinstance(reward_model, Path) else reward_model, "reward_model")
    tokenizer = load_tokenizer(spec.tokenizer_name_or_path, trust_remote_code=spec.trust_remote_code)
    model = build_score_model(spec, tokenizer).eval()
    rows = read_pairs(pairs, max_pairs)
    texts = [row["prompt"] + row[side] + tokenizer.eos_token for row in rows for side in ("chosen", "rejected")]
    scores, features = [], []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True)
        s, phi = sequence_scores_and_features(model, enc["input_ids"], enc["attention_mask"])  # (b,), (b, H)
        scores.append(s)
        features.append(phi)
    phi = torch.cat(features)  # (N, H)
    covariance = torch.linalg.inv(F.feature_precision(phi, ridge))  # (H, H) float64
    width = F.elliptical_width(phi, covariance)  # (N,)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"covariance": covariance.contiguous()}, str(out / COVARIANCE_FILE))
    manifest = {
        # relative to the folder where it can be (the two folders move together, as an ensemble's members do)
        "format": MANIFEST_FORMAT, "version": 1, "reward_model": os.path.relpath(Path(spec.name_or_path).resolve(), out.resolve()),
        "pairs": str(Path(pairs).resolve()), "texts": len(texts), "ridge": float(ridge),
        "score_std": torch.cat(scores).std().item(), "width_mean": width.mean().item(),
    }  # fmt: skip
    path = out / POSTERIOR_MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read_posterior(folder: str | Path) -> Posterior:
    """The checked posterior folder (``FileNotFoundError``/``ValueError`` naming it and what is wrong)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    where = f"reward_model.posterior: {folder}"
    path = folder / POSTERIOR_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no {POSTERIOR_MANIFEST} (write it with python -m lit_rlhf.posterior)")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{where}: {POSTERIOR_MANIFEST} is not JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{where}: {POSTERIOR_MANIFEST} is not a {MANIFEST_FORMAT} manifest")
    for key in ("score_std", "width_mean"):
        value = manifest.get(key)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where}: {POSTERIOR_MANIFEST}'s {key} must be a number > 0, got {value!r}")
    if not (folder / COVARIANCE_FILE).is_file():
        raise FileNotFoundError(f"{where}: no {COVARIANCE_FILE} beside {POSTERIOR_MANIFEST}")
    covariance = load_file(str(folder / COVARIANCE_FILE))["covariance"]
    model = Path(manifest.get("reward_model", ""))
    model = model if model.is_absolute() else (folder / model).resolve()
    if not model.is_dir():
        raise FileNotFoundError(f"{where}: its reward model {model} is not there")
    return Posterior(ModelSpec(name_or_path=str(model)), covariance, float(manifest["score_std"]),
                     float(manifest["width_mean"]), folder)  # fmt: skip


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward_model", required=True, help="the reward model's exported folder")
    parser.add_argument("--pairs", required=True, help="the .jsonl preference pairs it was trained on")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--max_pairs", type=int, default=None, help="the first N pairs only (default: all)")
    parser.add_argument("--ridge", type=float, default=1e-3, help="the prior precision lambda (> 0)")
    args = parser.parse_args(argv)
    if args.max_pairs is not None and args.max_pairs < 1:
        parser.error(f"--max_pairs must be >= 1, got {args.max_pairs}")
    if not (math.isfinite(args.ridge) and args.ridge > 0):
        parser.error(f"--ridge must be a finite number > 0, got {args.ridge}")
    try:
        path = fit_posterior(args.reward_model, args.pairs, args.out, args.max_pairs, args.ridge)
    except (OSError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

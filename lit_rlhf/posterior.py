"""A reward model's last-layer posterior as a reward source: its score less a multiple of its uncertainty.

The uncertainty is the elliptical width of the reward model's last hidden state at the scored token against the
hidden states of the texts it was trained on (``functional.elliptical_width``; Zhang et al. 2024,
arXiv:2403.05171, sec. 3): the spread of infinitely many heads on the one backbone, drawn from the head's
Gaussian posterior. Unlike an ensemble of reward models trained on the same pairs, which share the data's blind
spots and agree there, it is large wherever the features leave the span the training texts gave them.

Fit once, after the reward model::

    python -m lit_rlhf.posterior --config configs/rm.yaml --out runs/rm_posterior
    python -m lit_rlhf.posterior --reward_model runs/rm --pairs data/prefs.jsonl --out runs/rm_posterior

reads the preference pairs the reward model was trained on through a ``PreferenceDataModule``: with ``--config``
(the reward model's ``lit-rlhf fit`` config) its ``data`` as the fit read it, its training split, and its
``HFExport`` folder as the reward model; else any of its formats, with ``--split``, ``--max_length`` and
``--max_prompt_length`` as the reward model's config has them and no hold-out. It scores each chosen and rejected
sequence as the reward model was trained on it, and writes
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
from typing import Any, ClassVar

import torch

from lit_rlhf import functional as F
from lit_rlhf.models.spec import ModelSpec
from lit_rlhf.settings import Settings

__all__ = ["POSTERIOR_MANIFEST", "PosteriorReward", "fit_posterior", "read_posterior"]

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
    """A read posterior folder: the reward model's spec, the (H, H) covariance, the width's scale, and the (H,)
    response of the score head it was fit with (:func:`head_response`; None in a folder written before it was kept)."""

    reward_model: ModelSpec
    covariance: torch.Tensor
    score_std: float
    width_mean: float
    folder: Path
    head: torch.Tensor | None = None

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a reward model whose head does not take the covariance's H features, or (where the folder keeps
        it) whose head differs from the one the posterior was fit with: the reward model retrained since, in place
        (its spreads would measure another model's features)."""
        where = f"reward_model.posterior: {self.folder}"
        hidden = self.covariance.shape[0]
        try:
            response = head_response(model, hidden)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"{where}: its reward model {self.reward_model.name_or_path} does not take the "
                             f"covariance's {hidden} features ({err})") from err  # fmt: skip
        if self.head is not None:
            if not torch.allclose(response, self.head, rtol=1e-2, atol=1e-2 * float(self.head.abs().max())):
                raise ValueError(
                    f"{where}: its reward model {self.reward_model.name_or_path} has another score head than the one "
                    "the posterior was fit with (retrained since?); refit it with python -m lit_rlhf.posterior"
                )

    def spread(self, features: torch.Tensor) -> torch.Tensor:
        """(B, H) features -> (B,) ``s * u / mean_train(u)``, in score units."""
        if self.covariance.device != features.device:  # moved once, to the reward model's device
            self.covariance = self.covariance.to(features.device)
        width = F.elliptical_width(features, self.covariance)  # (B,)
        return width * (self.score_std / self.width_mean)  # (B,)


@torch.no_grad()
def fit_posterior(reward_model: str | Path | ModelSpec, data: Any, out: str | Path, ridge: float = 1e-3) -> Path:
    """Measure ``reward_model``'s last hidden states on its training pairs and write the posterior folder ``out``.

    Args:
        reward_model: the reward model (an exported folder, or a ``ModelSpec``).
        data: the :class:`~lit_rlhf.data.PreferenceDataModule` of the pairs it was trained on: every pair of its
            training split is scored as that module tokenises it (formats, length limits, EOS), chosen and rejected.
        out: the folder to write (``posterior.json``, ``covariance.safetensors``).
        ridge: the prior precision of ``functional.feature_precision`` (> 0).

    Returns:
        The path of ``posterior.json``.
    """
    from safetensors.torch import save_file
    from torch.utils.data import DataLoader

    from lit_rlhf.models import build_score_model, load_tokenizer, sequence_scores_and_features
    from lit_rlhf.rewards import check_trained_head  # (rewards imports this module)

    spec = ModelSpec.coerce(str(reward_model) if isinstance(reward_model, Path) else reward_model, "reward_model")
    check_trained_head(spec, f"reward_model {spec.name_or_path!r}")
    tokenizer = load_tokenizer(spec.tokenizer_name_or_path, trust_remote_code=spec.trust_remote_code)
    model = build_score_model(spec, tokenizer).eval()
    if data.train_dataset is None:
        data.setup("fit")
    loader = DataLoader(data.train_dataset, batch_size=data.hparams.batch_size, collate_fn=data.collator)
    pairs = [sequence_scores_and_features(model, b["input_ids"], b["attention_mask"]) for b in loader]
    scores, phi = torch.cat([s for s, _ in pairs]), torch.cat([f for _, f in pairs])  # (N,), (N, H)
    covariance = torch.linalg.inv(F.feature_precision(phi, ridge))  # (H, H) float64
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head = head_response(model, covariance.shape[0])  # (H,): what read_posterior's reward model must still have
    save_file({"covariance": covariance.contiguous(), "head": head.contiguous()}, str(out / COVARIANCE_FILE))
    manifest = {
        # relative to the folder where it can be (the two folders move together, as an ensemble's members do)
        "format": MANIFEST_FORMAT, "version": 1, "reward_model": os.path.relpath(Path(spec.name_or_path).resolve(), out.resolve()),
        "pairs": data.hparams.train_path, "split": data.hparams.split, "texts": len(scores), "ridge": float(ridge),
        "score_std": scores.std().item(), "width_mean": F.elliptical_width(phi, covariance).mean().item(),
    }  # fmt: skip
    path = out / POSTERIOR_MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read_posterior(folder: str | Path) -> Posterior:
    """The checked posterior folder, or its ``posterior.json`` (``FileNotFoundError``/``ValueError`` naming it and
    what is wrong)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if folder.name == POSTERIOR_MANIFEST and folder.is_file():  # the manifest itself (what fit_posterior returns)
        folder = folder.parent
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
    try:
        tensors = load_file(str(folder / COVARIANCE_FILE))
    except Exception as err:  # safetensors raises its own error types for a truncated or foreign file
        raise ValueError(f"{where}: {COVARIANCE_FILE} cannot be read ({err})") from err
    covariance, head = tensors.get("covariance"), tensors.get("head")
    if covariance is None or covariance.dim() != 2 or covariance.shape[0] != covariance.shape[1]:
        shape = None if covariance is None else tuple(covariance.shape)
        raise ValueError(f"{where}: {COVARIANCE_FILE} must hold an (H, H) `covariance`, got {shape}")
    if not bool(torch.isfinite(covariance).all()):
        raise ValueError(f"{where}: {COVARIANCE_FILE}'s covariance has non-finite values")
    if head is not None and tuple(head.shape) != (covariance.shape[0],):
        raise ValueError(f"{where}: {COVARIANCE_FILE}'s head must be ({covariance.shape[0]},), got {tuple(head.shape)}")
    model = Path(manifest.get("reward_model", ""))
    model = model if model.is_absolute() else (folder / model).resolve()
    if not model.is_dir():
        raise FileNotFoundError(f"{where}: its reward model {model} is not there")
    return Posterior(ModelSpec(name_or_path=str(model)), covariance, float(manifest["score_std"]),
                     float(manifest["width_mean"]), folder, None if head is None else head.float())  # fmt: skip


@torch.no_grad()
def head_response(model: torch.nn.Module, hidden: int) -> torch.Tensor:
    """(H,) float32: the reward model's score head on each of the H unit features (its weights plus its bias),
    through whatever wraps it (peft, a dtype): what identifies the head a posterior was fit with."""
    from lit_rlhf.models import score_head

    head = score_head(model)
    weight = next(head.parameters())
    probe = torch.eye(hidden, dtype=weight.dtype, device=weight.device)  # (H, H)
    return head(probe).float().reshape(hidden).cpu()  # (H,)


def read_fit_config(path: str) -> tuple[Any, str | None]:
    """A reward model's ``lit-rlhf fit`` config -> (its ``PreferenceDataModule``, built from the config's ``data`` as
    the fit built it, and its ``HFExport`` folder or None); ``ValueError`` naming the file and what is wrong."""
    import importlib

    import yaml

    from lit_rlhf.data import PreferenceDataModule

    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config {path}: cannot be read ({err})") from err
    data = config.get("data") if isinstance(config, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("class_path"), str):
        raise ValueError(f"--config {path}: no `data` with a class_path (the reward model's PreferenceDataModule)")
    module, _, name = data["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"--config {path}: data.class_path {data['class_path']!r} cannot be imported ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, PreferenceDataModule)):
        raise ValueError(f"--config {path}: data is {data['class_path']}, not a PreferenceDataModule (a reward model's)")
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    callbacks = trainer.get("callbacks") or []
    exports = [c.get("init_args", {}).get("dirpath") for c in callbacks
               if isinstance(c, dict) and str(c.get("class_path", "")).endswith("HFExport")]  # fmt: skip
    try:
        return cls(**(data.get("init_args") or {})), (exports[0] if exports else None)
    except TypeError as err:
        raise ValueError(f"--config {path}: data.init_args: {err}") from err


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the reward model's lit-rlhf fit config: its pairs read by its data module as "
                        "it trained on them (its training split), and its HFExport folder as --reward_model")
    parser.add_argument("--reward_model", help="the reward model's exported folder (and tokenizer)")
    parser.add_argument("--pairs", help="without --config: the pairs it was trained on (its train_path)")
    parser.add_argument("--split", help="without --config: their split, as its config's (default 'train')")
    parser.add_argument("--max_length", type=int, help="without --config: as its config's (default 512)")
    parser.add_argument("--max_prompt_length", type=int, help="without --config: as its config's (default 256)")
    parser.add_argument("--out", required=True, help="the folder to write")
    parser.add_argument("--ridge", type=float, default=1e-3, help="the prior precision lambda (> 0)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.ridge) and args.ridge > 0):
        parser.error(f"--ridge must be a finite number > 0, got {args.ridge}")
    pair_options = [f"--{k}" for k in ("pairs", "split", "max_length", "max_prompt_length") if getattr(args, k) is not None]
    if args.config is not None and pair_options:
        parser.error(f"--config reads the pairs as its data module does: drop {', '.join(pair_options)}")
    if args.config is None and args.pairs is None:
        parser.error("give --config (the reward model's fit config) or --pairs with --reward_model")
    from lit_rlhf.data import PreferenceDataModule

    try:
        if args.config is not None:
            data, export = read_fit_config(args.config)
            reward_model = args.reward_model or export
            if reward_model is None:
                parser.error(f"--config {args.config} has no HFExport callback: give --reward_model")
        else:
            if args.reward_model is None:
                parser.error("--pairs needs --reward_model")
            reward_model = args.reward_model
            lengths = {"max_length": args.max_length, "max_prompt_length": args.max_prompt_length}
            data = PreferenceDataModule(reward_model, args.pairs, val_fraction=0.0, split=args.split or "train",
                                        **{k: v for k, v in lengths.items() if v is not None})  # fmt: skip
        path = fit_posterior(reward_model, data, args.out, args.ridge)
    except (OSError, ValueError) as err:  # the data module's errors name the file, row and field
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()

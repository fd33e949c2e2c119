"""The fits of ``--ensemble``: the weak-KL over-optimisation run against five reward sources, per seed.

Every source learns from the same 2,400 pairs with the weak RM's recipe (``rm_weak.yaml``, 150 steps):

- ``single``: the weak RM itself (``rm_weak``); runs ``ppo_overoptimize[_seed<s>]``;
- ``finetune_ensemble``: three weak RMs on the one SFT backbone that differ in their head's seed, their
  data order and their Poisson bootstrap resample (``rm_weak_ensemble.yaml``; a *fine-tune ensemble* in
  the terms of Eisenstein et al. 2023, arXiv:2312.09244, sec. 3); runs ``ppo_overoptimize_ensemble[...]``;
- ``pretrain_ensemble``: three weak RMs each on its own SFT backbone, the SFT model trained from scratch
  with the member's seed (``rm_weak`` on ``sft`` and, for k = 1, 2, ``rm_weak_sft<k>`` on ``sft_seed<k>``:
  ``sft.yaml`` and ``rm_weak.yaml`` with every seed k): Eisenstein et al.'s *pretrain ensemble*. Members
  that differ only in a head fine-tuned on one backbone share that backbone's view of text no pair
  shows, so they agree where a policy goes beyond the data; members pre-trained apart extrapolate apart,
  and their spread, which mean - std penalises, grows there. Runs
  ``ppo_overoptimize_pretrain_ensemble[_seed<s>]`` (``ppo_overoptimize_pretrain_ensemble.yaml``, its
  manifest written by :func:`write_pretrain_manifest`).
- ``disagreement_ensemble``: the fine-tune ensemble's members (seeds, bootstrap) trained to agree on the
  pairs and disagree on unlabelled text, samples of the SFT policy no pair covers (``rm_weak_disagreement_
  ensemble.yaml``, ``RewardEnsembleModule(disagreement=...)``: D-BAT, Pagliardini et al. 2023,
  arXiv:2202.04414; the texts from :mod:`lit_rlhf.demo.unlabelled`). Runs
  ``ppo_overoptimize_disagreement_ensemble[_seed<s>]``.
- ``posterior``: not an ensemble of reward models but the weak RM's own last-layer posterior (``rm_weak_posterior``,
  :func:`write_posterior`: its last hidden states on its 2,400 training pairs; :mod:`lit_rlhf.posterior`), scored
  as the weak RM less one spread of the posterior (``ppo_overoptimize_posterior.yaml``): the spread of infinitely
  many heads on the one backbone, which grows where a response's features leave the training texts' span rather
  than where separately trained members happen to disagree. Runs ``ppo_overoptimize_posterior[_seed<s>]``.

The ensembles aggregate as mean - 1 std (Coste et al. 2024, arXiv:2310.02743). Each source's run has the
weak KL penalty and learning rate of ``ppo_overoptimize.yaml`` and runs once per training seed of ``--seeds``
(seed 0 is the run the report plots: the pipeline refuses --ensemble without it); the report's ``overoptimize_sources``
(:func:`lit_rlhf.demo.overoptimization.sources_summary`) compares their final policies seed by seed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from lit_rlhf.demo.stages import StageRunner, load_config, name_run
from lit_rlhf.demo.unlabelled import (
    FORCED_SHARE,
    MAX_NEW_TOKENS,
    MIN_NEW_TOKENS,
    N_TEXTS,
    TEMPERATURE,
    unlabelled_texts,
    write_texts,
)
from lit_rlhf.ensembles import write_ensemble_manifest
from lit_rlhf.posterior import fit_posterior

PRETRAIN_MEMBER_SEEDS = (1, 2)  # the members beyond the weak RM of the demo's own SFT backbone (seed 0)
PRETRAIN_MANIFEST = "rm_weak_pretrain_ensemble"
DISAGREEMENT_TEXTS = "rm_weak_disagreement_texts.jsonl"  # under OUT: rm_weak_disagreement_ensemble.yaml's texts
SMALL_TEXTS = 32  # --small: unlabelled texts
POSTERIOR = "rm_weak_posterior"  # under OUT: ppo_overoptimize_posterior.yaml's reward model
POSTERIOR_RIDGE = 1e-3
SOURCES = {  # source -> the config (and the seed-0 run name) of its PPO run
    "single": "ppo_overoptimize",
    "finetune_ensemble": "ppo_overoptimize_ensemble",
    "pretrain_ensemble": "ppo_overoptimize_pretrain_ensemble",
    "disagreement_ensemble": "ppo_overoptimize_disagreement_ensemble",
    "posterior": "ppo_overoptimize_posterior",
}
_INPUTS = {
    "single": ("sft", "rm_weak"),
    "finetune_ensemble": ("sft", "rm_weak_ensemble"),
    "pretrain_ensemble": ("sft", "rm_weak", *[f"{stage}{k}" for k in PRETRAIN_MEMBER_SEEDS for stage in ("sft_seed", "rm_weak_sft")]),
    "disagreement_ensemble": ("sft", "rm_weak_disagreement_ensemble"),
    "posterior": ("sft", "rm_weak"),  # the posterior is a function of rm_weak, written before every run
}  # fmt: skip


def parse_sources(text: str) -> tuple[str, ...]:
    """``--ensemble``'s comma-separated sources (``all``: every one) in :data:`SOURCES` order, ``single`` always
    among them (the baseline every source is compared with)."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    if names == {"all"}:
        return tuple(SOURCES)
    if "all" in names:
        raise ValueError(f"`all` is every source and stands alone, got {text!r}")
    unknown = sorted(names - set(SOURCES))
    if unknown or not names:
        raise ValueError(f"unknown reward source(s) {unknown or [text]}; choose from all, {', '.join(SOURCES)}")
    return tuple(source for source in SOURCES if source in names | {"single"})


def run_name(source: str, seed: int) -> str:
    """The run of ``source`` with training seed ``seed``: its config's name for seed 0, ``..._seed<s>`` else."""
    return SOURCES[source] + ("" if seed == 0 else f"_seed{seed}")


def source_runs(runs: dict) -> dict[str, dict[int, str]]:
    """source -> {seed: run} of the runs of ``runs`` (names to records) that belong to a source."""
    found: dict[str, dict[int, str]] = {}
    for name, record in runs.items():
        seed = record.config.get("seed_everything", 0)
        for source in SOURCES:
            if name == run_name(source, seed):
                found.setdefault(source, {})[seed] = name
    return found


def write_pretrain_manifest(out: Path) -> Path:
    """``OUT/rm_weak_pretrain_ensemble/ensemble.json``: the weak RM and the members on the other backbones."""
    members = ["../rm_weak", *[f"../rm_weak_sft{k}" for k in PRETRAIN_MEMBER_SEEDS]]
    return write_ensemble_manifest(
        out / PRETRAIN_MANIFEST, members, "mean_minus_std", 1.0, kind="pretrain", seeds=[0, *PRETRAIN_MEMBER_SEEDS]
    )


def fit_members(
    runner: StageRunner, out: Path, small: bool, salt: str = "", sources: tuple[str, ...] = tuple(SOURCES)
) -> None:
    """What each of ``sources`` scores with: ``rm_weak_ensemble`` (``finetune_ensemble``), an SFT backbone and a
    weak RM per pretrain seed (``pretrain_ensemble``), ``rm_weak_disagreement_ensemble`` on the SFT policy's
    unlabelled texts (sampled when that stage fits; its key holds the SFT stage's and the sampling settings), the
    weak RM's posterior (``posterior``: :func:`write_posterior`). ``single`` is the weak RM, fit by the demo.

    ``salt`` is the main SFT stage's (the assets' arguments): the extra SFT backbones train on the same
    assets, so they re-run, like it, when those change."""
    if "finetune_ensemble" in sources:
        runner.fit("rm_weak_ensemble", load_config("rm_weak_ensemble", out, small), ("sft",))
    if "pretrain_ensemble" in sources:
        for k in PRETRAIN_MEMBER_SEEDS:
            sft = name_run(load_config("sft", out, small), f"sft_seed{k}", k, (), out)
            sft["model"]["init_args"]["model"]["seed"] = k
            runner.fit(f"sft_seed{k}", sft, salt=salt)
            rm = name_run(load_config("rm_weak", out, small), f"rm_weak_sft{k}", k, (), out)
            rm["model"]["init_args"]["model"].update(name_or_path=str(out / f"sft_seed{k}"), seed=k)
            runner.fit(f"rm_weak_sft{k}", rm, ("sft", f"sft_seed{k}"))
        write_pretrain_manifest(out)
    if "disagreement_ensemble" in sources:
        n = SMALL_TEXTS if small else N_TEXTS
        record = runner.fit("rm_weak_disagreement_ensemble", load_config("rm_weak_disagreement_ensemble", out, small),
                            ("sft",), salt=f"texts={n},{TEMPERATURE},{FORCED_SHARE},{MIN_NEW_TOKENS},{MAX_NEW_TOKENS}",
                            before=lambda: write_disagreement_texts(out, n))  # fmt: skip
        if record.reused and not (out / DISAGREEMENT_TEXTS).is_file():  # the texts its config names: sampled again
            write_disagreement_texts(out, n)
    if "posterior" in sources:
        write_posterior(out, small)


def write_posterior(out: Path, small: bool = False) -> Path:
    """``OUT/rm_weak_posterior``: the weak RM's last-layer posterior on the pairs it was trained on, read by the data
    module of its own config (``rm_weak.yaml``: the first 2,400 pairs; seconds)."""
    from lit_rlhf.data import PreferenceDataModule

    data = PreferenceDataModule(**load_config("rm_weak", out, small)["data"]["init_args"])
    return fit_posterior(out / "rm_weak", data, out / POSTERIOR, ridge=POSTERIOR_RIDGE)


def write_disagreement_texts(out: Path, n: int) -> Path:
    """``OUT/rm_weak_disagreement_texts.jsonl``: ``n`` unlabelled SFT samples (:mod:`lit_rlhf.demo.unlabelled`)."""
    return write_texts(unlabelled_texts(out, n)[0], out / DISAGREEMENT_TEXTS)


def fit_runs(
    runner: StageRunner, out: Path, small: bool, seeds: list[int], check, sources: tuple[str, ...] = tuple(SOURCES)
) -> None:
    """The PPO run of each of ``sources`` for every seed (the single weak RM's seed 0, run by the demo itself,
    excepted).

    ``check`` is called with {run: config} of each source's config before anything trains
    (``pipeline.check_online_configs``)."""
    configs = {source: load_config(SOURCES[source], out, small) for source in sources}
    check({SOURCES[source]: config for source, config in configs.items()})
    for seed in seeds:
        for source, base in configs.items():
            run = run_name(source, seed)
            if run in runner.records:
                continue
            config = name_run(copy.deepcopy(base), run, seed, ("rng_seed",), out)
            runner.fit(run, config, _INPUTS[source], salt=posterior_key(out) if source == "posterior" else "")


def posterior_key(out: Path) -> str:
    """A digest of ``OUT/rm_weak_posterior``'s covariance and scale, rounded to 6 significant digits: a posterior
    written another way refits its runs on ``--reuse`` (its inputs' keys, SFT's and the weak RM's, would not
    change), while one fit again with another thread count (which moves the covariance by float rounding, ~1e-12)
    is the same posterior, as the stages it comes from are (:mod:`lit_rlhf.demo.stages` keys ignore --threads)."""
    import hashlib

    from lit_rlhf.posterior import read_posterior

    posterior = read_posterior(out / POSTERIOR)
    covariance = posterior.covariance.double()  # (H, H)
    scale = covariance.abs().max().clamp_min(1e-300)
    quantised = torch.round(covariance / scale * 1e6).to(torch.int64)  # (H, H)
    text = f"{float(scale):.6g},{posterior.score_std:.6g},{posterior.width_mean:.6g}"
    return hashlib.sha256(quantised.numpy().tobytes() + text.encode()).hexdigest()[:16]

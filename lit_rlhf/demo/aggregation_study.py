"""Which ensemble and which aggregation keep the weak-KL over-optimisation run off the floor, seed by seed.

``python -m lit_rlhf.demo.aggregation_study --out runs/demo --threads 2 --seeds 0,1,2`` reruns the
``--ensemble`` over-optimisation PPO (``ppo_overoptimize_ensemble.yaml``: weak fixed KL 0.001, lr 2e-4, 64
rollouts) of a finished ``pipeline --ensemble`` folder against each reward source of ``--sources`` and
evaluates every final policy as the pipeline does (the held-out prompts, the SFT reference, the weak RM as
the proxy), so its lifts compare with the report's ``overoptimize_sources``. A source is
``MEMBERS:AGGREGATION[:COEF]``:

- MEMBERS: ``single`` (``rm_weak``), ``finetune`` (``rm_weak_ensemble``'s three members on one SFT backbone),
  ``pretrain`` (``rm_weak`` and ``rm_weak_sft1/2``, three backbones) or ``union`` (all six: the two families
  together); ``finetune-z``, ``pretrain-z`` and ``union-z`` are the same members standardised by their scores of
  the held-out pairs (``member_stats`` in ``OUT/aggregation_study/<members>-z/ensemble.json``, written by
  :func:`lit_rlhf.ensembles.reference_stats`; ``functional.standardize_members``);
- AGGREGATION: ``mean``, ``mean_minus_std`` (COEF, default 1) or ``min`` (Coste et al. 2024,
  arXiv:2310.02743: the uncertainty-weighted and worst-case objectives); ignored for ``single``.

Runs go to ``OUT/aggregation_study/<source>_t<threads>_seed<s>`` (``--reuse`` keeps finished ones, by
``OUT/aggregation_study/stages.json``); the table of lift in SFT standard deviations / KL / grammatical rate
and the hold and floor counts (:func:`lit_rlhf.demo.overoptimization.final_policy`, as the report's
``overoptimize_sources``) go to the console and to ``OUT/aggregation_study/study_t<threads>.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from lit_rlhf.demo import evaluate
from lit_rlhf.demo.ensemble_runs import PRETRAIN_MANIFEST, PRETRAIN_MEMBER_SEEDS
from lit_rlhf.demo.overoptimization import final_policy, source_entry
from lit_rlhf.demo.stages import StageRunner, export_dir, load_config, name_run
from lit_rlhf.ensembles import ENSEMBLE_AGGREGATIONS, reference_stats, write_ensemble_manifest

STUDY = "aggregation_study"
# "-z": the same members standardised by their scores of the held-out pairs (ensembles.reference_stats)
MEMBERS = ("single", "finetune", "pretrain", "union", "finetune-z", "pretrain-z", "union-z")
DEFAULT_SOURCES = "single,finetune:mean_minus_std:1,finetune:mean_minus_std:2,finetune:min,pretrain:mean_minus_std:1,union:mean_minus_std:1"  # fmt: skip


def parse_source(text: str) -> tuple[str, str | None, float | None]:
    """``MEMBERS:AGGREGATION[:COEF]`` (or ``single``) -> (members, aggregation, coef); clear errors else."""
    parts = text.strip().split(":")
    members, rest = parts[0], parts[1:]
    if members not in MEMBERS:
        raise argparse.ArgumentTypeError(f"--sources {text!r}: members must be one of {', '.join(MEMBERS)}")
    if members == "single":
        return members, None, None
    if not rest or rest[0] not in ENSEMBLE_AGGREGATIONS or len(rest) > 2:
        raise argparse.ArgumentTypeError(
            f"--sources {text!r}: write MEMBERS:AGGREGATION[:COEF], AGGREGATION one of {', '.join(ENSEMBLE_AGGREGATIONS)}"
        )
    try:
        coef = float(rest[1]) if len(rest) == 2 else (1.0 if rest[0] == "mean_minus_std" else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sources {text!r}: COEF must be a number") from None
    return members, rest[0], coef


def source_name(members: str, aggregation: str | None, coef: float | None) -> str:
    return (
        members if aggregation is None else "_".join([members, aggregation, *([f"{coef:g}"] if coef else [])])
    )


def write_union_manifest(out: Path) -> Path:
    """``OUT/aggregation_study/union/ensemble.json``: the fine-tune members and the pretrain members."""
    folder = out / STUDY / "union"
    finetune = sorted(str(p.resolve()) for p in (out / "rm_weak_ensemble").glob("member_*"))
    pretrain = [
        str((out / name).resolve())
        for name in ("rm_weak", *[f"rm_weak_sft{k}" for k in PRETRAIN_MEMBER_SEEDS])
    ]
    return write_ensemble_manifest(folder, finetune + pretrain, "mean_minus_std", 1.0, kind="union")


def member_folders(out: Path, members: str) -> list[str]:
    """The member folders of an ensemble source (without its ``-z``)."""
    finetune = sorted(str(p.resolve()) for p in (out / "rm_weak_ensemble").glob("member_*"))
    pretrain = [
        str((out / name).resolve()) for name in ("rm_weak", *[f"rm_weak_sft{k}" for k in PRETRAIN_MEMBER_SEEDS])
    ]
    return {"finetune": finetune, "pretrain": pretrain, "union": finetune + pretrain}[members]


def write_standardised_manifest(out: Path, members: str) -> Path:
    """``OUT/aggregation_study/<members>-z/ensemble.json``: the members with their statistics on the held-out
    pairs (prompt + chosen / rejected + EOS), so the runs aggregate standardised scores."""
    from lit_rlhf.models import load_tokenizer

    folders = member_folders(out, members)
    eos = load_tokenizer(folders[0]).eos_token
    pairs = evaluate.read_jsonl(out / "assets" / "prefs_val.jsonl")
    texts = [p["prompt"] + p[side] + eos for p in pairs for side in ("chosen", "rejected")]
    stats = reference_stats(folders, texts)
    folder = out / STUDY / f"{members}-z"
    return write_ensemble_manifest(
        folder, folders, "mean_minus_std", 1.0, kind=f"{members}, standardised", member_stats=stats
    )


def reward_model(out: Path, members: str, aggregation: str | None, coef: float | None) -> dict:
    """The PPO run's ``reward_model`` settings for a source."""
    if members == "single":
        return {"name_or_path": str(out / "rm_weak")}
    if members.endswith("-z"):
        spec = {"ensemble": str(out / STUDY / members), "aggregation": aggregation}
        return spec | ({"coef": coef} if coef is not None else {})
    folder = {
        "finetune": out / "rm_weak_ensemble",
        "pretrain": out / PRETRAIN_MANIFEST,
        "union": out / STUDY / "union",
    }
    spec = {"ensemble": str(folder[members]), "aggregation": aggregation}
    return spec | ({"coef": coef} if coef is not None else {})


def run_study(
    out: Path, sources: list[tuple], seeds: list[int], threads: int, small: bool, reuse: bool
) -> dict:
    """Fit and evaluate every source for every seed; {source: :func:`~lit_rlhf.demo.overoptimization.source_entry`}."""
    report = json.loads((out / "report.json").read_text())
    sft = {"gold_mean": report["sft_gold_mean"], "gold_std": report["sft_gold_std"]}
    runner = StageRunner(out / STUDY, reuse=reuse)
    # the keys of the pipeline's stages the runs read: --reuse retrains after any of them was retrained
    recorded = json.loads((out / "stages.json").read_text()) if (out / "stages.json").exists() else {}
    inputs = ("sft", "rm_weak", "rm_weak_ensemble", *[f"rm_weak_sft{k}" for k in PRETRAIN_MEMBER_SEEDS])
    salt = f"threads={threads} " + " ".join(recorded.get(name, {}).get("key", "") for name in inputs)
    if any(members == "union" for members, *_ in sources):
        write_union_manifest(out)
    for members in sorted({m for m, *_ in sources if m.endswith("-z")}):
        write_standardised_manifest(out, members.removesuffix("-z"))
    prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_eval.jsonl")]
    from lit_rlhf.rollout import GenerationSettings

    generation = GenerationSettings(
        max_new_tokens=evaluate.EVAL_MAX_NEW_TOKENS, temperature=evaluate.EVAL_TEMPERATURE
    )
    study = {}
    for source in sources:
        name, rows = source_name(*source), []
        for seed in seeds:
            config = load_config("ppo_overoptimize_ensemble", out, small)
            config["model"]["init_args"]["reward_model"] = reward_model(out, *source)
            run = f"{name}_t{threads}_seed{seed}"
            config = name_run(config, run, seed, ("rng_seed",), out / STUDY)
            config["trainer"]["logger"]["init_args"]["save_dir"] = str(out / STUDY / "tb")
            runner.fit(run, config, salt=salt)
            samples = evaluate.sample_policy(
                Path(export_dir(config)) / "actor", prompts, generation, reference_dir=out / "sft",
                reward_model_dir=out / "rm_weak", batch_size=64 if small else 256,
            )  # fmt: skip
            rows.append({"seed": seed, "run": run, **final_policy(evaluate.summarize(samples), sft)})
        study[name] = source_entry(rows)
    return study


def table(study: dict, threads: int) -> str:
    """Markdown: one row per source, lift / KL / grammatical per seed, hold and floor counts."""
    seeds = [r["seed"] for r in next(iter(study.values()))["seeds"]]
    lines = [f"| threads | source | {' | '.join(f'seed {s}' for s in seeds)} | hold | floor |",
             "|---" * (4 + len(seeds)) + "|"]  # fmt: skip
    for name, entry in study.items():
        cells = [  # no lift where the SFT gold has no spread (the --small world)
            ("n/a" if r["gold_lift"] is None else f"{r['gold_lift']:+.2f}")
            + f" / {r['kl_ref']:.1f} / {r['grammatical_rate']:.3f}"
            for r in entry["seeds"]
        ]
        n = len(entry["seeds"])
        lines.append(
            f"| {threads} | {name} | {' | '.join(cells)} | {entry['holds']}/{n} | {entry['collapsed']}/{n} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    from lit_rlhf.demo.pipeline import parse_seeds, parse_threads

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", required=True, help="a folder of `python -m lit_rlhf.demo.pipeline --ensemble`"
    )
    parser.add_argument(
        "--sources", default=DEFAULT_SOURCES, help=f"comma-separated (default {DEFAULT_SOURCES})"
    )
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=[0, 1, 2],
        help="training seeds: a count N (0..N-1) or a list 0,3,7 (default 3)",
    )
    parser.add_argument("--threads", type=parse_threads, required=True, help="torch CPU threads (say which: "
                        "the runs depend on it)")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="the folder is a `--small` pipeline run")
    parser.add_argument("--reuse", action="store_true", help="keep the runs already recorded")
    args = parser.parse_args(argv)
    try:
        sources = [parse_source(text) for text in args.sources.split(",")]
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    out = Path(args.out)
    missing = [n for n in ("report.json", "rm_weak_ensemble", PRETRAIN_MANIFEST) if not (out / n).exists()]
    if missing:
        parser.error(
            f"--out {out}: no {', '.join(missing)}; run `python -m lit_rlhf.demo.pipeline --out {out} --ensemble` first"
        )
    import torch

    torch.set_num_threads(args.threads)
    study = run_study(out, sources, args.seeds, args.threads, args.small, args.reuse)
    (out / STUDY / f"study_t{args.threads}.json").write_text(json.dumps(study, indent=1) + "\n")
    print(table(study, args.threads))
    return study


if __name__ == "__main__":
    main()

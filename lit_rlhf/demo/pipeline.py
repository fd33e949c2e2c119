"""The offline demo, end to end: assets -> SFT -> reward model -> algorithms -> evaluation -> report.

    python -m lit_rlhf.demo.pipeline --out runs/demo [--algorithms ppo,...] [--seeds N|S1,S2,...]
        [--reuse] [--small] [--no-overoptimize] [--ensemble [SOURCES]] [--kl-sweep C1,C2,...] [--threads N]

1. builds the demo assets into ``OUT/assets`` (skipped when built before with the same settings);
2. runs the fits through the CLI, ``lit-rlhf fit --config OUT/configs/<run>.yaml``, where each config is
   ``configs/demo/<stage>.yaml`` with its ``runs/demo/`` paths moved under ``OUT`` (and, with ``--small``,
   tiny sizes; see :mod:`lit_rlhf.demo.stages`): SFT from scratch; the reward model from the SFT export;
   then each algorithm of ``--algorithms`` (registry :data:`~lit_rlhf.demo.algorithms.ALGORITHMS`) from
   the SFT policy against the same proxy reward model, once per training seed of ``--seeds``, each in its
   own process (its peak memory is measured) with a :class:`~lit_rlhf.demo.curves.GoldCurve` recording its
   gold reward on held-out prompts during the fit; then the weak reward model and the over-optimisation
   PPO run;
3. evaluates the SFT policy and every trained policy on the held-out evaluation prompts and the reward
   models on the held-out pairs, against the gold reward (:mod:`lit_rlhf.demo.evaluate`), and the
   best-of-n frontier of the SFT policy under the proxy reward model (:mod:`lit_rlhf.demo.frontier`);
4. writes ``OUT/report.md``, ``OUT/report.json``, ``OUT/samples.md`` and PNG plots
   (:mod:`lit_rlhf.demo.report`, :mod:`lit_rlhf.demo.compare`); TensorBoard logs stay in ``OUT/tb``.

Adding an algorithm to the side-by-side is writing ``configs/demo/<name>.yaml`` and one entry of
:data:`lit_rlhf.demo.algorithms.ALGORITHMS` (see :mod:`lit_rlhf.demo.algorithms`).

The reward over-optimisation run (Gao et al. 2022; skipped with ``--no-overoptimize``) adds a weaker
proxy reward model (``rm_weak.yaml``: a tenth of the pairs) optimised with a weak, fixed KL penalty
(``ppo_overoptimize.yaml``), whose gold and proxy rewards are plotted against the KL to the reference.
``--ensemble`` adds three ensembles of three weak reward models trained on the same pairs, one on the one
SFT backbone (``rm_weak_ensemble.yaml``), one on SFT backbones pre-trained with three seeds, one on the one
backbone trained to disagree on unlabelled text (``rm_weak_disagreement_ensemble.yaml``), and the same PPO
run against each one's mean minus one standard deviation (Coste et al. 2024) and against the weak RM less
one spread of its last-layer posterior, every source once per seed of ``--seeds``
(:mod:`lit_rlhf.demo.ensemble_runs`), plotted with the single weak model's run. ``--ensemble posterior`` (a
comma-separated list of :data:`~lit_rlhf.demo.ensemble_runs.SOURCES`) runs those sources only, beside the
single weak RM on every seed.
``--kl-sweep`` adds the over-optimisation run at each of those fixed KL coefficients, for each training seed,
and plots the final policies' gold and proxy rewards against their KL (:mod:`lit_rlhf.demo.kl_sweep`).
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()  # before the heavy imports below: they are part of the demo's wall time

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from lit_rlhf.callbacks import check_output_folder  # noqa: E402
from lit_rlhf.demo import assets, ensemble_runs, evaluate, frontier, kl_sweep, report  # noqa: E402
from lit_rlhf.demo.algorithms import (  # noqa: E402
    ALGORITHMS,
    DEFAULT_ALGORITHMS,
    algorithm_config,
    check_online_configs,
    parse_algorithms,
)
from lit_rlhf.demo.evaluate import EVAL_MAX_NEW_TOKENS, EVAL_TEMPERATURE  # noqa: E402
from lit_rlhf.demo.stages import StageRecord, StageRunner, export_dir, load_config  # noqa: E402

# Asset sizes of the full demo (see assets.build_assets); --small uses assets.SMALL.
FULL_ASSETS = dict(n_sft=80_000, n_prompts=16_384, n_pref_prompts=4_000, completions_per_prompt=4, n_eval_prompts=1_024)
# the best-of-n frontier: FRONTIER_N samples of the SFT policy on each of the first FRONTIER_PROMPTS
# evaluation prompts (--small: SMALL_FRONTIER of each); n up to 256 reaches log 256 - 255/256 = 4.55 nats, past the
# 4-nat budget, so every algorithm within it has a distance to the frontier (n = 64 stopped at 3.17 nats)
FRONTIER_PROMPTS, FRONTIER_N, SMALL_FRONTIER = 64, 256, (8, 8)


def parse_seeds(text: str) -> list[int]:
    """``"3"`` -> [0, 1, 2] (that many seeds from 0); ``"7,0,5"`` -> those seeds in increasing order ([0, 5, 7]):
    the first seed, whose runs the report's main table and ``ppo_*`` keys show, is the smallest."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()] if "," in text else list(range(int(text)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds: a count or a comma-separated list, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"--seeds: at least one seed, distinct and >= 0, got {text!r}")
    return sorted(seeds)


def parse_threads(text: str) -> int:
    """``--threads``: a positive number of torch CPU threads (torch itself fails on 0 with a traceback)."""
    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads: a positive whole number, got {text!r}") from None
    if threads < 1:
        raise argparse.ArgumentTypeError(f"--threads: at least 1 thread, got {threads}")
    return threads


def parse_ensemble(text: str) -> tuple[str, ...]:
    """``--ensemble``'s reward sources (:func:`lit_rlhf.demo.ensemble_runs.parse_sources`)."""
    try:
        return ensemble_runs.parse_sources(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--ensemble: {err}") from None


def parse_kl_sweep(text: str) -> list[float]:
    """``--kl-sweep``: distinct positive KL coefficients (:func:`lit_rlhf.demo.kl_sweep.parse_coefs`)."""
    try:
        return kl_sweep.parse_coefs(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_or_reuse_assets(folder: Path, small: bool, seed: int) -> dict:
    """The demo assets in ``folder``, built unless a manifest with the same arguments is there."""
    sizes = dict(assets.SMALL) if small else dict(FULL_ASSETS)
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        wanted = {**manifest["args"], **sizes, "seed": seed}
        if manifest["args"] == wanted:
            print(f"=== assets: reusing {folder}", flush=True)
            return manifest
    print(f"=== assets: building {folder}", flush=True)
    manifest_path.unlink(missing_ok=True)  # an interrupted build must leave no manifest to reuse
    assets.build_assets(folder, seed=seed, **sizes)
    return json.loads(manifest_path.read_text())


def run_stages(
    runner: StageRunner, out: Path, small: bool, algorithms: list[str], seeds: list[int], overoptimize: bool,
    manifest: dict, ensemble: Sequence[str] = (), sweep_coefs: Sequence[float] = (),
) -> dict[str, list[StageRecord]]:  # fmt: skip
    """Every fit of the demo; returns the runs of each algorithm (one per seed, in seed order). ``ensemble``:
    the reward sources of ``--ensemble`` (:func:`parse_ensemble`; none: no ensemble runs)."""
    sources = tuple(ensemble)
    salt = json.dumps(manifest["args"], sort_keys=True)
    runner.fit("sft", load_config("sft", out, small), salt=salt)
    runner.fit("rm", load_config("rm", out, small), ("sft",))
    configs = {(name, seed): algorithm_config(name, seed, out, small) for name in algorithms for seed in seeds}
    online = {
        ALGORITHMS[name].config or name: config for (name, _), (_, config) in configs.items() if ALGORITHMS[name].online
    }
    check_online_configs(online, manifest["max_response_tokens"])
    runs: dict[str, list[StageRecord]] = {name: [] for name in algorithms}
    for (name, _), (run, config) in configs.items():
        runs[name].append(runner.fit(run, config, ("sft", "rm"), subprocess_=True))
    if overoptimize:
        runner.fit("rm_weak", load_config("rm_weak", out, small), ("sft",))
        over = load_config("ppo_overoptimize", out, small)
        check_online_configs({"ppo_overoptimize": over}, manifest["max_response_tokens"])
        runner.fit("ppo_overoptimize", over, ("sft", "rm_weak"))
        if sources:  # the reward sources' runs, every seed (lit_rlhf.demo.ensemble_runs)
            ensemble_runs.fit_members(runner, out, small, salt, sources)
            check = functools.partial(check_online_configs, max_response_tokens=manifest["max_response_tokens"])
            ensemble_runs.fit_runs(runner, out, small, seeds, check, sources)
        for coef in sweep_coefs:
            for seed in seeds:
                run, config = kl_sweep.sweep_config(load_config(kl_sweep.BASE, out, small), coef, seed, out)
                runner.fit(run, config, ("sft", "rm_weak"))
    return runs


def evaluate_all(out: Path, runner: StageRunner, algorithm_runs: dict[str, list[StageRecord]], small: bool):
    """Samples and summaries of every policy on the evaluation prompts; reward-model accuracies."""
    from lit_rlhf.rollout import GenerationSettings

    prompts = [r["prompt"] for r in evaluate.read_jsonl(out / "assets" / "prompts_eval.jsonl")]
    generation = GenerationSettings(max_new_tokens=EVAL_MAX_NEW_TOKENS, temperature=EVAL_TEMPERATURE)
    policies = {"sft": (str(out / "sft"), out / "rm")}
    for name, records in algorithm_runs.items():
        for record in records:
            policy = Path(export_dir(record.config)) / ALGORITHMS[name].policy_subdir
            policies[record.run] = (str(policy), out / "rm")
    for runs in ensemble_runs.source_runs(runner.records).values():
        for name in runs.values():  # proxy: the single weak RM for all (an ensemble's own is in its curve)
            policies[name] = (str(Path(export_dir(runner.records[name].config)) / "actor"), out / "rm_weak")
    sweep_runs = [name for name in runner.records if kl_sweep.is_sweep_run(name)]
    for name in sweep_runs:  # the sweep's proxy is the weak RM, also for its KL-0 point (the SFT policy)
        policies[name] = (str(Path(export_dir(runner.records[name].config)) / "actor"), out / "rm_weak")
    if sweep_runs:
        policies[kl_sweep.SFT_WEAK] = (str(out / "sft"), out / "rm_weak")
    results = {}
    for key, (folder, reward_model) in policies.items():
        rows = evaluate.sample_policy(
            folder, prompts, generation, reference_dir=out / "sft", reward_model_dir=reward_model,
            batch_size=64 if small else 256,
        )  # fmt: skip
        results[key] = {"summary": evaluate.summarize(rows), "rows": rows}
    for name in [n for n in ("rm", "rm_weak") if n in runner.records]:
        results[name] = evaluate.evaluate_reward_model(out / name, out / "assets" / "prefs_val.jsonl")
    for name in [n for n in ("rm_weak_ensemble", "rm_weak_disagreement_ensemble") if n in runner.records]:
        members = sorted((out / name).glob("member_*"))
        results[name] = [
            evaluate.evaluate_reward_model(member, out / "assets" / "prefs_val.jsonl") for member in members
        ]
    if f"rm_weak_sft{ensemble_runs.PRETRAIN_MEMBER_SEEDS[0]}" in runner.records:
        results[ensemble_runs.PRETRAIN_MANIFEST] = [results["rm_weak"]] + [
            evaluate.evaluate_reward_model(out / f"rm_weak_sft{k}", out / "assets" / "prefs_val.jsonl")
            for k in ensemble_runs.PRETRAIN_MEMBER_SEEDS
        ]
    n_prompts, n = SMALL_FRONTIER if small else (FRONTIER_PROMPTS, FRONTIER_N)
    results["frontier"] = frontier.sample_frontier(out / "sft", out / "rm", prompts[:n_prompts], generation, n)
    return results


def run(
    out: Path,
    *,
    small: bool = False,
    overoptimize: bool = True,
    ensemble: Sequence[str] = (),
    kl_sweep_coefs: Sequence[float] = (),
    seed: int = 0,
    algorithms: Sequence[str] = DEFAULT_ALGORITHMS,
    seeds: Sequence[int] = (0,),
    reuse: bool = False,
    process_start: float | None = None,
) -> dict:
    """The whole demo into ``out``; returns the report dictionary (also written to ``out/report.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    wall: dict[str, float] = {}
    if process_start is not None:  # python start-up and imports, when run as a command
        wall["startup"] = start - process_start
        start = process_start
    stage_start = time.perf_counter()
    manifest = build_or_reuse_assets(out / "assets", small, seed)
    wall["assets"] = time.perf_counter() - stage_start
    runner = StageRunner(out, reuse=reuse)
    algorithm_runs = run_stages(
        runner, out, small, list(algorithms), list(seeds), overoptimize, manifest, ensemble, kl_sweep_coefs
    )
    wall.update({run: record.wall_s for run, record in runner.records.items()})
    stage_start = time.perf_counter()
    results = evaluate_all(out, runner, algorithm_runs, small)
    wall["evaluate"] = time.perf_counter() - stage_start
    summary = report.write_report(
        out,
        results=results,
        runs=runner.records,
        algorithm_runs=algorithm_runs,
        manifest=manifest,
        stage_wall_s=wall,
        start_time=start,
        seeds=list(seeds),
    )
    print(report.console_summary(summary), flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument("--small", action="store_true", help="a miniature of every stage (tests)")
    parser.add_argument(
        "--algorithms",
        type=parse_algorithms,
        default=list(DEFAULT_ALGORITHMS),
        help=f"comma-separated algorithms run side by side (registered: {', '.join(ALGORITHMS)};"
        f" default {','.join(DEFAULT_ALGORITHMS)})",
    )
    parser.add_argument(
        "--seeds",
        type=parse_seeds,
        default=[0],
        help="training seeds of every algorithm: a count N (seeds 0..N-1) or a list 0,3,7 (default 1)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="skip fits recorded in OUT/stages.json with the same config and inputs (e.g. SFT and RM)",
    )
    parser.add_argument(
        "--overoptimize",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the weak-RM, weak-KL over-optimisation demo (default: on)",
    )
    parser.add_argument(
        "--ensemble",
        type=parse_ensemble,
        nargs="?",
        const=tuple(ensemble_runs.SOURCES),
        default=(),
        metavar="SOURCES",
        help="with the over-optimisation demo, also its run against other reward sources learnt from the weak RM's"
        " pairs, every seed of --seeds (which must include 0): three weak-RM ensembles (3 members on one SFT"
        " backbone; 3 on backbones of 3 seeds; 3 trained to disagree off the pairs; mean - std) and the weak RM's"
        " last-layer posterior; SOURCES, comma-separated, picks some of "
        f"{','.join(ensemble_runs.SOURCES)} (default all; the single weak RM always runs)",
    )
    parser.add_argument(
        "--kl-sweep",
        type=parse_kl_sweep,
        default=[],
        metavar="C1,C2,...",
        help="with the over-optimisation demo, also its PPO run at each of these fixed KL coefficients (every"
        " seed of --seeds), the final policies' gold and proxy plotted against their KL",
    )
    parser.add_argument("--threads", type=parse_threads, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo assets")
    args = parser.parse_args(argv)
    if args.ensemble and not args.overoptimize:
        parser.error("--ensemble adds to the over-optimisation demo: it cannot run with --no-overoptimize")
    if args.ensemble and 0 not in args.seeds:  # seed 0's runs are the ones plotted, and the single weak RM's
        parser.error(f"--ensemble needs seed 0 among --seeds (its runs are the ones plotted), got {args.seeds}")
    if args.kl_sweep and not args.overoptimize:
        parser.error("--kl-sweep adds to the over-optimisation demo: it cannot run with --no-overoptimize")
    try:  # an output folder that cannot be written fails now, not after the first stage
        check_output_folder(args.out, "--out")
    except OSError as err:
        parser.error(str(err))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    process_start = _PROCESS_START if __name__ == "__main__" else None
    return run(
        Path(args.out),
        small=args.small,
        overoptimize=args.overoptimize,
        ensemble=args.ensemble,
        kl_sweep_coefs=args.kl_sweep,
        seed=args.seed,
        algorithms=args.algorithms,
        seeds=args.seeds,
        reuse=args.reuse,
        process_start=process_start,
    )


if __name__ == "__main__":
    main()

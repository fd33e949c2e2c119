"""The demo's report: ``report.md``, ``report.json``, ``samples.md`` and PNG plots read back from TensorBoard.

Curves come from the TensorBoard event files of the fits (tensorboard's ``EventAccumulator``): PPO logs
``rollout/score`` (proxy), ``rollout/monitor_score`` (gold) and ``rollout/kl_ref`` once per rollout;
they are averaged over windows of consecutive rollouts holding at least :data:`MIN_PROMPTS_PER_POINT`
prompts, so each plotted point is measured on that many responses.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from lit_rlhf.demo import compare, frontier, kl_sweep, overoptimization
from lit_rlhf.demo.curves import KL_BUDGET
from lit_rlhf.demo.evaluate import EVAL_TEMPERATURE
from lit_rlhf.demo.machine import CPU_FEATURES, cpu_features_text, machine, machine_line, stage_machine  # noqa: F401

MIN_PROMPTS_PER_POINT = 256
SAMPLES_IN_REPORT = 24


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of a TensorBoard run folder: tag -> [(step, value)] in logging order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0 = keep every event
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def window_means(values: list[float], window: int) -> list[float]:
    """Means of consecutive non-overlapping windows (a shorter last window is dropped unless it is the only one)."""
    n = max(len(values) // window, 1 if values else 0)
    return [sum(values[i * window : (i + 1) * window]) / len(values[i * window : (i + 1) * window]) for i in range(n)]


def reward_curves(scalars: dict, prompts_per_rollout: int) -> dict[str, list[float]]:
    """Windowed per-rollout series of a PPO run: kl, proxy, gold and the rollout index at each window's end."""
    window = math.ceil(MIN_PROMPTS_PER_POINT / prompts_per_rollout)
    series = {name: [v for _, v in scalars.get(tag, [])] for name, tag in
              (("kl", "rollout/kl_ref"), ("proxy", "rollout/score"), ("gold", "rollout/monitor_score"))}  # fmt: skip
    n = min(len(v) for v in series.values())
    curves = {name: window_means(v[:n], window) for name, v in series.items()}
    curves["rollout"] = [min((i + 1) * window, n) for i in range(len(curves["kl"]))]
    curves["window"] = window
    return curves


def plot_reward_vs_kl(
    curves: dict,
    path: Path,
    title: str,
    kl_target: float | None = None,
    kl_budget: float | None = None,
    sqrt_kl: bool = False,
) -> None:
    """Gold and proxy reward (change since the first window) against KL to the reference, and per rollout.

    ``sqrt_kl`` puts sqrt(KL) on the x axis, the distance Gao et al. (2022, arXiv:2210.10760, Sec. 3) plot
    over-optimisation against (their gold-reward fits are functions of it).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("proxy", "tab:orange"), ("gold", "tab:blue")):
        delta = [v - curves[name][0] for v in curves[name]]
        x = [max(kl, 0.0) ** 0.5 for kl in curves["kl"]] if sqrt_kl else curves["kl"]
        ax_kl.plot(x, delta, "o-", color=color, ms=3, label=f"{name} reward")
        ax_t.plot(curves["rollout"], delta, "o-", color=color, ms=3, label=f"{name} reward")
    scale = (lambda kl: kl**0.5) if sqrt_kl else (lambda kl: kl)
    if kl_target is not None:
        ax_kl.axvline(scale(kl_target), color="gray", ls="--", label=f"KL target {kl_target:g}")
    if kl_budget is not None:
        ax_kl.axvline(scale(kl_budget), color="tab:red", ls=":", label=f"KL budget {kl_budget:g}")
    unit = "KL(policy || reference), nats per response"
    ax_kl.set_xlabel(f"sqrt({unit})" if sqrt_kl else unit)
    ax_t.set_xlabel("rollout")
    for ax in (ax_kl, ax_t):
        ax.set_ylabel("reward - reward of the first window")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_kl2 = ax_t.twinx()
    ax_kl2.plot(curves["rollout"], curves["kl"], color="gray", alpha=0.5, label="KL")
    ax_kl2.set_ylabel("KL (gray)")
    fig.suptitle(f"{title} (each point: {curves['window']} rollouts, >= {MIN_PROMPTS_PER_POINT} prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rm_accuracy(scalars_by_run: dict[str, dict], path: Path) -> None:
    """Validation accuracy of the reward model(s) over training: against gold and against the labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run, scalars in scalars_by_run.items():
        for tag, style in (("val/gold_accuracy", "o-"), ("val/accuracy", "s--")):
            points = scalars.get(tag, [])
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], style, ms=4, label=f"{run} {tag}")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("held-out pair accuracy")
    ax.set_title("Reward model: gold ordering vs noisy labels")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def kl_target(init_args: dict) -> float | None:
    """The adaptive KL target (``kl.target``) of an online config's ``model.init_args``; None = fixed."""
    return (init_args.get("kl") or {}).get("target")


def _label(name: str) -> str:
    return name.upper().replace("_", " ")


def _samples_md(results: dict, names: list[str], temperature: float) -> str:
    """The first sampled responses of each policy on the same held-out prompts, with their gold rewards."""
    lines = [
        "# Sample responses on held-out prompts",
        "",
        f"One sampled response per prompt (temperature {temperature:g}) of each policy, with its gold reward"
        " (`*` = ungrammatical).",
        "",
        "| prompt | " + " | ".join(f"{_label(n)} response | gold" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for i, first in enumerate(results["sft"]["rows"][:SAMPLES_IN_REPORT]):
        cells = [first["prompt"]]
        for name in names:
            row = results[name]["rows"][i]
            cells += [row["response"], f"{row['gold']:+.1f}{'' if row['grammatical'] else '*'}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _table(results: dict, names: list[str]) -> list[str]:
    rows = [
        ("gold reward mean", "gold_mean", "{:+.2f}"),
        ("gold reward std", "gold_std", "{:.2f}"),
        ("proxy RM score mean", "proxy_mean", "{:+.2f}"),
        ("KL to reference (nats)", "kl_ref", "{:.2f}"),
        ("grammatical rate", "grammatical_rate", "{:.3f}"),
        ("response length (tokens)", "response_length", "{:.1f}"),
        ("truncated rate", "truncated_rate", "{:.3f}"),
    ]
    lines = ["| metric | " + " | ".join(_label(n) for n in names) + " |"]
    lines.append("|---|" + "---|" * len(names))
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(results[n]["summary"][key]) for n in names) + " |")
    return lines


def write_report(
    out: Path,
    *,
    results: dict,
    runs: dict,
    algorithm_runs: dict[str, list],
    manifest: dict,
    stage_wall_s: dict,
    start_time: float,
    seeds: list[int] | None = None,
) -> dict[str, Any]:
    """Plots, ``samples.md``, ``report.md`` and ``report.json`` in ``out``; returns the report dictionary.

    ``runs`` maps each fit's run name to its :class:`~lit_rlhf.demo.stages.StageRecord`, ``algorithm_runs``
    each algorithm to its records (one per training seed, in seed order). The main table shows the SFT
    policy, the first seed of each algorithm and the over-optimisation run; the ``ppo_*`` keys are PPO's
    first seed, ``algorithms`` holds every algorithm's means, spreads and per-seed figures. ``seeds`` (the
    demo's ``--seeds``) limits the reward sources' comparison to those seeds.
    """
    report_start = time.perf_counter()
    plots, curves = _training_plots(out, runs)
    first_runs = [records[0].run for records in algorithm_runs.values()]
    shown = ["sft", *first_runs, *[n for n in overoptimization.RUNS if n in results]]
    (out / "samples.md").write_text(_samples_md(results, shown, EVAL_TEMPERATURE))

    sft = results["sft"]["summary"]
    algorithms, gold_curves = _algorithm_figures(out, results, algorithm_runs, sft)
    plots["algorithms_gold"] = out / "algorithms_gold.png"
    compare.plot_gold_curves(gold_curves, plots["algorithms_gold"])
    if "frontier" in results:  # every algorithm's seeds (and the over-optimised policy) against best-of-n
        policies = {name: [(s["kl_ref"], s["gold_mean"]) for s in entry["seeds"]] for name, entry in algorithms.items()}
        for run in [n for n in overoptimization.RUNS if n in results]:
            over = results[run]["summary"]
            policies[f"{run} ({overoptimization.LABELS[run]})"] = [(over["kl_ref"], over["gold_mean"])]
        plots["frontier"] = out / "gold_vs_kl_frontier.png"
        frontier.plot_frontier(results["frontier"], policies, plots["frontier"])
    wall = dict(stage_wall_s, report=time.perf_counter() - report_start)
    current_machine = machine()
    summary: dict[str, Any] = {
        "rm_val_accuracy": results["rm"]["gold_accuracy"],
        "rm_val_label_accuracy": results["rm"]["label_accuracy"],
        "rm_val_pairs": results["rm"]["n_gold_ordered_pairs"],
        **{f"sft_{k}": v for k, v in sft.items()},
        "kl_budget": KL_BUDGET,
        "best_of_n_frontier": results.get("frontier"),
        "algorithms": algorithms,
        "n_seeds": len(next(iter(algorithm_runs.values()))),
        "max_response_tokens": manifest["max_response_tokens"],
        "machine": {**current_machine, **stage_machine(runs, current_machine)},
        "wall_s": time.perf_counter() - start_time,
        "wall_s_per_stage": wall,
        "reused_stages": [name for name, run in runs.items() if run.reused],
        "plots": {k: str(v) for k, v in plots.items()},
        "tensorboard": {name: str(run.log_dir) for name, run in runs.items()},
        "curves": curves,
        "assets": manifest["args"],
    }
    summary.update(ppo_fields(results, algorithm_runs, algorithms))
    summary.update(overoptimization.summary_fields(results, curves))
    summary.update(overoptimization.sources_summary(results, runs, seeds))
    summary.update(kl_sweep.summary_fields(results, runs))
    if "overoptimize_sweep" in summary:
        plots["overoptimize_kl_sweep"] = out / "overoptimize_kl_sweep.png"
        kl_sweep.plot_sweep(summary["overoptimize_sweep"], plots["overoptimize_kl_sweep"])
        summary["plots"]["overoptimize_kl_sweep"] = str(plots["overoptimize_kl_sweep"])
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(_report_md(summary, results, shown))
    return summary


def ppo_fields(results: dict, algorithm_runs: dict[str, list], algorithms: dict) -> dict[str, Any]:
    """The ``ppo_*`` keys and ``gold_lift_sft_std``: all of PPO's first run (``algorithm_runs["ppo"][0]``, the
    first seed, as in the main table); empty without PPO."""
    if not algorithm_runs.get("ppo"):
        return {}
    first = algorithm_runs["ppo"][0]
    ppo, ppo_init = results[first.run]["summary"], first.config["model"]["init_args"]
    (figures,) = [s for s in algorithms["ppo"]["seeds"] if s["run"] == first.run]
    return {
        **{f"ppo_{k}": v for k, v in ppo.items()},
        "ppo_run": first.run,
        "gold_lift_sft_std": figures["gold_lift_sft_std"],
        "ppo_kl_target": kl_target(ppo_init),
        "ppo_kl_budget": KL_BUDGET,
        "ppo_within_kl_budget": ppo["kl_ref"] <= KL_BUDGET,
        "max_new_tokens": ppo_init["generation"]["max_new_tokens"],
    }


def _training_plots(out: Path, runs: dict) -> tuple[dict[str, Path], dict]:
    """PPO's (and the over-optimisation run's) reward-vs-KL plots and curves, and the RM accuracy plot."""
    scalars = {name: read_scalars(run.log_dir) for name, run in runs.items()}
    plots, curves = {}, {}
    for name in [n for n in ("ppo", *overoptimization.RUNS) if n in runs]:
        init = runs[name].config["model"]["init_args"]
        per_rollout = runs[name].config["data"]["init_args"]["batch_size"]
        curves[name] = reward_curves(scalars[name], per_rollout)
        plots[name] = out / f"{name}_reward_vs_kl.png"
        title = "PPO" if name == "ppo" else f"Over-optimisation: {overoptimization.LABELS[name]}, weak KL penalty"
        budget = KL_BUDGET if name == "ppo" else None
        plot_reward_vs_kl(curves[name], plots[name], title, kl_target(init), budget, sqrt_kl=name != "ppo")
    if (set(overoptimization.RUNS) - {"ppo_overoptimize"}) & set(curves):
        plots["overoptimize_runs"] = out / "overoptimize_single_vs_ensemble.png"
        overoptimization.plot_runs(curves, plots["overoptimize_runs"])
    plots["rm_accuracy"] = out / "rm_accuracy.png"
    plot_rm_accuracy({n: scalars[n] for n in runs if n.startswith("rm")}, plots["rm_accuracy"])
    return plots, curves


def _algorithm_figures(out: Path, results: dict, algorithm_runs: dict[str, list], sft: dict) -> tuple[dict, dict]:
    """Each algorithm's per-seed figures aggregated (means, spreads), and its gold curves per seed."""
    algorithms, gold_curves = {}, {}
    for name, records in algorithm_runs.items():
        seeds = []
        for record in records:
            points = compare.read_curve(out / "curves" / f"{record.run}.json")
            seed = record.config["seed_everything"]
            memory = compare.read_memory(out / "memory" / f"{record.run}.json")
            summary = results[record.run]["summary"]
            frontier_points = results.get("frontier")
            seeds.append(compare.seed_figures(record.run, seed, summary, sft, points, record, memory, frontier_points))
            gold_curves.setdefault(name, []).append(points)
        algorithms[name] = compare.aggregate(seeds)
    return algorithms, gold_curves


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _report_md(summary: dict, results: dict, shown: list[str]) -> str:
    n_seeds = summary["n_seeds"]
    lines = [
        "# lit_rlhf demo: SFT -> reward model -> " + ", ".join(_label(n) for n in summary["algorithms"]),
        "",
        f"Policies evaluated on {summary['sft_n_prompts']} held-out prompts, one sampled response each"
        + (" (first training seed of each algorithm)." if n_seeds > 1 else "."),
        "",
        *_table(results, shown),
        "",
    ]
    if "ppo_gold_mean" in summary:
        lines += [
            f"- Gold lift of PPO over SFT: {_fmt(summary['gold_lift_sft_std'], '+.2f')} SFT standard deviations.",
            f"- KL to the reference: {summary['ppo_kl_ref']:.2f} nats per response, budget {KL_BUDGET:g}"
            f" ({'within' if summary['ppo_within_kl_budget'] else 'OVER'} budget; the adaptive KL controller"
            f" targets {summary['ppo_kl_target']}).",
        ]
    lines += [
        f"- Reward model held-out accuracy against gold: {summary['rm_val_accuracy']:.3f} on"
        f" {summary['rm_val_pairs']} pairs with different gold rewards (against the noisy labels:"
        f" {summary['rm_val_label_accuracy']:.3f}).",
        *machine_line(summary["machine"]),
        f"- Longest grammatical response: {summary['max_response_tokens']} tokens with EOS (the"
        " pipeline checks every online config's max_new_tokens against it).",
    ]
    lines += overoptimization.report_lines(summary)
    lines += kl_sweep.report_lines(summary)
    lines += ["", "## Algorithms side by side", "", *compare.section_md(summary)]
    lines += ["", "## Wall time per stage (s)", "", *wall_table(summary), "", "## Plots", ""]
    lines += [f"![{name}]({Path(p).name})" for name, p in summary["plots"].items()]
    lines += ["", "Samples: [samples.md](samples.md). TensorBoard: `tensorboard --logdir tb`.", ""]
    return "\n".join(lines)


def wall_table(summary: dict) -> list[str]:
    """The wall time of every stage, with the torch threads each fit ran with (reused ones: their own)."""
    reused, threads = set(summary["reused_stages"]), summary["machine"].get("threads_per_stage", {})
    lines = ["| stage | seconds | torch threads |", "|---|---|---|"]
    for stage, seconds in summary["wall_s_per_stage"].items():
        fit_threads = _fmt(threads[stage], "d") if stage in threads else ""
        lines.append(f"| {stage} | {seconds:.1f}{' (reused)' if stage in reused else ''} | {fit_threads} |")
    return [*lines, f"| **total** | **{summary['wall_s']:.1f}** | |"]


def console_summary(summary: dict) -> str:
    """A one-screen summary of the report."""
    wall = ", ".join(f"{k} {v:.0f}s" for k, v in summary["wall_s_per_stage"].items())
    lines = [
        "",
        "=" * 78,
        "lit_rlhf demo summary",
        f"  machine                        {summary['machine']['cpu']}"
        f" ({' '.join(summary['machine'].get('cpu_features', []))}), {summary['machine']['threads']} threads",
        *([f"  NOTE: {summary['machine']['note']}"] if summary["machine"].get("note") else []),
        f"  RM held-out accuracy vs gold   {summary['rm_val_accuracy']:.3f}",
        f"  SFT gold {summary['sft_gold_mean']:+.2f} +- {summary['sft_gold_std']:.2f},"
        f" grammatical {summary['sft_grammatical_rate']:.3f}",
    ]
    for name, entry in summary["algorithms"].items():
        ttt = entry["time_to_target_s"]
        lines.append(
            f"  {name:<14} gold {entry['gold_mean']:+.2f} (lift {_fmt(entry['gold_lift_sft_std'], '+.2f')} SFT std)"
            f"  KL {entry['kl_ref']:.2f}  grammatical {entry['grammatical_rate']:.3f}"
            f"  to target {_fmt(ttt, '.0f')} s  on target {entry['seeds_meeting_target']}/{entry['n_seeds']} seeds"
        )
    lines += overoptimization.console_lines(summary)
    lines += kl_sweep.console_lines(summary)
    lines += [f"  wall time     {summary['wall_s']:.0f} s ({wall})", "=" * 78]
    return "\n".join(lines)

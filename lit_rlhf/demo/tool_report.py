"""The tool world's report: ``report.json``, ``report.md``, ``samples.md`` and ``tool_world.png``.

Every policy (the SFT policy, each seed of GRPO with and without the tool) is summarised in both evaluation
settings (:mod:`lit_rlhf.demo.tool_evaluate`); the GRPO runs are aggregated over their seeds (mean, sample
standard deviation, per-seed values). The training curves (exact-match score and tool calls per episode, per
rollout) come from the fits' TensorBoard logs (``rollout/score``, ``rollout/tool_calls``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from lit_rlhf.demo.report import machine, machine_line, read_scalars, stage_machine, wall_table
from lit_rlhf.demo.tool_evaluate import SETTINGS

METRICS = ("accuracy", "tool_call_rate", "tool_calls", "tool_errors", "turns")
TARGET_RATIO = 2.0  # GRPO with the tool: at least twice the SFT policy's accuracy (issue 25)
SAMPLES_IN_REPORT = 16
LABELS = {"sft": "SFT", "grpo_no_tool": "GRPO without the tool", "grpo_tool": "GRPO with the tool"}


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample std over seeds of each metric of each setting (std 0 for one seed), and the seeds."""
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        values = {m: [s[setting][m] for s in per_seed] for m in METRICS}
        summary[setting] = {m: statistics.fmean(v) for m, v in values.items()}
        summary[setting]["std"] = {m: statistics.stdev(v) if len(v) > 1 else 0.0 for m, v in values.items()}
    summary["seeds"] = per_seed
    return summary


def target(sft: dict, algorithms: dict) -> dict[str, Any]:
    """The issue's target: mean accuracy of GRPO with the tool (with the tool) >= TARGET_RATIO x the SFT
    policy's (with the tool) and > GRPO without the tool's (without the tool, as it was trained)."""
    sft_accuracy = sft["tool"]["accuracy"]
    with_tool = algorithms["grpo_tool"]["tool"]["accuracy"]
    without = algorithms["grpo_no_tool"]["no_tool"]["accuracy"]
    return {
        "sft_accuracy": sft_accuracy,
        "grpo_tool_accuracy": with_tool,
        "grpo_no_tool_accuracy": without,
        "ratio_to_sft": with_tool / sft_accuracy if sft_accuracy else None,
        "required_ratio": TARGET_RATIO,
        "met": with_tool >= TARGET_RATIO * sft_accuracy and with_tool > without,
    }


def write_report(out: Path, *, results: dict, runs: dict, records: dict, manifest: dict, stage_wall_s: dict,
                 start_time: float) -> dict[str, Any]:  # fmt: skip
    """Plots and reports in ``out``; returns the report dictionary (``report.json``).

    ``results`` maps each policy (``sft`` and each GRPO run) to ``{setting: {"summary", "rows"}}``; ``runs``
    each GRPO algorithm to its seeds' stage records; ``records`` every fit's record by run name.
    """
    report_start = time.perf_counter()
    sft = {setting: results["sft"][setting]["summary"] for setting in SETTINGS}
    algorithms = {}
    for name, seed_records in runs.items():
        per_seed = [{"run": r.run, "seed": r.config["seed_everything"], "wall_s": r.wall_s,
                     **{s: results[r.run][s]["summary"] for s in SETTINGS}} for r in seed_records]  # fmt: skip
        algorithms[name] = aggregate(per_seed)
    curves = {r.run: _curves(r.log_dir) for seed_records in runs.values() for r in seed_records}
    plot = out / "tool_world.png"
    plot_tool_world(sft, algorithms, curves, plot)
    (out / "samples.md").write_text(_samples_md(results, runs))
    summary: dict[str, Any] = {
        "sft": sft,
        "algorithms": algorithms,
        "target": target(sft, algorithms),
        "n_seeds": len(next(iter(runs.values()))),
        "curves": curves,
        "wall_s_per_stage": dict(stage_wall_s, report=time.perf_counter() - report_start),
        "reused_stages": [name for name, record in records.items() if record.reused],
        "plots": {"tool_world": str(plot)},
        "tensorboard": {name: str(record.log_dir) for name, record in records.items()},
        "assets": manifest["args"],
    }
    current_machine = machine()
    summary["machine"] = {**current_machine, **stage_machine(records, current_machine)}
    summary["wall_s"] = time.perf_counter() - start_time
    (out / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(_report_md(summary))
    return summary


def _curves(log_dir: str) -> dict[str, list[float]]:
    scalars = read_scalars(log_dir)
    return {name: [v for _, v in scalars.get(f"rollout/{name}", [])] for name in ("score", "tool_calls")}


def plot_tool_world(sft: dict, algorithms: dict, curves: dict, path: Path) -> None:
    """Accuracy and tool-call rate of every policy in both settings (bars: seed means, dots: seeds), and
    the training curves of the GRPO runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = ["sft", *algorithms]
    for ax, metric in zip(axes[:2], ("accuracy", "tool_call_rate")):
        for j, (setting, color) in enumerate((("tool", "tab:blue"), ("no_tool", "tab:gray"))):
            x = [i + (j - 0.5) * 0.38 for i in range(len(names))]
            means = [sft[setting][metric] if n == "sft" else algorithms[n][setting][metric] for n in names]
            ax.bar(x, means, width=0.36, color=color, label="evaluated with the tool" if setting == "tool" else "without")
            for xi, name in zip(x, names):
                if name != "sft":
                    seeds = [s[setting][metric] for s in algorithms[name]["seeds"]]
                    ax.plot([xi] * len(seeds), seeds, "k.", ms=5)
        ax.set_xticks(range(len(names)), [LABELS[n].replace(" the tool", "\nthe tool") for n in names])
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title("Exact-match accuracy on held-out problems")
    axes[1].set_title("Episodes that call the calculator")
    ax = axes[2]
    for run, curve in curves.items():
        style = "-" if run.startswith("grpo_tool") else "--"
        ax.plot(range(1, len(curve["score"]) + 1), curve["score"], style, color="tab:blue", alpha=0.6,
                label=f"{run} score")  # fmt: skip
        if run.startswith("grpo_tool"):
            ax.plot(range(1, len(curve["tool_calls"]) + 1), curve["tool_calls"], style, color="tab:orange",
                    alpha=0.6, label=f"{run} tool calls")  # fmt: skip
    ax.set_xlabel("rollout")
    ax.set_ylabel("per episode (training prompts)")
    ax.set_title("GRPO training: score and tool calls")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def _policy_rows(summary: dict) -> list[tuple[str, dict, dict]]:
    """(label, figures in the tool setting, in the other) of the SFT policy and each GRPO run's first seed."""
    rows = [("SFT", summary["sft"]["tool"], summary["sft"]["no_tool"])]
    for name, entry in summary["algorithms"].items():
        first = entry["seeds"][0]
        rows.append((f"{LABELS[name]} ({first['run']})", first["tool"], first["no_tool"]))
    return rows


def _report_md(summary: dict) -> str:
    t, n_seeds = summary["target"], summary["n_seeds"]
    lines = [
        "# lit_rlhf tool world: SFT -> GRPO with and without a calculator",
        "",
        f"Target ({n_seeds} seed{'s' if n_seeds > 1 else ''}): GRPO with the tool {t['grpo_tool_accuracy']:.3f} vs"
        f" SFT {t['sft_accuracy']:.3f} (x{_fmt(t['ratio_to_sft'], '.2f')}, required x{t['required_ratio']:g}) and vs"
        f" GRPO without the tool {t['grpo_no_tool_accuracy']:.3f}: **{'met' if t['met'] else 'NOT met'}**.",
        "",
        "| policy | setting | accuracy | sums | products | tool-call rate | calls / episode | errors / episode |"
        " turns / episode | accuracy of answered calls |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, *settings in _policy_rows(summary):
        for setting, s in zip(SETTINGS, settings):
            lines.append(
                f"| {label} | {setting.replace('_', ' ')} | {s['accuracy']:.3f} | {s['sum']['accuracy']:.3f} |"
                f" {s['product']['accuracy']:.3f} | {s['tool_call_rate']:.3f} | {s['tool_calls']:.3f} |"
                f" {s['tool_errors']:.3f} | {s['turns']:.2f} | {_fmt(s['answered_call_accuracy'])} |"
            )
    lines += ["", "## Per seed (accuracy with the tool / without)", "", "| run | seed | with the tool | without | wall s |",
              "|---|---|---|---|---|"]  # fmt: skip
    for entry in summary["algorithms"].values():
        for s in entry["seeds"]:
            lines.append(f"| {s['run']} | {s['seed']} | {s['tool']['accuracy']:.3f} | {s['no_tool']['accuracy']:.3f} |"
                         f" {s['wall_s']:.0f} |")  # fmt: skip
    lines += ["", *machine_line(summary["machine"])]
    lines += ["", "## Wall time per stage (s)", "", *wall_table(summary)]
    lines += ["", "![tool world](tool_world.png)", "",
              "Samples: [samples.md](samples.md). TensorBoard: `tensorboard --logdir tb`.", ""]  # fmt: skip
    return "\n".join(lines)


def _samples_md(results: dict, runs: dict) -> str:
    names = ["sft", *(records[0].run for records in runs.values())]
    lines = ["# Sample episodes on held-out problems (with the tool)", "",
             "| problem | gold | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]  # fmt: skip
    for i, first in enumerate(results["sft"]["tool"]["rows"][:SAMPLES_IN_REPORT]):
        cells = [first["prompt"], str(first["answer"])]
        for name in names:
            row = results[name]["tool"]["rows"][i]
            cells.append(f"{'✓' if row['correct'] else '✗'} `{row['response'].strip()}`")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def console_summary(summary: dict) -> str:
    t = summary["target"]
    lines = ["", "=" * 78, "lit_rlhf tool world summary (exact-match accuracy on held-out problems)"]
    for label, tool, no_tool in _policy_rows(summary):
        lines.append(f"  {label:<42} with the tool {tool['accuracy']:.3f} (calls {tool['tool_call_rate']:.2f})"
                     f"  without {no_tool['accuracy']:.3f}")  # fmt: skip
    lines.append(
        f"  target over {summary['n_seeds']} seed(s): {t['grpo_tool_accuracy']:.3f} vs SFT {t['sft_accuracy']:.3f}"
        f" (x{_fmt(t['ratio_to_sft'], '.2f')}) and vs no tool {t['grpo_no_tool_accuracy']:.3f}:"
        f" {'met' if t['met'] else 'NOT met'}"
    )
    m = summary["machine"]
    lines.append(f"  machine {m['cpu']}, {m['threads']} threads" + (f"; NOTE: {m['note']}" if m.get("note") else ""))
    lines += [f"  wall time {summary['wall_s']:.0f} s", "=" * 78]
    return "\n".join(lines)

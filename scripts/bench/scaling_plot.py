"""The scaling curves of scaling.py's ``--out`` JSON: one figure per axis and a markdown table.

    .venv/bin/python scripts/bench/scaling_plot.py scaling.json --out-dir docs/scaling [--table table.md]

Each figure has a row per workload (W1 GRPO: seconds per rollout; W2 DPO: seconds per pair) with a time
panel and a peak-RSS panel, lit_rlhf against TRL, every point of the axis with the other settings at the
base point. A run that failed is drawn as an x on the axis at its x position and listed in the table as
failed, with its error. Times: GRPO the median over the timed rollouts (wall clock); DPO the wall time of
the timed steps over their pairs (pair_bench.py's ``pairs_per_s``); peak RSS the run's ``ru_maxrss``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaling import ALGO_AXES, AXIS_LABELS  # noqa: E402

UNITS = dict(grpo="s / rollout", dpo="s / pair")
TITLES = dict(grpo="W1 GRPO", dpo="W2 DPO")
COLOURS = dict(lit="tab:blue", trl="tab:orange")


def run_figures(run: dict, algo: str) -> list[dict] | None:
    """Per timed rollout (GRPO) or for the timed steps (DPO, one entry): wall and CPU time, peak RSS (MB),
    parameters, response tokens and (GRPO) the generation / scoring / update split; None if it failed."""
    if "error" in run:
        return None
    if algo == "dpo":
        return [dict(time=1 / run["pairs_per_s"], cpu=1 / run["cpu_pairs_per_s"], rss=run["peak_rss_mb"],
                     params=run["params"], tokens=None, generation=None, scoring=None, update=None)]  # fmt: skip
    return [
        dict(time=r["total"], cpu=r["cpu_total"], rss=run["peak_rss_mb"], params=run["actor_params"],
             tokens=tokens, generation=r["generation"], scoring=r["scoring"], update=r["update"])
        for r, tokens in zip(run["rollouts"][1:], run["response_tokens"][1:])
    ]  # fmt: skip


def point_figures(entry: dict, algo: str) -> dict[str, dict]:
    """Per implementation: the medians over the timed rollouts of all the point's repeats (DPO: over its
    repeats) and the time's min-max, or ``{"error": ...}`` if no run finished."""
    out = {}
    for impl in ("lit", "trl"):
        figures = [run_figures(rep[impl], algo) for rep in entry["runs"] if impl in rep]
        done = [row for f in figures if f is not None for row in f]
        if not done:
            out[impl] = dict(error=next(rep[impl]["error"] for rep in entry["runs"] if impl in rep))
            continue
        out[impl] = {
            k: None if done[0][k] is None else statistics.median(d[k] for d in done) for k in done[0]
        }
        out[impl]["time_range"] = (min(d["time"] for d in done), max(d["time"] for d in done))
    return out


def curve(result: dict, algo: str, axis: str) -> list[tuple[object, dict]]:
    """``[(axis value, point_figures)]`` of the points on ``axis`` (the others at the base point); empty
    where the run did not sweep ``axis`` (only the base point lies on it)."""
    base, rows = result["sweep"]["base"], []
    if axis not in result["sweep"]["axes"]:
        return []
    for entry in result["runs"].get(algo, {}).values():
        point = entry["point"]
        if all(point[k] == v for k, v in base.items() if k != axis and not (algo == "dpo" and k == "k")):
            rows.append((point[axis], point_figures(entry, algo)))
    order = list(result["sweep"]["axes"][axis])
    return sorted(rows, key=lambda row: order.index(row[0])) if len(rows) > 1 else []  # not swept: no curve


def x_value(axis: str, value, figures: dict) -> float:
    """The plotted x: the actor's measured parameter count on the model axis, else the value itself."""
    if axis == "model":
        return next(f["params"] for f in figures.values() if "params" in f)
    return float(value)


def plot_axis(result: dict, axis: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ("grpo", "dpo") if axis in ALGO_AXES[a] and curve(result, a, axis)]
    fig, axes = plt.subplots(len(algos), 2, figsize=(9, 3.2 * len(algos)), squeeze=False)
    for row, algo in zip(axes, algos):
        points = curve(result, algo, axis)
        for impl in ("lit", "trl"):
            label = "lit_rlhf" if impl == "lit" else f"TRL {result['versions'].get('trl', {}).get('trl', '')}"
            for panel, key, scale in ((row[0], "time", 1.0), (row[1], "rss", 1 / 1024)):
                good = [
                    (x_value(axis, v, f), f[impl][key] * scale) for v, f in points if "error" not in f[impl]
                ]
                bad = [x_value(axis, v, f) for v, f in points if "error" in f[impl]]
                if good:
                    panel.plot(*zip(*good), "o-", color=COLOURS[impl], label=label)
                if bad:
                    panel.plot(bad, [0] * len(bad), "x", color=COLOURS[impl], ms=10, label=f"{label}: failed")
        for value, figs in points:
            if "error" not in figs["lit"] and "error" not in figs["trl"]:
                ratio = figs["trl"]["time"] / figs["lit"]["time"]
                row[0].annotate(f"{ratio:.2f}x", (x_value(axis, value, figs), figs["trl"]["time"]),
                                textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)  # fmt: skip
        row[0].set_ylabel(f"{TITLES[algo]}: {UNITS[algo]}")
        row[1].set_ylabel(f"{TITLES[algo]}: peak RSS (GB)")
        for panel in row:
            panel.set_xscale("log", base=2 if axis in ("prompt_len", "k") else 10)
            panel.set_xlabel(AXIS_LABELS[axis])
            panel.set_ylim(0, panel.get_ylim()[1] * 1.1)  # room for the ratio labels
            panel.grid(alpha=0.3)
            ticks = [x_value(axis, v, f) for v, f in points]
            panel.set_xticks(ticks, [tick_label(axis, v, t) for (v, _), t in zip(points, ticks)])
            panel.minorticks_off()
        row[0].legend(fontsize=8)
    fig.suptitle(f"Cost against {AXIS_LABELS[axis]} (labels: TRL time / lit_rlhf time); {result['cpu']}, "
                 f"{result['threads']} thread", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def tick_label(axis: str, value, x: float) -> str:
    if axis == "model":
        return f"{x / 1e6:.1f}M"
    if axis == "vocab":
        return f"{int(value) // 1000}k"
    return str(value)


def table(result: dict) -> str:
    """One markdown row per point of each curve: time lit / TRL, their ratio, peak RSS, tokens."""
    lines = [
        "| workload | axis | value | actor params | lit_rlhf [min-max] | TRL [min-max] | TRL/lit time | "
        "peak RSS MB lit / TRL | GRPO generation / scoring / update s, lit vs TRL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for algo in ("grpo", "dpo"):
        for axis in ALGO_AXES[algo]:
            for value, figs in curve(result, algo, axis):
                lit, trl = figs["lit"], figs["trl"]
                params = next((f["params"] for f in figs.values() if "params" in f), 0)

                def cell(f: dict, key: str, fmt: str) -> str:
                    return "failed" if "error" in f else (format(f[key], fmt) if f[key] is not None else "-")

                def timed(f: dict) -> str:
                    return (
                        "failed"
                        if "error" in f
                        else f"{f['time']:.3g} [{f['time_range'][0]:.3g}-{f['time_range'][1]:.3g}]"
                    )

                def split(f: dict) -> str:
                    return "/".join(cell(f, k, ".2f") for k in ("generation", "scoring", "update"))

                ratio = "-" if "error" in lit or "error" in trl else f"**{trl['time'] / lit['time']:.2f}**"
                lines.append(
                    f"| {TITLES[algo]}, {UNITS[algo]} | {axis} | {tick_label(axis, value, params)} | {params / 1e6:.1f}M | "
                    f"{timed(lit)} | {timed(trl)} | {ratio} | "
                    f"{cell(lit, 'rss', '.0f')} / {cell(trl, 'rss', '.0f')} | "
                    f"{split(lit) + ' vs ' + split(trl) if algo == 'grpo' else '-'} |"
                )
    errors = [f"{algo} {name} {impl}: {rep[impl]['error']}" for algo, entries in result["runs"].items()
              for name, entry in entries.items() for rep in entry["runs"] for impl in rep
              if "error" in rep[impl]]  # fmt: skip
    return "\n".join(lines + [""] + [f"- failed: {e}" for e in errors]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--table", help="also write the markdown table to this file")
    args = parser.parse_args()
    result = json.loads(Path(args.results).read_text())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for axis in AXIS_LABELS:
        if any(curve(result, algo, axis) for algo in result["runs"]):
            plot_axis(result, axis, out / f"scaling_{axis}.png")
    text = table(result)
    print(text)
    if args.table:
        Path(args.table).write_text(text)


if __name__ == "__main__":
    main()

"""The side-by-side of algorithms in the demo report: per-seed figures, their spread, the gold curves.

Per run (one algorithm, one training seed): the final evaluation on every held-out prompt (gold mean,
lift over the SFT policy in SFT standard deviations, KL to the SFT reference, grammatical rate), the
stage's wall seconds and peak RSS (its own process), the growth of its resident set during training
(:class:`~lit_rlhf.callbacks.PeakMemory`: what the algorithm itself holds, without imports and loading),
its training seconds (evaluation excluded) and the
time to target of its gold curve (:mod:`lit_rlhf.demo.curves`). Per algorithm: the mean, sample standard
deviation and minimum of each figure over its seeds, and the per-seed values.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lit_rlhf.demo.curves import KL_BUDGET, TARGET_LIFT, gold_lift, lift, target_point
from lit_rlhf.demo.frontier import distance_to_frontier

METRICS = (
    "gold_mean", "gold_lift_sft_std", "kl_ref", "grammatical_rate",
    "time_to_target_s", "steps_to_target", "train_s", "wall_s", "peak_rss_mb", "train_peak_rss_growth_mb",
    "frontier_distance",
)  # fmt: skip
MIN_GRAMMATICAL_RATE = 0.95  # the demo's target also keeps >= 95% of the reviews grammatical


def read_curve(path: str | Path) -> list[dict]:
    """The points of a gold curve written by :class:`~lit_rlhf.demo.curves.GoldCurve`."""
    return json.loads(Path(path).read_text())["points"]


def read_memory(path: str | Path) -> float | None:
    """Training's peak RSS growth in MB from :class:`~lit_rlhf.callbacks.PeakMemory`'s file (None if absent)."""
    path = Path(path)
    return json.loads(path.read_text()).get("train_peak_rss_growth_mb") if path.is_file() else None


def seed_figures(
    run: str, seed: int, summary: dict, sft: dict, points: list[dict], record, train_memory_mb: float | None = None,
    frontier_points: list[dict] | None = None,
) -> dict:  # fmt: skip
    """The figures of one run: final evaluation ``summary`` against the SFT one, its curve, stage record,
    training peak-memory growth (``train_memory_mb``) and its gold minus the best-of-n frontier's at its KL
    (``frontier_points``, :mod:`lit_rlhf.demo.frontier`; None without them or beyond the frontier's KL)."""
    lift_sft = gold_lift(summary, sft)
    target = target_point(points)
    figures = {
        "seed": seed,
        "run": run,
        "gold_mean": summary["gold_mean"],
        "gold_lift_sft_std": lift_sft,
        "kl_ref": summary["kl_ref"],
        "grammatical_rate": summary["grammatical_rate"],
        "time_to_target_s": None if target is None else target["seconds"],
        "steps_to_target": None if target is None else target["step"],
        "train_s": points[-1]["seconds"],
        "wall_s": record.wall_s,
        "peak_rss_mb": record.peak_rss_mb,
        "train_peak_rss_growth_mb": train_memory_mb,
        "frontier_distance": None
        if frontier_points is None
        else distance_to_frontier(frontier_points, summary["kl_ref"], summary["gold_mean"]),
        "reused": record.reused,
        "curve_prompts": points[0]["n_prompts"],
    }
    figures["meets_target"] = bool(
        lift_sft is not None
        and lift_sft >= TARGET_LIFT
        and summary["kl_ref"] <= KL_BUDGET
        and summary["grammatical_rate"] >= MIN_GRAMMATICAL_RATE
    )
    return figures


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Mean (None if any value is None), sample standard deviation and minimum of the non-None values."""
    present = [v for v in values if v is not None]
    return {
        "mean": statistics.fmean(values) if present and len(present) == len(values) else None,
        "std": statistics.stdev(present) if len(present) >= 2 else None,
        "min": min(present) if present else None,
    }


def aggregate(per_seed: list[dict]) -> dict:
    """One algorithm's entry of ``report.json``: means over seeds, their std and min, and the seeds."""
    spreads = {m: spread([s[m] for s in per_seed]) for m in METRICS}
    return {
        **{m: spreads[m]["mean"] for m in METRICS},
        "std": {m: spreads[m]["std"] for m in METRICS},
        "min": {m: spreads[m]["min"] for m in METRICS},
        "n_seeds": len(per_seed),
        "seeds_meeting_target": sum(s["meets_target"] for s in per_seed),
        "seeds_reaching_target_in_curve": sum(s["time_to_target_s"] is not None for s in per_seed),
        "seeds": per_seed,
    }


def _cell(entry: dict, metric: str, spec: str) -> str:
    mean, std, low = entry[metric], entry["std"][metric], entry["min"][metric]
    missing = "never" if "to_target" in metric else "n/a"  # a seed that never reached the target
    text = missing if mean is None else format(mean, spec)
    if entry["n_seeds"] == 1:
        return text
    n_missing = sum(seed[metric] is None for seed in entry["seeds"])
    if mean is None and n_missing < entry["n_seeds"]:  # the spread is of the other seeds only: say so
        text = f"{missing} on {n_missing} of {entry['n_seeds']} seeds; the others"
    text += "" if std is None else f" ± {format(std, spec.lstrip('+'))}"
    return text + ("" if low is None else f" (min {format(low, spec)})")


def table_md(algorithms: dict[str, dict]) -> list[str]:
    """The markdown table of the side-by-side: one row per algorithm."""
    columns = (
        ("gold mean", "gold_mean", "+.2f"), ("lift (SFT std)", "gold_lift_sft_std", "+.2f"),
        ("KL (nats)", "kl_ref", ".2f"), ("grammatical", "grammatical_rate", ".3f"),
        ("time to target (s)", "time_to_target_s", ".1f"), ("steps to target", "steps_to_target", ".0f"),
        ("train s", "train_s", ".0f"),
        ("wall s", "wall_s", ".0f"), ("peak RSS MB", "peak_rss_mb", ".0f"),
        ("training peak RSS growth MB", "train_peak_rss_growth_mb", ".0f"),
        ("gold - best-of-n at its KL", "frontier_distance", "+.2f"),
    )  # fmt: skip
    lines = ["| algorithm | seeds | " + " | ".join(c[0] for c in columns) + " | seeds on target |"]
    lines.append("|---|---|" + "---|" * len(columns) + "---|")
    for name, entry in algorithms.items():
        cells = [_cell(entry, metric, spec) for _, metric, spec in columns]
        seeds = ",".join(str(s["seed"]) for s in entry["seeds"])
        on_target = f"{entry['seeds_meeting_target']}/{entry['n_seeds']}"
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + f" | {on_target} |")
    return lines


def plot_gold_curves(curves: dict[str, list[list[dict]]], path: Path) -> None:
    """Gold lift on the held-out prompts against KL and against training seconds: one colour per algorithm,
    one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, runs) in enumerate(curves.items()):
        color = f"C{i}"
        for j, points in enumerate(runs):
            lifts = lift(points)
            if lifts[0] is None:
                continue
            label = name if j == 0 else None
            ax_kl.plot([p["kl_ref"] for p in points], lifts, "o-", ms=3, color=color, alpha=0.8, label=label)
            ax_s.plot([p["seconds"] for p in points], lifts, "o-", ms=3, color=color, alpha=0.8, label=label)
    for ax in (ax_kl, ax_s):
        ax.axhline(TARGET_LIFT, color="tab:green", ls="--", lw=1, label=f"target lift {TARGET_LIFT:g}")
        ax.set_ylabel("gold lift (SFT std, held-out prompts)")
        ax.grid(alpha=0.3)
    ax_kl.axvline(KL_BUDGET, color="tab:red", ls=":", label=f"KL budget {KL_BUDGET:g}")
    ax_kl.set_xlabel("KL(policy || SFT reference), nats per response")
    ax_s.set_xlabel("training seconds (evaluation excluded)")
    ax_kl.legend()
    n_prompts = next(iter(curves.values()))[0][0]["n_prompts"]
    fig.suptitle(f"Gold reward during training ({n_prompts} held-out prompts per point, one line per seed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curve_prompts(summary: dict) -> int:
    """Held-out prompts per gold-curve point of a report's runs."""
    first = next(iter(summary["algorithms"].values()))["seeds"][0]
    return first["curve_prompts"]


def section_md(summary: dict) -> list[str]:
    """The report's side-by-side section: what the figures are, then the table."""
    n_seeds = summary["n_seeds"]
    if n_seeds == 1:
        seeds_line = (
            "One training seed per algorithm (`--seeds 1`, the default): no spread is measured; "
            "`--seeds 3` reports mean ± sample std (min) over three seeds."
        )
    else:
        seeds_line = f"{n_seeds} training seeds per algorithm: mean ± sample std (min) over seeds."
    return [
        f"From the same SFT policy against the same proxy reward model. {seeds_line} Lift and KL on every"
        f" held-out prompt at the end of training; time to target = training seconds (gold-curve"
        f" evaluations excluded) until the gold curve's lift first reaches {TARGET_LIFT:g} SFT std"
        f" within {KL_BUDGET:g} nats, on {curve_prompts(summary)} held-out prompts per point;"
        f" on target = lift >= {TARGET_LIFT:g}, KL <= {KL_BUDGET:g}, grammatical >="
        f" {MIN_GRAMMATICAL_RATE:g} at the end; wall s and peak RSS of the stage's own process.",
        "",
        *table_md(summary["algorithms"]),
        "",
        "Per-seed figures: `report.json` -> `algorithms.<name>.seeds`; curves: `curves/<run>.json`.",
    ]

"""The demo's over-optimisation runs in the report: the single weak RM's and, with ``--ensemble``, the ensemble's.

Both runs are PPO with the same weak, fixed KL penalty and learning rate, from the SFT policy; the proxy of
``ppo_overoptimize`` is the weak reward model (``rm_weak``), that of ``ppo_overoptimize_ensemble`` the mean
minus one standard deviation of three weak reward models trained on the same pairs (``rm_weak_ensemble``;
Coste et al. 2024, arXiv:2310.02743). Their final policies are evaluated like every other (the "proxy" of
that evaluation is the single weak RM for both); their training curves (gold and proxy per window of
rollouts) are read as Gao et al. (2022, arXiv:2210.10760) read theirs: against sqrt(KL).

Summary keys: ``overoptimize_<k>`` and ``overoptimize_ensemble_<k>`` (the evaluation summary of each final
policy), ``overoptimize_curve`` / ``overoptimize_ensemble_curve`` (:func:`~lit_rlhf.demo.curves.
overoptimization_shape`), ``rm_weak_val_accuracy``, ``rm_weak_ensemble_member_accuracies``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lit_rlhf.demo.curves import overoptimization_shape

RUNS = {"ppo_overoptimize": "overoptimize", "ppo_overoptimize_ensemble": "overoptimize_ensemble"}
LABELS = {"ppo_overoptimize": "single weak RM", "ppo_overoptimize_ensemble": "ensemble of 3 weak RMs (mean - std)"}


def summary_fields(results: dict, curves: dict) -> dict[str, Any]:
    """The report keys of the over-optimisation runs present in ``results`` (evaluations) and ``curves``."""
    fields: dict[str, Any] = {}
    for run, prefix in RUNS.items():
        if run in results:
            fields.update({f"{prefix}_{k}": v for k, v in results[run]["summary"].items()})
        if run in curves:
            fields[f"{prefix}_curve"] = overoptimization_shape(curves[run])
    if "rm_weak" in results:
        fields["rm_weak_val_accuracy"] = results["rm_weak"]["gold_accuracy"]
    if "rm_weak_ensemble" in results:
        fields["rm_weak_ensemble_member_accuracies"] = [m["gold_accuracy"] for m in results["rm_weak_ensemble"]]
    return fields


def plot_runs(curves: dict, path: Path) -> None:
    """Gold and proxy reward (change since the first window) of each over-optimisation run against sqrt(KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gold, ax_proxy) = plt.subplots(1, 2, figsize=(11, 4))
    for run, color in zip(RUNS, ("tab:red", "tab:green")):
        if run not in curves:
            continue
        x = [max(kl, 0.0) ** 0.5 for kl in curves[run]["kl"]]
        for ax, name in ((ax_gold, "gold"), (ax_proxy, "proxy")):
            ax.plot(x, [v - curves[run][name][0] for v in curves[run][name]], "o-", color=color, ms=3, label=LABELS[run])
    for ax, name in ((ax_gold, "gold"), (ax_proxy, "proxy (each run's own)")):
        ax.set_xlabel("sqrt(KL(policy || reference)), nats per response")
        ax.set_ylabel(f"{name} reward - first window")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Over-optimisation: weak KL penalty, a single weak RM against an ensemble of weak RMs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shape_text(shape: dict) -> str:
    return (
        f"proxy {shape['proxy_rise']:+.2f} (largest fall between windows {shape['proxy_largest_drop']:.2f}); gold"
        f" peaks at {shape['gold_peak']:+.2f} at KL {shape['gold_peak_kl']:.1f} and ends at {shape['gold_final']:+.2f}"
        f" ({'peaks and falls' if shape['peaks_and_falls'] else 'no peak and fall'})"
    )


def report_lines(summary: dict) -> list[str]:
    """``report.md`` bullets of the over-optimisation runs."""
    lines = []
    if "rm_weak_val_accuracy" in summary:
        lines.append(
            f"- Over-optimisation run: weak proxy RM accuracy {summary['rm_weak_val_accuracy']:.3f};"
            f" final gold {summary['overoptimize_gold_mean']:+.2f}, KL {summary['overoptimize_kl_ref']:.2f}."
        )
    if "overoptimize_curve" in summary:
        lines.append(
            "- Over-optimisation curve (training rollouts, relative to the first window): "
            + _shape_text(summary["overoptimize_curve"])
            + "."
        )
    if "overoptimize_ensemble_gold_mean" in summary:
        accuracies = ", ".join(f"{a:.3f}" for a in summary.get("rm_weak_ensemble_member_accuracies", []))
        lines.append(
            f"- Ensemble run (members' accuracies {accuracies}): final gold"
            f" {summary['overoptimize_ensemble_gold_mean']:+.2f}, KL {summary['overoptimize_ensemble_kl_ref']:.2f},"
            f" grammatical {summary['overoptimize_ensemble_grammatical_rate']:.3f}; curve: "
            + _shape_text(summary["overoptimize_ensemble_curve"])
            + "."
        )
    return lines


def console_lines(summary: dict) -> list[str]:
    """The console summary's lines of the over-optimisation runs."""
    lines = []
    for prefix, label in (("overoptimize", "over-optimisation"), ("overoptimize_ensemble", "ensemble")):
        if f"{prefix}_gold_mean" not in summary:
            continue
        accuracy = (
            f"weak RM acc {summary['rm_weak_val_accuracy']:.3f}"
            if prefix == "overoptimize"
            else "members " + "/".join(f"{a:.3f}" for a in summary.get("rm_weak_ensemble_member_accuracies", []))
        )
        curve = summary.get(f"{prefix}_curve")
        peak = f", gold peak {curve['gold_peak']:+.2f} (vs first window)" if curve else ""
        lines.append(
            f"  {label}: {accuracy}, final gold {summary[f'{prefix}_gold_mean']:+.2f},"
            f" proxy {summary[f'{prefix}_proxy_mean']:+.2f}, KL {summary[f'{prefix}_kl_ref']:.2f}{peak}"
        )
    return lines

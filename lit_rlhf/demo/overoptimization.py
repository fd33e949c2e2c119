"""The demo's over-optimisation runs in the report: the single weak RM's and, with ``--ensemble``, three ensembles'
and the weak RM's last-layer posterior's.

Every run is PPO with the same weak, fixed KL penalty and learning rate, from the SFT policy; the proxy of
``ppo_overoptimize`` is the weak reward model (``rm_weak``), that of ``ppo_overoptimize_ensemble`` the mean
minus one standard deviation of three weak reward models on one SFT backbone (``rm_weak_ensemble``), that of
``ppo_overoptimize_pretrain_ensemble`` the same aggregate of three weak reward models on SFT backbones
pre-trained with three seeds (``rm_weak_pretrain_ensemble``), that of ``ppo_overoptimize_disagreement_ensemble``
the same aggregate of three weak reward models trained to disagree off the pairs (``rm_weak_disagreement_
ensemble``), that of ``ppo_overoptimize_posterior`` the weak RM's score less one spread of its last-layer
posterior (``rm_weak_posterior``, :mod:`lit_rlhf.posterior`; see :mod:`lit_rlhf.demo.ensemble_runs`; Coste et
al. 2024, arXiv:2310.02743; Eisenstein et al. 2023, arXiv:2312.09244). Their final policies are evaluated
like every other (the "proxy" of that evaluation is the single weak RM for all); the seed-0 training curves
(gold and proxy per window of rollouts) are read as Gao et al. (2022, arXiv:2210.10760) read theirs: against
sqrt(KL); with ``--seeds`` every source runs per seed and :func:`sources_summary` compares the final policies.

Summary keys: ``overoptimize_<k>``, ``overoptimize_ensemble_<k>``, ``overoptimize_pretrain_ensemble_<k>``,
``overoptimize_disagreement_ensemble_<k>`` and ``overoptimize_posterior_<k>``
(the evaluation summary of each seed-0 final policy), ``<prefix>_curve`` (:func:`~lit_rlhf.demo.curves.
overoptimization_shape`), ``rm_weak_val_accuracy``, ``rm_weak_ensemble_member_accuracies``,
``rm_weak_pretrain_ensemble_member_accuracies``, ``rm_weak_disagreement_ensemble_member_accuracies`` and
``overoptimize_sources`` (:func:`sources_summary`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_rlhf.demo.curves import gold_lift, overoptimization_shape
from lit_rlhf.demo.ensemble_runs import PRETRAIN_MANIFEST, source_runs
from lit_rlhf.demo.world import UNGRAMMATICAL_REWARD

RUNS = {
    "ppo_overoptimize": "overoptimize",
    "ppo_overoptimize_ensemble": "overoptimize_ensemble",
    "ppo_overoptimize_pretrain_ensemble": "overoptimize_pretrain_ensemble",
    "ppo_overoptimize_disagreement_ensemble": "overoptimize_disagreement_ensemble",
    "ppo_overoptimize_posterior": "overoptimize_posterior",
}
LABELS = {
    "ppo_overoptimize": "single weak RM",
    "ppo_overoptimize_ensemble": "ensemble of 3 weak RMs on one SFT backbone (mean - std)",
    "ppo_overoptimize_pretrain_ensemble": "ensemble of 3 weak RMs on SFT backbones of 3 seeds (mean - std)",
    "ppo_overoptimize_disagreement_ensemble": "ensemble of 3 weak RMs trained to disagree off the pairs (mean - std)",
    "ppo_overoptimize_posterior": "the weak RM less 1 x its last-layer posterior's spread",
}
_MEMBERS = {
    "overoptimize_ensemble": "rm_weak_ensemble",
    "overoptimize_pretrain_ensemble": PRETRAIN_MANIFEST,
    "overoptimize_disagreement_ensemble": "rm_weak_disagreement_ensemble",
    "overoptimize_posterior": None,  # the weak RM's own last-layer posterior: no members
}
HOLDS_SFT_STD = 1.0  # a final policy "holds" at a gold of at least SFT's mean + this many SFT std
FLOOR_MARGIN = 1.0  # ... and "collapsed" at a gold within this of the world's floor (UNGRAMMATICAL_REWARD)


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
    for members in _MEMBERS.values():
        if members is not None and members in results:
            fields[f"{members}_member_accuracies"] = [m["gold_accuracy"] for m in results[members]]
    return fields


def final_policy(final: dict, sft: dict) -> dict[str, Any]:
    """A final policy's evaluation ``final`` against the SFT policy's ``sft``: gold, its lift in SFT standard
    deviations, KL, grammatical rate, whether it holds (at least SFT + ``HOLDS_SFT_STD`` std) and whether it
    collapsed (a gold within ``FLOOR_MARGIN`` of the world's floor)."""
    lift = gold_lift(final, sft)
    return {"gold_mean": final["gold_mean"], "gold_lift": lift, "kl_ref": final["kl_ref"],
            "grammatical_rate": final["grammatical_rate"], "holds": lift is not None and lift >= HOLDS_SFT_STD,
            "collapsed": final["gold_mean"] <= UNGRAMMATICAL_REWARD + FLOOR_MARGIN}  # fmt: skip


def sources_summary(results: dict, runs: dict, seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """``overoptimize_sources``: per reward source, every seed's :func:`final_policy` and the counts; empty
    without ``--ensemble``. With ``seeds`` (the demo's ``--seeds``) only those seeds' runs count, so every
    source is summarised over the same seeds."""
    found = source_runs(runs)
    if len(found) < 2 or "sft" not in results:
        return {}
    sft = results["sft"]["summary"]
    out = {}
    for source, source_seeds in found.items():
        rows = [
            {"seed": seed, "run": run, **final_policy(results[run]["summary"], sft)}
            for seed, run in sorted(source_seeds.items())
            if seeds is None or seed in seeds
        ]
        out[source] = source_entry(rows)
    return {"overoptimize_sources": out}


def source_entry(rows: list[dict]) -> dict[str, Any]:
    """One reward source's :func:`final_policy` rows (one per seed) with their mean and lowest lift (None
    unless every row has one) and how many hold and collapsed."""
    lifts = [r["gold_lift"] for r in rows if r["gold_lift"] is not None]
    mean, low = (sum(lifts) / len(lifts), min(lifts)) if len(lifts) == len(rows) else (None, None)
    return {"seeds": rows, "mean_gold_lift": mean, "min_gold_lift": low,
            "holds": sum(r["holds"] for r in rows), "collapsed": sum(r["collapsed"] for r in rows)}  # fmt: skip


def plot_runs(curves: dict, path: Path) -> None:
    """Gold and proxy reward (change since the first window) of each over-optimisation run against sqrt(KL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gold, ax_proxy) = plt.subplots(1, 2, figsize=(11, 4))
    for run, color in zip(RUNS, ("tab:red", "tab:green", "tab:blue", "tab:purple", "tab:orange"), strict=True):
        if run not in curves:
            continue
        x = [max(kl, 0.0) ** 0.5 for kl in curves[run]["kl"]]
        for ax, name in ((ax_gold, "gold"), (ax_proxy, "proxy")):
            ys = [v - curves[run][name][0] for v in curves[run][name]]
            ax.plot(x, ys, "o-", color=color, ms=3, label=LABELS[run])
    for ax, name in ((ax_gold, "gold"), (ax_proxy, "proxy (each run's own)")):
        ax.set_xlabel("sqrt(KL(policy || reference)), nats per response")
        ax.set_ylabel(f"{name} reward - first window")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Over-optimisation: weak KL penalty, a single weak RM against ensembles of weak RMs and its posterior")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _lift(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f}"


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
    for prefix, members in _MEMBERS.items():
        if f"{prefix}_gold_mean" not in summary:
            continue
        accuracies = (
            f"weak RM accuracy {summary.get('rm_weak_val_accuracy', float('nan')):.3f}"
            if members is None
            else "members' accuracies " + ", ".join(f"{a:.3f}" for a in summary.get(f"{members}_member_accuracies", []))
        )
        lines.append(
            f"- {LABELS['ppo_' + prefix]} ({accuracies}): final gold"
            f" {summary[f'{prefix}_gold_mean']:+.2f}, KL {summary[f'{prefix}_kl_ref']:.2f},"
            f" grammatical {summary[f'{prefix}_grammatical_rate']:.3f}; curve: "
            + _shape_text(summary[f"{prefix}_curve"])
            + "."
        )
    for source, entry in summary.get("overoptimize_sources", {}).items():
        seeds = "; ".join(
            f"seed {r['seed']}: gold {r['gold_mean']:+.2f} ({_lift(r['gold_lift'])} SFT std), KL {r['kl_ref']:.1f},"
            f" grammatical {r['grammatical_rate']:.3f}" + (" (collapsed)" if r["collapsed"] else "")
            for r in entry["seeds"]
        )
        lines.append(
            f"- Final policies, {source}: {seeds}. Mean lift {_lift(entry['mean_gold_lift'])} (min"
            f" {_lift(entry['min_gold_lift'])}); {entry['holds']}/{len(entry['seeds'])} at least SFT +"
            f" {HOLDS_SFT_STD:g} std, {entry['collapsed']} collapsed to the floor."
        )
    return lines


def console_lines(summary: dict) -> list[str]:
    """The console summary's lines of the over-optimisation runs."""
    lines = []
    for prefix, label in (("overoptimize", "over-optimisation"), ("overoptimize_ensemble", "ensemble"),
                          ("overoptimize_pretrain_ensemble", "pretrain ensemble"),
                          ("overoptimize_disagreement_ensemble", "disagreement ensemble"),
                          ("overoptimize_posterior", "last-layer posterior")):  # fmt: skip
        if f"{prefix}_gold_mean" not in summary:
            continue
        accuracy = (
            f"weak RM acc {summary['rm_weak_val_accuracy']:.3f}"
            if _MEMBERS.get(prefix) is None
            else "members " + "/".join(f"{a:.3f}" for a in summary.get(f"{_MEMBERS[prefix]}_member_accuracies", []))
        )
        curve = summary.get(f"{prefix}_curve")
        peak = f", gold peak {curve['gold_peak']:+.2f} (vs first window)" if curve else ""
        lines.append(
            f"  {label}: {accuracy}, final gold {summary[f'{prefix}_gold_mean']:+.2f},"
            f" proxy {summary[f'{prefix}_proxy_mean']:+.2f}, KL {summary[f'{prefix}_kl_ref']:.2f}{peak}"
        )
    for source, entry in summary.get("overoptimize_sources", {}).items():
        lifts = ", ".join(_lift(r["gold_lift"]) for r in entry["seeds"])
        lines.append(
            f"  {source} per seed: gold lift {lifts} (SFT std); {entry['holds']}/{len(entry['seeds'])} hold,"
            f" {entry['collapsed']} collapsed"
        )
    return lines

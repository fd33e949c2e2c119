"""The over-optimisation sweep: the weak-RM PPO run at a range of fixed KL coefficients (``--kl-sweep``).

One over-optimisation run is one trajectory, and how it ends differs from seed to seed and CPU to CPU: a
small change of rounding decides when (and whether) the policy runs into the weak reward model's blind
spot. Gao et al. (2022, arXiv:2210.10760, fig. 1) read over-optimisation as a function of
the KL to the initial policy; here every KL coefficient of the sweep is its own PPO run
(``configs/demo/ppo_overoptimize.yaml`` with ``kl.coef`` replaced, fixed, for each training seed), and its
final policy is one point: its KL to the SFT policy, its gold reward and its proxy reward (the weak RM's
score), all measured on the held-out evaluation prompts. A weaker penalty lets the policy go further from
the reference: along the sweep the proxy rises with the KL while the gold first rises and then falls.
The SFT policy itself is the point at KL 0.

Summary keys: ``overoptimize_sweep`` (``points``: one per run; ``sft``: the KL-0 point; ``run_std``: how far
the final proxy and gold of two runs of one coefficient scatter, from the seeds (:func:`run_variance`);
``shape``: per seed, :func:`sweep_shape` with the proxy's scatter in the noise of a proxy fall, and with
evaluation noise alone under ``*_evaluation_noise``) and the plot ``overoptimize_kl_sweep.png``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lit_rlhf.demo.stages import name_run

BASE = "ppo_overoptimize"  # the config every run of the sweep starts from
PREFIX = f"{BASE}_kl"  # run names: ppo_overoptimize_kl0.01, ppo_overoptimize_kl0.01_seed1
SFT_WEAK = "sft_weak_proxy"  # the SFT policy evaluated with the weak RM as its proxy (the KL-0 point)

__all__ = [
    "is_sweep_run", "parse_coefs", "plot_sweep", "run_name", "run_variance", "sweep_config", "sweep_shape",
    "summary_fields",
]  # fmt: skip


def parse_coefs(text: str) -> list[float]:
    """``"0.1,0.01"`` -> [0.1, 0.01]: distinct positive KL coefficients whose run names (:func:`run_name`)
    differ too (``ValueError`` names the bad one, or the two that share a name)."""
    coefs = []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        try:
            coef = float(part)
        except ValueError:
            raise ValueError(f"--kl-sweep: {part!r} is not a number") from None
        if not math.isfinite(coef) or coef <= 0:
            raise ValueError(f"--kl-sweep: every KL coefficient must be a finite number > 0, got {part!r}")
        coefs.append(coef)
    if len(coefs) < 2 or len(set(coefs)) != len(coefs):
        raise ValueError(f"--kl-sweep: at least two distinct coefficients, got {text!r}")
    named: dict[str, float] = {}
    for coef in coefs:  # runs are named by the coefficient's :g spelling: two must not share one
        other = named.setdefault(run_name(coef, 0), coef)
        if other != coef:
            raise ValueError(
                f"--kl-sweep: {other!r} and {coef!r} would both be run {run_name(coef, 0)!r} (names keep 6"
                " significant digits); give coefficients that differ within them"
            )
    return coefs


def run_name(coef: float, seed: int) -> str:
    """``ppo_overoptimize_kl<coef>`` for seed 0, ``..._seed<s>`` for the others."""
    return f"{PREFIX}{coef:g}" + ("" if seed == 0 else f"_seed{seed}")


def is_sweep_run(run: str) -> bool:
    return run.startswith(PREFIX)


def sweep_config(base: dict, coef: float, seed: int, out: Path) -> tuple[str, dict]:
    """Run name and config of one sweep point: ``base`` (the over-optimisation config under ``out``) with
    the fixed KL coefficient ``coef`` (no adaptive target) and training seed ``seed``."""
    run = run_name(coef, seed)
    config = name_run(copy.deepcopy(base), run, seed, ("rng_seed",), out)
    init = config["model"]["init_args"]
    init["kl"] = {**{k: v for k, v in init.get("kl", {}).items() if k not in ("target", "horizon")}, "coef": coef}
    return run, config


def _noise(a: dict, b: dict, key: str, run_var: float = 0.0) -> float:
    """Two standard errors of the difference of two points' means of ``key``: each point's evaluation
    variance (``{key}_std`` squared over ``n_prompts``; 0 without the spread) plus ``run_var`` per point that
    is a training run (``a``/``b`` with ``"trained": True``; the SFT point is not)."""
    variance = sum(
        (p[f"{key}_std"] ** 2 / p["n_prompts"] if f"{key}_std" in p else 0.0) + (run_var if p.get("trained") else 0.0)
        for p in (a, b)
    )
    return 2.0 * math.sqrt(variance)


def run_variance(points: Sequence[dict], key: str) -> float:
    """The variance of ``key`` between training runs of one KL coefficient, beyond their evaluations' noise.

    Runs of one coefficient with other seeds are replicates: the pooled variance of their ``key`` across seeds
    (sum of squared deviations from each coefficient's mean over the sum of (seeds - 1)) holds both how far
    one run ends from another and each evaluation's sampling noise; the mean evaluation variance
    (``{key}_std`` squared over ``n_prompts``) is taken off, and what remains (at least 0) is the runs' own.
    Where the seeds of one coefficient end at different KLs on a steep part of the curve, that difference
    counts as scatter too, so the bound is the looser there. 0 without a coefficient of two seeds or more.
    """
    by_coef: dict[float, list[dict]] = {}
    for p in points:
        by_coef.setdefault(p["coef"], []).append(p)
    groups = [g for g in by_coef.values() if len(g) > 1]
    if not groups:
        return 0.0
    squares, dof = 0.0, 0
    for group in groups:
        mean = sum(p[key] for p in group) / len(group)
        squares, dof = squares + sum((p[key] - mean) ** 2 for p in group), dof + len(group) - 1
    replicated = [p for g in groups for p in g]
    name = key.removesuffix("_mean")
    evaluation = sum(p[f"{name}_std"] ** 2 / p["n_prompts"] for p in replicated if f"{name}_std" in p)
    return max(0.0, squares / dof - evaluation / len(replicated))


def sweep_shape(points: Sequence[dict], sft: dict, run_var: dict[str, float] | None = None) -> dict[str, Any]:
    """Gao et al.'s picture read from one seed's sweep points, the SFT policy as the point at KL 0.

    Args:
        points: ``{"kl_ref", "gold_mean", "proxy_mean"}`` of each run of one seed (any order), optionally
            with ``kl_ref_std``, ``gold_std``, ``proxy_std`` and ``n_prompts`` (the evaluation's spreads and size).
        sft: the same keys for the SFT policy (its proxy by the weak RM).
        run_var: ``{"proxy": v, "gold": v}``, how far one training run's final ``proxy_mean`` / ``gold_mean``
            scatters from another's at the same setting (:func:`run_variance`, from the sweep's seeds); added to
            the noise of every point but the SFT policy's. None: evaluation noise alone.

    A difference between two points counts when it exceeds two standard errors of the difference of their
    means (independent samples of ``n_prompts`` responses each; exactly 0 without the spreads): at the
    plateau of the proxy, the means of neighbouring points differ by sampling noise alone. The KL of a
    point is such a mean too, so one point lies at a larger KL than another only when their KLs differ
    beyond their noise; two runs that end at the same KL within it have no order along the KL, and a
    difference of their proxies is no fall. Two points are two training runs, so with ``run_var`` the noise of
    a proxy or gold difference also holds how far two runs of one setting end apart; the KL's order is read
    from the evaluations alone.

    Returns (rewards relative to the SFT policy's, points in order of KL): ``proxy_rise`` (proxy at the
    largest KL), ``proxy_largest_drop`` (the largest fall of the proxy from any point to one at a larger KL
    beyond noise; 0 when it never falls), ``proxy_falls`` (some such fall exceeds its noise), ``gold_peak``
    and ``gold_peak_kl``, ``gold_at_largest_kl``, ``gold_drop_from_peak``, and ``peaks_and_falls``: the
    proxy rises (above SFT's, with no fall beyond noise), the gold peaks at a point between KL 0 and the
    largest KL, and the gold at the largest KL is below that peak beyond noise.
    """
    run_var = run_var or {}
    ordered = [sft, *sorted(({**p, "trained": True} for p in points), key=lambda p: p["kl_ref"])]
    proxy = [p["proxy_mean"] - sft["proxy_mean"] for p in ordered]  # (P + 1,)
    gold = [p["gold_mean"] - sft["gold_mean"] for p in ordered]  # (P + 1,)
    peak = max(range(len(gold)), key=gold.__getitem__)
    pairs = [  # (i, j): point j lies at a larger KL than point i beyond the noise of the two KLs
        (i, j)
        for j in range(len(ordered))
        for i in range(j)
        if ordered[j]["kl_ref"] - ordered[i]["kl_ref"] > _noise(ordered[i], ordered[j], "kl_ref")
    ]
    drops = [proxy[i] - proxy[j] for i, j in pairs]  # (pairs,)
    noise = [_noise(ordered[i], ordered[j], "proxy", run_var.get("proxy", 0.0)) for i, j in pairs]  # (pairs,)
    proxy_falls = any(drop > tolerance for drop, tolerance in zip(drops, noise))
    gold_falls = gold[peak] - gold[-1] > _noise(ordered[peak], ordered[-1], "gold", run_var.get("gold", 0.0))
    return {
        "proxy_rise": proxy[-1],
        "proxy_largest_drop": max([0.0, *drops]),
        "proxy_falls": proxy_falls,
        "gold_peak": gold[peak],
        "gold_peak_kl": ordered[peak]["kl_ref"],
        "gold_at_largest_kl": gold[-1],
        "gold_drop_from_peak": gold[peak] - gold[-1],
        "peaks_and_falls": proxy[-1] > 0 and not proxy_falls and 0 < peak < len(gold) - 1 and gold_falls,
    }


def summary_fields(results: dict, runs: dict) -> dict[str, Any]:
    """``overoptimize_sweep`` of the report: every run's point (coef, seed, KL, gold, proxy, grammatical
    rate), the SFT point and the shape per seed; empty without sweep runs."""
    names = [run for run in runs if is_sweep_run(run) and run in results]
    if not names or SFT_WEAK not in results:
        return {}
    keys = ("kl_ref", "gold_mean", "gold_std", "proxy_mean", "proxy_std", "grammatical_rate", "n_prompts")
    optional = ("kl_ref_std",)  # absent from evaluations made before it was recorded

    def fields(summary: dict) -> dict:
        return {**{k: summary[k] for k in keys}, **{k: summary[k] for k in optional if k in summary}}

    points = []
    for run in names:
        config = runs[run].config
        points.append({"run": run, "coef": config["model"]["init_args"]["kl"]["coef"],
                       "seed": config["seed_everything"], **fields(results[run]["summary"])})  # fmt: skip
    sft = fields(results[SFT_WEAK]["summary"])
    run_var = {key: run_variance(points, f"{key}_mean") for key in ("proxy", "gold")}
    shape = {}
    for seed in sorted({p["seed"] for p in points}):
        own = [p for p in points if p["seed"] == seed]
        strict = sweep_shape(own, sft)  # evaluation noise alone: two runs of one setting taken to end alike
        # The proxy's rise is judged against how far two runs' final proxies scatter; the gold's fall against
        # the evaluations' noise: its scatter across seeds at the weakest coefficients is the collapse itself
        # (one seed runs into the exploit, another not), which is what the check looks for, not noise.
        shape[str(seed)] = {**sweep_shape(own, sft, {"proxy": run_var["proxy"]}),
                            "proxy_falls_evaluation_noise": strict["proxy_falls"],
                            "peaks_and_falls_evaluation_noise": strict["peaks_and_falls"]}  # fmt: skip
    run_std = {key: math.sqrt(v) for key, v in run_var.items()}
    return {"overoptimize_sweep": {"points": points, "sft": sft, "run_std": run_std, "shape": shape}}


def plot_sweep(sweep: dict, path: Path) -> None:
    """Gold and proxy (minus the SFT policy's) of every sweep run against sqrt(KL), one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_gold, ax_proxy) = plt.subplots(1, 2, figsize=(11, 4))
    sft = sweep["sft"]
    for seed in sorted({p["seed"] for p in sweep["points"]}):
        points = sorted([p for p in sweep["points"] if p["seed"] == seed], key=lambda p: p["kl_ref"])
        x = [0.0, *[math.sqrt(max(p["kl_ref"], 0.0)) for p in points]]
        for ax, key in ((ax_gold, "gold_mean"), (ax_proxy, "proxy_mean")):
            y = [0.0, *[p[key] - sft[key] for p in points]]
            ax.plot(x, y, "o-", ms=4, label=f"seed {seed}")
            if seed == min(p["seed"] for p in sweep["points"]):
                for xi, yi, p in zip(x[1:], y[1:], points):
                    ax.annotate(f"{p['coef']:g}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax, name in ((ax_gold, "gold"), (ax_proxy, "proxy (the weak RM)")):
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xlabel("sqrt(KL(policy || SFT)), sqrt(nats); labels: the KL coefficient")
        ax.set_ylabel(f"{name} reward - SFT's")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Over-optimisation sweep: PPO against the weak RM, one run per fixed KL coefficient")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_lines(summary: dict) -> list[str]:
    """``report.md`` bullets of the sweep (none without one)."""
    sweep = summary.get("overoptimize_sweep")
    if not sweep:
        return []
    lines = ["- Over-optimisation sweep (final policies; gold and proxy relative to SFT's):"]
    for seed, shape in sweep["shape"].items():
        points = sorted([p for p in sweep["points"] if str(p["seed"]) == seed], key=lambda p: p["kl_ref"])
        row = "; ".join(
            f"coef {p['coef']:g}: KL {p['kl_ref']:.1f}, gold {p['gold_mean'] - sweep['sft']['gold_mean']:+.2f},"
            f" proxy {p['proxy_mean'] - sweep['sft']['proxy_mean']:+.2f}"
            for p in points
        )
        verdict = "peaks and falls while the proxy rises" if shape["peaks_and_falls"] else "not the textbook picture"
        lines.append(
            f"  - seed {seed}: {row}. Gold peaks at {shape['gold_peak']:+.2f} at KL {shape['gold_peak_kl']:.1f},"
            f" ends at {shape['gold_at_largest_kl']:+.2f}; the proxy's largest fall {shape['proxy_largest_drop']:.2f}"
            f" ({'beyond' if shape['proxy_falls'] else 'within'} the noise of two runs, run-to-run scatter"
            f" {sweep.get('run_std', {}).get('proxy', 0.0):.3f}; {_strict(shape)}): {verdict}."
        )
    return lines


def _strict(shape: dict) -> str:
    """The verdict with evaluation noise alone, as a clause."""
    if "proxy_falls_evaluation_noise" not in shape:
        return "no evaluation-noise-only verdict"
    fall = "beyond" if shape["proxy_falls_evaluation_noise"] else "within"
    picture = "the picture" if shape["peaks_and_falls_evaluation_noise"] else "not the picture"
    return f"{fall} evaluation noise alone, {picture} by that bound"


def console_lines(summary: dict) -> list[str]:
    """The console summary's lines of the sweep (one per seed)."""
    sweep = summary.get("overoptimize_sweep")
    if not sweep:
        return []
    return [
        f"  KL sweep seed {seed}: gold peak {s['gold_peak']:+.2f} at KL {s['gold_peak_kl']:.1f}, at the largest KL"
        f" {s['gold_at_largest_kl']:+.2f}; proxy {s['proxy_rise']:+.2f} (largest fall {s['proxy_largest_drop']:.2f})"
        f" -> {'peaks and falls' if s['peaks_and_falls'] else 'no peak and fall'}"
        f" ({'yes' if s.get('peaks_and_falls_evaluation_noise') else 'no'} with evaluation noise alone)"
        for seed, s in sweep["shape"].items()
    ]

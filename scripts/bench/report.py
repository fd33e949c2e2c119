"""Markdown tables of the benchmark results (medians, spreads, A/B ratios, targets of issue 7)."""

from __future__ import annotations

import statistics

PHASES = ("total", "generation", "scoring", "update", "optimizer", "other")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def _spread(values: list[float]) -> str:
    return f"{_fmt(statistics.median(values))} [{_fmt(min(values))}-{_fmt(max(values))}]"


def _row(name: str, a: list[float], b: list[float], target: str = "") -> str:
    ratios = [x / y for x, y in zip(a, b)] if all(b) else []
    ratio = (
        " / ".join(f"{r:.2f}" for r in (min(ratios), statistics.median(ratios), max(ratios)))
        if ratios
        else "-"
    )
    return f"| {name} | {_spread(a)} | {_spread(b)} | {ratio} | {target} |"


def _label(phase: str) -> str:
    return "update: optimizer.step" if phase == "optimizer" else phase


def _header(a: str, b: str) -> list[str]:
    return [
        f"| metric | {a}: median [min-max] | {b}: median [min-max] | {a}/{b}: min / median / max | target |",
        "| --- | --- | --- | --- | --- |",
    ]


def ppo_run_stats(run: dict) -> dict[str, float]:
    """Medians over a run's timed rollouts (all but the first, warm-up one)."""
    timed = run["rollouts"][1:] or run["rollouts"]
    stats = {key: statistics.median(r[key] for r in timed) for key in timed[0]}
    stats["tok_s"] = run["tokens_per_rollout"] / stats["total"]
    stats["cpu_tok_s"] = run["tokens_per_rollout"] / stats["cpu_total"]
    stats["peak_rss_mb"] = run["peak_rss_mb"]
    return stats


def ppo_table(pairs: list[tuple[dict, dict]], a: str, b: str, settings: dict) -> str:
    sa = [ppo_run_stats(ra) for ra, _ in pairs]
    sb = [ppo_run_stats(rb) for _, rb in pairs]

    def col(stats: list[dict], key: str) -> list[float]:
        return [s[key] for s in stats]

    run = pairs[0][0]
    lines = [
        f"### PPO: {run['actor_params'] / 1e6:.2f}M-parameter Llama actor, critic and reward model separate; "
        f"{settings['batch']} prompts x {settings['response_len']} tokens per rollout, "
        f"{settings['ppo_epochs']} epochs x {settings['num_minibatches']} minibatches; "
        f"{len(run['rollouts']) - 1} timed rollouts per run, {len(pairs)} runs each",
        "",
        *_header(a, b),
        _row("rollout tokens/s (wall)", col(sa, "tok_s"), col(sb, "tok_s"), ">= 2.0x"),
        _row("rollout tokens/s per CPU-second", col(sa, "cpu_tok_s"), col(sb, "cpu_tok_s"), ">= 2.0x"),
    ]
    for phase in PHASES:
        label = "s / rollout (wall)" if phase == "total" else f"- {_label(phase)} s"
        lines.append(_row(label, col(sa, phase), col(sb, phase)))
    for phase in PHASES:
        label = "CPU s / rollout" if phase == "total" else f"- {_label(phase)} CPU s"
        lines.append(_row(label, col(sa, "cpu_" + phase), col(sb, "cpu_" + phase)))
    lines.append(_row("peak RSS MB", col(sa, "peak_rss_mb"), col(sb, "peak_rss_mb"), "<= 0.8x"))
    return "\n".join(lines) + "\n"


def rm_table(pairs: list[tuple[dict, dict]], a: str, b: str) -> str:
    lines = [
        f"### Reward model: hidden-64 2-layer GPT-2, {len(pairs)} runs each",
        "",
        *_header(a, b),
        _row(
            "pairs/s (wall)",
            [x["pairs_per_s"] for x, _ in pairs],
            [y["pairs_per_s"] for _, y in pairs],
            ">= 1.5x",
        ),
        _row(
            "pairs/s per CPU-second",
            [x["cpu_pairs_per_s"] for x, _ in pairs],
            [y["cpu_pairs_per_s"] for _, y in pairs],
            ">= 1.5x",
        ),
        _row("peak RSS MB", [x["peak_rss_mb"] for x, _ in pairs], [y["peak_rss_mb"] for _, y in pairs]),
    ]
    return "\n".join(lines) + "\n"


def flops_table(peak: dict, run: dict, settings: dict) -> str:
    stats = ppo_run_stats(run)
    flops = run["update_flops"]
    rows_tokens = (
        settings["batch"] * (settings["prompt_len"] + settings["response_len"]) * settings["ppo_epochs"]
    )
    estimate = 6 * (run["actor_params"] + run["critic_params"]) * rows_tokens
    wall, cpu = flops / stats["update"] / 1e9, flops / stats["cpu_update"] / 1e9
    lines = [
        f"### FLOP utilisation of the PPO update phase ({run['impl']}, {run['actor_params'] / 1e6:.1f}M-parameter "
        f"actor + {run['critic_params'] / 1e6:.1f}M critic, {len(run['rollouts']) - 1} timed rollouts)",
        "",
        "| quantity | wall | per CPU-second |",
        "| --- | --- | --- |",
        f"| matmul peak fp32, GFLOP/s | {peak['fp32_gflops']:.1f} | {peak['fp32_cpu_gflops']:.1f} |",
        f"| matmul peak bf16, GFLOP/s | {peak['bf16_gflops']:.2f} | {peak['bf16_cpu_gflops']:.2f} |",
        f"| update FLOPs / rollout (FlopCounterMode; 6*N*D = {estimate / 1e9:.0f} G) | {flops / 1e9:.0f} G | |",
        f"| update time / rollout, s | {stats['update']:.2f} | {stats['cpu_update']:.2f} |",
        f"| - of which optimizer.step, s | {stats['optimizer']:.2f} | {stats['cpu_optimizer']:.2f} |",
        f"| update achieved, GFLOP/s | {wall:.1f} | {cpu:.1f} |",
        f"| fraction of fp32 peak (target >= 30%) | {wall / peak['fp32_gflops']:.0%} "
        f"| {cpu / peak['fp32_cpu_gflops']:.0%} |",
        f"| PPO rollout tokens/s of this model | {stats['tok_s']:.0f} | {stats['cpu_tok_s']:.0f} |",
        f"| peak RSS MB | {run['peak_rss_mb']:.0f} | |",
    ]
    return "\n".join(lines) + "\n"


def versions_line(results: dict) -> str:
    """Package versions of each implementation, from its first run."""
    seen: dict[str, dict] = {}
    for key in ("ppo", "rm"):
        for pair in results.get(key, []):
            for side, run in zip(("a", "b"), pair):
                seen.setdefault(results[side], run.get("versions", {}))
    parts = [f"{impl}: " + ", ".join(f"{k} {v}" for k, v in vers.items()) for impl, vers in seen.items()]
    return "versions - " + "; ".join(parts) if parts else ""

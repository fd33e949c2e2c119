"""Markdown tables of the benchmark results (medians, spreads, A/B ratios, targets) of one workload and
one pair of implementations; the summary over peers is in peers.py. Pure Python: no torch, no lit_rlhf,
no TRL."""

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
    """Medians over a run's timed rollouts (all but the first, warm-up one).

    Tokens/s: the control's fixed ``tokens_per_rollout`` over the median rollout time; for EOS-stopped
    workloads (a ``response_tokens`` list and no fixed length) the real response tokens of the timed
    rollouts over their summed time.
    """
    timed = run["rollouts"][1:] or run["rollouts"]
    stats = {key: statistics.median(r[key] for r in timed) for key in timed[0]}
    if run.get("workload", "control") == "control":
        stats["tok_s"] = run["tokens_per_rollout"] / stats["total"]
        stats["cpu_tok_s"] = run["tokens_per_rollout"] / stats["cpu_total"]
    else:
        tokens = run["response_tokens"][1:] if len(run["rollouts"]) > 1 else run["response_tokens"]
        stats["tok_s"] = sum(tokens) / sum(r["total"] for r in timed)
        stats["cpu_tok_s"] = sum(tokens) / sum(r["cpu_total"] for r in timed)
        stats["tokens"] = statistics.mean(tokens)
    stats["peak_rss_mb"] = run["peak_rss_mb"]
    return stats


ROLLOUT_WORKLOADS = ("W1_grpo", "W3_ppo", "control_ppo")
PAIR_WORKLOADS = ("W2_rm", "W2_dpo", "control_rm")
THROUGHPUT_UNITS = {
    "W1_grpo": "response tokens/s",
    "W3_ppo": "response tokens/s",
    "control_ppo": "rollout tokens/s",
    "W2_rm": "pairs/s",
    "W2_dpo": "pairs/s",
    "control_rm": "pairs/s",
}


BF16_SUFFIX = "_bf16"  # the bf16-mixed rows of a workload (W1_grpo_bf16, W3_ppo_bf16)


def base_workload(name: str) -> str:
    """The workload a row measures: ``W1_grpo_bf16`` -> ``W1_grpo``."""
    return name.removesuffix(BF16_SUFFIX)


def throughput(workload: str, run: dict) -> float:
    """The wall-clock throughput of one run in the workload's unit (THROUGHPUT_UNITS)."""
    if base_workload(workload) in ROLLOUT_WORKLOADS:
        return ppo_run_stats(run)["tok_s"]
    return run["pairs_per_s"]


def ppo_table(
    pairs: list[tuple[dict, dict]], a: str, b: str, settings: dict, title: str | None = None,
    unit: str = "rollout tokens/s", rss_target: str = "<= 0.8x", target: str = ">= 2.0x",
) -> str:  # fmt: skip
    """Rollout workloads (control PPO, W1 GRPO, W3 PPO): throughput (``target`` of its ratio), phases, peak
    RSS (``rss_target``)."""
    sa = [ppo_run_stats(ra) for ra, _ in pairs]
    sb = [ppo_run_stats(rb) for _, rb in pairs]

    def col(stats: list[dict], key: str) -> list[float]:
        return [s[key] for s in stats]

    run = pairs[0][0]
    if title is None:
        title = (
            f"PPO: {run['actor_params'] / 1e6:.2f}M-parameter Llama actor, critic and reward model separate; "
            f"{settings['batch']} prompts x {settings['response_len']} tokens per rollout, "
            f"{settings['ppo_epochs']} epochs x {settings['num_minibatches']} minibatches"
        )
    lines = [
        f"### {title}; {len(run['rollouts']) - 1} timed rollouts per run, {len(pairs)} runs each",
        "",
        *_header(a, b),
        _row(f"{unit} (wall)", col(sa, "tok_s"), col(sb, "tok_s"), target),
        _row(f"{unit} per CPU-second", col(sa, "cpu_tok_s"), col(sb, "cpu_tok_s"), target),
    ]
    if "tokens" in sa[0]:
        lines.append(_row("response tokens / rollout (mean)", col(sa, "tokens"), col(sb, "tokens")))
    for phase in PHASES:
        label = "s / rollout (wall)" if phase == "total" else f"- {_label(phase)} s"
        lines.append(_row(label, col(sa, phase), col(sb, phase)))
    for phase in PHASES:
        label = "CPU s / rollout" if phase == "total" else f"- {_label(phase)} CPU s"
        lines.append(_row(label, col(sa, "cpu_" + phase), col(sb, "cpu_" + phase)))
    lines.append(_row("peak RSS MB", col(sa, "peak_rss_mb"), col(sb, "peak_rss_mb"), rss_target))
    return "\n".join(lines) + "\n"


def rm_table(
    pairs: list[tuple[dict, dict]],
    a: str,
    b: str,
    title: str = "Reward model: hidden-64 2-layer GPT-2",
    target: str = ">= 1.5x",
) -> str:
    """Pair workloads (control RM, W2 RM, W2 DPO): pairs/s and peak RSS; ``target`` of the pairs/s ratio."""
    lines = [
        f"### {title}, {len(pairs)} runs each",
        "",
        *_header(a, b),
        _row(
            "pairs/s (wall)",
            [x["pairs_per_s"] for x, _ in pairs],
            [y["pairs_per_s"] for _, y in pairs],
            target,
        ),
        _row(
            "pairs/s per CPU-second",
            [x["cpu_pairs_per_s"] for x, _ in pairs],
            [y["cpu_pairs_per_s"] for _, y in pairs],
            target,
        ),
        _row("peak RSS MB", [x["peak_rss_mb"] for x, _ in pairs], [y["peak_rss_mb"] for _, y in pairs]),
    ]
    return "\n".join(lines) + "\n"


def run_dtype(run: dict) -> str:
    """``fp32`` or ``bf16``: the matmul dtype of a run (``precision`` bf16-mixed: autocast to bfloat16)."""
    return "bf16" if run.get("precision") == "bf16-mixed" else "fp32"


def peak_table(peak: dict, min_speedup: float) -> str:
    """The matmul peak of each dtype (matmul_peak.py) and whether the bf16 rows run (bf16/fp32 >=
    ``min_speedup``)."""
    ratio = peak["bf16_gflops"] / peak["fp32_gflops"]
    verdict = "run" if ratio >= min_speedup else "skipped"
    lines = [
        f"### Matmul peak ({peak['threads']} thread(s)): bf16 rows {verdict} (bf16/fp32 {ratio:.2f}x, "
        f"threshold {min_speedup:g}x)",
        "",
        "| dtype | GFLOP/s (wall) | GFLOP/s per CPU-second | by size (wall) |",
        "| --- | --- | --- | --- |",
    ]
    for dtype in ("fp32", "bf16"):
        sizes = ", ".join(f"{n}: {g:g}" for n, g in peak[f"{dtype}_by_size"].items())
        lines.append(
            f"| {dtype} | {peak[f'{dtype}_gflops']:.1f} | {peak[f'{dtype}_cpu_gflops']:.1f} | {sizes} |"
        )
    return "\n".join(lines) + "\n"


def precision_speedups(runs: dict[str, list[dict[str, dict]]]) -> str:
    """Each implementation's bf16-mixed / float32 throughput per workload with a bf16 row (medians of the
    runs of each row, ``runs`` as compare.py keeps them, one ``{implementation: result}`` per repeat: the
    rows are measured at different times, so this ratio is noisier than A/B)."""
    lines = []
    for name, repeats in runs.items():
        base = base_workload(name)
        if name == base or base not in runs:
            continue
        parts = []
        for impl in dict.fromkeys(impl for rep in repeats for impl in rep):
            bf16 = [throughput(base, rep[impl]) for rep in repeats if impl in rep]
            fp32 = [throughput(base, rep[impl]) for rep in runs[base] if impl in rep]
            if fp32:
                parts.append(f"{impl} {statistics.median(bf16) / statistics.median(fp32):.2f}x")
        lines.append(f"- {base}: bf16-mixed / float32 throughput, " + ", ".join(parts))
    return ("### What bf16 buys (same run)\n\n" + "\n".join(lines) + "\n") if lines else ""


def flops_table(peak: dict, run: dict, settings: dict) -> str:
    """FLOP utilisation of the PPO update against the matmul peak of the dtype the run multiplies in."""
    stats = ppo_run_stats(run)
    dtype = run_dtype(run)
    flops = run["update_flops"]
    rows_tokens = (
        settings["batch"] * (settings["prompt_len"] + settings["response_len"]) * settings["ppo_epochs"]
    )
    estimate = 6 * (run["actor_params"] + run["critic_params"]) * rows_tokens
    wall, cpu = flops / stats["update"] / 1e9, flops / stats["cpu_update"] / 1e9
    target = " (target >= 60%)" if dtype == "fp32" else ""
    lines = [
        f"### FLOP utilisation of the PPO update phase ({run['impl']}, {run.get('precision', '32-true')}, "
        f"{run['actor_params'] / 1e6:.1f}M-parameter actor + {run['critic_params'] / 1e6:.1f}M critic, "
        f"{len(run['rollouts']) - 1} timed rollouts)",
        "",
        "| quantity | wall | per CPU-second |",
        "| --- | --- | --- |",
        f"| matmul peak fp32, GFLOP/s | {peak['fp32_gflops']:.1f} | {peak['fp32_cpu_gflops']:.1f} |",
        f"| matmul peak bf16, GFLOP/s | {peak['bf16_gflops']:.1f} | {peak['bf16_cpu_gflops']:.1f} |",
        f"| update FLOPs / rollout (FlopCounterMode; 6*N*D = {estimate / 1e9:.0f} G) | {flops / 1e9:.0f} G | |",
        f"| update time / rollout, s | {stats['update']:.2f} | {stats['cpu_update']:.2f} |",
        f"| - of which optimizer.step, s | {stats['optimizer']:.2f} | {stats['cpu_optimizer']:.2f} |",
        f"| update achieved, GFLOP/s | {wall:.1f} | {cpu:.1f} |",
        f"| fraction of the {dtype} peak{target} | {wall / peak[f'{dtype}_gflops']:.0%} "
        f"| {cpu / peak[f'{dtype}_cpu_gflops']:.0%} |",
        f"| PPO rollout tokens/s of this model | {stats['tok_s']:.0f} | {stats['cpu_tok_s']:.0f} |",
        f"| peak RSS MB | {run['peak_rss_mb']:.0f} | |",
    ]
    return "\n".join(lines) + "\n"

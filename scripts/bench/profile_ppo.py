"""torch.profiler over one timed PPO rollout (``ppo_bench.py --profile FILE``).

The profiler starts at the end of the first (warm-up) rollout and stops at the end of the second, so
it sees exactly one steady-state rollout. FILE gets the phase split of that rollout and the top ops by
self CPU time, both for the whole rollout and for each phase (ops are attributed to the phase that was
running when they started).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path


def profiled(run, args, timeline, flops, tokens):
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    mark = timeline.mark
    bounds: dict[str, float] = {}  # phase marks of the profiled rollout, in us since the profiler started
    started: list[float] = []

    def marking(name: str) -> None:
        now = time.perf_counter()
        mark(name)
        if name == "iter_end" and not started:
            prof.__enter__()
            started.append(time.perf_counter())
        elif started and "end" not in bounds:
            bounds[name if name != "iter_end" else "end"] = (now - started[0]) * 1e6
            if name == "iter_end":
                prof.__exit__(None, None, None)

    timeline.mark = marking
    out = run(args, timeline, flops, tokens)
    Path(args.profile).write_text(_report(prof, timeline.rollouts()[1], bounds))
    return out


def _report(prof, phases: dict[str, float], bounds: dict[str, float]) -> str:
    lines = ["phase split of the profiled rollout (wall s, CPU s; includes profiler overhead):"]
    for key in ("generation", "scoring", "update", "other", "total"):
        lines.append(f"  {key:<10} {phases[key]:7.3f}  {phases['cpu_' + key]:7.3f}")
    lines += ["", "top ops of the whole rollout by self CPU time:", ""]
    lines.append(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    )
    if {"gen_start", "gen_end", "upd_start"} <= bounds.keys():
        per_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for event in prof.events():
            start = event.time_range.start
            phase = (
                "generation" if bounds["gen_start"] <= start < bounds["gen_end"]
                else "scoring" if bounds["gen_end"] <= start < bounds["upd_start"]
                else "update" if start >= bounds["upd_start"]
                else "other"
            )  # fmt: skip
            per_phase[phase][event.key] += event.self_cpu_time_total
            counts[phase][event.key] += 1
        for phase, totals in per_phase.items():
            total = sum(totals.values()) / 1e6
            lines += ["", f"{phase}: {total:.3f} s of op self time; top ops (self s, calls):"]
            for key, us in totals.most_common(15):
                lines.append(f"  {us / 1e6:8.3f}  {counts[phase][key]:6d}  {key}")
    return "\n".join(lines) + "\n"

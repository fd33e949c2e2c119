"""lit_rlhf vs TRL, side by side in one invocation: the realistic workloads of issue 16 (W1 GRPO, W2 RM
and DPO, W3 PPO), the fixed-length controls (PPO, reward model), matmul peak and FLOP utilisation.

    .venv/bin/python scripts/bench/compare.py --trl-python .bench-venv/bin/python
        --trl-new-python .bench-venv-new/bin/python [--threads 1] [--workloads W1_grpo,W2_dpo]
        [--size full|smoke] [--repeats 3] [--out results.json] [--bf16-rows auto|on|off]

The fp32 and bf16 matmul peaks are measured first (matmul_peak.py). Where the bf16 peak is at least
``common.BF16_ROWS_MIN_SPEEDUP`` times the fp32 one (``--bf16-rows auto``), W1 and W3 also run as the rows
``W1_grpo_bf16`` and ``W3_ppo_bf16`` (lit_rlhf under Lightning's bf16-mixed, TRL with ``bf16=True``), and
the FLOP-utilisation run is repeated under bf16-mixed, its utilisation taken against the bf16 peak.

Builds the shared assets once (tokenizer, initial weights, prompts, pairs), then runs every benchmark as
its own subprocess (so peak RSS is per run). Each repeat runs every implementation of the workload once,
the order rotating by one place per repeat (A B C, B C A, C A B; with two: A B, B A, ...) so that load
from other jobs on a shared machine hits all alike, and the tables give medians with min-max spreads and
the ratio of A to each peer (min / median / max over the repeats). The peers are B (``trl``, TRL 1.12.0,
the last release with PPOTrainer) and, on W1 GRPO and W2 RM/DPO, C (``trl-new``, the newest TRL
release, in its own environment); the headline ratio of each workload is against its faster peer (by
median throughput) and both are reported. ``--out`` writes the raw results and ``"summary": {workload:
{"throughput_ratio", "rss_ratio", "peer", "peers", ...}}`` (peers.summary).

Implementations are ``lit`` (the installed lit_rlhf), ``lit@DIR`` (lit_rlhf imported from DIR, e.g. a
patched copy, for A/B tests of an optimisation), ``trl`` (``--trl-python``) and ``trl-new``
(``--trl-new-python``). Run ``scripts/bench/setup.sh`` first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import BF16_ROWS_MIN_SPEEDUP, PPO, RESULT_PREFIX, child_env, log  # noqa: E402
from peers import (  # noqa: E402
    NEW_PEER_WORKLOADS,
    impl_labels,
    run_order,
    summary,
    summary_table,
    tables,
    versions_by_impl,
    versions_table,
    workload_peers,
)
from report import (  # noqa: E402
    BF16_SUFFIX,
    flops_table,
    peak_table,
    precision_speedups,
)
from workloads import SIZES, WORKLOADS, assets_dir  # noqa: E402


class Runner:
    def __init__(self, args, workdir: Path) -> None:
        self.args, self.workdir = args, workdir

    def python(self, name: str) -> str:
        """The interpreter of an implementation: the TRL environments' for ``trl`` and ``trl-new``."""
        return {"trl": self.args.trl_python, "trl-new": self.args.trl_new_python}.get(name, sys.executable)

    def run(self, script: str, impl: str, *extra: str) -> dict:
        """Run ``script`` for ``impl`` in a fresh process and return its BENCH_RESULT."""
        name, _, src = impl.partition("@")
        env = child_env(self.args.threads)
        if src:
            env["PYTHONPATH"] = str(Path(src).resolve())
        cmd = [self.python(name), str(HERE / script), "--threads", str(self.args.threads), *extra]
        if script != "matmul_peak.py":
            cmd += ["--impl", "trl" if name.startswith("trl") else name, "--assets", str(self.args.assets)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=self.workdir, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            log(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        log(f"  {script} {impl} {' '.join(extra)}: {time.perf_counter() - start:.0f} s")
        return {**json.loads(lines[-1][len(RESULT_PREFIX) :]), "impl": impl}

    def repeats(self, script: str, impls: list[str], *extra: str) -> list[dict[str, dict]]:
        """``repeats`` dicts ``{impl: result}``, the run order rotating every repeat (peers.run_order)."""
        order = [run_order(impls, i) for i in range(self.args.repeats)]
        return [{impl: self.run(script, impl, *extra) for impl in impls} for impls in order]


def workload_jobs(args) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Workload name -> (benchmark script, its arguments) at ``args.size``."""
    size = SIZES[args.size]
    rollouts = args.rollouts or size["control_rollouts"]
    rm_steps = args.rm_steps or size["control_rm_steps"]
    sized = ("--size", args.size)
    jobs = {
        "W1_grpo": ("grpo_bench.py", sized),
        "W2_rm": ("pair_bench.py", ("--algo", "rm", *sized)),
        "W2_dpo": ("pair_bench.py", ("--algo", "dpo", *sized)),
        "W3_ppo": ("ppo_bench.py", ("--workload", "W3_ppo", "--rollouts", str(size["ppo_rollouts"]), *sized)),
        "control_ppo": ("ppo_bench.py", ("--rollouts", str(rollouts))),
        "control_rm": ("rm_bench.py", ("--steps", str(rm_steps), "--warmup", str(args.rm_warmup))),
    }
    for name in BF16_WORKLOADS:
        script, extra = jobs[name]
        jobs[name + BF16_SUFFIX] = (script, (*extra, "--precision", "bf16-mixed"))
    return jobs


BF16_WORKLOADS = ("W1_grpo", "W3_ppo")  # the workloads with a bf16-mixed row


def bf16_rows_wanted(mode: str, peak: dict | None) -> bool:
    """``--bf16-rows``: ``on``, ``off``, or ``auto`` = where the measured bf16 matmul peak is at least
    BF16_ROWS_MIN_SPEEDUP times the fp32 one."""
    if mode != "auto":
        return mode == "on"
    return peak is not None and peak["bf16_gflops"] >= BF16_ROWS_MIN_SPEEDUP * peak["fp32_gflops"]


def with_bf16_rows(names: list[str]) -> list[str]:
    """``names`` with each BF16_WORKLOADS member followed by its bf16 row (``flops`` by ``flops_bf16``)."""
    out = []
    for name in names:
        out.append(name)
        if name in BF16_WORKLOADS or name == "flops":
            out.append(name + BF16_SUFFIX)
    return out


def selected(args) -> list[str]:
    """The workloads (and ``flops``) to run, in WORKLOADS order; ``all`` = every workload, plus the
    FLOP-utilisation section at the full size."""
    if args.workloads == "all":
        return [*WORKLOADS, *(["flops"] if args.size == "full" else [])]
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(names) - {*WORKLOADS, "flops"})
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {', '.join(WORKLOADS)}, flops or all")
    return [name for name in (*WORKLOADS, "flops") if name in names]


def build_assets(args, names: list[str]) -> None:
    """Build the missing assets in subprocesses (this driver stays small, see common.peak_rss_mb)."""
    assets, env = Path(args.assets), child_env(args.threads)
    assets.mkdir(parents=True, exist_ok=True)
    if {"control_ppo", "control_rm", "flops"} & set(names) and not (assets / "pairs.json").exists():
        log(f"building the control assets in {assets}")
        cmd = [sys.executable, str(HERE / "common.py"), str(assets)]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
    if set(names) & {"W1_grpo", "W2_rm", "W2_dpo", "W3_ppo"} and not (
        assets_dir(assets, args.size) / "reward" / "config.json"
    ).exists():
        log(f"building the 32k-vocabulary assets ({args.size}) in {assets_dir(assets, args.size)}")
        cmd = [sys.executable, str(HERE / "workloads.py"), str(assets), args.size]
        subprocess.run(cmd, env=env, check=True, capture_output=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trl-python", default=".bench-venv/bin/python",
        help="python of the trl 1.12.0 venv (implementation trl)",
    )
    parser.add_argument(
        "--trl-new-python", default=".bench-venv-new/bin/python",
        help="python of the newest TRL's venv (implementation trl-new)",
    )
    parser.add_argument("--a", default="lit", help="first implementation (numerator of the ratios)")
    parser.add_argument("--b", default="trl", help="second implementation (a denominator)")
    parser.add_argument(
        "--c", default="auto",
        help=f"third implementation, on {', '.join(NEW_PEER_WORKLOADS)} only: auto = trl-new where --b is "
        "trl, none = no third",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (equal for all)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per implementation and workload")
    parser.add_argument(
        "--workloads", default="all",
        help=f"comma-separated subset of {','.join(WORKLOADS)},flops (default: all; flops only at --size full)",
    )  # fmt: skip
    parser.add_argument(
        "--size", choices=sorted(SIZES), default="full",
        help="work per run (workloads.SIZES): full (run.sh's figures) or smoke (< 1 min per workload)",
    )  # fmt: skip
    parser.add_argument("--rollouts", type=int, help="control PPO rollouts per run, the first one untimed")
    parser.add_argument("--rm-steps", type=int, help="timed control reward-model steps per run")
    parser.add_argument("--rm-warmup", type=int, default=5, help="untimed control RM steps before them")
    parser.add_argument("--flops-rollouts", type=int, default=3, help="PPO rollouts of the >= 20M model")
    parser.add_argument("--assets", help="reuse (or create) the assets in this folder instead of a temp one")
    parser.add_argument("--out", help="also write every raw result and the summary to this JSON file")
    parser.add_argument(
        "--bf16-rows", choices=["auto", "on", "off"], default="auto",
        help=f"the bf16-mixed rows of {', '.join(BF16_WORKLOADS)} (and flops): auto = where the "
        f"measured bf16 matmul peak is >= {BF16_ROWS_MIN_SPEEDUP:g}x the fp32 one",
    )  # fmt: skip
    parser.add_argument(
        "--peak-seconds", type=float, default=1.0, help="matmul_peak.py time per dtype and size"
    )
    args = parser.parse_args(argv)
    # absolute (runs start in a temp folder), but not resolved: a venv's python is a symlink
    args.trl_python, args.trl_new_python = map(os.path.abspath, (args.trl_python, args.trl_new_python))
    args.c = third_impl(args.b, args.c)
    impls = [args.a, args.b, *([args.c] if args.c else [])]
    if len(set(impls)) < len(impls):
        parser.error(f"--a, --b and --c name the same implementation twice: {impls}")
    return args


def third_impl(b: str, c: str) -> str | None:
    """``--c``: ``auto`` = ``trl-new`` where B is ``trl`` (TRL 1.12.0), else none; ``none`` = none."""
    if c == "auto":
        return "trl-new" if b == "trl" else None
    return None if c == "none" else c


def check_pythons(args, names: list[str]) -> None:
    """A clear error before any run when a TRL environment that the selected workloads need is missing."""
    needed = {"trl": args.trl_python, "trl-new": args.trl_new_python}
    impls = {impl for name in names if not name.startswith("flops")
             for impl in (args.a, *workload_peers(name, args.b, args.c))}  # fmt: skip
    for impl in sorted(impls & needed.keys()):
        if not os.access(needed[impl], os.X_OK):
            flag = "--trl-python" if impl == "trl" else "--trl-new-python (or --c none)"
            raise SystemExit(
                f"no TRL environment for {impl} at {needed[impl]}: run scripts/bench/setup.sh or pass {flag}"
            )


def measure(args, names: list[str], tmp: Path) -> dict:
    """Every selected workload's repeats, the matmul peak and the FLOP-utilisation runs."""
    build_assets(args, names)
    runner, jobs = Runner(args, tmp), workload_jobs(args)
    results: dict = dict(threads=args.threads, a=args.a, b=args.b, c=args.c, size=args.size)
    results.update(runs={}, peers={})
    if args.bf16_rows == "auto" or "flops" in names:
        log("matmul peak of fp32 and bf16")
        results["peak"] = runner.run("matmul_peak.py", "lit", "--seconds", str(args.peak_seconds))
    results["bf16_rows"] = bf16_rows_wanted(args.bf16_rows, results.get("peak"))
    if results["bf16_rows"]:
        names = with_bf16_rows(names)
    for name in names:
        if name.startswith("flops"):
            precision = "bf16-mixed" if name != "flops" else "32-true"
            log(f"lit_rlhf PPO on the >= 20M-parameter model, {precision}")
            flop_args = ("--model", "large", "--rollouts", str(args.flops_rollouts), "--count-flops")
            results[name] = runner.run("ppo_bench.py", args.a, *flop_args, "--precision", precision)
            continue
        script, extra = jobs[name]
        results["peers"][name] = workload_peers(name, args.b, args.c)
        impls = [args.a, *results["peers"][name]]
        log(f"{name}: {args.repeats} x ({', '.join(impls)}), the order rotating")
        results["runs"][name] = runner.repeats(script, impls, *extra)
    results["versions"] = versions_by_impl(results["runs"])
    results["pythons"] = {impl: runner.python(impl.partition("@")[0]) for impl in results["versions"]}
    return results


def print_report(results: dict, args) -> None:
    c = f", C={args.c}" if args.c else ""
    header = f"threads={args.threads}, repeats={args.repeats}, A={args.a}, B={args.b}{c}, size={args.size}"
    print(f"\n## lit_rlhf benchmarks ({header})\n")
    labels = impl_labels(results["versions"])
    print(versions_table(results["versions"], results["pythons"]))
    if "peak" in results:
        print(peak_table(results["peak"], BF16_ROWS_MIN_SPEEDUP))
    if results["runs"]:
        print(summary_table(results["summary"], args.a, labels))
    for table in tables(results, args.a, labels):
        print(table)
    speedups = precision_speedups(results["runs"])
    if speedups:
        print(speedups)
    for name in ("flops", "flops" + BF16_SUFFIX):
        if name in results:
            print(flops_table(results["peak"], results[name], PPO))
    print(f"total benchmark time: {results['wall_s'] / 60:.1f} min")


def main() -> None:
    args = parse_args()
    names = selected(args)
    if "flops" in names and args.a.startswith("trl"):
        log("skipping the FLOP-utilisation run: it measures lit_rlhf (A), not TRL")
        names.remove("flops")
    check_pythons(args, names)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit_rlhf_bench_") as tmp:
        if args.assets is None:
            args.assets = str(Path(tmp) / "assets")
        results = measure(args, names, Path(tmp))
    results["wall_s"] = time.perf_counter() - start
    if args.out:  # the raw results first: a fault in the tables loses no measurement
        Path(args.out).write_text(json.dumps(results, indent=1))
    results["summary"] = summary(results["runs"], args.a, results["peers"])
    print_report(results, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

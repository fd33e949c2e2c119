"""lit_rlhf vs TRL, side by side in one invocation: the realistic workloads of issue 16 (W1 GRPO, W2 RM
and DPO, W3 PPO), the fixed-length controls (PPO, reward model), matmul peak and FLOP utilisation.

    .venv/bin/python scripts/bench/compare.py --trl-python .bench-venv/bin/python [--threads 1]
        [--workloads W1_grpo,W2_dpo] [--size full|smoke] [--repeats 3] [--out results.json]
        [--bf16-rows auto|on|off]

The fp32 and bf16 matmul peaks are measured first (matmul_peak.py). Where the bf16 peak is at least
``common.BF16_ROWS_MIN_SPEEDUP`` times the fp32 one (``--bf16-rows auto``), W1 and W3 also run as the rows
``W1_grpo_bf16`` and ``W3_ppo_bf16`` (lit_rlhf under Lightning's bf16-mixed, TRL with ``bf16=True``), and
the FLOP-utilisation run is repeated under bf16-mixed, its utilisation taken against the bf16 peak.

Builds the shared assets once (tokenizer, initial weights, prompts, pairs), then runs every benchmark as
its own subprocess (so peak RSS is per run), alternating the two implementations (A B, B A, A B, ...)
so that load from other jobs on a shared machine hits both alike, and prints Markdown tables of
medians with min-max spreads and the A/B ratio's min / median / max over the repeat pairs. ``--out``
writes the raw results and ``"summary": {workload: {"throughput_ratio", "rss_ratio", ...}}`` (medians
of A/B over the repeat pairs, report.summary).

Implementations are ``lit`` (the installed lit_rlhf), ``lit@DIR`` (lit_rlhf imported from DIR, e.g. a
patched copy, for A/B tests of an optimisation) and ``trl``. Run ``scripts/bench/setup.sh`` first.
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
from report import (  # noqa: E402
    BF16_SUFFIX,
    base_workload,
    flops_table,
    peak_table,
    ppo_table,
    precision_speedups,
    rm_table,
    summary,
    summary_table,
    versions_line,
)
from workloads import SIZES, WORKLOADS, assets_dir  # noqa: E402


class Runner:
    def __init__(self, args, workdir: Path) -> None:
        self.args, self.workdir = args, workdir

    def run(self, script: str, impl: str, *extra: str) -> dict:
        """Run ``script`` for ``impl`` in a fresh process and return its BENCH_RESULT."""
        name, _, src = impl.partition("@")
        python = self.args.trl_python if name == "trl" else sys.executable
        env = child_env(self.args.threads)
        if src:
            env["PYTHONPATH"] = str(Path(src).resolve())
        cmd = [python, str(HERE / script), "--threads", str(self.args.threads), *extra]
        if script != "matmul_peak.py":
            cmd += ["--impl", name, "--assets", str(self.args.assets)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=self.workdir, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if proc.returncode != 0 or not lines:
            log(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
        log(f"  {script} {impl} {' '.join(extra)}: {time.perf_counter() - start:.0f} s")
        return json.loads(lines[-1][len(RESULT_PREFIX) :])

    def alternate(self, script: str, *extra: str) -> list[tuple[dict, dict]]:
        """``repeats`` (A, B) result pairs, the order flipping every repeat."""
        a, b = self.args.a, self.args.b
        pairs = []
        for i in range(self.args.repeats):
            if i % 2 == 0:
                ra, rb = self.run(script, a, *extra), self.run(script, b, *extra)
            else:
                rb, ra = self.run(script, b, *extra), self.run(script, a, *extra)
            pairs.append((ra, rb))
        return pairs


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


def tables(results: dict, a: str, b: str) -> list[str]:
    runs = results["runs"]
    titled = {
        "W1_grpo": "W1 GRPO: K = 8 responses of <= 64 tokens (EOS-stopped) per prompt of 64-256 tokens, vocab 32k",
        "W3_ppo": "W3 PPO: responses of <= 64 tokens (EOS-stopped), prompts of 16-256 tokens, vocab 32k",
    }
    out = []
    for row, pairs in runs.items():
        name = base_workload(row)
        if name == "control_ppo":
            out.append(ppo_table(pairs, a, b, PPO, rss_target="<= 0.8x", target=">= 1.0x"))
        elif name in titled:
            run = pairs[0][0]
            title = f"{titled[name]}, {run['actor_params'] / 1e6:.1f}M-parameter Llama actor"
            if row != name:  # a bf16 row: no target of the issue
                title = f"{row}: {title}; bf16-mixed (lit_rlhf: Trainer precision bf16-mixed, TRL: bf16=True)"
                out.append(ppo_table(pairs, a, b, PPO, title, "response tokens/s", "", ""))
            else:
                out.append(ppo_table(pairs, a, b, PPO, title, "response tokens/s", "<= 0.7x"))
        elif name == "control_rm":
            out.append(rm_table(pairs, a, b, target=">= 1.0x"))
        else:
            what = "Reward model (Llama classifier)" if name == "W2_rm" else "DPO (Llama causal LM)"
            title = (
                f"{name} {what}: prompts 64-512 tokens, chosen/rejected 16-128, vocab 32k, "
                f"{pairs[0][0]['params'] / 1e6:.1f}M parameters"
            )
            out.append(rm_table(pairs, a, b, title))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-python", default=".bench-venv/bin/python", help="python of the TRL venv")
    parser.add_argument("--a", default="lit", help="first implementation (numerator of the ratios)")
    parser.add_argument("--b", default="trl", help="second implementation (denominator)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (equal for both)")
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
    args = parser.parse_args()
    # absolute (runs start in a temp folder), but not resolved: a venv's python is a symlink
    args.trl_python = os.path.abspath(args.trl_python)
    names = selected(args)
    if "flops" in names and args.a.startswith("trl"):
        log("skipping the FLOP-utilisation run: it measures lit_rlhf (A), not TRL")
        names.remove("flops")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit_rlhf_bench_") as tmp:
        if args.assets is None:
            args.assets = str(Path(tmp) / "assets")
        build_assets(args, names)
        runner, jobs = Runner(args, Path(tmp)), workload_jobs(args)
        results: dict = {"threads": args.threads, "a": args.a, "b": args.b, "size": args.size, "runs": {}}
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
            log(f"{name}: {args.repeats} x ({args.a}, {args.b})")
            results["runs"][name] = runner.alternate(script, *extra)
    results["wall_s"] = time.perf_counter() - start
    if args.out:  # the raw results first: a fault in the tables loses no measurement
        Path(args.out).write_text(json.dumps(results, indent=1))
    results["summary"] = summary(results["runs"])
    header = f"threads={args.threads}, repeats={args.repeats}, A={args.a}, B={args.b}, size={args.size}"
    print(f"\n## lit_rlhf benchmarks ({header})\n")
    if "peak" in results:
        print(peak_table(results["peak"], BF16_ROWS_MIN_SPEEDUP))
    if results["runs"]:
        print(summary_table(results["summary"], args.a, args.b))
    for table in tables(results, args.a, args.b):
        print(table)
    speedups = precision_speedups(results["runs"], args.a, args.b)
    if speedups:
        print(speedups)
    for name in ("flops", "flops" + BF16_SUFFIX):
        if name in results:
            print(flops_table(results["peak"], results[name], PPO))
    print(versions_line(results))
    print(f"total benchmark time: {results['wall_s'] / 60:.1f} min")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

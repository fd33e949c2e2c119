"""lit_rlhf vs TRL, side by side in one invocation: PPO, reward model, matmul peak and FLOP utilisation.

    .venv/bin/python scripts/bench/compare.py --trl-python .bench-venv/bin/python [--threads 1]

Builds the shared assets once (tokenizer, initial weights, prompts, pairs), then runs every benchmark as
its own subprocess (so peak RSS is per run), alternating the two implementations (A B, B A, A B, ...)
so that load from other jobs on a shared machine hits both alike, and prints Markdown tables of
medians with min-max spreads and the A/B ratio's min / median / max over the repeat pairs.

Implementations are ``lit`` (the installed lit_rlhf), ``lit@DIR`` (lit_rlhf imported from DIR, e.g. a
patched copy, for A/B tests of an optimisation) and ``trl``. Run ``scripts/bench/setup.sh`` first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import PPO, RESULT_PREFIX, child_env, log  # noqa: E402
from report import flops_table, ppo_table, rm_table, versions_line  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trl-python", default=".bench-venv/bin/python", help="python of the TRL venv")
    parser.add_argument("--a", default="lit", help="first implementation (numerator of the ratios)")
    parser.add_argument("--b", default="trl", help="second implementation (denominator)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every run (equal for both)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per implementation and benchmark")
    parser.add_argument("--rollouts", type=int, default=4, help="PPO rollouts per run, the first one untimed")
    parser.add_argument("--rm-steps", type=int, default=60, help="timed reward-model steps per run")
    parser.add_argument("--rm-warmup", type=int, default=5, help="untimed reward-model steps before them")
    parser.add_argument("--flops-rollouts", type=int, default=3, help="PPO rollouts of the >= 20M model")
    parser.add_argument("--only", default="ppo,rm,flops", help="comma-separated subset of ppo,rm,flops")
    parser.add_argument("--assets", help="reuse (or create) the assets in this folder instead of a temp one")
    parser.add_argument("--out", help="also write every raw result to this JSON file")
    args = parser.parse_args()
    sections = set(args.only.split(","))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit_rlhf_bench_") as tmp:
        if args.assets is None:
            args.assets = str(Path(tmp) / "assets")
        assets = Path(args.assets)
        if not (assets / "pairs.json").exists():
            log(f"building assets in {assets}")
            assets.mkdir(parents=True, exist_ok=True)
            # in a subprocess: this driver stays small, see common.peak_rss_mb
            cmd = [sys.executable, str(HERE / "common.py"), str(assets)]
            subprocess.run(cmd, env=child_env(args.threads), check=True, capture_output=True)
        runner = Runner(args, Path(tmp))
        results: dict = {"threads": args.threads, "a": args.a, "b": args.b}
        if "ppo" in sections:
            log(f"PPO: {args.repeats} x ({args.a}, {args.b}), {args.rollouts} rollouts each")
            results["ppo"] = runner.alternate("ppo_bench.py", "--rollouts", str(args.rollouts))
        if "rm" in sections:
            log(f"RM: {args.repeats} x ({args.a}, {args.b}), {args.rm_steps} steps each")
            results["rm"] = runner.alternate(
                "rm_bench.py", "--steps", str(args.rm_steps), "--warmup", str(args.rm_warmup)
            )
        if "flops" in sections and args.a.startswith("trl"):
            log("skipping the FLOP-utilisation run: it measures lit_rlhf (A), not TRL")
            sections.discard("flops")
        if "flops" in sections:
            log("matmul peak, then lit_rlhf PPO on the >= 20M-parameter model")
            results["peak"] = runner.run("matmul_peak.py", "lit")
            flop_args = ("--model", "large", "--rollouts", str(args.flops_rollouts), "--count-flops")
            results["flops"] = runner.run("ppo_bench.py", args.a, *flop_args)
    results["wall_s"] = time.perf_counter() - start
    header = f"threads={args.threads}, repeats={args.repeats}, A={args.a}, B={args.b}"
    print(f"\n## lit_rlhf benchmarks ({header})\n")
    if "ppo" in results:
        print(ppo_table(results["ppo"], args.a, args.b, PPO))
    if "rm" in results:
        print(rm_table(results["rm"], args.a, args.b))
    if "flops" in results:
        print(flops_table(results["peak"], results["flops"], PPO))
    print(versions_line(results))
    print(f"total benchmark time: {results['wall_s'] / 60:.1f} min")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

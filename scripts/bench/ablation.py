"""What each of lit_rlhf's techniques contributes on W1 (GRPO) and W3 (PPO): one switch turned off
against the defaults, alternating runs of one process each (lit_rlhf only).

    python scripts/bench/ablation.py --assets DIR [--repeats 2] [--threads 1] [--only NAME,...]

``DIR`` holds the assets of ``workloads.py`` (``python scripts/bench/workloads.py DIR full`` builds them).
Each ablation passes ``--lit-args`` to ``grpo_bench.py`` / ``ppo_bench.py`` (constructor-argument
overrides); the defaults run first and last alternately. Prints CPU milliseconds per response token
(sampled tokens differ between samplers, so per-token time is the comparable figure), the phase split
per rollout and peak RSS, as medians with [min-max] over the repeats, and the off/on ratio per pair.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULT_PREFIX, child_env, log  # noqa: E402

W1 = ("grpo_bench.py", ("--size", "full"))
W3 = ("ppo_bench.py", ("--workload", "W3_ppo", "--size", "full", "--rollouts", "3"))
# name -> (workload, the overrides that switch the technique off)
ABLATIONS = {
    "old log-probs from the update": (W1, {"update": {"old_logprobs_from_update": False}}),
    "inverse-CDF sampler": (W1, {"generation": {"sampler": "multinomial"}}),
    "decoding LM head layout": (W1, {"generation": {"decoding_head": "plain"}}),
    "packed LM head (vs transposed)": (W1, {"generation": {"decoding_head": "transposed"}}),
    "group prefill": (W1, {"generation": {"group_prefill": "never"}}),
    "lean decoding loop": (W1, {"generation": {"decode_loop": "generate"}}),
    "shared-prompt layout": (W1, {"scoring": {"shared_prefix": "off"}}),
    "LM head on real tokens (W1)": (W1, {"actor": {"logits_chunking": "off"}}),
    "least-cost bucketing": (W3, {"scoring": {"bucketing": {"split_cost": None}}}),
    "LM head on real tokens (W3)": (W3, {"actor": {"logits_chunking": "off"}}),
    "fused LM-head backward (W1)": (W1, {"actor": {"fused_lm_head": False}}),
    "fused LM-head backward (W3)": (W3, {"actor": {"fused_lm_head": False}}),
}
PHASES = ("generation", "scoring", "update")


def run(args, workload, overrides: dict) -> dict:
    script, extra = workload
    cmd = [sys.executable, str(HERE / script), "--impl", "lit", "--assets", args.assets, "--threads",
           str(args.threads), "--lit-args", json.dumps(overrides), *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=child_env(args.threads), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    timed = result["rollouts"][1:]  # the first rollout is a warm-up
    tokens = sum(result["response_tokens"][1 : len(timed) + 1])
    summary = {"ms_per_token": 1e3 * sum(r["cpu_total"] for r in timed) / tokens, "rss": result["peak_rss_mb"]}
    summary.update({p: statistics.mean(r[f"cpu_{p}"] for r in timed) for p in PHASES})
    return summary


def spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", help="comma-separated ablation names (default: all)")
    args = parser.parse_args()
    names = list(ABLATIONS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = sorted(set(names) - set(ABLATIONS))
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {list(ABLATIONS)}")
    rows = ["| technique (switched off) | on: CPU ms / response token | off | off/on | on: gen / scoring / update s "
            "| off: gen / scoring / update s | peak RSS MB on / off |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in names:
        workload, overrides = ABLATIONS[name]
        on, off = [], []
        for i in range(args.repeats):
            if i % 2 == 0:  # alternate which runs first
                a, b = run(args, workload, {}), run(args, workload, overrides)
            else:
                b, a = run(args, workload, overrides), run(args, workload, {})
            on.append(a)
            off.append(b)
            log(f"{name}: on {a['ms_per_token']:.2f} ms/token, off {b['ms_per_token']:.2f}")
        ratios = [b["ms_per_token"] / a["ms_per_token"] for a, b in zip(on, off)]
        phases = [" / ".join(f"{statistics.median(r[p] for r in side):.2f}" for p in PHASES) for side in (on, off)]
        rss = f"{statistics.median(r['rss'] for r in on):.0f} / {statistics.median(r['rss'] for r in off):.0f}"
        rows.append(
            f"| {name} | {spread([r['ms_per_token'] for r in on])} | {spread([r['ms_per_token'] for r in off])} "
            f"| **{spread(ratios)}** | {phases[0]} | {phases[1]} | {rss} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()

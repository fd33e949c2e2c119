"""The rollout engine as a benchmark dimension: lit_rlhf's Hugging Face engine against its vLLM engine on the
W1 GRPO and W3 PPO workloads, side by side in one run (alternating order, fresh process per run).

    .venv-vllm/bin/python scripts/bench/engine_bench.py --assets .bench-assets [--repeats 3] [--threads 1]
        [--size full|smoke] [--workloads W1_grpo,W3_ppo] [--out engine.json]

Runs in the vLLM environment (``make test-vllm`` builds ``.venv-vllm``): both engines then run with the same
torch and transformers. Each run is ``grpo_bench.py`` / ``ppo_bench.py --workload W3_ppo`` with
``--lit-args '{"engine": ...}'``, all else equal (the vLLM engine: float32 like the trainer, eager, prefix
caching on, 1 GiB KV cache). Per run, over the timed rollouts (the first is a warm-up): median generation
seconds per rollout, median weight-sync seconds (the vLLM engine's ``rollout/engine_sync_s``; inside the
update phase), median rollout seconds, response tokens per second end to end (all timed rollouts' response
tokens / their wall time) and peak RSS. Printed as medians [min-max] over the repeats, with vLLM/HF ratios
of the paired runs, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import RESULT_PREFIX, child_env, log  # noqa: E402
from workloads import SIZES  # noqa: E402

ENGINES = {"hf": "hf", "vllm": {"class_path": "vllm", "init_args": {"kv_cache_gib": 1}}}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def jobs(size: str) -> dict[str, tuple[str, list[str]]]:
    sized = ["--size", size]
    return {
        "W1_grpo": ("grpo_bench.py", sized),
        "W3_ppo": ("ppo_bench.py", ["--workload", "W3_ppo", "--rollouts", str(SIZES[size]["ppo_rollouts"]), *sized]),
    }


def run(script: str, extra: list[str], engine: str, args) -> dict:
    cmd = [sys.executable, str(HERE / script), "--impl", "lit", "--assets", str(args.assets),
           "--threads", str(args.threads), *extra, "--lit-args", json.dumps({"engine": ENGINES[engine]})]  # fmt: skip
    env = {**child_env(args.threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        log(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    log(f"  {script} {engine}: {time.perf_counter() - start:.0f} s")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def figures(result: dict) -> dict[str, float]:
    """One run's figures over its timed rollouts (the first rollout is a warm-up)."""
    rollouts, tokens = result["rollouts"][1:], result["response_tokens"][1:]
    syncs = [s["sync_s"] for s in result.get("engine_stats", [])[1:] if "sync_s" in s]
    return {
        "generation_s": statistics.median(r["generation"] for r in rollouts),
        "sync_s": statistics.median(syncs) if syncs else 0.0,
        "rollout_s": statistics.median(r["total"] for r in rollouts),
        "tokens_per_s": sum(tokens) / sum(r["total"] for r in rollouts),
        "peak_rss_mb": result["peak_rss_mb"],
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def table(name: str, pairs: list[tuple[dict, dict]]) -> list[str]:
    lines = [f"\n{name}: Hugging Face engine vs vLLM engine, medians [min-max] of {len(pairs)} runs each",
             "| figure | HF | vLLM | vLLM/HF |", "|---|---|---|---|"]  # fmt: skip
    for key in ("generation_s", "sync_s", "rollout_s", "tokens_per_s", "peak_rss_mb"):
        hf, vl = [p[0][key] for p in pairs], [p[1][key] for p in pairs]
        ratio = spread([v / h for h, v in zip(hf, vl)]) if all(hf) else "-"
        lines.append(f"| {key} | {spread(hf)} | {spread(vl)} | {ratio} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default=".bench-assets")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--workloads", default="W1_grpo,W3_ppo")
    parser.add_argument("--out")
    args = parser.parse_args()
    from compare import build_assets

    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(names) - set(jobs(args.size)))
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {', '.join(jobs(args.size))}")
    build_assets(args, names)
    import torch
    import transformers
    import vllm

    header = (f"CPU: {cpu_model()}; threads {args.threads}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, vLLM {vllm.__version__}; size {args.size}")  # fmt: skip
    log(header)
    results: dict[str, list] = {}
    for name in names:
        script, extra = jobs(args.size)[name]
        pairs = []
        for i in range(args.repeats):
            order = ("hf", "vllm") if i % 2 == 0 else ("vllm", "hf")
            runs = {engine: run(script, extra, engine, args) for engine in order}
            pairs.append((figures(runs["hf"]), figures(runs["vllm"])))
        results[name] = pairs
    print(header)
    for name, pairs in results.items():
        print("\n".join(table(name, pairs)))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

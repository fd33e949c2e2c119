#!/usr/bin/env bash
# lit_rlhf vs TRL benchmarks (W1 GRPO, W2 RM/DPO, W3 PPO, the fixed-length PPO/RM controls, matmul
# peak, FLOP utilisation) in one invocation.
#
#   scripts/bench/run.sh [compare.py flags, e.g. --threads 1 --repeats 3 --out results.json]
#
# Needs lit_rlhf's .venv (make venv) and the TRL venv of scripts/bench/setup.sh (BENCH_VENV, default
# .bench-venv). Default settings (--size full, every workload) take about 20-25 minutes on a 2-core
# CPU with --threads 1 --repeats 3; --size smoke proves the harness in < 1 min per workload.
set -euo pipefail
cd "$(dirname "$0")/../.."
BENCH_VENV="${BENCH_VENV:-.bench-venv}"
if [ ! -x "$BENCH_VENV/bin/python" ]; then
    echo "no TRL environment at $BENCH_VENV: run scripts/bench/setup.sh (or set BENCH_VENV)" >&2
    exit 1
fi
exec .venv/bin/python scripts/bench/compare.py --trl-python "$BENCH_VENV/bin/python" "$@"

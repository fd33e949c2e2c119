#!/usr/bin/env bash
# lit_rlhf vs TRL benchmarks (W1 GRPO, W2 RM/DPO, W3 PPO, the fixed-length PPO/RM controls, matmul
# peak, FLOP utilisation) in one invocation.
#
#   scripts/bench/run.sh [compare.py flags, e.g. --threads 1 --repeats 3 --out results.json]
#
# Needs lit_rlhf's .venv (make venv, or LIT_PYTHON) and the two TRL venvs of scripts/bench/setup.sh
# (BENCH_VENV, default .bench-venv: trl 1.12.0; BENCH_VENV_NEW, default .bench-venv-new: the newest trl, the
# second peer of W1 and W2; --c none runs without it). Default settings (--size full, every workload) take
# about 20-30 minutes on a 2-core CPU with --threads 1 --repeats 3; --size smoke proves the harness in
# < 1 min per workload.
set -euo pipefail
cd "$(dirname "$0")/../.."
BENCH_VENV="${BENCH_VENV:-.bench-venv}"
BENCH_VENV_NEW="${BENCH_VENV_NEW:-.bench-venv-new}"
if [ ! -x "$BENCH_VENV/bin/python" ]; then
    echo "no TRL environment at $BENCH_VENV: run scripts/bench/setup.sh (or set BENCH_VENV)" >&2
    exit 1
fi
LIT_PYTHON="${LIT_PYTHON:-.venv/bin/python}"
exec "$LIT_PYTHON" scripts/bench/compare.py --trl-python "$BENCH_VENV/bin/python" \
    --trl-new-python "$BENCH_VENV_NEW/bin/python" "$@"

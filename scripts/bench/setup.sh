#!/usr/bin/env bash
# The benchmarks' TRL environment, kept apart from lit_rlhf's own (.venv): TRL is never a lit_rlhf
# dependency. PPOTrainer exists up to trl 1.12.0 (trl.experimental.ppo), so that release is pinned.
# transformers is pinned to the version in lit_rlhf's .venv (when there is one) so that both libraries
# run the very same model code.
#
#   scripts/bench/setup.sh                      # creates .bench-venv
#   BENCH_VENV=/some/path scripts/bench/setup.sh
set -euo pipefail
BENCH_VENV="${BENCH_VENV:-.bench-venv}"
LIT_PYTHON="${LIT_PYTHON:-.venv/bin/python}"
same_transformers=()
if [ -x "$LIT_PYTHON" ]; then
    same_transformers=("transformers==$("$LIT_PYTHON" -c 'import transformers; print(transformers.__version__)')")
fi
python3 -m venv "$BENCH_VENV"
"$BENCH_VENV/bin/pip" install torch==2.13.0
# requests: GRPOTrainer imports trl.generation.vllm_client, which needs it even without vLLM
"$BENCH_VENV/bin/pip" install trl==1.12.0 requests "${same_transformers[@]}"

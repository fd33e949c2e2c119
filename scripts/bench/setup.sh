#!/usr/bin/env bash
# The benchmarks' two TRL environments, kept apart from lit_rlhf's own (.venv): TRL is never a lit_rlhf
# dependency.
#
#   BENCH_VENV     (default .bench-venv):     trl 1.12.0, the last release with PPOTrainer (trl.experimental.ppo);
#                                             the peer of every workload (implementation `trl`)
#   BENCH_VENV_NEW (default .bench-venv-new): trl $TRL_NEW (default 1.16.0, the newest release the registry
#                                             served when the harness was last measured); the second peer of
#                                             W1 GRPO, W2 RM and W2 DPO (implementation `trl-new`)
#
# Both get torch 2.13.0 and the transformers of lit_rlhf's .venv (when there is one), so the three
# environments run the very same model code. Check for a newer TRL with `pip index versions trl`.
#
#   scripts/bench/setup.sh                      # creates both
#   TRL_NEW=1.17.0 scripts/bench/setup.sh       # another newest release
#   BENCH_VENV=/some/path BENCH_VENV_NEW=/other/path scripts/bench/setup.sh
set -euo pipefail
BENCH_VENV="${BENCH_VENV:-.bench-venv}"
BENCH_VENV_NEW="${BENCH_VENV_NEW:-.bench-venv-new}"
TRL_OLD="1.12.0"
TRL_NEW="${TRL_NEW:-1.16.0}"
LIT_PYTHON="${LIT_PYTHON:-.venv/bin/python}"
same_transformers=()
if [ -x "$LIT_PYTHON" ]; then
    same_transformers=("transformers==$("$LIT_PYTHON" -c 'import transformers; print(transformers.__version__)')")
fi
for pair in "$BENCH_VENV=$TRL_OLD" "$BENCH_VENV_NEW=$TRL_NEW"; do
    venv="${pair%=*}" trl="${pair##*=}"
    python3 -m venv "$venv"
    "$venv/bin/pip" install torch==2.13.0
    # requests: GRPOTrainer imports trl.generation.vllm_client, which needs it even without vLLM
    "$venv/bin/pip" install "trl==$trl" requests "${same_transformers[@]}"
    "$venv/bin/python" -c 'import sys, torch, transformers, trl; print(f"{sys.prefix}: trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")'
done

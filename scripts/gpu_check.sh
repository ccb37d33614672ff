#!/usr/bin/env bash
# One GPU, one go, within 10 minutes: the GPU tests (tests/gpu/: FSDP2 bf16 step, colocated VLLMEngine with
# sleep mode, a short learning run of the qwen2-test preset, ...) and a short benchmark printing rollout
# tokens/s, training tokens/s and the training MFU (benchmarks/gpu_check.py).
#   bash scripts/gpu_check.sh                      # on a GPU machine, from the repository root
#   RLKIT_PEAK_FLOPS=312e12 bash scripts/gpu_check.sh   # a GPU missing from the benchmark's table
#   bash scripts/gpu_check.sh --device cpu         # the benchmark alone, tiny, on CPU (checks the script's logic)
# RLKIT_GPU_TESTS_S and RLKIT_GPU_BENCH_S set the tests' and the benchmark's time limits (420 s, 150 s); PYTHON the
# interpreter (python3). The tests and the benchmark share one model cache (RLKIT_CACHE, default /tmp/rlkit-cache-gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
export RLKIT_CACHE="${RLKIT_CACHE:-/tmp/rlkit-cache-gpu-check}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
device=cuda
if [[ "${1:-}" == "--device" ]]; then device="${2:?--device needs cuda or cpu}"; fi
start=$SECONDS
if [[ "$device" == cuda ]]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible: run on a GPU machine, or pass --device cpu')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  # the tests (their own pytest session; conftest warms up the embedded model once)
  # (the benchmark runs whatever the tests gave: one GPU session yields both; the exit status is the first failure's)
  tests=0 && timeout "${RLKIT_GPU_TESTS_S:-420}" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs || tests=$?
  bench=0 && timeout "${RLKIT_GPU_BENCH_S:-150}" "$PY" benchmarks/gpu_check.py --device cuda --preset qwen2-small --steps 12 \
    || bench=$?
  echo "gpu_check.sh: done in $((SECONDS - start)) s (tests exit $tests, benchmark exit $bench)"
  exit $((tests ? tests : bench))
else
  timeout 600 "$PY" benchmarks/gpu_check.py --device cpu --preset qwen2-test --steps 3 --prompts 2 --samples 4 --tokens 8
fi
echo "gpu_check.sh: done in $((SECONDS - start)) s"

#!/usr/bin/env bash
# The GPU checks (docs/gpu.md): the gpu-marked tests on CUDA, then the decode step at real sizes.
#   bash scripts/gpu.sh [OUT_DIR]      # default gpu-results/; PYTHON picks the interpreter (default python3)
# Writes OUT_DIR/{environment.txt,tests.log,bench_gpu.log,bench_gpu.json}; exits non-zero if a part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "device", torch.cuda.get_device_name())'
} 2>&1 | tee "$out/environment.txt"
"$python" -m pytest -m gpu tests/test_gpu.py -q -s -p no:cacheprovider 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
"$python" -m spd.bench gpu --out "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "gpu tests: rc $tests; benchmark: rc $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]

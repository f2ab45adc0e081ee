#!/bin/bash
# One device call: build check, GPU tests, benchmark; logs under $OUT.
# Usage (from the repo root on the GPU machine): bash bench/gpu_run.sh [tests|bench|all]
set -o pipefail
what=${1:-all}
# Kernels compile into models/.cache/pycuda (the default; tests and bench alike).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > "$OUT/machine.txt" 2>&1
python3 -c "import pycuda, cuda.bindings, torch, transformers; print(pycuda.VERSION, torch.__version__, transformers.__version__)" >> "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -40
  timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" tests/kernels/test_cuda_model.py 2>&1 | tee "$OUT/test_model.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_cuda.py --write ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log" | tail -30
  cp docs/PERFORMANCE.md "$OUT/" 2>/dev/null
fi

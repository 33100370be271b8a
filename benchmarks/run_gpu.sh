#!/usr/bin/env bash
# The GPU checks in one go (run from the repo root on a machine with CUDA): the GPU tests,
# then the throughput benchmark (with the staging ratio). Logs and results go to $OUT (default runs/gpu).
#   OUT=runs/gpu bash benchmarks/run_gpu.sh
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
timeout "${TEST_TIMEOUT:-240}" $PY -m pytest -o addopts="" -q -m gpu tests/gpu -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 |
  tee "$OUT/gpu_tests.log"
timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/throughput.py --device cuda --seeds 3 \
  --steps "${STEPS:-300}" --out "$OUT/throughput_cuda.md" 2>&1 | tee "$OUT/throughput.log"

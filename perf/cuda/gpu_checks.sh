#!/usr/bin/env bash
# The CUDA checks in one call, for a machine that already has a CUDA torch and Triton (a lent GPU
# with no package index): install shardkit without dependencies into that Python, run the
# CUDA-only tests (`-m cuda`), then the optimizer benchmark on CUDA. `make test-gpu` does the same
# from a fresh venv where pip can download a CUDA torch.
#
#   OUT=/tmp/gpu bash perf/cuda/gpu_checks.sh     # logs, junit XML, optim_cuda.json + .png under $OUT
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-perf/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
$PY -m pip install --quiet --no-deps --no-build-isolation --no-index -e . || exit 1
$PY -m pytest -q -m cuda -p no:cacheprovider --junitxml="$OUT/test_gpu.xml" \
    tests/kernels 2>&1 | tee "$OUT/test_gpu.log" | tail -25
tests_rc=${PIPESTATUS[0]}
$PY perf/optim.py --device cuda --repeats 100 --out "$OUT" 2>&1 | tee "$OUT/optim_cuda.log" | tail -25
echo "tests exit $tests_rc, optim benchmark exit ${PIPESTATUS[0]}"

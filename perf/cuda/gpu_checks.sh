#!/usr/bin/env bash
# The CUDA checks in one call, for a machine that already has a CUDA torch and Triton (a lent GPU
# with no package index): install shardkit without dependencies into that Python, run every
# CUDA-only test (`-m cuda`: kernels, the fused loss, the one-GPU step path, 2-GPU DataParallel where there are 2),
# the optimizer benchmark on CUDA, then `shardkit train --device cuda` end to end for a few
# layouts. `make test-gpu` does the first parts from a fresh venv where pip can download a CUDA torch.
#
#   OUT=/tmp/gpu bash perf/cuda/gpu_checks.sh     # test log, optim_cuda.json + .png, train_*.json under $OUT
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-perf/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
$PY -m pip install --quiet --no-deps --no-build-isolation --no-index -e . || exit 1
SECONDS=0
$PY -m pytest -q -m cuda -p no:cacheprovider \
    tests/kernels tests/compose tests/data_parallel tests/tensor 2>&1 | tee "$OUT/test_gpu.log" | tail -25
tests_rc=${PIPESTATUS[0]}
echo "cuda tests: ${SECONDS}s"
$PY perf/optim.py --device cuda --repeats 100 --out "$OUT" 2>&1 | tail -25
bench_rc=${PIPESTATUS[0]}
# whole training runs on the GPU: one rank (NCCL world of one), the step path of each layout
train_rc=0
for args in "--strategy ddp" "--strategy zero2 --fp16" "--strategy zero3 --bf16" "--strategy zero3 --checkpointing blocks"; do
    echo "== shardkit train --device cuda $args"
    $PY -m shardkit.cli train --device cuda --steps 60 --eval-every 30 $args \
        --log-json "$OUT/train_$(echo "$args" | tr -c 'a-z0-9\n' '_' | tr -s _).json" 2>&1 | tail -6
    rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && train_rc=$rc
done
echo "tests exit $tests_rc, optim benchmark exit $bench_rc, train runs exit $train_rc"

#!/usr/bin/env bash
# Flash-LoRA kernels on one GPU: the GPU kernel tests (log + junit) then the kernel benchmark, results in OUTDIR.
# Usage inside a device command: bash scripts/kernel_gpu_check.sh OUTDIR [python -m kernels.bench arguments...]
# Needs torch, triton, pytest (pytest-xdist for -n); no jsonargparse.
set -u
OUTDIR=$1
shift
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$OUTDIR/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$OUTDIR/gpu.txt"
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu $XDIST -p no:cacheprovider tests/test_kernel_gpu.py \
  tests/test_kernel_decode_gpu.py --junitxml="$OUTDIR/gpu_tests.xml" >"$OUTDIR/gpu_tests.log" 2>&1
echo "tests exit $?"
timeout "${BENCH_TIMEOUT:-280}" python3 -m kernels.bench --out "$OUTDIR" "$@" >"$OUTDIR/bench.log" 2>&1
echo "bench exit $?"
grep -E "passed|failed|error" "$OUTDIR/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUTDIR/gpu_tests.log" | head -20
tail -c 6000 "$OUTDIR/bench.log"

#!/usr/bin/env bash
# One device call: fused-op and engine checks on the GPU, then the decode benchmarks (embedded shapes, 8B shapes) and
# the agent trace (8B). Everything lands in $1 (default /tmp/engine_out) and is packed into $2/engine_results.tgz.
# Usage on the device: bash scripts/gpu_engine_check.sh WORKDIR OUTDIR "[1024,8192]"
set -uo pipefail
WORK=${1:-/tmp/engine_out}; PACK=${2:-$WORK}; CTX=${3:-"[1024,8192]"}
mkdir -p "$WORK" "$PACK"
source scripts/device_model.sh >/dev/null 2>&1 || true
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$WORK/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_kernel_decode_gpu.py -m gpu -x \
  2>&1 | tail -4 | tee "$WORK/gpu_tests.log"
timeout 100 python3 scripts/gpu_engine_smoke.py 2>&1 | tee "$WORK/smoke.log"
timeout 100 python3 cli.py bench decode --model smollm2-135m --context 2048 --batches "[1,64]" --new_tokens 128 \
  --out "$WORK/decode_135m" 2>&1 | grep -E "ms/token|^\|" | tee "$WORK/decode_135m.log"
timeout 150 python3 cli.py bench decode --model llama-3.1-8b --context 2048 --batches "[1,32]" --new_tokens 64 \
  --out "$WORK/decode_8b" 2>&1 | grep -E "ms/token|^\|" | tee "$WORK/decode_8b.log"
timeout 200 python3 cli.py bench trace --model llama-3.1-8b --contexts "$CTX" --out "$WORK/trace_8b" 2>&1 \
  | grep -E "^L_ctx" | tee "$WORK/trace_8b.log"
tar czf "$PACK/engine_results.tgz" -C "$WORK" .

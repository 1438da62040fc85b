#!/usr/bin/env bash
# One device call: fused-op GPU tests, then the decode benchmarks (embedded shapes, 8B shapes) and the agent trace
# (8B). Everything lands in $1 (default /tmp/engine_out) and is packed into $2/engine_results.tgz.
# Usage on the device: bash scripts/gpu_engine_check.sh WORKDIR OUTDIR
set -uo pipefail
WORK=${1:-/tmp/engine_out}; PACK=${2:-$WORK}
mkdir -p "$WORK" "$PACK"
source scripts/device_model.sh >/dev/null 2>&1 || true
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
pack() { tar czf "$PACK/engine_results.tgz" -C "$WORK" .; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$WORK/gpu.txt"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fused_ops.py -m gpu 2>&1 | tail -3 | tee "$WORK/gpu_tests.log"
timeout 80 python3 cli.py bench decode --model smollm2-135m --context 2048 --batches "[1,64]" --new_tokens 128 \
  --out "$WORK/decode_135m" 2>&1 | grep -E "ms/token|^\|" | tee "$WORK/decode_135m.log"; pack
timeout 100 python3 cli.py bench decode --model llama-3.1-8b --context 2048 --batches "[1,32]" --new_tokens 64 \
  --eager false --out "$WORK/decode_8b" 2>&1 | grep -E "ms/token|^\|" | tee "$WORK/decode_8b.log"; pack
timeout 130 python3 cli.py bench trace --model llama-3.1-8b --contexts "[8192]" --out "$WORK/trace_8k" 2>&1 \
  | grep -E "^L_ctx" | tee "$WORK/trace_8k.log"; pack
timeout 150 python3 cli.py bench trace --model llama-3.1-8b --contexts "[16384]" --kernel_off false \
  --out "$WORK/trace_16k" 2>&1 | grep -E "^L_ctx" | tee "$WORK/trace_16k.log"; pack

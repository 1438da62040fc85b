#!/usr/bin/env bash
# One device call: engine smoke (graphs vs eager, kernel on/off), decode benchmarks (embedded shapes, 8B shapes),
# and a short trace. Usage on the device: bash scripts/gpu_engine_check.sh OUTDIR [trace contexts]
set -uo pipefail
OUT=${1:-/tmp/engine_out}; CTX=${2:-"[1024,8192]"}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
timeout 120 python3 scripts/gpu_engine_smoke.py 2>&1 | tee "$OUT/smoke.log"
timeout 110 python3 cli.py bench decode --model smollm2-135m --context 2048 --batches "[1,64]" --new_tokens 128 \
  --out "$OUT/decode_135m" 2>&1 | tail -25 | tee "$OUT/decode_135m.log"
timeout 170 python3 cli.py bench decode --model llama-3.1-8b --context 2048 --batches "[1,32]" --new_tokens 64 \
  --out "$OUT/decode_8b" 2>&1 | tail -25 | tee "$OUT/decode_8b.log"
timeout 160 python3 cli.py bench trace --model llama-3.1-8b --contexts "$CTX" --out "$OUT/trace_8b" 2>&1 \
  | grep -v Warning | tee "$OUT/trace_8b.log"

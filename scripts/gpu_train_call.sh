#!/usr/bin/env bash
# Device call that starts the embedded-model training sweep (stage 1 then stage 2, in the background) and, while it
# runs, the GPU session tests on the embedded model. Needs the GGUF joined (scripts/device_model.sh).
# Usage on the device: bash scripts/gpu_train_call.sh OUTDIR SECONDS_TO_STAY
set -uo pipefail
OUT=${1:-/tmp/train_out}; STAY=${2:-480}
T0=$(date +%s)
source scripts/device_model.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
mkdir -p "$OUT" runs
python3 -c "from lragent.models import load_model; load_model('default')" 2>&1 | tail -1   # GGUF -> safetensors
DEV="python3 cli.py eval --benchmark {dataset} --scheme non_shared --adapters {adapters} --limit 15 --runs 1 --batch 15"
DEV="$DEV --dtype bfloat16 --out {run_dir}/eval_dev --quiet true"
setsid nohup bash -c "python3 scripts/sweep_embedded.py run --stage 1 --budget 420 --lrs 2e-3,1e-3,5e-4 \
  --targets qv,qvo_mlp --ranks 8 --parallel 6 --after-run '$DEV' > runs/stage1.out 2>&1; \
  python3 scripts/sweep_embedded.py run --stage 2 --budget 330 --pick auto --after-run '$DEV' > runs/stage2.out 2>&1" \
  > runs/chain.out 2>&1 < /dev/null &
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_session_gpu.py tests/test_fused_ops.py -m gpu \
  --tb=line 2>&1 | tail -15 | tee "$OUT/session_gpu_tests.log"
while [ $(( $(date +%s) - T0 )) -lt "$STAY" ]; do sleep 15; done
python3 scripts/sweep_embedded.py status 2>&1 | tail -20
tail -5 runs/stage1.out

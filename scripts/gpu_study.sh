#!/usr/bin/env bash
# Device driver of the sharing study (eval_suite/study.py, issue 17). Each call: join the embedded GGUF from its carried
# parts (scripts/device_model.sh; the first call of a lease carries part 1 only and stops there), convert it once, start
# `python -m eval_suite.study run` in the background if it is not running (it outlives the call while the machine stays
# warm), and pack the study root into $OUT every 30 s, so a lost machine loses at most that. A new machine resumes
# from the study committed in results/study/root (finished jobs are never run again).
# Usage on the device: bash scripts/gpu_study.sh SECONDS_TO_STAY [study options, e.g. --benchmarks scienceqa]
set -uo pipefail
STAY=${1:-540}; shift || true
T0=$(date +%s)
source scripts/device_model.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
if [ ! -f /tmp/gguf/model.gguf ]; then echo "model not complete yet: $(ls /tmp/gguf)"; exit 0; fi
ROOT=/tmp/study
if [ ! -d $ROOT ] && [ -d results/study/root ]; then cp -r results/study/root $ROOT; fi
mkdir -p $ROOT
python3 -c "from lragent.models import load_model; load_model('default')" 2>&1 | tail -1   # GGUF -> safetensors, once
if ! pgrep -f "^[^ ]*python[0-9.]* -m eval_suite.study run" >/dev/null; then  # the driver itself, not any command line that names it
  setsid nohup python3 -m eval_suite.study run --root $ROOT --reset-failed "$@" >> $ROOT/driver.log 2>&1 < /dev/null &
  sleep 5
fi
while [ $(( $(date +%s) - T0 )) -lt "$STAY" ]; do
  sleep 30
  python3 -m eval_suite.study pack --root $ROOT --out "$OUT" > /dev/null 2>&1
done
python3 -m eval_suite.study pack --root $ROOT --out "$OUT"
python3 -m eval_suite.study plan --root $ROOT "$@" | awk '{print $1}' | sort | uniq -c
tail -25 $ROOT/driver.log
for f in $ROOT/eval/*/*/episodes.jsonl; do [ -f "$f" ] && echo "$f $(wc -l < "$f")"; done
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader

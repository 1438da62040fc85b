#!/usr/bin/env bash
# Device driver of the sharing study and the recipe sweep (eval_suite/study/driver.py). Each call: collect the carried model
# pieces (scripts/device_model.sh; a call that only carries a piece stops there), convert the model once per machine,
# start `python -m eval_suite.study run` in the background if it is not running (it outlives the call while the machine
# stays warm), and pack the root into $OUT every 30 s, so a lost machine loses at most that. A new machine resumes from
# a carried pack (.resume/<stage>/study.tar.gz.part*: `device_carry.sh prepare-accuracy` packs the committed
# results/study_qwen archives); finished jobs are never run again, and a driver started while a killed one's jobs still
# run waits for them. (The embedded model's study is finished: its records are in results/study/archive/.)
#
# Usage on the device: [MODEL=qwen2.5-coder-1.5b] [STAGE=sweep] bash scripts/gpu_study.sh SECONDS_TO_STAY [options]
#   MODEL  default (the embedded SmolLM2-135M, carried as .gguf1/.gguf2) or qwen2.5-coder-1.5b (carried as .accNN)
#   STAGE  study (the λ study) or sweep (the recipe sweep); options go to `eval_suite.study.driver run` (e.g. --benchmarks)
# [MODEL=...] [STAGE=...] bash scripts/gpu_study.sh stop   stops that root's driver and every job it runs (SIGTERM to
#   the driver's process group, then SIGKILL to what is left after 30 s; the jobs' finished episodes stay), then packs
#   the root into $OUT: the GPU is free for other work. (A driver started with setsid and & ignores SIGINT, and
#   killing the jobs alone is not enough: the driver launches them again.)
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
STAY=${1:-540}; shift || true
T0=$(date +%s)
MODEL=${MODEL:-default}
STAGE=${STAGE:-study}
# The decisive study's jobs began with one feeding width and no fed-token groups: its unfinished jobs keep that
# computation (set either variable to override)
[ "$STAGE" = decide ] && export LRAGENT_FEED_WIDTHS=${LRAGENT_FEED_WIDTHS:-1} LRAGENT_FEED_GROUP=${LRAGENT_FEED_GROUP:-1}
if [ "$STAY" = stop ]; then
  ROOT=/tmp/${STAGE}_${MODEL}
  mine() { pgrep -f -- "$ROOT( |/|$)" | grep -vx "$$" || true; }  # the driver (--root ROOT) and its jobs (ROOT/...)
  for pid in $(pgrep -f "^[^ ]*python[0-9.]* -m eval_suite.study run --root $ROOT "); do
    kill -TERM -- "-$(ps -o pgid= "$pid" | tr -d ' ')" 2>/dev/null || kill -TERM "$pid"
  done
  for pid in $(mine); do kill -TERM "$pid" 2>/dev/null; done  # jobs adopted from an earlier driver's group
  for _ in $(seq 30); do [ -z "$(mine)" ] && break; sleep 1; done
  for pid in $(mine); do kill -KILL "$pid" 2>/dev/null; done
  echo "stopped: $([ -z "$(mine)" ] && echo "nothing of $ROOT runs" || echo "still running: $(mine)")"
  [ -d "$ROOT" ] && PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD python3 -m eval_suite.study pack --root "$ROOT" --out "${OUT:-/tmp/study_pack}" | tail -1
  exit 0
fi
source scripts/device_model.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
if [ "$MODEL" = default ]; then
  if [ ! -f /tmp/gguf/model.gguf ]; then echo "model not complete yet: $(ls /tmp/gguf)"; exit 0; fi
  python3 -c "from lragent.models import load_model; load_model('default')" 2>&1 | tail -1   # GGUF -> safetensors
else
  if [ -z "${LRAGENT_ACCURACY_GGUF:-}" ]; then echo "accuracy model not complete yet"; exit 0; fi
  python3 -m lragent.accuracy_model 2>&1 | grep -v "it/s\]" | tail -2   # size/sha256 check, GGUF -> safetensors, once
fi
ROOT=/tmp/${STAGE}_${MODEL}
if [ ! -d "$ROOT" ]; then
  if ls /tmp/resume_pack/"$STAGE"/study.tar.gz.part* > /dev/null 2>&1; then  # the committed root, carried as .resume
    rm -rf /tmp/resume && mkdir -p /tmp/resume
    cat /tmp/resume_pack/"$STAGE"/study.tar.gz.part* | tar xz -C /tmp/resume && mv /tmp/resume/study "$ROOT"
    echo "resumed $ROOT from .resume ($(find "$ROOT" -name summary.json | wc -l) summaries)"
  fi
fi
mkdir -p "$ROOT"
ARGS=(--root "$ROOT" --model "$MODEL" --stage "$STAGE")
DRIVER="^[^ ]*python[0-9.]* -m eval_suite.study run --root $ROOT "  # this root's driver, not any line that names it
if ! pgrep -f "$DRIVER" >/dev/null; then  # (a study and a sweep driver may run side by side)
  setsid nohup python3 -m eval_suite.study run "${ARGS[@]}" --reset-failed "$@" >> "$ROOT/driver.log" 2>&1 < /dev/null &
  sleep 5
fi
while [ $(( $(date +%s) - T0 )) -lt "$STAY" ]; do
  left=$(( STAY - ($(date +%s) - T0) ))
  sleep $(( left < 30 ? left : 30 ))  # never past the stay: the call also needs time for the final pack and plan
  python3 -m eval_suite.study pack --root "$ROOT" --out "$OUT" > /dev/null 2>&1
  pgrep -f "$DRIVER" > /dev/null || break  # every job done or given up
done
python3 -m eval_suite.study pack --root "$ROOT" --out "$OUT"
python3 -m eval_suite.study plan "${ARGS[@]}" "$@" | awk '{print $1}' | sort | uniq -c
tail -25 "$ROOT/driver.log"
for f in "$ROOT"/eval/*/*/episodes.jsonl; do [ -f "$f" ] && echo "$f $(wc -l < "$f")"; done
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader

#!/usr/bin/env bash
# ScienceQA with the answer_text constraint (the Finish letter chosen by scoring each option's text, mean log-prob),
# 3 runs of the 90 dev questions, on one GPU, several eval processes at once (each with --batch). Rows:
#   shipped_<scheme>  data/adapters/scienceqa_sharedA under all five schemes
#   lam0_<scheme>     results/study/root/train/scienceqa_lam0/adapters     under non_shared, base_lr_shared, full_shared
#   lam0.25_<scheme>  results/study/root/train/scienceqa_lam0.25/adapters  likewise
# Each row writes $OUT/<name>/ (episodes.jsonl grows as episodes finish; log in $OUT/<name>.log); then each set is
# merged into $OUT/merged_<set>/ (report.md: rows non_shared+answer_text, ...; paired gaps to non_shared+answer_text).
# Resumable: RESUME=DIR copies DIR/<name>/ (a previous call's $OUT, e.g. committed under results/) into $OUT first, and
# eval skips the episodes already there. Rows that finish are not rerun.
# Usage on the device (model prepared by scripts/device_model.sh, which this sources):
#   bash scripts/gpu_answer_text.sh [SECONDS=540] [PARALLEL=auto] [extra eval options, e.g. --limit 1 --device cpu]
set -uo pipefail
SECS=${1:-540}; PAR=${2:-auto}; shift 2 2>/dev/null || shift $#
EXTRA=("$@")
T0=$(date +%s)
OUT=${OUT:?set OUT to the output directory}
source scripts/device_model.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
mkdir -p "$OUT"
SHIPPED=data/adapters/scienceqa_sharedA
STUDY=results/study/root/train
JOBS=()  # name|adapters|scheme|batch
for s in non_shared base_lr_shared full_shared base_shared droidspeak; do JOBS+=("shipped_$s|$SHIPPED|$s"); done
for lam in 0 0.25; do
  for s in non_shared base_lr_shared full_shared; do JOBS+=("lam${lam}_$s|$STUDY/scienceqa_lam$lam/adapters|$s"); done
done
batch_of() { case $1 in non_shared) echo 32 ;; droidspeak) echo 48 ;; *) echo 64 ;; esac; }  # as eval_suite/study.py
if [ "$PAR" = auto ]; then  # ~20 GB per non_shared process, ~14 GB per other (H200, bf16, capacity 8192)
  FREE=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -1)
  PAR=$(( ${FREE:-40000} / 20000 )); [ "$PAR" -lt 1 ] && PAR=1
fi
echo "answer_text: ${#JOBS[@]} rows, $PAR at a time, ${SECS}s, out $OUT, extra: ${EXTRA[*]:-none}"
if [ -n "${RESUME:-}" ]; then
  for j in "${JOBS[@]}"; do n=${j%%|*}; [ -d "$RESUME/$n" ] && [ ! -d "$OUT/$n" ] && cp -r "$RESUME/$n" "$OUT/$n"; done
  echo "resumed from $RESUME: $(cat "$OUT"/*/episodes.jsonl 2>/dev/null | wc -l) episodes already there"
fi
progress() {
  local line="" n
  for j in "${JOBS[@]}"; do n=${j%%|*}; line+=" $n=$(cat "$OUT/$n/episodes.jsonl" 2>/dev/null | wc -l)"; done
  echo "[$(( $(date +%s) - T0 ))s]$line (of 270 each)"
}
run_one() {  # name adapters scheme
  local left=$(( SECS - ($(date +%s) - T0) ))
  [ "$left" -le 5 ] && return 0
  [ -f "$OUT/$1/summary.json" ] && return 0  # eval writes it once every episode of the row is in
  timeout "$left" python3 cli.py eval --benchmark scienceqa --constrain answer_text --runs 3 --adapters "$2" \
    --scheme "$3" --batch "$(batch_of "$3")" --dtype bfloat16 --out "$OUT/$1" --quiet true "${EXTRA[@]}" \
    >> "$OUT/$1.log" 2>&1
  echo "$1: exit $? ($(cat "$OUT/$1/episodes.jsonl" 2>/dev/null | wc -l) episodes)"
}
for j in "${JOBS[@]}"; do
  IFS='|' read -r name adapters scheme <<< "$j"
  while [ "$(jobs -rp | wc -l)" -ge "$PAR" ]; do sleep 2; done
  run_one "$name" "$adapters" "$scheme" &
  sleep 1
done
while [ "$(jobs -rp | wc -l)" -gt 0 ]; do progress; sleep 30; done
wait
progress
for set in shipped lam0 lam0.25; do
  DIRS=$(ls -d "$OUT/${set}"_*/ 2>/dev/null | grep -E "/${set}_[a-z_]+/$" | while read -r d; do
    [ -f "$d/episodes.jsonl" ] && [ -s "$d/episodes.jsonl" ] && echo "${d%/}"; done | paste -sd, -)
  [ -z "$DIRS" ] && continue
  echo "== $set"
  python3 cli.py eval --merge "[$DIRS]" --out "$OUT/merged_$set" 2>&1 | grep -v "^Loading" | tail -7
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

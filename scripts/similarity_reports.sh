#!/usr/bin/env bash
# Regenerates results/similarity/: the cache-similarity reports (`cli.py similarity`) of the trained
# lambda = 0 adapter sets of both benchmarks (shared A and independent A) and of the untrained controls (B = 0, shared
# and independent A), then the cross-run summary (summary.md, summary.json). About 1-2 minutes per run on 2 CPU cores.
#
#   bash scripts/similarity_reports.sh [ADAPTERS_ROOT] [OUT]
#
# ADAPTERS_ROOT holds {hotpotqa,scienceqa}_{sharedA,indepA}/ (default data/adapters); OUT defaults to
# results/similarity. SAMPLES (16), MAX_TOKENS (2048) and DEVICE (cpu) may be set in the environment.
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${1:-data/adapters}
OUT=${2:-results/similarity}
COMMON=(--samples "${SAMPLES:-16}" --max_tokens "${MAX_TOKENS:-2048}" --device "${DEVICE:-cpu}")
runs=()
for bench in hotpotqa scienceqa; do
  for a in sharedA indepA; do
    python cli.py similarity --adapters "$ROOT/${bench}_${a}" --benchmark "$bench" "${COMMON[@]}" \
      --out "$OUT/${bench}_${a}"
    runs+=("$OUT/${bench}_${a}")
  done
  python cli.py similarity --adapter_init zero --benchmark "$bench" "${COMMON[@]}" --out "$OUT/${bench}_zero_sharedA"
  python cli.py similarity --adapter_init zero --independent_a true --benchmark "$bench" "${COMMON[@]}" \
    --out "$OUT/${bench}_zero_indepA"
  runs+=("$OUT/${bench}_zero_sharedA" "$OUT/${bench}_zero_indepA")
done
joined=$(IFS=,; echo "${runs[*]}")
python cli.py similarity --merge "[$joined]" --out "$OUT"

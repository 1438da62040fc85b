#!/usr/bin/env bash
# One GPU, many processes: the agent loop is launch-bound, so each (scheme, shard) gets its own process.
# Usage: bash scripts/gpu_eval_parallel.sh ADAPTERS LIMIT SHARDS SECONDS OUTDIR
set -u
ADAPTERS=$1; LIMIT=$2; SHARDS=$3; SECS=$4; OUTDIR=$5
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
mkdir -p "$OUTDIR"
for scheme in non_shared full_shared droidspeak base_shared base_lr_shared; do
  for i in $(seq 0 $((SHARDS - 1))); do
    timeout "$SECS" python3 cli.py eval --benchmark hotpotqa --scheme $scheme --adapters "$ADAPTERS" --runs 1 \
      --limit "$LIMIT" --shard $i/$SHARDS --device cuda --dtype bfloat16 --out "$OUTDIR/${scheme}_$i" \
      > "$OUTDIR/${scheme}_$i.log" 2>&1 &
  done
done
timeout "$SECS" python3 cli.py eval --benchmark hotpotqa --adapter_init zero --runs 1 --limit "$LIMIT" --device cuda \
  --dtype bfloat16 --out "$OUTDIR/untrained" > "$OUTDIR/untrained.log" 2>&1 &
wait
DIRS=$(ls -d "$OUTDIR"/*/ | grep -v '/merged/$' | paste -sd, -)
python3 cli.py eval --merge "[$DIRS]" --out "$OUTDIR/merged" > "$OUTDIR/merge.log" 2>&1
echo "episodes: $(cat "$OUTDIR"/*/episodes.jsonl 2>/dev/null | wc -l)"

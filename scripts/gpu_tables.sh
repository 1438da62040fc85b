#!/usr/bin/env bash
# Device driver for the accuracy tables (issue 10): keeps a queue of `cli.py eval` jobs running in the background
# (at most $PAR at a time, resumable: a job's episodes.jsonl is appended episode by episode) and, in the foreground,
# re-packs what exists into OUTDIR/tables.tar.gz every 30 s, so a call cut off by its time limit still returns
# everything finished so far. Call it again (same machine, within its warm window) to keep going.
# Usage on the device: bash scripts/gpu_tables.sh OUTDIR SECONDS_TO_STAY
set -uo pipefail
OUT=${1:-/tmp/tables_out}; STAY=${2:-500}; PAR=${PAR:-6}; BATCH=${BATCH:-60}
T0=$(date +%s)
source scripts/device_model.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
[ -d .gguf1/adapters ] && mkdir -p /tmp/adapters && cp -r .gguf1/adapters/* /tmp/adapters/
mkdir -p /tmp/tables "$OUT"
python3 -c "from lragent.models import load_model; load_model('default')" 2>&1 | tail -1   # GGUF -> safetensors, once
cat > /tmp/tables/jobs.txt <<'JOBS'
hotpotqa sharedA/non_shared --scheme non_shared --runs 3
scienceqa sharedA/non_shared --scheme non_shared --runs 3
hotpotqa untrained/non_shared --scheme non_shared --runs 1 --adapter_init zero
scienceqa untrained/non_shared --scheme non_shared --runs 1 --adapter_init zero
scienceqa sharedA/non_shared+constrained --scheme non_shared --runs 1 --constrain all
hotpotqa sharedA/base_lr_shared --scheme base_lr_shared --runs 1
scienceqa sharedA/base_lr_shared --scheme base_lr_shared --runs 1
hotpotqa sharedA/full_shared --scheme full_shared --runs 1
scienceqa sharedA/full_shared --scheme full_shared --runs 1
hotpotqa sharedA/droidspeak --scheme droidspeak --runs 1
scienceqa sharedA/droidspeak --scheme droidspeak --runs 1
hotpotqa sharedA/base_shared --scheme base_shared --runs 1
scienceqa sharedA/base_shared --scheme base_shared --runs 1
JOBS
if ! pgrep -f "/tmp/tables/queue.sh" >/dev/null; then
  cat > /tmp/tables/queue.sh <<QUEUE
# gpu_tables_queue
while read -r ds name args; do
  out=/tmp/tables/\$ds/\$name
  [ -f \$out/summary.json ] && continue
  while [ \$(pgrep -f "cli.py eval" | wc -l) -ge $PAR ]; do sleep 3; done
  mkdir -p \$out
  ad="--adapters /tmp/adapters/\${ds}_sharedA"; case "\$args" in *adapter_init*) ad="";; esac
  python3 cli.py eval --benchmark \$ds \$ad --batch $BATCH --dtype bfloat16 \
    --out \$out --quiet true \$args > \$out.log 2>&1 < /dev/null &
  sleep 15
done < /tmp/tables/jobs.txt
wait
QUEUE
  setsid nohup bash /tmp/tables/queue.sh > /tmp/tables/queue.out 2>&1 < /dev/null &
fi
pack() { tar czf "$OUT/tables.tar.gz.tmp" -C /tmp tables 2>/dev/null && mv "$OUT/tables.tar.gz.tmp" "$OUT/tables.tar.gz"; }
while [ $(( $(date +%s) - T0 )) -lt "$STAY" ]; do sleep 30; pack; done
pack
for f in /tmp/tables/*/*/episodes.jsonl; do echo "$f $(wc -l < "$f")"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader

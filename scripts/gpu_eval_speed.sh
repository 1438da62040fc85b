#!/usr/bin/env bash
# Batched-eval throughput, old against new, side by side on one machine with two GPUs (issue 17: the study's evals
# ran ~8 episodes/min per process). The same eval (ScienceQA dev questions, the study's λ = 0 adapters, one run,
# --batch 64, bf16) runs with its agent calls prefilled eagerly row by row (--prefill_in_decode 0, GPU 0) and fed
# through the batched decode graph (--prefill_in_decode 128, GPU 1), at the same time, each alone on its GPU, for at
# most LIMIT_S seconds. Writes $OUT/eval_speed/speed.json (episodes finished, seconds, episodes/min per path, both
# GPUs' utilisation samples, provenance) and each run's episodes/summary.
# Usage (device, repo root, after scripts/device_model.sh joined the model): bash scripts/gpu_eval_speed.sh [LIMIT_S]
set -uo pipefail
LIMIT_S=${1:-240}
source scripts/device_model.sh > /dev/null
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
O=$OUT/eval_speed
mkdir -p "$O"
ADAPTERS=results/study/root/train/scienceqa_lam0/adapters
SCHEME=${SCHEME:-base_lr_shared}
run() {  # $1 gpu, $2 prefill_in_decode
  local d=/tmp/eval_speed/fed$2
  rm -rf "$d"
  local t0=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES=$1 timeout -s INT -k 20 "$LIMIT_S" python3 cli.py eval --benchmark scienceqa \
    --adapters "$ADAPTERS" --scheme "$SCHEME" --runs 1 --batch 64 --dtype bfloat16 --prefill_in_decode "$2" \
    --out "$d" --quiet true > "$O/fed$2.log" 2>&1
  echo "$? $(date +%s.%N) $t0" > "$O/fed$2.rc"
  cp "$d"/episodes.jsonl "$O/fed$2_episodes.jsonl" 2>/dev/null
  cp "$d"/summary.json "$O/fed$2_summary.json" 2>/dev/null
}
( while true; do nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader >> "$O/util.txt"; \
  sleep 5; done ) &
MON=$!
run 0 0 &
P0=$!
run 1 128 &
P1=$!
wait $P0 $P1
kill $MON 2>/dev/null
python3 - "$O" "$LIMIT_S" "$SCHEME" <<'EOF'
import json, sys
from pathlib import Path
from lragent.provenance import provenance
o, limit, scheme = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = {"what": f"eval scienceqa {scheme}, 90 dev questions x 1 run, --batch 64, bf16, study lambda=0 adapters",
       "limit_s": limit, "paths": {}}
for fed in (0, 128):
    rc, t1, t0 = (Path(o / f"fed{fed}.rc").read_text().split() + ["0", "0", "0"])[:3]
    eps = o / f"fed{fed}_episodes.jsonl"
    n = sum(1 for line in eps.read_text().splitlines() if line.strip()) if eps.is_file() else 0
    sec = float(t1) - float(t0)
    out["paths"][f"prefill_in_decode={fed}"] = {"rc": int(rc), "episodes": n, "seconds_incl_load": round(sec, 1),
                                                 "episodes_per_min": round(60 * n / sec, 2) if sec else None}
util = [ln.split(", ") for ln in (o / "util.txt").read_text().splitlines() if ln.strip()]
for g in ("0", "1"):
    u = [float(r[1].split()[0]) for r in util if r[0] == g]
    out[f"gpu{g}_util_mean_pct"] = round(sum(u) / len(u), 1) if u else None
out["provenance"] = provenance(dtype="bfloat16", command="bash scripts/gpu_eval_speed.sh " + str(limit))
(o / "speed.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out["paths"], indent=1), out["gpu0_util_mean_pct"], out["gpu1_util_mean_pct"])
EOF

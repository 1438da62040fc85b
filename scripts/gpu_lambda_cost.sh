#!/usr/bin/env bash
# The λ term's cost at 8B shapes, the shared pass's two-piece attention on and off, side by side (issue 19).
# Writes under $OUT/lambda_cost/: probe_wide_attention.{json,log} (the shared pass's attention candidates, forward +
# backward, against the plain pass's; the decomposed rows at realistic splits: per-query path with Q/K padded, with
# cuDNN wide values, and two-piece), tests.log (the shared-pass GPU tests), bench_two_piece_{1,0}/bench_train.*
# (bench train λ 0 / 0.5 weighted and sampled (lambda_mode), checkpointing on and off; 1 = the two-piece attention (default), 0 = LRAGENT_TWO_PIECE=0:
# one attention over [V_base | V_lr], cuDNN wide values). Byte tokens and random weights: no model file needed.
# Usage (device, repo root): LRAGENT_COMMIT=<sha> bash scripts/gpu_lambda_cost.sh
set -uo pipefail
D=${OUT:-./lambda_cost_out}/lambda_cost
mkdir -p "$D"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PY=$(command -v python3 || command -v python)
t=$(date +%s)
[ -f scripts/device_model.sh ] && source scripts/device_model.sh > /dev/null
"$PY" scripts/probe_wide_attention.py --out "$D/probe_wide_attention.json" > "$D/probe_wide_attention.log" 2>&1
tail -13 "$D/probe_wide_attention.log"; echo "probe $(( $(date +%s) - t )) s"
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_shared_pass_gpu.py \
  tests/test_training_recipe.py > "$D/tests.log" 2>&1
tail -3 "$D/tests.log"
for mode in 1 0; do
  t=$(date +%s)
  LRAGENT_TWO_PIECE=$mode "$PY" cli.py bench train --model llama-3.1-8b --data hotpotqa --seq_len 2048 \
    --batch_size 4 --steps 8 --warmup_steps 2 --lambdas '[0, 0.5]' --lambda_modes '[weight, sample]' --checkpointing '[true, false]' \
    --pack_prefixes false --peft_baseline false --out "$D/bench_two_piece_$mode" > "$D/bench_two_piece_$mode.log" 2>&1
  echo "bench two_piece=$mode: exit $? in $(( $(date +%s) - t )) s"
  grep -E "^\|" "$D/bench_two_piece_$mode/bench_train.md" 2>/dev/null | head -12
done

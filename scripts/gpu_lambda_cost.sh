#!/usr/bin/env bash
# The λ term's cost at 8B shapes (issue 19), in one device call. Writes under $OUT/lambda_cost/:
#   tests.log              the shared-pass GPU tests (two-piece values and gradients against float32, each SDPA
#                          backend, kernels against their PyTorch implementation) and the training-recipe GPU tests
#   profile_two_piece.*    the shared pass's attention forward + backward against the plain pass's (8B shapes)
#   profile_train_step*    an 8-layer step's kernels: plain, shared, and the weighted λ 0.5 step (one backward)
#   bench_two_piece_M/     bench train λ 0 / 0.5 (weighted and sampled: lambda_mode), checkpointing on and off, with
#                          LRAGENT_TWO_PIECE=M for each M in $MODES (1: two-piece attention, the default; 0: one
#                          attention over [V_base | V_lr] on cuDNN with wide values, the path before)
#   probe_wide_attention.* only with PROBE=1 (the attention candidates side by side)
#   bench_cross_<tok>_<producer>/  only with CROSS=1: bench train λ 0 / 0.5 (weighted) on cross-role batches
#                          (--cross_role_batches: the sources' plain terms scored in the shared pass), checkpointing
#                          on, $CROSS_LEN tokens (default 4096), producers "prefix" and "random", byte tokens and, when
#                          the folder .tok is carried (the embedded tokenizer's files), those tokens too. CROSS=only
#                          runs these alone (no tests, profiles or the two-piece benches). CROSS_TOKS (default
#                          "byte .tok") and CROSS_PRODUCERS (default "prefix random"; "none": the ordinary batches,
#                          a control) set which run, in that order. CROSS_LEN: max_length (default 4096).
#                          CROSS_MAXTOK: token-budget batches of that many padded tokens instead of 4 sequences
#                          (the embedded tokenizer's examples are short: 4 of them are ~2,600 tokens). WARM_ROUNDS
#                          (default 1): untimed rounds over the timed batches first (bench train --warm_rounds).
#                          CROSS_DATA (default hotpotqa): the benchmark (its name joins the folder's when not hotpotqa).
#                          CROSS_MIN_SHARE: data.cross_role_min_share (unset: bench train's default, 0.6; runs before
#                          3f167da linked every pair, which is 0).
#                          Make .tok here (3.4 MB, git-ignored) and carry it: mkdir -p .tok && cp "$(python -c 'from lragent.models import
#                          _embedded_converted_dir as d; print(d())')"/{tokenizer.json,tokenizer_config.json,config.json} .tok/
# Byte tokens and random weights: no model file needed. Needs ~100 GiB with checkpointing off: an H200.
# Usage (device, repo root): LRAGENT_COMMIT=<sha> [MODES="1 0"] [STEPS=8] [ROUNDS=1] [PROBE=0] [CROSS=0|1|only]
#   bash scripts/gpu_lambda_cost.sh
set -uo pipefail
D=${OUT:-./lambda_cost_out}/lambda_cost
mkdir -p "$D"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PY=$(command -v python3 || command -v python)
MODES=${MODES:-1 0}
STEPS=${STEPS:-8}
[ -f scripts/device_model.sh ] && source scripts/device_model.sh > /dev/null
cross_benches() {  # the cross-role batches' λ cost (see the header)
  local toks=() tok producer t
  for tok in ${CROSS_TOKS:-byte .tok}; do
    [ "$tok" = byte ] || [ -f "$tok/tokenizer.json" ] && toks+=("$tok")
  done
  for tok in "${toks[@]}"; do
    for producer in ${CROSS_PRODUCERS:-prefix random}; do
      t=$(date +%s)
      local data=${CROSS_DATA:-hotpotqa}
      local name="bench_cross_$([ "$data" = hotpotqa ] || echo "${data}_")$(basename "$tok" | tr -d .)_$producer"
      "$PY" cli.py bench train --model llama-3.1-8b --data "$data" --tokenizer "$tok" --seq_len "${CROSS_LEN:-4096}" \
        --batch_size 4 ${CROSS_MAXTOK:+--max_tokens "$CROSS_MAXTOK"} --steps "$STEPS" --warmup_steps 2 \
        --lambdas '[0, 0.5]' --checkpointing '[true]' --pack_prefixes false --peft_baseline false \
        --rounds "${ROUNDS:-1}" --warm_rounds "${WARM_ROUNDS:-1}" \
        --cross_role_batches "$([ "$producer" = none ] && echo false || echo true)" \
        ${CROSS_MIN_SHARE:+--cross_role_min_share "$CROSS_MIN_SHARE"} \
        --producer "$([ "$producer" = none ] && echo random || echo "$producer")" --out "$D/$name" > "$D/$name.log" 2>&1
      echo "$name: exit $? in $(( $(date +%s) - t )) s"
      grep -E "^\|" "$D/$name/bench_train.md" 2>/dev/null | head -5
    done
  done
}
if [ "${CROSS:-0}" = only ]; then
  cross_benches
  exit 0
fi
t=$(date +%s)
"$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_shared_pass_gpu.py \
  tests/test_training_recipe.py tests/test_cross_role_batches.py > "$D/tests.log" 2>&1
tail -3 "$D/tests.log"; echo "tests $(( $(date +%s) - t )) s"
t=$(date +%s)
"$PY" scripts/profile_two_piece.py --out "$D" > "$D/profile_two_piece.log" 2>&1
head -8 "$D/profile_two_piece.log"; echo "profile $(( $(date +%s) - t )) s"
t=$(date +%s)
"$PY" scripts/profile_train_step.py --layers 8 --scored 32 --out "$D/profile_train_step_8layers_scored32.json" \
  > "$D/profile_train_step.log" 2>&1
grep -E "^== " "$D/profile_train_step.log"; echo "profile step $(( $(date +%s) - t )) s"
if [ "${PROBE:-0}" = 1 ]; then
  "$PY" scripts/probe_wide_attention.py --out "$D/probe_wide_attention.json" > "$D/probe_wide_attention.log" 2>&1
  tail -13 "$D/probe_wide_attention.log"
fi
for mode in $MODES; do
  t=$(date +%s)
  LRAGENT_TWO_PIECE=$mode "$PY" cli.py bench train --model llama-3.1-8b --data hotpotqa --seq_len 2048 \
    --batch_size 4 --steps "$STEPS" --warmup_steps 2 --lambdas '[0, 0.5]' --lambda_modes '[weight, sample]' \
    --checkpointing '[true, false]' --pack_prefixes false --peft_baseline false --rounds "${ROUNDS:-1}" --out "$D/bench_two_piece_$mode" \
    > "$D/bench_two_piece_$mode.log" 2>&1
  echo "bench two_piece=$mode: exit $? in $(( $(date +%s) - t )) s"
  grep -E "^\|" "$D/bench_two_piece_$mode/bench_train.md" 2>/dev/null | head -12
done
[ "${CROSS:-0}" = 1 ] && cross_benches

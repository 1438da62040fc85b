#!/usr/bin/env bash
# Training at 8B shapes on one GPU, in one call of at most ~8 minutes on an H100 (issue 19). Writes under $OUT:
#
#   shared_pass.json             the one-pass λ term against the two-pass form on this GPU (tiny model)
#   bench/bench_train.{json,md}  lragent bench train: llama-3.1-8b shapes (random weights), hotpotqa role examples
#                                (byte tokens) cut to 2048, batch 4, bf16-mixed; λ 0 and 0.5 with gradient
#                                checkpointing on, λ 0 with it off, and the plain transformers + peft loop
#   fit{1,2}_config.yaml         configs/hotpotqa.yaml with the run paths under $RUN and a FitSpeed callback
#   fit1.log, fit1_speed.json    fit (paper settings: batch 4, max_length 4096, lr, schedule; accumulation 2 instead
#                                of 8 to fit the budget) on 8B shapes for $FIT_STEPS1 optimizer steps, checkpointing
#   fit2.log, fit2_speed.json    resumed with --ckpt_path last to $FIT_STEPS2 steps
#   export.log, export/          export of the last checkpoint (one PEFT directory per role)
#   peft_check.json              the PEFT directories loaded back into transformers + peft: equal logits per role
#   timings.txt                  wall seconds of each phase;  nvidia-smi.txt
#
# Run (the lead, on the device machine):  LRAGENT_COMMIT=<sha> bash scripts/gpu_bench_train.sh
#   (LRAGENT_COMMIT: the commit the provenance names; the device copy's .git can be a stale snapshot)
# CPU check of the commands (tiny model, seconds):
#   OUT=/tmp/gbt LRAGENT_MODEL=tiny-llama LRAGENT_OVERRIDES='{"vocab_size": 258, "num_hidden_layers": 2}' \
#     LRAGENT_SEQ=128 LRAGENT_FIT_LEN=128 LRAGENT_BENCH_STEPS=1 bash scripts/gpu_bench_train.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu_train}
MODEL=${LRAGENT_MODEL:-llama-3.1-8b}
OVERRIDES=${LRAGENT_OVERRIDES:-null}
SEQ=${LRAGENT_SEQ:-2048}
BATCH=${LRAGENT_BATCH:-4}
BENCH_STEPS=${LRAGENT_BENCH_STEPS:-4}
FIT_LEN=${LRAGENT_FIT_LEN:-4096}
FIT_STEPS1=${LRAGENT_FIT_STEPS1:-3}
FIT_STEPS2=${LRAGENT_FIT_STEPS2:-6}
RUN=${LRAGENT_RUN_DIR:-runs/gpu_fit_8b}  # checkpoints stay out of $OUT (their size)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/timings.txt"
(nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1) || true
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

phase() {  # phase NAME LOG command...: runs, logs, records wall seconds and status; later phases still run
  local name=$1 log=$2
  shift 2
  local t0=$SECONDS rc=0
  echo "== $name: $*" | tee "$log"
  "$@" >> "$log" 2>&1 || rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/timings.txt"
  tail -n 25 "$log"
  return 0
}

# 0. the one-pass λ term equals the two-pass form on this device (tiny model, seconds)
phase shared_pass "$OUT/shared_pass.log" "$PY" scripts/check_shared_pass.py --out "$OUT/shared_pass.json"

# 1. bench train: lragent (λ 0 / 0.5, checkpointing on; λ 0 off) and the PEFT loop on the same batches
[ -n "${LRAGENT_SKIP_BENCH:-}" ] || phase bench "$OUT/bench.log" "$PY" cli.py bench train --model "$MODEL" --model_overrides "$OVERRIDES" \
  --data hotpotqa --seq_len "$SEQ" --batch_size "$BATCH" --steps "$BENCH_STEPS" --warmup_steps 2 \
  --lambdas '[0, 0.5]' --checkpointing '[true, false]' --pack_prefixes false --out "$OUT/bench"

# 2. fit on the paper config, 8B shapes: the run's paths under $RUN and a FitSpeed callback (one config per run)
"$PY" - "$RUN" "$OUT" <<'EOF'
import importlib.util
import sys

import yaml

run, out = sys.argv[1], sys.argv[2]
cfg = yaml.safe_load(open("configs/hotpotqa.yaml").read().replace("runs/hotpotqa", run))
if not any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX")):  # keep the CSV logger only
    cfg["trainer"]["logger"] = [lg for lg in cfg["trainer"]["logger"] if "TensorBoard" not in lg["class_path"]]
# no progress bar in a log file
cfg["trainer"]["callbacks"] = [cb for cb in cfg["trainer"]["callbacks"] if "ProgressBar" not in cb["class_path"]]
cfg["trainer"]["enable_progress_bar"] = False
for i in (1, 2):
    speed = {"class_path": "eval_suite.bench_train.FitSpeed", "init_args": {"out": f"{out}/fit{i}_speed.json"}}
    cfg_i = {**cfg, "trainer": {**cfg["trainer"], "callbacks": [*cfg["trainer"]["callbacks"], speed]}}
    open(f"{out}/fit{i}_config.yaml", "w").write(yaml.safe_dump(cfg_i, sort_keys=False))
EOF
FIT=(--model.model_name "$MODEL" --model.model_overrides "$OVERRIDES" --model.tokenizer_name byte
  --model.model_dtype bfloat16 --model.gradient_checkpointing true --data.max_length "$FIT_LEN"
  --trainer.accumulate_grad_batches 2 --trainer.val_check_interval 6 --trainer.limit_val_batches 4
  --trainer.log_every_n_steps 1)
phase fit1 "$OUT/fit1.log" "$PY" cli.py fit --config "$OUT/fit1_config.yaml" "${FIT[@]}" \
  --trainer.max_steps "$FIT_STEPS1"
phase fit2 "$OUT/fit2.log" "$PY" cli.py fit --config "$OUT/fit2_config.yaml" "${FIT[@]}" \
  --trainer.max_steps "$FIT_STEPS2" --ckpt_path last
ls -la "$RUN/checkpoints" >> "$OUT/timings.txt" 2>&1 || true

# 3. export the last checkpoint and load the PEFT directories back
phase export "$OUT/export.log" "$PY" cli.py export --ckpt "$RUN/checkpoints/last.ckpt" --out "$OUT/export"
phase peft_check "$OUT/peft_check.log" "$PY" scripts/check_peft_export.py --ckpt "$RUN/checkpoints/last.ckpt" \
  --export "$OUT/export" --out "$OUT/peft_check.json"
rm -f "$RUN"/checkpoints/*.ckpt.tmp
cp -r "$RUN/csv" "$OUT/fit_csv" 2>/dev/null || true
cat "$OUT/timings.txt"

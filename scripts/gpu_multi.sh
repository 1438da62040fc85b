#!/usr/bin/env bash
# Several GPUs (issue 21), one device call on a 2-GPU machine (all ten phases: about 9 minutes; first run on two
# H100s, cut to five phases, in results/multi_gpu_h100x2_2026-11-25/). Writes
# under $OUT:
#
#   emb1.log, emb1_speed.json        embedded SmolLM2 (configs/embedded_hotpotqa.yaml), 1 GPU, accumulate 2,
#                                    $EMB_EPOCHS epochs, validation after each: val loss, tokens/s
#   emb1s.log, emb1s_speed.json      the same with another adapter init (model.adapter_seed 1): run-to-run noise
#   emb2.log, emb2_speed*.json       DDP on 2 GPUs (configs/ddp.yaml), accumulate 1: the same global batch, the same
#                                    batches per optimizer step as emb1; per-rank and global tokens/s
#   b1.log, b1_speed.json, b1_export/    8B shapes (configs/hotpotqa.yaml + configs/fsdp_8b.yaml's model), 1 GPU,
#                                    accumulate 2, $B_STEPS1 steps: the one-GPU export (format reference)
#   f1.log, f1_speed*.json           FSDP (configs/fsdp_8b.yaml) on 2 GPUs, $B_STEPS1 steps, checkpoint: peak memory
#                                    per GPU, tokens/s
#   f2.log, f2_speed*.json, f2_export/   resumed with --ckpt_path last to $B_STEPS2 steps; ExportAdapters' export
#   d8.log, d8_speed*.json           DDP on 2 GPUs at 8B shapes (the whole base on each GPU), $B_STEPS1 steps: the
#                                    strategy to compare FSDP with where the base fits one GPU
#   fx.log, fx_export/               cli.py export --device cuda of the FSDP run's last checkpoint
#   ev1.log, ev1/ ; ev2.log, ev2/    eval --devices 1 and --devices 2 (HotpotQA, shipped adapters, $EV_LIMIT questions)
#   timings.txt, nvidia-smi.txt      wall seconds and status of each phase
#   multi_gpu.json, multi_gpu.md     eval_suite/multi_gpu_report.py: the figures and checks, with provenance
#
# Run (on the device machine):  OUT=$OUT LRAGENT_COMMIT=<sha> bash scripts/gpu_multi.sh
# Options (environment): PHASES="f1 f2 emb1+b1 emb2" runs only those phases, in that order, "a+b" side by side on
#   one GPU each (default: all ten, one after the other, as above);
#   BUDGET_S stops the phases at that many seconds (the one running is killed, the rest skipped; the report follows);
#   EMB_MODEL=random trains the DDP phases on random weights with the embedded model's shapes (smollm2-135m, byte
#   tokens) instead of the embedded GGUF, for a call that cannot carry the 98 MB GGUF; EMB_LIMIT1/EMB_LIMIT2 (batches
#   per epoch on one GPU / per rank under DDP), VAL_MAX (held-out examples per role), EMB_EPOCHS, B_STEPS1/B_STEPS2,
#   EV_LIMIT shorten a call; APPEND=1 goes on from an earlier call in the same $OUT and $RUN (its checkpoints and
#   timings kept). The report states which model the DDP phases used ($OUT/emb_model.txt).
# CPU check of every phase (gloo, tiny random models, 2 CPU processes; a few minutes):
#   OUT=/tmp/gm LRAGENT_MULTI_CPU=1 bash scripts/gpu_multi.sh
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out/gpu_multi}
RUN=${LRAGENT_RUN_DIR:-runs/gpu_multi}  # checkpoints stay out of $OUT (their size)
PY=${PYTHON:-python3}
CPU=${LRAGENT_MULTI_CPU:-}
mkdir -p "$OUT" "$RUN"
if [ -z "${APPEND:-}" ]; then  # APPEND=1: a second call goes on in the same $OUT and $RUN (checkpoints, timings)
  rm -rf "${RUN:?}"/*
  : > "$OUT/timings.txt"
fi
(nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1) || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

if [ -n "$CPU" ]; then  # tiny sizes; the same commands
  EMB_EPOCHS=${EMB_EPOCHS:-1}; EMB_LIMIT1=8; EMB_LIMIT2=4; B_STEPS1=${B_STEPS1:-3}; B_STEPS2=${B_STEPS2:-5}; EV_LIMIT=${EV_LIMIT:-2}
  TINY='{"vocab_size": 258, "num_hidden_layers": 2}'
  EMB=(--trainer.accelerator cpu --trainer.precision 32-true --model.model_name tiny-llama --model.tokenizer_name byte
    --model.model_overrides "$TINY" --data.max_length 512 --data.max_tokens 2048 --data.val_max_per_role 4)
  BIG=(--trainer.accelerator cpu --trainer.precision 32-true --model.model_name tiny-llama --model.model_overrides "$TINY"
    --model.model_dtype float32 --data.max_length 1024)
  EV=(--device cpu --model default --max_steps 1 --thought_tokens 4 --argument_tokens 3)
  EXPORT_DEVICE=cpu
else
  EMB_EPOCHS=${EMB_EPOCHS:-2}; EMB_LIMIT1=${EMB_LIMIT1:-1.0}; EMB_LIMIT2=${EMB_LIMIT2:-1.0}; B_STEPS1=${B_STEPS1:-4}; B_STEPS2=${B_STEPS2:-8}; EV_LIMIT=${EV_LIMIT:-24}
  EMB=(); BIG=(--data.max_length "${B_LEN:-2048}"); EV=(--device cuda --dtype bfloat16); EXPORT_DEVICE=cuda
  rm -f "$OUT/emb_model.txt"  # the embedded model unless EMB_MODEL=random says otherwise
  if [ "${EMB_MODEL:-embedded}" = random ]; then
    EMB=(--model.model_name smollm2-135m --model.tokenizer_name byte)
    echo "random weights with the embedded model's shapes (smollm2-135m), byte tokens" > "$OUT/emb_model.txt"
  fi
fi
[ -n "$CPU" ] && echo "tiny random LLaMA (CPU check)" > "$OUT/emb_model.txt"
[ -n "${VAL_MAX:-}" ] && EMB+=(--data.val_max_per_role "$VAL_MAX")
PHASES=${PHASES:-"emb1 emb1s emb2 b1 f1 f2 d8 fx ev1 ev2"}
DEADLINE=$((SECONDS + ${BUDGET_S:-100000}))  # a phase still running at the deadline is stopped (exit 124)

phase() {  # phase NAME command...: runs into $OUT/NAME.log, records wall seconds and status; later phases still run
  local name=$1
  shift
  local t0=$SECONDS rc=0 left=$((DEADLINE - SECONDS))
  if [ "$left" -le 10 ]; then echo "$name rc=skipped seconds=0" | tee -a "$OUT/timings.txt"; return 0; fi
  echo "== $name: $*" | tee "$OUT/$name.log"
  timeout -k 10 "$left" "$@" >> "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/timings.txt"
  tail -n 5 "$OUT/$name.log"
  return 0
}

# Derived configs: no early stopping, time budget or progress bar; a FitSpeed and an ExportAdapters (last weights)
# per run; checkpoints every few steps for the 8B runs; CSV logs under $RUN.
"$PY" - "$RUN" "$OUT" <<'EOF'
import sys

import yaml

run, out = sys.argv[1], sys.argv[2]
drop = ("EarlyStopping", "TimeBudget", "ProgressBar", "RunStatus", "ModelCheckpoint", "ExportAdapters")


def derive(base: str, name: str, ckpt_every: int | None, warmup: int = 2) -> None:
    cfg = yaml.safe_load(open(base))
    tr = cfg["trainer"]
    tr["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                     "init_args": {"save_dir": f"{run}/{name}", "name": "csv", "version": 0}}]
    cbs = [cb for cb in tr["callbacks"] if not any(d in cb["class_path"] for d in drop)]
    cbs.append({"class_path": "eval_suite.bench_train.FitSpeed", "init_args": {"out": f"{out}/{name}_speed.json", "warmup": warmup}})
    cbs.append({"class_path": "lit_modules.export.ExportAdapters",
                "init_args": {"out_dir": f"{out}/{name}_export", "best": False}})
    if ckpt_every:
        cbs.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": f"{run}/fsdp/checkpoints", "save_last": True,
                                  "every_n_train_steps": ckpt_every, "monitor": None}})
    tr.update(callbacks=cbs, enable_progress_bar=False, enable_checkpointing=bool(ckpt_every), default_root_dir=run,
              num_sanity_val_steps=0, log_every_n_steps=1)
    open(f"{out}/{name}_config.yaml", "w").write(yaml.safe_dump(cfg, sort_keys=False))


for name in ("emb1", "emb1s", "emb2"):
    derive("configs/embedded_hotpotqa.yaml", name, None)
derive("configs/hotpotqa.yaml", "b1", None, warmup=1)  # few micro-batches: only the first is not timed
derive("configs/hotpotqa.yaml", "d8", None, warmup=1)
for name in ("f1", "f2"):
    derive("configs/hotpotqa.yaml", name, 1, warmup=1)
EOF

# 1-3. embedded model: one GPU with accumulation 2 (twice: adapter seeds 0 and 1) and DDP on two GPUs, $EMB_EPOCHS
# epochs (42 token-budget batches each: 21 optimizer steps either way), validation on the whole held-out set after
# each epoch. On the CPU the epoch is cut to the first 8 global batches (limit_train_batches counts a rank's batches).
E=(--trainer.max_epochs "$EMB_EPOCHS" --trainer.max_steps -1 --trainer.val_check_interval 1.0 "${EMB[@]}")
# 4-7. 8B shapes (random weights, byte tokens): one GPU (accumulate 2) for the export format; FSDP on two GPUs
# (accumulate 1: the same global batch) with a checkpoint each step, resumed; the export command on its checkpoint
B=(--config configs/fsdp_8b.yaml --trainer.limit_val_batches 0 --trainer.max_epochs -1 "${BIG[@]}")
# 8-9. evaluation: one process, then two shard processes (one per GPU) merged
V=(--benchmark hotpotqa --scheme base_lr_shared --limit "$EV_LIMIT" --runs 1 --quiet true "${EV[@]}")

run_phase() {  # run_phase NAME: the command of one phase, in $PHASES order
  case $1 in
    emb1) phase emb1 "$PY" cli.py fit --config "$OUT/emb1_config.yaml" "${E[@]}" --trainer.accumulate_grad_batches 2 \
            --trainer.limit_train_batches "$EMB_LIMIT1" ;;
    emb1s) phase emb1s "$PY" cli.py fit --config "$OUT/emb1s_config.yaml" "${E[@]}" \
             --trainer.accumulate_grad_batches 2 --trainer.limit_train_batches "$EMB_LIMIT1" --model.adapter_seed 1 ;;
    emb2) phase emb2 "$PY" cli.py fit --config "$OUT/emb2_config.yaml" --config configs/ddp.yaml "${E[@]}" \
            --trainer.accumulate_grad_batches 1 --trainer.limit_train_batches "$EMB_LIMIT2" ;;
    b1) phase b1 "$PY" cli.py fit --config "$OUT/b1_config.yaml" "${B[@]}" --trainer.devices 1 --trainer.strategy auto \
          --trainer.accumulate_grad_batches 2 --trainer.max_steps "$B_STEPS1" ;;
    f1) phase f1 "$PY" cli.py fit --config "$OUT/f1_config.yaml" "${B[@]}" --trainer.accumulate_grad_batches 1 \
          --trainer.max_steps "$B_STEPS1" ;;
    f2) phase f2 "$PY" cli.py fit --config "$OUT/f2_config.yaml" "${B[@]}" --trainer.accumulate_grad_batches 1 \
          --trainer.max_steps "$B_STEPS2" --ckpt_path last ;;
    d8) phase d8 "$PY" cli.py fit --config "$OUT/d8_config.yaml" "${B[@]}" --trainer.strategy ddp --trainer.devices 2 \
          --trainer.accumulate_grad_batches 1 --trainer.max_steps "$B_STEPS1" ;;
    fx) phase fx "$PY" cli.py export --ckpt "$RUN/fsdp/checkpoints/last.ckpt" --out "$OUT/fx_export" \
          --device "$EXPORT_DEVICE" ;;
    ev1) phase ev1 "$PY" cli.py eval "${V[@]}" --devices 1 --out "$OUT/ev1" ;;
    ev2) phase ev2 "$PY" cli.py eval "${V[@]}" --devices 2 --out "$OUT/ev2" ;;
    *) echo "unknown phase $1: allowed emb1 emb1s emb2 b1 f1 f2 d8 fx ev1 ev2" >&2; exit 2 ;;
  esac
}
for group in $PHASES; do  # "a+b": a on the first GPU and b on the second, at the same time (one-GPU phases only)
  if [[ $group == *+* ]]; then
    i=0
    for name in ${group//+/ }; do
      if [ -n "$CPU" ]; then run_phase "$name" & else CUDA_VISIBLE_DEVICES=$i run_phase "$name" & fi
      i=$((i + 1))
    done
    wait
  else
    run_phase "$group"
  fi
done

cp -r "$RUN"/*/csv "$OUT/" 2>/dev/null || true
for r in emb1 emb1s emb2; do cp "$RUN/$r/csv/version_0/metrics.csv" "$OUT/${r}_metrics.csv" 2>/dev/null || true; done
"$PY" -m eval_suite.multi_gpu_report --out "$OUT" \
  --command "OUT=$OUT LRAGENT_MULTI_CPU=$CPU EMB_MODEL=${EMB_MODEL:-embedded} PHASES='$PHASES' bash scripts/gpu_multi.sh" \
  2>&1 | tee "$OUT/report.log"
cat "$OUT/timings.txt"

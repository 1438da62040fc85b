#!/usr/bin/env bash
# Several GPUs: DDP and FSDP fits and `eval --devices N` at each GPU count in $SIZES against one GPU,
# in one or more device calls (APPEND=1 goes on). First run on two H100s (five phases) in
# results/multi_gpu_h100x2_2026-11-25/. Writes under $OUT (N: each count in $SIZES, e.g. "2 4"; A: the largest):
#
#   emb1.log, emb1_speed.json        embedded SmolLM2 (configs/embedded_hotpotqa.yaml), 1 GPU, accumulate A,
#                                    $EMB_EPOCHS epochs, validation after each: val loss, tokens/s
#   emb1rK, ddpNrK (K 2..9)          emb1 and ddpN again (the same seeds): the report pools every repeat's tokens/s
#                                    and gives each repeat pair's val/loss difference against the seed noise
#                                    (one GPU's pace drifts by 10-15% between fits on one host); interleave them,
#                                    e.g. PHASES="emb1 ddp4 emb1r2 ddp4r2 emb1r3 ddp4r3"
#   emb1s.log, emb1s_speed.json      the same with another adapter init (model.adapter_seed 1): run-to-run noise;
#                                    emb1sK / q1sK: adapter seed K (2..9), more draws of that noise
#   ddpN.log, ddpN_speed*.json       DDP on N GPUs (configs/ddp.yaml), accumulate A/N: the same global batch, the same
#                                    batches per optimizer step as emb1; per-rank and global tokens/s
#   q1, q1s, qddpN                   the same three on the accuracy model (configs/qwen_hotpotqa.yaml), $Q_LIMIT global
#                                    batches, $Q_VAL held-out examples per role (needs LRAGENT_ACCURACY_GGUF)
#   b1.log, b1_speed.json, b1_export/    8B shapes (configs/hotpotqa.yaml + configs/fsdp_8b.yaml's model), 1 GPU,
#                                    accumulate A, $B_STEPS1 steps: the one-GPU reference (speed, memory, export format)
#   fsdpN.log, fsdpN_speed*.json     FSDP (configs/fsdp_8b.yaml) on N GPUs, accumulate A/N, $B_STEPS1 steps, a
#                                    checkpoint each step: peak memory per GPU, tokens/s
#   fsdpNr.log, fsdpNr_export/       resumed with --ckpt_path last to $B_STEPS2 steps; ExportAdapters' export
#   ddp8bN.log, ddp8bN_speed*.json   DDP on N GPUs at 8B shapes (the whole base on each GPU), $B_STEPS1 steps: the
#                                    strategy to compare FSDP with where the base fits one GPU
#   fxN.log, fxN_export/             cli.py export --device cuda of fsdpNr's last checkpoint
#   peftN.log, peftN.json            fsdpNr's export loaded in peft.PeftModel.from_pretrained, role by role, its logits
#                                    against lragent's (eval_suite/diagnostics/peft_check.py)
#   ev1.log, ev1/ ; evN.log, evN/    eval --devices 1 and --devices N, dev questions of $EV_BENCHMARKS (base_lr_shared,
#                                    shipped adapters, $EV_LIMIT questions each, $EV_RUNS runs): same records, wall ratio;
#                                    one command over every benchmark (eval --benchmark a,b: each process runs them in
#                                    turn; EV_SEPARATE=1: one command per benchmark, as before 2026-11-28);
#                                    phase evN-<benchmark> runs one benchmark into evN/<benchmark> (a run too long for
#                                    one call: one benchmark per call, APPEND=1; the report adds the parts' seconds;
#                                    an eval stopped at the call's BUDGET_S resumes from its log when the same phase
#                                    runs in the next call, and the report counts both calls' seconds as one phase)
#   evwarm.log, evwarm/              before them (not timed against anything): the same eval options on 2 questions x 1
#                                    run, so that every timed run finds the kernels compiled (Triton's cache on disk)
#                                    and the files read once: whichever of ev1 and evN came first paid that alone
#   timings.txt, nvidia-smi.txt      wall seconds and status of each phase
#   multi_gpu.json, multi_gpu.md     eval_suite/bench/multi_gpu_report.py: the figures and checks, with provenance
#
# Run (on the device machine):  OUT=$OUT LRAGENT_COMMIT=<sha> SIZES="2 4" bash scripts/gpu_multi.sh
# Options (environment): SIZES the GPU counts to compare with one GPU (default "2"; each must divide the largest);
#   PHASES="fsdp4 fsdp4r emb1+b1 ddp4" runs only those phases, in that order, "a+b" side by side on one GPU each
#   (default: every phase above for every size, one after the other);
#   BUDGET_S stops the phases at that many seconds (the one running is killed, the rest skipped; the report follows);
#   EMB_MODEL=random trains the embedded DDP phases on random weights with the embedded model's shapes (smollm2-135m,
#   byte tokens) instead of the embedded GGUF, for a call that cannot carry the 98 MB GGUF; EMB_LIMIT1 (global batches
#   per epoch, default 10·A; a rank gets EMB_LIMIT1/N, or the same fraction when it is one: keep it a multiple of
#   A and at most an epoch's batches, or DDP trains on other data than one GPU), VAL_MAX (held-out examples per role),
#   EMB_EXTRA adds options to every embedded-model fit (e.g. "--model.model_dtype bfloat16"); FITSPEED_SYNC=1 times
#   the fits as before 2026-11-28 (a device sync at each micro-batch, the host clock) instead of with CUDA events;
#   FITSPEED_SYNC_DEBUG=1 counts each micro-batch's host-device syncs and names their lines (a diagnostic).
#   LRAGENT_LIGHTNING_SIGTERM=1 leaves Lightning's per-batch SIGTERM broadcast (a GPU drain) in the DDP fits instead of
#   lit_modules/sigterm_check.py's host agreement: to time the two side by side.
#   DDP_EXTRA adds options to the embedded model's ddpN phases only, e.g. "--trainer.strategy
#   lightning.pytorch.strategies.DDPStrategy --trainer.strategy.gradient_as_bucket_view true".
#   EMB_EPOCHS, B_STEPS1/B_STEPS2 (default 11/13: 10 timed steps after the first), EV_LIMIT, EV_RUNS, EV_BENCHMARKS,
#   Q_LIMIT, Q_VAL shorten a call; EV_MODEL, EV_BATCH the eval's --model and --batch, EV_EXTRA more eval options
#   (e.g. "--batch_invariant true"); EV_ADAPTERS a folder
#   holding <benchmark>_sharedA to evaluate (default: data/adapters, which a slimmed carry leaves behind; for the
#   accuracy model copy qwen_<benchmark>_sharedA there under that name); APPEND=1 goes on from an earlier call in the
#   same $OUT and $RUN (its checkpoints and timings kept). The report states which model the DDP phases used ($OUT/emb_model.txt).
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

SIZES=${SIZES:-2}
A=$(printf '%s\n' $SIZES | sort -n | tail -1)  # one GPU accumulates A micro-batches: the global batch of every run
for n in $SIZES; do
  if ! [[ $n =~ ^[0-9]+$ ]] || [ "$n" -lt 2 ] || [ $((A % n)) -ne 0 ]; then
    echo "SIZES=\"$SIZES\": GPU counts of at least 2, each dividing the largest ($A)" >&2; exit 2
  fi
done
seed_of() {  # seed_of emb1s | emb1sK | q1s | q1sK: the adapter seed of a noise run (1, or K)
  local k=${1##*s}
  echo "${k:-1}"
}
per_rank() {  # per_rank LIMIT N: a global batch count split over N ranks; a fraction of an epoch stays as it is
  case $1 in *.*) echo "$1" ;; *) echo $(($1 / $2)) ;; esac
}

if [ -n "$CPU" ]; then  # tiny sizes; the same commands
  EMB_EPOCHS=${EMB_EPOCHS:-1}; EMB_LIMIT1=$((4 * A)); B_STEPS1=${B_STEPS1:-3}; B_STEPS2=${B_STEPS2:-5}
  EV_LIMIT=${EV_LIMIT:-2}; EV_RUNS=${EV_RUNS:-1}; EV_BENCHMARKS=${EV_BENCHMARKS:-hotpotqa}
  TINY='{"vocab_size": 258, "num_hidden_layers": 2}'
  EMB=(--trainer.accelerator cpu --trainer.precision 32-true --model.model_name tiny-llama --model.tokenizer_name byte
    --model.model_overrides "$TINY" --data.max_length 512 --data.max_tokens 2048 --data.val_max_per_role 4)
  BIG=(--trainer.accelerator cpu --trainer.precision 32-true --model.model_name tiny-llama --model.model_overrides "$TINY"
    --model.model_dtype float32 --data.max_length 1024)
  EV=(--device cpu --model default --max_steps 1 --thought_tokens 4 --argument_tokens 3)
  EXPORT_DEVICE=cpu; PEFT=(--model tiny-llama --overrides "$TINY" --dtype float32 --device cpu)
else
  # 10·A global batches an epoch (the embedded HotpotQA epoch has 42): every rank then gets the same whole number of
  # batches, so DDP sees exactly one GPU's data (a whole epoch split 4 ways drops 2 batches a rank cannot share)
  EMB_EPOCHS=${EMB_EPOCHS:-2}; EMB_LIMIT1=${EMB_LIMIT1:-$((10 * A))}; B_STEPS1=${B_STEPS1:-11}; B_STEPS2=${B_STEPS2:-13}
  EV_LIMIT=${EV_LIMIT:-24}; EV_RUNS=${EV_RUNS:-1}; EV_BENCHMARKS=${EV_BENCHMARKS:-hotpotqa scienceqa}
  EMB=(); BIG=(--data.max_length "${B_LEN:-2048}"); EV=(--device cuda --dtype bfloat16); EXPORT_DEVICE=cuda
  PEFT=(--model llama-3.1-8b --dtype float32 --device cuda)  # bf16 rounding reaches the adapters' effect at 8B
  rm -f "$OUT/emb_model.txt"  # the embedded model unless EMB_MODEL=random says otherwise
  if [ "${EMB_MODEL:-embedded}" = random ]; then
    EMB=(--model.model_name smollm2-135m --model.tokenizer_name byte)
    echo "random weights with the embedded model's shapes (smollm2-135m), byte tokens" > "$OUT/emb_model.txt"
  fi
fi
Q_LIMIT=${Q_LIMIT:-$((8 * A))}; Q_VAL=${Q_VAL:-16}
[ -n "$CPU" ] && echo "tiny random LLaMA (CPU check)" > "$OUT/emb_model.txt"
[ -n "${VAL_MAX:-}" ] && EMB+=(--data.val_max_per_role "$VAL_MAX")
[ -n "${EMB_EXTRA:-}" ] && read -r -a _emb_extra <<< "$EMB_EXTRA" && EMB+=("${_emb_extra[@]}")  # e.g. "--model.model_dtype bfloat16"
DDP=()  # DDP_EXTRA: options of the embedded model's DDP phases only (e.g. the strategy's own settings)
[ -n "${DDP_EXTRA:-}" ] && read -r -a DDP <<< "$DDP_EXTRA"
if [ -z "${PHASES:-}" ]; then
  PHASES="emb1 emb1s"; for n in $SIZES; do PHASES+=" ddp$n"; done
  [ -z "$CPU" ] && [ -n "${LRAGENT_ACCURACY_GGUF:-}" ] && { PHASES+=" q1 q1s"; for n in $SIZES; do PHASES+=" qddp$n"; done; }
  PHASES+=" b1"; for n in $SIZES; do PHASES+=" fsdp$n fsdp${n}r ddp8b$n fx$n peft$n"; done
  PHASES+=" evwarm ev1"; for n in $SIZES; do PHASES+=" ev$n"; done
fi
DEADLINE=$((SECONDS + ${BUDGET_S:-100000}))  # a phase still running at the deadline is stopped (exit 124)

phase() {  # phase NAME command...: runs into $OUT/NAME.log, records wall seconds and status; later phases still run
  local name=$1
  shift
  local t0=$SECONDS rc=0 left=$((DEADLINE - SECONDS))
  if [ "$left" -le 10 ]; then echo "$name rc=skipped seconds=0" | tee -a "$OUT/timings.txt"; return 0; fi
  echo "== $name: $*" | tee ${APPEND:+-a} "$OUT/$name.log"  # a phase run again (APPEND=1: resumed) keeps its log
  timeout -k 10 "$left" "$@" >> "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/timings.txt"
  tail -n 5 "$OUT/$name.log"
  return 0
}

# Derived configs: no early stopping, time budget or progress bar; a FitSpeed and an ExportAdapters (last weights)
# per run; checkpoints every step for the FSDP runs; CSV logs under $RUN.
"$PY" - "$RUN" "$OUT" $SIZES <<'EOF2'
import os
import sys

import yaml

run, out, sizes = sys.argv[1], sys.argv[2], sys.argv[3:]
drop = ("EarlyStopping", "TimeBudget", "ProgressBar", "RunStatus", "ModelCheckpoint", "ExportAdapters")
# FITSPEED_SYNC=1: the timer before 2026-11-28 (a device sync each micro-batch); FITSPEED_SYNC_DEBUG=1: count syncs
FITSPEED_SWITCHES = {"sync_steps": os.environ.get("FITSPEED_SYNC") == "1",
                     "sync_debug": os.environ.get("FITSPEED_SYNC_DEBUG") == "1"}


def derive(base: str, name: str, ckpt_dir: str | None, warmup: int = 2) -> None:
    cfg = yaml.safe_load(open(base))
    tr = cfg["trainer"]
    tr["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                     "init_args": {"save_dir": f"{run}/{name}", "name": "csv", "version": 0}}]
    cbs = [cb for cb in tr["callbacks"] if not any(d in cb["class_path"] for d in drop)]
    cbs.append({"class_path": "eval_suite.bench.train.FitSpeed",
                "init_args": {"out": f"{out}/{name}_speed.json", "warmup": warmup, **FITSPEED_SWITCHES}})
    cbs.append({"class_path": "lit_modules.export.ExportAdapters",
                "init_args": {"out_dir": f"{out}/{name}_export", "best": False}})
    if ckpt_dir:
        cbs.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                    "init_args": {"dirpath": ckpt_dir, "save_last": True, "every_n_train_steps": 1, "monitor": None}})
    tr.update(callbacks=cbs, enable_progress_bar=False, enable_checkpointing=bool(ckpt_dir), default_root_dir=run,
              num_sanity_val_steps=0)  # the recipe's log_every_n_steps: logging syncs the host each time it logs
    open(f"{out}/{name}_config.yaml", "w").write(yaml.safe_dump(cfg, sort_keys=False))


seeds = [""] + [str(k) for k in range(2, 10)]  # emb1s / q1s: adapter seed 1; emb1sK / q1sK: seed K
repeats = [f"r{k}" for k in range(2, 10)]  # emb1rK / ddpNrK: the same fit again (pooled by the report)
for name in (["emb1"] + [f"emb1s{k}" for k in seeds] + [f"ddp{n}" for n in sizes] + [f"emb1{r}" for r in repeats]
             + [f"ddp{n}{r}" for n in sizes for r in repeats]):
    derive("configs/embedded_hotpotqa.yaml", name, None)
for name in ["q1"] + [f"q1s{k}" for k in seeds] + [f"qddp{n}" for n in sizes]:
    derive("configs/qwen_hotpotqa.yaml", name, None)
derive("configs/hotpotqa.yaml", "b1", None, warmup=1)  # few micro-batches: only the first is not timed
for n in sizes:
    derive("configs/hotpotqa.yaml", f"ddp8b{n}", None, warmup=1)
    for name in (f"fsdp{n}", f"fsdp{n}r"):
        derive("configs/hotpotqa.yaml", name, f"{run}/fsdp{n}/checkpoints", warmup=1)
EOF2

# Embedded model: one GPU with accumulation A (twice: adapter seeds 0 and 1) and DDP on N GPUs with accumulation
# A/N, $EMB_EPOCHS epochs (the same global batches and optimizer steps either way), validation on the whole held-out set
# after each epoch. On the CPU the epoch is cut to the first 4·A global batches (limit_train_batches counts a rank's).
E=(--trainer.max_epochs "$EMB_EPOCHS" --trainer.max_steps -1 --trainer.val_check_interval 1.0 "${EMB[@]}")
# The accuracy model: the same at $Q_LIMIT global batches, one epoch, $Q_VAL held-out examples per role.
Q=(--trainer.max_epochs 1 --trainer.max_steps -1 --trainer.val_check_interval 1.0 --trainer.use_distributed_sampler false
  --data.val_max_per_role "$Q_VAL")
# 8B shapes (random weights, byte tokens): one GPU (accumulate A) for the reference; FSDP on N GPUs (accumulate A/N:
# the same global batch) with a checkpoint each step, resumed; the export command on its checkpoint
B=(--config configs/fsdp_8b.yaml --trainer.limit_val_batches 0 --trainer.max_epochs -1 "${BIG[@]}")
# evaluation: one process, then N shard processes (one per GPU) merged, on each benchmark in turn
V=(--scheme base_lr_shared --limit "$EV_LIMIT" --runs "$EV_RUNS" --quiet true "${EV[@]}")
[ -n "${EV_MODEL:-}" ] && V+=(--model "$EV_MODEL")  # e.g. qwen2.5-coder-1.5b (then EV_ADAPTERS holds its sets)
[ -n "${EV_EXTRA:-}" ] && read -r -a _extra <<< "$EV_EXTRA" && V+=("${_extra[@]}")  # e.g. "--batch_invariant true"
[ -n "${EV_BATCH:-}" ] && V+=(--batch "$EV_BATCH")  # rows per process: several GPUs only help when the episodes
                                                     # outnumber one GPU's batch (else each shard waits as long)


ev_phase() {  # ev_phase NAME evN BENCHMARKS: one eval --devices N over the benchmarks (each shard process runs them in
  # turn, eval --benchmark a,b), into evN/<benchmark>; EV_SEPARATE=1: one eval per benchmark, one after the other
  phase "$1" bash -c 'py=$1 n=$2 out=$3 benchmarks=$4 ad=$5; shift 5
    if [ -z "${EV_SEPARATE:-}" ]; then
      set -- --benchmark "$(echo $benchmarks | tr " " ,)" "$@" ${ad:+--adapters "$ad/{benchmark}_sharedA"}
      [ "$(echo $benchmarks | wc -w)" -gt 1 ] && exec "$py" cli.py eval "$@" --devices "$n" --out "$out/ev$n"
      exec "$py" cli.py eval "$@" --devices "$n" --out "$out/ev$n/$benchmarks"
    fi
    for b in $benchmarks; do
      "$py" cli.py eval --benchmark "$b" "$@" ${ad:+--adapters "$ad/${b}_sharedA"} --devices "$n" --out "$out/ev$n/$b" || exit
    done' _ "$PY" "${2#ev}" "$OUT" "$3" "${EV_ADAPTERS:-}" "${V[@]}"
}

run_phase() {  # run_phase NAME: the command of one phase, in $PHASES order
  local n=${1##*[!0-9]} base=${1%%[0-9]*}
  case $1 in
    emb1 | emb1r[2-9]) phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${E[@]}" --trainer.accumulate_grad_batches "$A" \
            --trainer.limit_train_batches "$EMB_LIMIT1" ;;
    emb1s | emb1s[2-9]) phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${E[@]}" \
             --trainer.accumulate_grad_batches "$A" --trainer.limit_train_batches "$EMB_LIMIT1" --model.adapter_seed "$(seed_of "$1")" ;;
    ddp8b[0-9]*) n=${1#ddp8b}
        phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${B[@]}" --trainer.strategy ddp --trainer.devices "$n" \
          --trainer.accumulate_grad_batches $((A / n)) --trainer.max_steps "$B_STEPS1" ;;
    ddp[0-9]*) n=${1#ddp}; n=${n%r*}  # ddpN, or its repeat ddpNrK
        phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" --config configs/ddp.yaml "${E[@]}" \
            --trainer.devices "$n" --trainer.accumulate_grad_batches $((A / n)) \
            --trainer.limit_train_batches "$(per_rank "$EMB_LIMIT1" "$n")" "${DDP[@]}" ;;
    q1) phase q1 "$PY" cli.py fit --config "$OUT/q1_config.yaml" "${Q[@]}" --trainer.accumulate_grad_batches "$A" \
          --trainer.limit_train_batches "$Q_LIMIT" ;;
    q1s | q1s[2-9]) phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${Q[@]}" --trainer.accumulate_grad_batches "$A" \
           --trainer.limit_train_batches "$Q_LIMIT" --model.adapter_seed "$(seed_of "$1")" ;;
    qddp[0-9]*) phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" --config configs/ddp.yaml "${Q[@]}" \
            --trainer.devices "$n" --trainer.accumulate_grad_batches $((A / n)) \
            --trainer.limit_train_batches "$(per_rank "$Q_LIMIT" "$n")" ;;
    b1) phase b1 "$PY" cli.py fit --config "$OUT/b1_config.yaml" "${B[@]}" --trainer.devices 1 --trainer.strategy auto \
          --trainer.accumulate_grad_batches "$A" --trainer.max_steps "$B_STEPS1" ;;
    fsdp[0-9]*r) n=${1%r}; n=${n#fsdp}
        phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${B[@]}" --trainer.devices "$n" \
          --trainer.accumulate_grad_batches $((A / n)) --trainer.max_steps "$B_STEPS2" --ckpt_path last ;;
    fsdp[0-9]*) phase "$1" "$PY" cli.py fit --config "$OUT/$1_config.yaml" "${B[@]}" --trainer.devices "$n" \
          --trainer.accumulate_grad_batches $((A / n)) --trainer.max_steps "$B_STEPS1" ;;
    fx[0-9]*) phase "$1" "$PY" cli.py export --ckpt "$RUN/fsdp$n/checkpoints/last.ckpt" --out "$OUT/$1_export" \
          --device "$EXPORT_DEVICE" ;;
    peft[0-9]*) phase "$1" "$PY" -m eval_suite.diagnostics.peft_check --export "$OUT/fsdp${n}r_export" "${PEFT[@]}" \
          --out "$OUT/$1.json" ;;
    evwarm) phase evwarm bash -c 'py=$1 out=$2 benchmarks=$3 ad=$4; shift 4
        "$py" cli.py eval --benchmark "$(echo $benchmarks | tr " " ,)" "$@" ${ad:+--adapters "$ad/{benchmark}_sharedA"} \
          --limit 2 --runs 1 --devices 1 --out "$out/evwarm/{benchmark}"' _ "$PY" "$OUT" "$EV_BENCHMARKS" \
          "${EV_ADAPTERS:-}" "${V[@]}" ;;
    ev[0-9]*-*) ev_phase "$1" "${1%%-*}" "${1#*-}" ;;  # evN-<benchmark>: that benchmark alone (one call each)
    ev[0-9]*) ev_phase "$1" "$1" "$EV_BENCHMARKS" ;;
    *) echo "unknown phase $1 (base $base): allowed emb1 emb1s[K] emb1rK ddpN ddpNrK q1 q1s[K] qddpN b1 fsdpN fsdpNr ddp8bN fxN peftN evwarm ev1 evN evN-<benchmark>" >&2
       exit 2 ;;
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

for r in emb1 emb1s emb1s{2..9} emb1r{2..9} q1 q1s q1s{2..9} $(for n in $SIZES; do echo "ddp$n qddp$n ddp${n}r"{2..9}; done); do
  cp "$RUN/$r/csv/version_0/metrics.csv" "$OUT/${r}_metrics.csv" 2>/dev/null || true
done
"$PY" -m eval_suite.bench.multi_gpu_report --out "$OUT" --sizes "$SIZES" \
  --command "OUT=$OUT LRAGENT_MULTI_CPU=$CPU EMB_MODEL=${EMB_MODEL:-embedded} SIZES='$SIZES' PHASES='$PHASES'\
${EMB_EXTRA:+ EMB_EXTRA='$EMB_EXTRA'}${DDP_EXTRA:+ DDP_EXTRA='$DDP_EXTRA'}${FITSPEED_SYNC:+ FITSPEED_SYNC=$FITSPEED_SYNC}\
${FITSPEED_SYNC_DEBUG:+ FITSPEED_SYNC_DEBUG=$FITSPEED_SYNC_DEBUG}${OMP_NUM_THREADS:+ OMP_NUM_THREADS=$OMP_NUM_THREADS}\
${LRAGENT_LIGHTNING_SIGTERM:+ LRAGENT_LIGHTNING_SIGTERM=$LRAGENT_LIGHTNING_SIGTERM} bash scripts/gpu_multi.sh" \
  2>&1 | tee "$OUT/report.log"
cat "$OUT/timings.txt"

#!/usr/bin/env bash
# The benchmarks on the device machine, one driver: each run writes its report with provenance under $OUT/<bench>/.
#
#   bash scripts/gpu_bench.sh decode [options]   python cli.py bench decode (ms/token vs the floor and transformers)
#   bash scripts/gpu_bench.sh trace  [options]   python cli.py bench trace  (the paper's 17-step trace per scheme)
#   bash scripts/gpu_bench.sh kernel [options]   python cli.py bench kernel (fused vs SDPA vs naive expansion)
#   bash scripts/gpu_bench.sh train  [options]   python cli.py bench train  (training steps vs transformers + peft)
#   bash scripts/gpu_bench.sh gemv   [options]   python -m eval_suite.bench.fused_gemv (the fused GEMVs' launches vs
#                                                unfused + cuBLAS, against the weights' floor)
#   bash scripts/gpu_bench.sh profile [options]  python -m eval_suite.bench.profile_decode (where a decode step's time goes;
#                                                the engine switches as set in the environment, e.g. LRAGENT_FUSED_GEMV=0)
#   bash scripts/gpu_bench.sh readme             the README's speed table on this GPU, one commit: 8B decode at
#                                                2k, batch 1 and 32, with transformers, twice (decode1, decode2; each
#                                                with the plans $DECODE_PLANS, default "", "qkv_rope=0",
#                                                "qkv_maxnreg=0" and "pdl=0", two turns; the table takes ""), the
#                                                trace at 16k (non_shared, full_shared, base_lr_shared) and at 32k
#                                                ($TRACE32_SCHEMES,
#                                                default full_shared,base_lr_shared: non_shared's cache outgrows an H100),
#                                                then python -m eval_suite.bench.speed_table over them
#                                                ($OUT/readme/speed_table.md; the whole folder also in
#                                                $OUT/readme.tar.gz, packed after each phase: a device call brings
#                                                back no file two folders deep). $README_PHASES runs some of the
#                                                phases (default "decode1 decode2 trace16k trace32k table"): the
#                                                whole took 7 and 13 minutes on two H200s, up to more than one
#                                                device command, so split it over calls with one $OUT kept in /tmp
#   bash scripts/gpu_bench.sh eval NAME [options]  python cli.py bench eval (episodes per GPU-second of eval jobs, the
#                                                GPU's busy share) into /tmp/bench_eval/NAME, packed as
#                                                $OUT/NAME.tar.gz (the accuracy model converted first, if carried);
#                                                the jobs run as the study runs them (OMP_NUM_THREADS=1)
#   bash scripts/gpu_bench.sh pair NAME [R] [N] [SCHEMES]  the served / in-process pair on HotpotQA AutoAct episodes:
#                                                per scheme (default base_lr_shared,non_shared) bench serve with R
#                                                clients and rows (default 64) over N sessions (default 256), the
#                                                server a process of its own, then per scheme eval --batch R --limit N
#                                                --runs 1 --launch_ahead true on the same questions; the accuracy model
#                                                and its shipped HotpotQA set ($PAIR_MODEL, $PAIR_ADAPTERS); every
#                                                record in $OUT/NAME.tar.gz, packed after each phase (a call returns few
#                                                files, and one cut short keeps what finished). The servers inherit
#                                                LRAGENT_SERVE_PROFILE and LRAGENT_SWITCH_INTERVAL_MS
#   bash scripts/gpu_bench.sh fit8b              the paper-settings fit on 8B shapes (random weights, checkpointing,
#                                                accumulation 2): FIT_STEPS1 steps, resumed with --ckpt_path last to
#                                                FIT_STEPS2, exported (one PEFT directory per role)
#
# Options go to the bench command unchanged (`python cli.py bench NAME --help`); e.g.
#   bash scripts/gpu_bench.sh decode --model llama-3.1-8b --context 2048 --batches "[1,32]"
#   bash scripts/gpu_bench.sh trace --model qwen2.5-coder-1.5b --contexts "[16384]"
# The carried models are joined first (scripts/device_model.sh): --model default / qwen2.5-coder-1.5b then load.
# Every phase's wall time and exit status go to $OUT/timings.txt; nvidia-smi to $OUT/nvidia-smi.txt.
# Here, without a GPU, `bash scripts/gpu_bench.sh --help` prints this header.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  decode | trace | kernel | train | fit8b | gemv | profile | readme | eval | pair) BENCH=$1; shift ;;
  -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;;
  *) echo "error: bench ${1:-nothing}: allowed decode, trace, kernel, train, fit8b, gemv, profile, readme, eval, pair (--help)" >&2
    exit 2 ;;
esac
[ -f scripts/device_model.sh ] && source scripts/device_model.sh > /dev/null
OUT=${OUT:-bench_out}
PY=${PYTHON:-python3}
mkdir -p "$OUT/$BENCH"
(nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1) || true
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

phase() {  # phase NAME command...: runs, logs to $OUT/NAME.log, records wall seconds and status; later phases still run
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/timings.txt"
  tail -n 25 "$OUT/$name.log"
}

case "$BENCH" in
  gemv) phase gemv "$PY" -m eval_suite.bench.fused_gemv "$@" --out "$OUT/gemv"; exit 0 ;;
  profile) phase profile "$PY" -m eval_suite.bench.profile_decode "$@" --out "$OUT/profile"; exit 0 ;;
  eval)
    NAME=${1:?eval needs a NAME}; shift
    [ -n "${LRAGENT_ACCURACY_GGUF:-}" ] && "$PY" -m lragent.accuracy_model 2>&1 | grep -v "it/s\]" | tail -1
    mkdir -p /tmp/bench_eval
    OMP_NUM_THREADS=1 phase "$NAME" "$PY" cli.py bench eval "$@" --out "/tmp/bench_eval/$NAME"
    tar czf "$OUT/$NAME.tar.gz" -C /tmp/bench_eval "$NAME"
    exit 0 ;;
  pair)
    NAME=${1:?pair needs a NAME}; R=${2:-64}; N=${3:-256}; SCHEMES=${4:-base_lr_shared,non_shared}
    [ -n "${LRAGENT_ACCURACY_GGUF:-}" ] && "$PY" -m lragent.accuracy_model 2>&1 | grep -v "it/s\]" | tail -1
    A=(--model "${PAIR_MODEL:-qwen2.5-coder-1.5b}" --adapters "${PAIR_ADAPTERS:-data/adapters/qwen_hotpotqa_sharedA}"
      --dtype bfloat16)
    mkdir -p "/tmp/bench_pair/$NAME"
    pack() { tar czf "$OUT/$NAME.tar.gz" -C /tmp/bench_pair "$NAME"; }
    for S in ${SCHEMES//,/ }; do
      OMP_NUM_THREADS=1 phase "serve${R}_$S" "$PY" cli.py bench serve "${A[@]}" --workload autoact --benchmark hotpotqa \
        --schemes "$S" --clients "$R" --sessions "$N" --max_rows "$R" --stream false \
        --out "/tmp/bench_pair/$NAME/serve${R}_$S"
      pack
    done
    for S in ${SCHEMES//,/ }; do
      OMP_NUM_THREADS=1 phase "eval${R}_$S" "$PY" cli.py eval "${A[@]}" --benchmark hotpotqa --scheme "$S" \
        --split dev,test --limit "$N" --batch "$R" --runs 1 --launch_ahead true --quiet true \
        --out "/tmp/bench_pair/$NAME/eval${R}_$S"
      pack
    done
    exit 0 ;;
  fit8b) ;;
  readme)
    D=(--model llama-3.1-8b --context 2048 --batches "[1,32]" --eager false --repeats 2
      --plans "${DECODE_PLANS:-[\"\", \"qkv_rope=0\", \"qkv_maxnreg=0\", \"pdl=0\"]}")
    # the records lie two folders deep, which a device call does not bring back: packed into one file after each
    # phase (a call cut short keeps what finished)
    pack() {
      tar czf "$OUT/readme.tar.gz.part" -C "$OUT" readme timings.txt && mv "$OUT/readme.tar.gz.part" "$OUT/readme.tar.gz"
    }
    for p in ${README_PHASES:-decode1 decode2 trace16k trace32k table}; do
      case "$p" in
        decode1 | decode2) phase "$p" "$PY" cli.py bench decode "${D[@]}" --out "$OUT/readme/$p" ;;
        # the table needs no kernel-off rows (Figure 4's): without them the call fits one 10-minute device command
        trace16k) phase trace16k "$PY" cli.py bench trace --model llama-3.1-8b --contexts "[16384]" --kernel_off false \
          --schemes non_shared,full_shared,base_lr_shared --out "$OUT/readme/trace16k" ;;
        trace32k) phase trace32k "$PY" cli.py bench trace --model llama-3.1-8b --contexts "[32768]" --kernel_off false \
          --schemes "${TRACE32_SCHEMES:-full_shared,base_lr_shared}" --out "$OUT/readme/trace32k" ;;
        table) phase table "$PY" -m eval_suite.bench.speed_table "$OUT/readme" --out "$OUT/readme/speed_table.md" ;;
        *) echo "error: README_PHASES names $p: allowed decode1 decode2 trace16k trace32k table" >&2; exit 2 ;;
      esac
      pack
    done
    exit 0 ;;
  *) phase "$BENCH" "$PY" cli.py bench "$BENCH" "$@" --out "$OUT/$BENCH"; exit 0 ;;
esac

# fit8b: configs/hotpotqa.yaml (the paper's settings) on LLaMA-3.1-8B shapes, byte tokens, with a FitSpeed callback
RUN=${RUN:-runs/gpu_fit_8b}  # checkpoints stay out of $OUT (their size)
"$PY" - "$RUN" "$OUT/$BENCH" <<'EOF'
import sys

import yaml

run, out = sys.argv[1], sys.argv[2]
cfg = yaml.safe_load(open("configs/hotpotqa.yaml").read().replace("runs/hotpotqa", run))
cfg["trainer"]["logger"] = [lg for lg in cfg["trainer"]["logger"] if "TensorBoard" not in lg["class_path"]]
cfg["trainer"]["callbacks"] = [cb for cb in cfg["trainer"]["callbacks"] if "ProgressBar" not in cb["class_path"]]
cfg["trainer"]["enable_progress_bar"] = False
for i in (1, 2):
    speed = {"class_path": "eval_suite.bench.train.FitSpeed", "init_args": {"out": f"{out}/fit{i}_speed.json"}}
    cfg_i = {**cfg, "trainer": {**cfg["trainer"], "callbacks": [*cfg["trainer"]["callbacks"], speed]}}
    open(f"{out}/fit{i}_config.yaml", "w").write(yaml.safe_dump(cfg_i, sort_keys=False))
EOF
FIT=(--model.model_name "${MODEL:-llama-3.1-8b}" --model.tokenizer_name byte --model.model_dtype bfloat16
  --model.gradient_checkpointing true --trainer.accumulate_grad_batches 2 --trainer.val_check_interval 6
  --trainer.limit_val_batches 4 --trainer.log_every_n_steps 1)
phase fit1 "$PY" cli.py fit --config "$OUT/$BENCH/fit1_config.yaml" "${FIT[@]}" --trainer.max_steps "${FIT_STEPS1:-3}"
phase fit2 "$PY" cli.py fit --config "$OUT/$BENCH/fit2_config.yaml" "${FIT[@]}" --trainer.max_steps "${FIT_STEPS2:-6}" \
  --ckpt_path last
phase export "$PY" cli.py export --ckpt "$RUN/checkpoints/last.ckpt" --out "$OUT/$BENCH/export"
cp -r "$RUN/csv" "$OUT/$BENCH/fit_csv" 2>/dev/null || true
cat "$OUT/timings.txt"

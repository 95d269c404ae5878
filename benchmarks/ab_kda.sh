#!/usr/bin/env bash
# A/B of KDA kernel versions kept on git branches, in one device call.
#   here:           bash benchmarks/ab_kda.sh prepare BRANCH...   # writes alt/BRANCH.py (untracked: travels)
#   on the device:  bash benchmarks/ab_kda.sh run [SIZES]         # default SIZES 4x8192,1x32768
# `run` times ours and every alt/*.py in its own process (a kernel that faults does not end the run), each
# first checked against float64 (bench_kda.py's check), and prints one line per version and shape.
set -uo pipefail
cmd=${1:?prepare or run}
shift
if [ "$cmd" = prepare ]; then
  mkdir -p alt
  for b in "$@"; do git show "$b:src/kdamoe/model/kda_triton.py" > "alt/$b.py" && echo "alt/$b.py"; done
  exit 0
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
sizes=${1:-4x8192,1x32768}
cd benchmarks
timeout 120 python3 bench_kda.py --impls ours-bounded --sizes "$sizes" --no-million --out "$OUT/ab_ours.json" 2>&1 \
  | grep -E "rel err|ms$|Error" | cut -c1-160
for f in ../alt/*.py; do
  name=$(basename "$f" .py)
  timeout 120 python3 bench_kda.py --impls "$name-bounded" --alt "$name=$f" --sizes "$sizes" --no-million \
    --out "$OUT/ab_$name.json" 2>&1 | grep -E "rel err|ms$|Error" | cut -c1-160
done

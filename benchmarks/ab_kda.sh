#!/usr/bin/env bash
# A/B of KDA kernel versions kept on git branches, in one device call.
#   here:           bash benchmarks/ab_kda.sh prepare BRANCH...   # writes alt/BRANCH.py (untracked: travels)
#   on the device:  bash benchmarks/ab_kda.sh run [SIZES]         # default SIZES 4x8192,1x32768
#                   bash benchmarks/ab_kda.sh pick BRANCH         # after `run`, in the same call
# `run` times ours and every alt/*.py in its own process (a kernel that faults does not end the run), each
# first checked against float64 (bench_kda.py's check), and prints one line per version and shape. `pick` copies
# alt/BRANCH.py over the kernels (in the device's copy of the tree) when its forward+backward beat ours by at least
# 1 % at every size and its errors are within issue 4's bounds (o < 5e-3, gradients < 1e-2); it exits 1
# otherwise. So one call can test and benchmark the winner: `pick B && compute-sanitizer ...; gpu_suite.sh`.
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
if [ "$cmd" = pick ]; then
  name=${1:?pick BRANCH}
  python3 - "$OUT/ab_ours.json" "$OUT/ab_$name.json" <<'PY' || exit 1
import json, sys
ours, alt = (json.load(open(p)) for p in sys.argv[1:])
ok = True
for key, row in ours["times"].items():
    if "fwd+bwd" in key:
        o, a = next(iter(row.values())), next(iter(alt["times"][key].values()))
        print(f"{key}: ours {o:.3f} ms, alt {a:.3f} ms ({o / a:.3f}x)")
        ok &= a < 0.99 * o
err = next(iter(alt["errors"].values()))
ok &= err["o"] < 5e-3 and max(err.values()) < 1e-2
print("errors", {n: f"{x:.1e}" for n, x in err.items()}, "->", "pick" if ok else "keep ours")
sys.exit(0 if ok else 1)
PY
  cp "alt/$name.py" src/kdamoe/model/kda_triton.py
  exit 0
fi
sizes=${1:-4x8192,1x32768}
cd benchmarks
timeout 120 python3 bench_kda.py --impls ours-bounded --sizes "$sizes" --no-million --out "$OUT/ab_ours.json" 2>&1 \
  | grep -E "rel err|ms$|Error" | cut -c1-160
for f in ../alt/*.py; do
  name=$(basename "$f" .py)
  timeout 120 python3 bench_kda.py --impls "$name-bounded" --alt "$name=$f" --sizes "$sizes" --no-million \
    --out "$OUT/ab_$name.json" 2>&1 | grep -E "rel err|ms$|Error" | cut -c1-160
done

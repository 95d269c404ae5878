#!/usr/bin/env bash
# A/B of KDA kernel versions kept on git branches, in one device command.
#   here:           bash tools/ab_kda.sh prepare BRANCH...   # alt/BRANCH/: its model folder (untracked: travels)
#   on the device:  bash tools/ab_kda.sh run [SIZES]         # default SIZES 4x8192,1x32768
#                   bash tools/ab_kda.sh pick BRANCH...      # after `run`, in the same command
# `run` times ours and every alt/*/ (each a copy of src/kdamoe/model, imported as a package of its own) in its own
# process (a kernel that faults does not end the run), each first checked against float64 (bench_kda.py's check),
# and prints one line per version and shape. `pick` takes, of the named branches whose forward+backward beat ours by
# at least 1 % at every size and whose errors are within the bounds (o < 5e-3, gradients < 1e-2), the one with the
# least total forward+backward time, and puts alt/BRANCH/ in place of src/kdamoe/model (in the device's copy of the
# tree); it exits 1 when none qualifies. So one command can test and benchmark the winner:
# `pick A B && compute-sanitizer ...; gpu_suite.sh`.
set -uo pipefail
cmd=${1:?prepare, run or pick}
shift
alt_dir() { echo "alt/${1//\//_}"; }  # a branch name with slashes as one folder name
if [ "$cmd" = prepare ]; then
  for b in "$@"; do
    d=$(alt_dir "$b")
    rm -rf "$d" && mkdir -p "$d" && git archive "$b" src/kdamoe/model | tar -x -C "$d" --strip-components=3 \
      && echo "$d"
  done
  exit 0
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
if [ "$cmd" = pick ]; then
  [ $# -ge 1 ] || { echo "pick BRANCH..."; exit 2; }
  names=()
  for b in "$@"; do names+=("$(basename "$(alt_dir "$b")")"); done
  name=$(python3 - "$OUT" "${names[@]}" <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
ours = json.load(open(os.path.join(out, "ab_ours.json")))
best = None
for name in names:
    path = os.path.join(out, f"ab_{name}.json")
    if not os.path.exists(path):
        print(f"{name}: no result (it failed or timed out)", file=sys.stderr)
        continue
    alt, ok, total = json.load(open(path)), True, 0.0
    for key, row in ours["times"].items():
        if "fwd+bwd" in key:
            o, a = next(iter(row.values())), next(iter(alt["times"].get(key, {"-": float("inf")}).values()))
            print(f"{name} {key}: ours {o:.3f} ms, alt {a:.3f} ms ({o / a:.3f}x)", file=sys.stderr)
            ok &= a < 0.99 * o
            total += a
    err = next(iter(alt["errors"].values()))
    ok &= err["o"] < 5e-3 and max(err.values()) < 1e-2
    print(f"{name} errors", {n: f"{x:.1e}" for n, x in err.items()}, "->", "candidate" if ok else "no", file=sys.stderr)
    if ok and (best is None or total < best[0]):
        best = (total, name)
print(best[1] if best else "")
PY
)
  [ -n "$name" ] || { echo "pick: keep ours"; exit 1; }
  echo "pick: $name"
  rm -rf src/kdamoe/model && cp -r "alt/$name" src/kdamoe/model
  exit 0
fi
sizes=${1:-4x8192,1x32768}
cd benchmarks
timeout 120 python3 bench_kda.py --impls ours-bounded --sizes "$sizes" --no-million --out "$OUT/ab_ours.json" 2>&1 \
  | grep -E "rel err|ms$|GiB kept|Error" | cut -c1-160
for d in ../alt/*/; do
  name=$(basename "$d")
  timeout 120 python3 bench_kda.py --impls "$name-bounded" --alt "$name=$d" --sizes "$sizes" --no-million \
    --out "$OUT/ab_$name.json" 2>&1 | grep -E "rel err|ms$|GiB kept|Error" | cut -c1-160
done

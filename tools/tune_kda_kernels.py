"""Launch settings of the KDA Triton kernels (num_warps, num_stages, maxnreg), each kernel timed on its own.

A round sets every kernel of ``kda_launch.LAUNCH`` to one candidate (on top of the current setting) and the
column-slice widths ``kda_launch.SLICE`` to one of ``--slices`` (a JSON list of overrides; the rounds are all
pairs), and runs one bf16 forward+backward (H=16, head dim 128, bounded fused gate) under torch.profiler: each
kernel's mean time over ``--iters`` runs, per size. Round 0 is the current table. The rounds compile first in
parallel worker processes (triton's disk cache), then run one after another here. Every round's outputs and
gradients are compared with round 0's (a launch setting must not change results beyond rounding order). Prints one
table per kernel, the fastest setting marked; then, per slice set, the whole forward+backward (``do_bench``) with
every kernel at its fastest setting against the current table — a kernel's best setting can lose in the whole
sequence (two picks, each faster on its own, can make the forward+backward slower), so every pick goes through
`tools/ab_kda.sh` too. Writes JSON.

    PYTHONPATH=src python tools/tune_kda_kernels.py [--sizes 4x8192,1x32768] \
        [--slices '[{}, {"wu_k": 32, "wu_v": 32}]'] [--candidates '[{}, {"num_warps": 1}]']
"""

import argparse
import json
import multiprocessing as mp
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_kda  # noqa: E402
from kdamoe.model import kda_launch  # noqa: E402

# candidates, each on top of the current setting
CANDIDATES = [
    {},
    dict(num_warps=4),
    dict(num_warps=8),
    dict(num_warps=4, num_stages=2),
    dict(num_warps=8, num_stages=2),
    dict(num_warps=4, num_stages=1),
    dict(num_warps=8, num_stages=1),
    dict(num_warps=8, maxnreg=128),
    dict(num_warps=4, maxnreg=128),
    dict(num_warps=2),
    dict(num_warps=4, num_stages=3),  # fla-core's recompute_w_u / reverse loop setting on the H200
    dict(num_warps=2, num_stages=3),
    dict(num_warps=1),  # fla-core's intra and solve kernels run one warp per program
]  # 16 warps: illegal memory access in triton 3.6 (H200)
SKIP = {"recurrent"}  # decode only
NO_STAGES = {"fwd_state"}  # its num_stages is set by the launch
CURRENT = {name: dict(cfg) for name, cfg in kda_launch.LAUNCH.items()}
CURRENT_SLICE = dict(kda_launch.SLICE)


def round_config(cand):
    base = {name: dict(cfg) for name, cfg in CURRENT.items()}
    for name, cfg in base.items():
        if name not in SKIP:
            cfg.update({k: v for k, v in cand.items() if not (k == "num_stages" and name in NO_STAGES)})
    return base


def set_round(rnd):
    """rnd = (launch candidate, slice overrides)"""
    cand, slices = rnd
    kda_launch.LAUNCH.clear()
    kda_launch.LAUNCH.update(round_config(cand))
    kda_launch.SLICE.clear()
    kda_launch.SLICE.update(CURRENT_SLICE, **slices)


def inputs(size):
    B, T = map(int, size.split("x"))
    x = bench_kda.make(B, T)
    for n in bench_kda.LEAVES:
        x[n].requires_grad_()
    do = torch.randn_like(x["v"])
    return x, do


def fwdbwd(x, do):
    for n in bench_kda.LEAVES:
        x[n].grad = None
    o = bench_kda.run_ours(x, "bounded")
    o.backward(do)
    return [o.detach()] + [x[n].grad for n in bench_kda.LEAVES]


def compile_round(args):
    r, rnd, sizes = args
    set_round(rnd)
    try:
        for size in sizes:
            fwdbwd(*inputs(size))
        torch.cuda.synchronize()
        return r, None
    except Exception as err:  # noqa: BLE001 (reported per round)
        return r, f"{type(err).__name__}: {str(err)[:200]}"


def rel_diff(out, ref):
    """Largest relative difference of the outputs and gradients of one run from another's."""
    return max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))


def kernel_times(x, do, iters):
    fwdbwd(x, do)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fwdbwd(x, do)
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.key.endswith("_kernel"):
            name = e.key[1:-len("_kernel")]
            if name in kda_launch.LAUNCH:
                times[name] = e.device_time_total / 1e3 / iters
    return times


def combined_launch(rounds, times, slice_set):
    """LAUNCH with every kernel at its fastest candidate among the rounds of ``slice_set``; ``times[r]`` maps
    kernel name -> ms for round r (rounds that failed are missing). A kernel launched under several LAUNCH entries
    (``bwd_state``, ``bwd_state_few``, ``bwd_state_lp``; ``fwd_state``, ``fwd_state_o``) ran under one of them at
    the size timed, so the pick goes to all of them."""
    launch = {name: dict(cfg) for name, cfg in CURRENT.items()}
    for kernel in {name for t in times.values() for name in t}:
        rows = [(times[r][kernel], r) for r, (_, sl) in enumerate(rounds)
                if sl == slice_set and r in times and kernel in times[r]]
        picked = round_config(rounds[min(rows)[1]][0]) if rows else {}
        for name in launch:
            if (name == kernel or name.startswith(kernel + "_")) and name not in SKIP and rows:
                launch[name] = picked[name]
    return launch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4x8192,1x32768")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--slices", default="[{}]", help="JSON list of SLICE overrides")
    ap.add_argument("--candidates", help="JSON list of launch candidates in place of CANDIDATES ({} first)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tune_kda.json"))
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    slices = json.loads(args.slices)
    unknown = {k for sl in slices for k in sl} - set(CURRENT_SLICE)
    if unknown:
        ap.error(f"--slices: unknown keys {sorted(unknown)} (kda_launch.SLICE has {sorted(CURRENT_SLICE)})")
    candidates = CANDIDATES if args.candidates is None else json.loads(args.candidates)
    if candidates[:1] != [{}]:
        ap.error("--candidates: the first must be {} (the current table, round 0)")
    rounds = [(c, sl) for sl in slices for c in candidates]
    labels = [f"{c or 'current'} {sl or ''}".strip() for c, sl in rounds]
    with mp.get_context("spawn").Pool(min(args.jobs, len(rounds))) as pool:
        errors = dict(pool.map(compile_round, [(r, rnd, sizes) for r, rnd in enumerate(rounds)]))
    res = {"candidates": candidates, "current": CURRENT, "current_slice": CURRENT_SLICE, "rounds_labels": labels,
           "rounds": {}}
    for size in sizes:
        x, do = inputs(size)
        set_round(rounds[0])
        ref = fwdbwd(x, do)
        for r, rnd in enumerate(rounds):
            if errors[r]:
                print(f"round {r} {labels[r]}: {errors[r]}")
                continue
            set_round(rnd)
            diff = rel_diff(fwdbwd(x, do), ref)
            res["rounds"][f"{size} {r}"] = dict(times=kernel_times(x, do, args.iters), diff_vs_round0=diff)
        for name in kda_launch.LAUNCH:
            if name in SKIP:
                continue
            rows = [(r, res["rounds"][f"{size} {r}"]["times"].get(name)) for r in range(len(rounds))
                    if f"{size} {r}" in res["rounds"]]
            rows = [(r, t) for r, t in rows if t is not None]
            if not rows:
                continue
            best = min(rows, key=lambda rt: rt[1])[0]
            print(f"\n{size} {name}")
            for r, t in rows:
                d = res["rounds"][f"{size} {r}"]["diff_vs_round0"]
                print(f"  {'*' if r == best else ' '} {t:8.3f} ms  diff {d:.1e}  {labels[r]}")
        # the picks together, in the whole forward+backward
        times = {r: res["rounds"][f"{size} {r}"]["times"] for r in range(len(rounds)) if f"{size} {r}" in res["rounds"]}
        set_round(rounds[0])
        whole = {"current": do_bench(lambda: fwdbwd(x, do), warmup=25, rep=200, return_mode="median")}
        print(f"\n{size} whole forward+backward: current {whole['current']:.3f} ms")
        for sl in slices:
            kda_launch.LAUNCH.clear()
            kda_launch.LAUNCH.update(combined_launch(rounds, times, sl))
            kda_launch.SLICE.clear()
            kda_launch.SLICE.update(CURRENT_SLICE, **sl)
            diff = rel_diff(fwdbwd(x, do), ref)
            ms = do_bench(lambda: fwdbwd(x, do), warmup=25, rep=200, return_mode="median")
            whole[f"picks {sl or ''}".strip()] = ms
            print(f"  every kernel at its fastest {sl or ''}: {ms:.3f} ms ({whole['current'] / ms:.3f}x)  diff {diff:.1e}")
        res.setdefault("whole_fwd_bwd_ms", {})[size] = whole
    set_round(rounds[0])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

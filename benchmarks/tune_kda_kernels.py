"""Launch settings of the KDA Triton kernels (num_warps, num_stages, maxnreg), each kernel timed on its own.

Round r sets every kernel of ``kda_triton.LAUNCH`` to its r-th candidate (on top of the current setting) and
runs one bf16 forward+backward (H=16, head dim 128, bounded fused gate) under torch.profiler: each kernel's mean
time over ``--iters`` runs, per size. Round 0 is the current table. The rounds compile first in parallel worker
processes (triton's disk cache), then run one after another here. Every round's outputs and gradients are
compared with round 0's (a launch setting must not change results beyond rounding order). Prints one table per
kernel, the fastest setting marked, and writes JSON.

    PYTHONPATH=src python benchmarks/tune_kda_kernels.py [--sizes 4x8192,1x32768]
"""

import argparse
import json
import multiprocessing as mp
import os

import torch

import bench_kda
from kdamoe.model import kda_triton

# candidates, each on top of the current setting
CANDIDATES = [
    {},
    dict(num_warps=4),
    dict(num_warps=8),
    dict(num_warps=4, num_stages=2),
    dict(num_warps=8, num_stages=2),
    dict(num_warps=8, maxnreg=128),
    dict(num_warps=4, maxnreg=128),
    dict(num_warps=2),
]  # 16 warps: illegal memory access in triton 3.6 (H200)
SKIP = {"recurrent"}  # decode only
NO_STAGES = {"fwd_state"}  # its num_stages is set by the launch
CURRENT = {name: dict(cfg) for name, cfg in kda_triton.LAUNCH.items()}


def round_config(r):
    base = {name: dict(cfg) for name, cfg in CURRENT.items()}
    for name, cfg in base.items():
        if name not in SKIP:
            cfg.update({k: v for k, v in CANDIDATES[r].items() if not (k == "num_stages" and name in NO_STAGES)})
    return base


def set_round(r):
    kda_triton.LAUNCH.clear()
    kda_triton.LAUNCH.update(round_config(r))


def inputs(size):
    B, T = map(int, size.split("x"))
    x = bench_kda.make(B, T)
    for n in ("q", "k", "v", "g", "beta"):
        x[n].requires_grad_()
    do = torch.randn_like(x["v"])
    return x, do


def fwdbwd(x, do):
    for n in ("q", "k", "v", "g", "beta"):
        x[n].grad = None
    o = bench_kda.run_ours(x, "bounded")
    o.backward(do)
    return [o.detach()] + [x[n].grad for n in ("q", "k", "v", "g", "beta")]


def compile_round(args):
    r, sizes = args
    set_round(r)
    try:
        for size in sizes:
            fwdbwd(*inputs(size))
        torch.cuda.synchronize()
        return r, None
    except Exception as err:  # noqa: BLE001 (reported per round)
        return r, f"{type(err).__name__}: {str(err)[:200]}"


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
            if name in kda_triton.LAUNCH:
                times[name] = e.device_time_total / 1e3 / iters
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4x8192,1x32768")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=len(CANDIDATES))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tune_kda.json"))
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        errors = dict(pool.map(compile_round, [(r, sizes) for r in range(len(CANDIDATES))]))
    res = {"candidates": CANDIDATES, "current": CURRENT, "rounds": {}}
    for size in sizes:
        x, do = inputs(size)
        set_round(0)
        ref = fwdbwd(x, do)
        for r in range(len(CANDIDATES)):
            if errors[r]:
                print(f"round {r} {CANDIDATES[r]}: {errors[r]}")
                continue
            set_round(r)
            out = fwdbwd(x, do)
            diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(out, ref))
            res["rounds"][f"{size} {r}"] = dict(times=kernel_times(x, do, args.iters), diff_vs_round0=diff)
        for name in kda_triton.LAUNCH:
            if name in SKIP:
                continue
            rows = [(r, res["rounds"][f"{size} {r}"]["times"].get(name)) for r in range(len(CANDIDATES))
                    if f"{size} {r}" in res["rounds"]]
            rows = [(r, t) for r, t in rows if t is not None]
            if not rows:
                continue
            best = min(rows, key=lambda rt: rt[1])[0]
            print(f"\n{size} {name}")
            for r, t in rows:
                d = res["rounds"][f"{size} {r}"]["diff_vs_round0"]
                print(f"  {'*' if r == best else ' '} {t:8.3f} ms  diff {d:.1e}  {CANDIDATES[r] or 'current'}")
    set_round(0)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

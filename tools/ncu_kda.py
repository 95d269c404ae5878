"""Two forward+backward passes of ours and of fla-core (bounded gate, bf16, H=16, D=128) for Nsight Compute: where
a kernel's cycles go (stall reasons, shared memory, occupancy), which `do_bench` cannot say. On the device, with
fla-core's tuned configs unpacked (`tar xzf .gpu/fla_autotune.tgz -C ~/.triton/cache`: no autotuning under ncu):

    ncu -k regex:"bwd_state_kernel|dhu_blockdim64|_fwd_state_kernel|fwd_kernel_h" -c 8 --section SpeedOfLight \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 tools/ncu_kda.py [--size 4x8192] > $OUT/ncu.txt

(the chunk loops of both; the second pass of each is the one to read, the first compiles).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_kda import LEAVES, fwd_bwd, make, run_fla, run_ours  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="4x8192", help="BxT")
B, T = (int(n) for n in ap.parse_args().size.split("x"))
x = make(B, T)
for n in LEAVES:
    x[n].requires_grad_()
do = torch.randn_like(x["v"])
for fn in (run_ours, run_fla):
    for _ in range(2):
        fwd_bwd(fn, x, "bounded", do)
    torch.cuda.synchronize()

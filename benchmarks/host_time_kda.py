"""Host time of one KDA Triton forward (launches only, no synchronisation) against its GPU time, one pass vs slabs:

    python3 benchmarks/host_time_kda.py --sizes 1x32768,1x131072

A slabbed call (``kda_triton._slabs``) makes six launches per slab; when the host takes longer to launch a call
than the GPU to run it, the GPU waits. Prints a table and writes JSON (``--out``).
"""
import argparse
import json
import os
import time

import torch
import triton

from bench_kda import H, make, run_ours
from kdamoe.model import kda_triton


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1x32768,1x131072")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_time_kda.json"))
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        B, T = map(int, size.split("x"))
        x = make(B, T)  # bench_kda.py's inputs: H = 16, head dim 128, bf16, the bounded gate's raw input

        def run():
            return run_ours(x, "bounded")

        for mode, forced in (("one pass", 1 << 40), ("slabs", None)):
            kda_triton.SLAB_TOKENS = forced
            with torch.no_grad():
                run()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    run()
                host = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
                gpu = triton.testing.do_bench(run)
            slabs = None if forced else kda_triton._slabs(B, T, H, x["q"].device,
                                                          kda_triton.SLAB_MIN_TOKEN_HEADS["forward"])
            rows.append(dict(size=size, mode=mode, slabs=len(slabs) if slabs else 1, host_ms=host, gpu_ms=gpu))
            print(f"{size:>9} {mode:>8} ({rows[-1]['slabs']} slabs): host {host:.3f} ms per call, do_bench {gpu:.3f} ms")
        kda_triton.SLAB_TOKENS = None
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

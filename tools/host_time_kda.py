"""Host time of one KDA Triton forward (launches only, no synchronisation) against its GPU time, over slab lengths:

    python3 tools/host_time_kda.py --sizes 1x32768,1x131072 --slab-tokens auto,0,8192,4096 [--cprofile]

A slabbed call (``kda_launch.slab_ranges``) makes six launches per slab; when the host takes longer to launch a call
than the GPU to run it, the GPU waits. Per size and slab length (``auto``: the library's choice; 0: one pass; N:
``kda_launch.SLAB_TOKENS = N``) it prints the host's time per call, ``do_bench``'s time (what a caller sees) and the
time of the same call replayed from a CUDA graph (no host work: what the GPU alone needs). ``--cprofile`` adds the
host's top functions per call for each row. Writes JSON (``--out``).
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_kda import H, make, run_ours  # noqa: E402
from kdamoe.model import kda_launch  # noqa: E402


def graph_ms(run):
    """do_bench of ``run`` replayed from a CUDA graph (captured after a warm-up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return triton.testing.do_bench(graph.replay)


def host_profile(run, calls=20):
    """The host's top functions (by own time) over ``calls`` calls of ``run``, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        run()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
    return text.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1x32768,1x131072")
    ap.add_argument("--slab-tokens", default="auto,0", help="comma list: auto, 0 (one pass) or a slab length")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "host_time_kda.json"))
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        B, T = map(int, size.split("x"))
        x = make(B, T)  # bench_kda.py's inputs: H = 16, head dim 128, bf16, the bounded gate's raw input

        def run():
            return run_ours(x, "bounded")

        for choice in args.slab_tokens.split(","):
            kda_launch.SLAB_TOKENS = None if choice == "auto" else (1 << 40 if choice == "0" else int(choice))
            slabs = kda_launch.slab_ranges(B, T, H, x["q"].device, kda_launch.SLAB_MIN_TOKEN_HEADS["forward"])
            with torch.no_grad():
                run()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    run()
                host = (time.perf_counter() - t0) / 20 * 1e3
                torch.cuda.synchronize()
                gpu = triton.testing.do_bench(run)
                graph = graph_ms(run)
                prof = host_profile(run) if args.cprofile else None
            rows.append(dict(size=size, slab_tokens=choice, slabs=len(slabs) if slabs else 1, host_ms=host,
                             do_bench_ms=gpu, graph_ms=graph))
            print(f"{size:>9} slab tokens {choice:>6} ({rows[-1]['slabs']:>2} slabs): host {host:.3f} ms per call, "
                  f"do_bench {gpu:.3f} ms, CUDA graph {graph:.3f} ms")
            if prof:
                print(prof)
        kda_launch.SLAB_TOKENS = None
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""CPU benchmark: the torch chunked KDA (``chunk_kda``, backend="torch") against the naive per-token loop.

Checks the chunked output against the loop first, then times the forward of both (best of ``--repeats``)
and prints a table; results go to a JSON file. Example:

    python benchmarks/bench_kda_torch.py --lengths 1024 4096 --out benchmarks/results/kda_torch_cpu.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kdamoe


def inputs(T, B, H, K, V, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    lower_bound = -5.0 if gate == "bounded" else None
    g = kdamoe.kda_gate(torch.randn(B, T, H, K, generator=gen), torch.zeros(H), gate=gate, lower_bound=lower_bound)
    return q, k, v, g, beta


def best_time(fn, repeats):
    """Best wall and process-CPU seconds over ``repeats`` calls (after one warm-up call)."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64, help="K = V")
    parser.add_argument("--gate", choices=["bounded", "softplus"], default="bounded")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of the chunked path (the loop gets 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks/results/kda_torch_cpu.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    with torch.no_grad():
        for T in args.lengths:
            q, k, v, g, beta = inputs(T, args.batch, args.heads, args.head_dim, args.head_dim, args.gate)
            o_chunk, s_chunk = kdamoe.chunk_kda(q, k, v, g, beta, output_final_state=True, backend="torch")
            o_loop, s_loop = kdamoe.naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
            err_o = ((o_chunk - o_loop).norm() / o_loop.norm()).item()
            err_s = ((s_chunk - s_loop).norm() / s_loop.norm()).item()
            if not (err_o < 1e-4 and err_s < 1e-4):
                raise SystemExit(f"chunked path disagrees with the loop at T={T}: rel err o {err_o:.2e}, state {err_s:.2e}")
            chunk_wall, chunk_cpu = best_time(lambda: kdamoe.chunk_kda(q, k, v, g, beta, backend="torch"), args.repeats)
            loop_wall, loop_cpu = best_time(lambda: kdamoe.naive_recurrent_kda(q, k, v, g, beta), 2)
            rows.append(dict(T=T, chunk_ms=chunk_wall * 1e3, naive_ms=loop_wall * 1e3, speedup=loop_wall / chunk_wall,
                             chunk_cpu_ms=chunk_cpu * 1e3, naive_cpu_ms=loop_cpu * 1e3, speedup_cpu=loop_cpu / chunk_cpu,
                             rel_err_o=err_o, rel_err_state=err_s))

    print(f"KDA forward on CPU, float32, B={args.batch} H={args.heads} K=V={args.head_dim}, {args.gate} gate, "
          f"{torch.get_num_threads()} threads (best of runs; CPU = process time)")
    print(f"{'T':>6} {'chunk ms':>9} {'naive ms':>9} {'speedup':>8} {'chunk cpu':>10} {'naive cpu':>10} {'speedup':>8} {'rel err o':>10}")
    for r in rows:
        print(f"{r['T']:>6} {r['chunk_ms']:>9.1f} {r['naive_ms']:>9.1f} {r['speedup']:>7.1f}x {r['chunk_cpu_ms']:>10.1f} "
              f"{r['naive_cpu_ms']:>10.1f} {r['speedup_cpu']:>7.1f}x {r['rel_err_o']:>10.1e}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(batch=args.batch, heads=args.heads, head_dim=args.head_dim, gate=args.gate, dtype="float32",
                threads=torch.get_num_threads(), torch=torch.__version__, machine=platform.processor() or platform.machine())
    out.write_text(json.dumps(dict(config=meta, results=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Where the time goes inside the KDA and MoE ops: torch.profiler kernel tables, in one run.

KDA (bf16, H=16, head dim 128, fused bounded gate): ours vs flash-linear-attention's ``chunk_kda`` (when
``fla-core`` is importable), forward and forward+backward at 4x8K and 1x32K. MoE (16K tokens, hidden 2048,
128 experts top-8, width 768): our grouped experts alone and the bare ``grouped_mm`` GEMMs on pre-sorted
tokens (no permutation, no activation) as the floor. Also prints registers and spills of our Triton kernels.

    PYTHONPATH=src python benchmarks/profile_ops.py [--what kda,moe] [--kda-impls ours,fla,NAME --alt NAME=PATH]
"""

import argparse
import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

import bench_kda


def kernel_table(fn, label, rows=20):
    """Run ``fn`` twice (warm), then once under the profiler; print the kernels by total CUDA time."""
    fn()
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"\n== {label}: {total / 1e3:.3f} ms of kernels")
    out = []
    for e in events[:rows]:
        print(f"{e.device_time_total / 1e3:9.3f} ms {e.count:5d}x  {e.key[:110]}")
        out.append(dict(name=e.key, ms=e.device_time_total / 1e3, count=e.count))
    return dict(total_ms=total / 1e3, kernels=out)


def kda(res, names, alts, sizes):
    impls = {"ours": bench_kda.run_ours}
    if bench_kda.fla_chunk_kda is not None:
        impls["fla"] = bench_kda.run_fla
    for alt in alts:
        label, path = alt.split("=", 1)
        impls[label] = bench_kda.load_alt(label, path)
    impls = {n: f for n, f in impls.items() if n in names}
    for B, T in (tuple(map(int, s.split("x"))) for s in sizes.split(",")):
        x = bench_kda.make(B, T)
        for n in bench_kda.LEAVES:
            x[n].requires_grad_()
        do = torch.randn_like(x["v"])
        for name, fn in impls.items():
            def fwd():
                with torch.no_grad():
                    fn(x, "bounded")

            def fwdbwd():
                bench_kda.fwd_bwd(fn, x, "bounded", do)

            for mode, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
                key = f"kda {name} {B}x{T // 1024}K {mode}"
                res[key] = kernel_table(f, key)
                res[key]["do_bench_ms"] = do_bench(f, warmup=20, rep=200, return_mode="median")
                print(f"do_bench median {res[key]['do_bench_ms']:.3f} ms")



def moe(res):
    from kdamoe import KDAMoEConfig
    from kdamoe.model.moe import _GROUPED_MM, KDAMoEExperts, KDAMoESparseMoeBlock
    N, D, E, k, I = 16384, 2048, 128, 8, 768
    cfg = KDAMoEConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                       num_hidden_layers=1, mlp_layer_types=["dense"])
    ex = KDAMoEExperts(cfg).cuda().bfloat16()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(N)])
    w = torch.rand(N, k, device="cuda").softmax(-1)
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)

    def experts_fb():
        ex.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        ex(xx, idx, w).backward(dy)

    counts = torch.bincount(idx.view(-1), minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    xs = torch.randn(N * k, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gu = ex.gate_up_proj.detach().requires_grad_()
    dn = ex.down_proj.detach().requires_grad_()
    dys = torch.randn(N * k, D, device="cuda", dtype=torch.bfloat16)

    def bare_fb():
        gu.grad = dn.grad = xs.grad = None
        h = _GROUPED_MM(xs, gu.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        y = _GROUPED_MM(a * b, dn.transpose(-2, -1), offs=offs)
        y.backward(dys)

    block_cfg = KDAMoEConfig(hidden_size=D, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                             num_hidden_layers=1, mlp_layer_types=["dense"], num_shared_experts=1,
                             router_balancing="quantile")
    block = KDAMoESparseMoeBlock(block_cfg).cuda().bfloat16().train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    xb = x.view(1, N, D)

    def block_fb():
        block.zero_grad(set_to_none=True)
        xx = xb.detach().requires_grad_()
        block(xx)[0].backward(dy.view(1, N, D))

    def max_vio():
        with torch.no_grad():
            loads = torch.bincount(block.router(x)[2].reshape(-1), minlength=E).double()
        return ((loads.max() - loads.mean()) / loads.mean()).item()

    flops = 6 * N * k * 3 * D * I

    def table(key, f):
        res[key] = kernel_table(f, key, rows=40)
        ms = do_bench(f, warmup=10, rep=100, return_mode="median")
        res[key].update(do_bench_ms=ms, tflops=flops / ms / 1e9)
        print(f"do_bench median {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s")

    table("moe experts fwd+bwd (uniform random routing)", experts_fb)
    table("moe bare grouped_mm fwd+bwd", bare_fb)
    done = 0
    for updates in (0, 1, 8):  # the router as initialised, then after quantile-balancing updates on this batch
        for _ in range(updates - done):
            block._take_window()  # drop what the timing runs accumulated
            block(xb)
            block.apply_balancing()
        done = updates
        table(f"moe block fwd+bwd ({updates} QB updates, MaxVio {max_vio():.2f})", block_fb)


def registers():
    """Registers, spills and shared memory of every KDA kernel compiled so far (the kernel files of the model
    folder)."""
    kernels = {id(fn): (name, fn) for module_name, module in list(sys.modules.items())
               if module_name.startswith("kdamoe.model.kda") for name, fn in vars(module).items()
               if isinstance(fn, triton.runtime.jit.JITFunction)}
    for name, fn in sorted(kernels.values(), key=lambda nf: nf[0]):
        caches = getattr(fn, "device_caches", None)
        if not caches:
            continue
        for entry in caches.values():
            for kern in entry[0].values():
                try:
                    kern._init_handles()
                    print(f"{name:28s} regs {kern.n_regs:4d} spills {kern.n_spills:6d} shared {kern.metadata.shared}")
                except Exception as err:  # noqa: BLE001 (diagnostic only)
                    print(name, "no metadata:", err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="kda,moe")
    ap.add_argument("--kda-impls", default="ours,fla", help="comma-separated: ours, fla, and --alt labels")
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                    help="another copy of the model folder to profile (see bench_kda.py --alt)")
    ap.add_argument("--sizes", default="4x8192,1x32768", help="KDA shapes, comma-separated BxT")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_ops.json"))
    args = ap.parse_args()
    res = {}
    if "kda" in args.what:
        kda(res, args.kda_impls.split(","), args.alt, args.sizes)
        registers()
    if "moe" in args.what:
        moe(res)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

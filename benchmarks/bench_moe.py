"""MoE layer benchmark (GPU): the kdamoe sparse MoE block vs grouped-GEMM experts alone vs transformers' in-tree
KimiLinear MoE block (grouped_mm experts + sigmoid router + shared expert) vs a dense bf16 GEMM, in one run.

Expert-compute FLOPs (routed experts only; gate, up and down projections are 3 matmuls of D x I per routed token):
    forward          2 * N * k * 3 * D * I
    forward+backward 6 * N * k * 3 * D * I
TFLOP/s below are these FLOPs over the measured time (so router, permutation, shared expert and balancing
statistics count as overhead); the JSON also gives the rate with the shared expert's FLOPs counted
(`2 * N * (k + shared) * 3 * D * I` forward). The router first takes `--balance-steps` quantile-balancing updates
on the benchmark batch (the state a QB-trained layer runs in; MaxVio before and after is printed) and
transformers' block gets the same selection bias, so all implementations route alike. Before timing, every
implementation's output is compared with a float64 loop reference that uses the same weights and routing
(relative Frobenius error). Times are `triton.testing.do_bench` medians (calls back to back, as in bench_kda.py);
the `synced` column synchronises before every call (so it also counts each call's launch latency from an idle
GPU). The dense GEMM's rate is the better of the two timings.

    python benchmarks/bench_moe.py --out bench_moe.json          # GPU, 16K tokens, d 2048, 128 experts top-8, I 768
    python benchmarks/bench_moe.py --smoke                       # tiny CPU run: checks that everything executes
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kdamoe.model.configuration_kdamoe import KDAMoEConfig
from kdamoe.model.moe import KDAMoESparseMoeBlock


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--shared", type=int, default=1, help="shared experts (width inter * shared)")
    p.add_argument("--gemm", type=int, default=8192, help="size of the dense reference GEMM")
    p.add_argument("--balance-steps", type=int, default=8, help="QB updates of the router before timing")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls of the synchronised (and CPU) timing")
    p.add_argument("--iters", type=int, default=20, help="timed calls of the synchronised (and CPU) timing")
    p.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU in float32")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.hidden, args.experts, args.topk, args.inter, args.gemm = 64, 32, 8, 2, 16, 128
        args.warmup, args.iters = 1, 2
    return args


class Timer:
    """Median milliseconds of `fn()`. On CUDA `triton.testing.do_bench` (as bench_kda.py): calls issued back to
    back, as the layers of a training step are, so host-side launch work overlaps the GPU's; `synced` instead
    synchronises before every call (each call then also pays its launch latency from an idle GPU). On the CPU,
    wall-clock time."""

    def __init__(self, device, warmup, iters):
        self.cuda = device.type == "cuda"
        self.warmup, self.iters = warmup, iters

    def __call__(self, fn, synced=False, warmup=None, iters=None) -> float:
        if self.cuda and not synced:
            from triton.testing import do_bench
            return do_bench(fn, warmup=50, rep=300, return_mode="median")
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        times = []
        for _ in range(self.iters if iters is None else iters):
            if self.cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def reference_moe(x, gate_up, down, index, weights, activation, shared=None):
    """float64 loop reference: sum_k w * down_e(act(gate_e x, up_e x)) (+ shared expert)."""
    x, gate_up, down, weights = x.double(), gate_up.double(), down.double(), weights.double()
    out = torch.zeros_like(x)
    for e in torch.unique(index).tolist():
        token, slot = torch.nonzero(index == e, as_tuple=True)
        g, u = (x[token] @ gate_up[e].T).chunk(2, -1)
        h = activation(g, u)
        out.index_add_(0, token, (h @ down[e].T) * weights[token, slot, None])
    if shared is not None:
        sg, su, sd = (w.double() for w in shared)
        out += activation(x @ sg.T, x @ su.T) @ sd.T
    return out


def situ_ref(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


def swiglu_ref(g, u):
    return F.silu(g) * u


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def routing_weights64(x, router_weight, index, scale):
    s = torch.sigmoid(x.double() @ router_weight.double().T).gather(1, index)
    return s / s.sum(-1, keepdim=True) * scale


def build_blocks(args, device, dtype):
    """kdamoe blocks (situ_glu, swiglu) and transformers' KimiLinearMoE, all with the same weights."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearMoE

    shape = dict(hidden_size=args.hidden, num_experts=args.experts, num_experts_per_tok=args.topk,
                 moe_intermediate_size=args.inter, routed_scaling_factor=1.0)
    config = KDAMoEConfig(num_hidden_layers=1, mlp_layer_types=["dense"], num_shared_experts=args.shared,
                          router_balancing="quantile", **shape)
    ours = KDAMoESparseMoeBlock(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    ours_swiglu = KDAMoESparseMoeBlock(KDAMoEConfig(**{**config.to_dict(), "expert_activation": "swiglu"}))
    ours_swiglu.load_state_dict(ours.state_dict())

    hf_config = KimiLinearConfig(num_shared_experts=args.shared, n_group=1, topk_group=1, norm_topk_prob=True,
                                 hidden_act="silu", experts_implementation="grouped_mm", **shape)
    theirs = KimiLinearMoE(hf_config)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.gate.e_score_correction_bias.zero_()
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
        if args.shared:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(theirs.shared_experts, name).weight.copy_(getattr(ours.shared_experts, name).weight)
    # both routers compute in fp32 from the same (dtype-rounded) weights, so they pick the same experts
    return [m.to(device=device, dtype=dtype).train() for m in (ours, ours_swiglu, theirs)]


def _max_vio(block, x, num_experts) -> float:
    with torch.no_grad():
        loads = torch.bincount(block.router(x.view(-1, x.shape[-1]))[2].reshape(-1), minlength=num_experts)
    return ((loads.max() - loads.double().mean()) / loads.double().mean()).item()


def main():
    args = parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    timer = Timer(device, args.warmup, args.iters)
    N, D, E, k, I = args.tokens, args.hidden, args.experts, args.topk, args.inter
    flops_fwd = 2 * N * k * 3 * D * I
    flops_fwdbwd = 6 * N * k * 3 * D * I
    with_shared = (k + args.shared) / k  # the shared expert's FLOPs counted too

    ours, ours_swiglu, theirs = build_blocks(args, device, dtype)
    x = torch.randn(1, N, D, device=device, dtype=dtype)
    dy = torch.randn(1, N, D, device=device, dtype=dtype)
    shared = None
    if args.shared:
        shared = tuple(getattr(ours.shared_experts, n).weight for n in ("gate_proj", "up_proj", "down_proj"))

    # ---- quantile balancing on this batch, then the same selection bias for every implementation
    max_vio = {"before": _max_vio(ours, x, E)}
    for _ in range(args.balance_steps):
        ours(x)
        ours.apply_balancing()
    max_vio["after"] = _max_vio(ours, x, E)
    ours_swiglu.router.bias.copy_(ours.router.bias)
    theirs.gate.e_score_correction_bias = ours.router.bias.detach().clone()  # fp32, as ours
    print(f"MaxVio of the routing: {max_vio['before']:.3f} before, {max_vio['after']:.3f} after "
          f"{args.balance_steps} QB updates", flush=True)

    # ---- correctness vs float64 before timing
    with torch.no_grad():
        _, _, index, _, _ = ours.router(x.view(N, D))
        w64 = routing_weights64(x.view(N, D), ours.router.weight, index, 1.0)
        ref_situ = reference_moe(x.view(N, D), ours.experts.gate_up_proj, ours.experts.down_proj, index, w64,
                                 situ_ref, shared)
        ref_swiglu = reference_moe(x.view(N, D), ours.experts.gate_up_proj, ours.experts.down_proj, index, w64,
                                   swiglu_ref, shared)
        ref_experts = reference_moe(x.view(N, D), ours.experts.gate_up_proj, ours.experts.down_proj, index, w64,
                                    situ_ref)
        errors = {
            "kdamoe block, situ_glu": rel_err(ours(x)[0].view(N, D), ref_situ),
            "kdamoe block, swiglu": rel_err(ours_swiglu(x)[0].view(N, D), ref_swiglu),
            "(a) grouped experts alone, situ_glu": rel_err(ours.experts(x.view(N, D), index, w64.float()),
                                                           ref_experts),
            "(b) transformers KimiLinearMoE, silu": rel_err(theirs(x).view(N, D), ref_swiglu),
        }
    # ---- timing
    weights = w64.float().to(device)

    def fwd_bwd(fn):
        def run():  # one training step's work: fresh parameter gradients (no accumulation into old ones)
            for m in (ours, ours_swiglu, theirs):
                m.zero_grad(set_to_none=True)
            xx = x.detach().requires_grad_()
            fn(xx).backward(dy)
        return run

    cases = {
        "kdamoe block, situ_glu": lambda t: ours(t)[0],
        "kdamoe block, swiglu": lambda t: ours_swiglu(t)[0],
        "(a) grouped experts alone, situ_glu": lambda t: ours.experts(t.view(N, D), index, weights).view_as(t),
        "(b) transformers KimiLinearMoE, silu": lambda t: theirs(t),
    }
    results = []
    for name, fn in cases.items():
        with torch.no_grad():
            fwd_ms = timer(lambda: fn(x))
        fwdbwd_ms = timer(fwd_bwd(fn))
        fwdbwd_ms_synced = timer(fwd_bwd(fn), synced=True)
        for m in (ours, ours_swiglu, theirs):
            m.zero_grad(set_to_none=True)
        shared = with_shared if "alone" not in name else 1.0
        results.append({"name": name, "rel_err_vs_fp64": errors[name], "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                        "fwdbwd_ms_synced": fwdbwd_ms_synced,
                        "fwd_tflops": flops_fwd / fwd_ms / 1e9, "fwdbwd_tflops": flops_fwdbwd / fwdbwd_ms / 1e9,
                        "fwdbwd_tflops_incl_shared": shared * flops_fwdbwd / fwdbwd_ms / 1e9})
    ours.apply_balancing()
    ours(x)[0].sum().backward()  # one more training window, then time the once-per-step update alone
    apply_ms = timer(ours.apply_balancing, synced=True, warmup=0, iters=1)  # the one call with pending statistics

    a = torch.randn(args.gemm, args.gemm, device=device, dtype=dtype)
    b = torch.randn(args.gemm, args.gemm, device=device, dtype=dtype)
    # the dense rate is the better of both timings (back to back it runs ~10 % slower on the H200: sustained
    # clocks), so the fractions below are never flattered by a slow reference
    gemm_ms_both = {"do_bench": timer(lambda: a @ b), "synced": timer(lambda: a @ b, synced=True)}
    gemm_ms = min(gemm_ms_both.values())
    dense_tflops = 2 * args.gemm**3 / gemm_ms / 1e9

    by_name = {r["name"]: r for r in results}
    summary = {
        "block_speedup_vs_transformers_fwdbwd": by_name["(b) transformers KimiLinearMoE, silu"]["fwdbwd_ms"]
        / by_name["kdamoe block, situ_glu"]["fwdbwd_ms"],
        "block_fwdbwd_fraction_of_dense": by_name["kdamoe block, situ_glu"]["fwdbwd_tflops"] / dense_tflops,
        "experts_fwdbwd_fraction_of_dense": by_name["(a) grouped experts alone, situ_glu"]["fwdbwd_tflops"]
        / dense_tflops,
        "block_fwdbwd_fraction_of_dense_incl_shared": by_name["kdamoe block, situ_glu"]["fwdbwd_tflops_incl_shared"]
        / dense_tflops,
        "synced_block_speedup_vs_transformers_fwdbwd": by_name["(b) transformers KimiLinearMoE, silu"][
            "fwdbwd_ms_synced"] / by_name["kdamoe block, situ_glu"]["fwdbwd_ms_synced"],
        "synced_block_fwdbwd_fraction_of_dense": flops_fwdbwd / by_name["kdamoe block, situ_glu"]["fwdbwd_ms_synced"]
        / 1e9 / dense_tflops,
    }
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": str(dtype),
        "shape": {"tokens": N, "hidden": D, "experts": E, "top_k": k, "expert_width": I, "shared": args.shared},
        "flops_formula": {"fwd": "2*N*k*3*D*I", "fwdbwd": "6*N*k*3*D*I"},
        "max_vio": max_vio, "balance_steps": args.balance_steps,
        "results": results,
        "apply_balancing_ms": apply_ms,
        "dense_gemm": {"size": args.gemm, "ms": gemm_ms, "tflops": dense_tflops, "ms_by_timing": gemm_ms_both},
        "summary": summary,
    }

    print(f"{report['device']}, {dtype}, N={N} D={D} E={E} k={k} I={I} shared={args.shared}; "
          f"expert FLOPs fwd 2*N*k*3*D*I, fwd+bwd 6*N*k*3*D*I")
    print(f"{'implementation':40s} {'relerr':>9s} {'fwd ms':>9s} {'TFLOP/s':>8s} {'f+b ms':>9s} {'TFLOP/s':>8s} "
          f"{'synced f+b':>10s}")
    for r in results:
        print(f"{r['name']:40s} {r['rel_err_vs_fp64']:9.2e} {r['fwd_ms']:9.3f} {r['fwd_tflops']:8.1f} "
              f"{r['fwdbwd_ms']:9.3f} {r['fwdbwd_tflops']:8.1f} {r['fwdbwd_ms_synced']:10.3f}")
    print(f"{'(c) dense GEMM ' + str(args.gemm) + '^3':40s} {'':9s} {gemm_ms:9.3f} {dense_tflops:8.1f}")
    print(f"apply_balancing (once per optimizer step): {apply_ms:.3f} ms")
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()

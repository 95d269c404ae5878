"""Benchmark the Triton KDA kernels against flash-linear-attention's ``chunk_kda`` and SDPA, in one run.

bf16, H=16 heads, head dim 128. For (B, T) in (4, 8K), (1, 32K), (1, 128K): forward and forward+backward
as the model calls the op (raw q/k, their L2 norm and the gate in the op: ``use_qk_l2norm_in_kernel=True``,
``use_gate_in_kernel=True``; ``--qk normalised`` times it on pre-normalised q/k instead) of ours (bounded
gate, softplus gate), fla 0.6 (``safe_gate=True, lower_bound=-5``, and its softplus gate) and SDPA causal
(flash); then a 1M-token forward with peak memory. Every variant is first checked against a float64 reference on a
slice (relative error of the output and the gradients). Times are ``triton.testing.do_bench`` medians. Prints a
table; writes JSON to ``$OUT/bench_kda.json`` (or ``--out``).

    PYTHONPATH=src python benchmarks/bench_kda.py [--quick]
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench
from model_folder import import_model_folder

from kdamoe.model import kda
from kdamoe.model.kda_chunk import chunk_kda_triton
from kdamoe.model.kda_fused_recurrent import recurrent_kda_triton

try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda
except ImportError:  # the peer is optional
    fla_chunk_kda = None

H, D = 16, 128
LB = -5.0
LEAVES = ("q", "k", "v", "g", "beta")  # the inputs that get gradients
QK_NORM = True  # the L2 norm of q and k inside the op (the model's call); False with --qk normalised


def make(B, T, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q, k = r(B, T, H, D), r(B, T, H, D)
    if not QK_NORM:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    q, k = q.bfloat16(), k.bfloat16()
    v = r(B, T, H, D).bfloat16()
    g_raw = r(B, T, H, D).bfloat16()
    beta = torch.rand(B, T, H, device=device, generator=gen).bfloat16()
    A_log = torch.log(torch.empty(H, device=device).uniform_(1, 16, generator=gen))
    dt = torch.exp(torch.empty(H * D, device=device).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    return dict(q=q, k=k, v=v, g=g_raw, beta=beta, A_log=A_log, dt_bias=dt_bias)


def run_ours(x, gate, fn=chunk_kda_triton):
    lb = LB if gate == "bounded" else None
    A_log = torch.zeros_like(x["A_log"]) if gate == "bounded" else x["A_log"]  # bounded: A_log = 0 (docs/design.md §2)
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=A_log,
              dt_bias=x["dt_bias"], lower_bound=lb, gate=gate, use_qk_l2norm_in_kernel=QK_NORM)[0]


def load_alt(label, path):
    """``chunk_kda_triton`` of another copy of the model folder at ``path`` (e.g. ``mkdir -p alt/B && git archive
    BRANCH src/kdamoe/model | tar -x -C alt/B --strip-components=3``), imported as a package of its own, for an A/B
    timing of two kernel versions in one run."""
    module = import_model_folder(label, path, "kda_chunk")
    return lambda x, gate: run_ours(x, gate, module.chunk_kda_triton)


def run_fla(x, gate):
    A_log = torch.zeros_like(x["A_log"]) if gate == "bounded" else x["A_log"]
    kw = dict(safe_gate=True, lower_bound=LB) if gate == "bounded" else {}
    return fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_gate_in_kernel=True, A_log=A_log,
                         dt_bias=x["dt_bias"], use_qk_l2norm_in_kernel=QK_NORM, **kw)[0]


def run_sdpa(x, gate=None):
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def reference(x, gate):
    """float64 torch chunked KDA (the kda.py reference) with the same gate."""
    lb = LB if gate == "bounded" else None
    A_log = torch.zeros_like(x["A_log"]) if gate == "bounded" else x["A_log"]
    xs = {n: t.double().detach().requires_grad_(n in "qkvg" or n == "beta") for n, t in x.items()}
    o = kda.chunk_kda(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], use_gate_in_kernel=True, A_log=A_log.double(),
                      dt_bias=xs["dt_bias"], lower_bound=lb, gate=gate, use_qk_l2norm_in_kernel=QK_NORM,
                      backend="torch")[0]
    return o, xs


def rel(a, b):
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(fn, gate, backward=True):
    """Largest relative error over two shapes: one long sequence (few programs per chunk loop, which then take
    their `*_few` launch settings) and 8 short ones (the many-programs settings), so both launch regimes the
    timings use are checked."""
    err = {}
    for B, T in ((1, 4096), (8, 512)):
        x = make(B, T, seed=1)  # all H heads: fla-core's autotuning keys on H, so its tuned entries serve the timings
        ro, rx = reference(x, gate)
        leaves = {n: x[n].clone().requires_grad_(backward) for n in LEAVES}
        o = fn({**x, **leaves}, gate)
        e = {"o": rel(o, ro)}
        if backward:
            do = torch.randn_like(ro)
            (ro * do).sum().backward()
            (o.float() * do.float()).sum().backward()
            e.update({f"d{n}": rel(leaves[n].grad, rx[n].grad) for n in leaves})
        err = {n: max(x_, err.get(n, 0.0)) for n, x_ in e.items()}
    return err


def fwd_bwd(fn, x, gate, do):
    """One forward+backward as every timing and kernel table here runs it: the leaves (``x[n]`` for n in LEAVES,
    requiring grad) have their gradients cleared first, so no gradient-accumulation kernels run."""
    for n in LEAVES:
        x[n].grad = None
    fn(x, gate).backward(do)


def time_it(fn, x, gate, backward):
    if not backward:
        with torch.no_grad():
            return do_bench(lambda: fn(x, gate), warmup=50, rep=300, return_mode="median")
    for n in LEAVES:
        x[n].requires_grad_()
    do = torch.randn_like(x["v"])
    return do_bench(lambda: fwd_bwd(fn, x, gate, do), warmup=50, rep=300, return_mode="median")


def saved_gib(fn, x, gate):
    """GiB that the autograd graph holds between the forward and the backward (the output included): what a
    layer keeps per call while training without activation checkpointing."""
    leaves = {n: x[n].requires_grad_() for n in LEAVES}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = fn({**x, **leaves}, gate)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    del o
    return held / 2**30


def peak_forward(fn, x, gate):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        o = fn(x, gate)
        torch.cuda.synchronize()
        ms = do_bench(lambda: fn(x, gate), warmup=1, rep=1, return_mode="median")
    ok = bool(torch.isfinite(o).all())
    return ms, torch.cuda.max_memory_allocated() / 2**30, ok


def profile(B, T, impls):
    """Per-kernel CUDA times (µs) of one forward and one forward+backward of each of ``impls`` (name -> (fn,
    gate)): ours and fla-core side by side, kernel by kernel. Printed, and returned as {impl: {pass: {kernel: µs}}}
    for the JSON."""
    out = {}
    x = make(B, T)
    for n in LEAVES:
        x[n].requires_grad_()
    do = torch.ones_like(x["v"])
    for name, (fn, gate) in impls.items():
        for bwd in (False, True):
            def step():
                fwd_bwd(fn, x, gate, do) if bwd else fn(x, gate)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            rows = sorted(((e.device_time_total, e.key) for e in prof.key_averages()
                           if e.device_type == torch.autograd.DeviceType.CUDA), reverse=True)
            step_name = "fwd+bwd" if bwd else "fwd"
            out.setdefault(name, {})[step_name] = {key: round(us, 1) for us, key in rows}
            print(f"{name}, {B}x{T} {step_name}, per kernel (µs; total {sum(us for us, _ in rows):.0f}):")
            for us, key in rows[:16]:
                print(f"  {us:9.1f}  {key[:80]}")
    return out


def gpu_checks():
    """Decode kernel, varlen and causality on the GPU (bf16 inputs, fp32 log-decay, as the benchmark)."""
    out = {}
    x = make(1, 3000, seed=3)
    for n in "qk":  # the kernels' own calls here take unit-norm q/k
        x[n] = F.normalize(x[n].float(), dim=-1).bfloat16()
    g = LB * torch.sigmoid(x["g"].float())
    cu = torch.tensor([0, 1, 700, 700, 2871, 3000], device="cuda")
    h0 = torch.randn(5, H, D, D, device="cuda")
    args = (x["q"], x["k"], x["v"], g, x["beta"])
    o, ht = chunk_kda_triton(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ro, rht = kda.chunk_kda(*(t.double() for t in args), initial_state=h0.double(), output_final_state=True,
                            cu_seqlens=cu, backend="torch")
    out["varlen_o"], out["varlen_state"] = rel(o, ro), rel(ht, rht)
    state = h0[:2].clone()
    dec = [t[:, :6].reshape(2, 3, *t.shape[2:]) for t in args]
    o, ht = recurrent_kda_triton(*dec, initial_state=state, output_final_state=True)
    ro, rht = kda.naive_recurrent_kda(*(t.double() for t in dec), initial_state=h0[:2].double(), output_final_state=True)
    out["decode_o"], out["decode_state"], out["decode_in_place"] = rel(o, ro), rel(ht, rht), ht is state
    one = [t[:, :1] for t in args]
    st = h0[:1].clone()
    out["decode_1tok_us"] = 1e3 * do_bench(lambda: recurrent_kda_triton(*one, initial_state=st, output_final_state=True),
                                          warmup=20, rep=100, return_mode="median")
    t0 = 150  # causality: change tokens >= t0, compare outputs < t0 and their gradients bit for bit
    base = [t[:, :300].clone() for t in args]
    pert = [t.clone() for t in base]
    pert[0][:, t0:] = pert[0][:, t0:].flip(1)
    pert[1][:, t0:] = pert[1][:, t0:].roll(7, 1)
    pert[2][:, t0:] *= -3
    pert[3][:, t0:] = LB
    pert[4][:, t0:] = 1 - pert[4][:, t0:]
    res = []
    for inp in (base, pert):
        leaves = [t.clone().requires_grad_() for t in inp]
        o, _ = chunk_kda_triton(*leaves)
        o[:, :t0].float().pow(2).sum().backward()
        res.append([o[:, :t0]] + [t.grad[:, :t0] for t in leaves])
    out["causal_bit_exact"] = all(torch.equal(a, b) for a, b in zip(*res))
    print("gpu checks:", out, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes only")
    ap.add_argument("--fwd-only", action="store_true", help="skip the backward checks and timings")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of each of --impls at the first of --sizes")
    ap.add_argument("--sizes", default="4x8192,1x32768,1x131072", help="comma-separated BxT")
    ap.add_argument("--impls", default="ours-bounded,ours-softplus,fla-bounded,sdpa", help="comma-separated")
    ap.add_argument("--qk", choices=("raw", "normalised"), default="raw",
                    help="raw q/k normalised inside the op (the model's call), or pre-normalised q/k")
    ap.add_argument("--skip-checks", action="store_true", help="no float64 / GPU checks (timings only)")
    ap.add_argument("--no-million", action="store_true", help="skip the 1M-token forward")
    ap.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                    help="another copy of the model folder, timed as NAME-bounded / NAME-softplus (repeatable)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_kda.json"))
    args = ap.parse_args()
    global QK_NORM
    QK_NORM = args.qk == "raw"
    dev = torch.cuda.get_device_name()
    res = dict(gpu=dev, torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               fla=None, qk=args.qk, heads=H, head_dim=D, dtype="bf16", errors={}, times={}, saved_gib={}, million={})
    try:
        import fla
        res["fla"] = fla.__version__
    except ImportError:
        pass
    wanted = args.impls.split(",")
    impls = {"ours-bounded": (run_ours, "bounded"), "ours-softplus": (run_ours, "softplus")}
    for alt in args.alt:
        label, path = alt.split("=", 1)
        run_alt = load_alt(label, path)
        for gate in ("bounded", "softplus"):
            impls[f"{label}-{gate}"] = (run_alt, gate)
            if f"ours-{gate}" in wanted:
                wanted.append(f"{label}-{gate}")
    if fla_chunk_kda is not None:
        impls["fla-bounded"] = (run_fla, "bounded")
    impls = {n: f for n, f in impls.items() if n in wanted}
    if not args.skip_checks:
        res["gpu_checks"] = gpu_checks()
        for name, (fn, gate) in impls.items():
            res["errors"][name] = check(fn, gate, backward=not args.fwd_only)
            print(name, "rel err vs float64:", {k: f"{v:.1e}" for k, v in res["errors"][name].items()}, flush=True)
    if "sdpa" in wanted:
        impls["sdpa"] = (run_sdpa, None)
    sizes = [(1, 8192)] if args.quick else [tuple(int(x) for x in bt.split("x")) for bt in args.sizes.split(",")]
    if args.profile and not args.fwd_only:
        res["profile"] = {f"{sizes[0][0]}x{sizes[0][1]}": profile(*sizes[0], impls)}
    for B, T in sizes:
        x = make(B, T)
        for name, (fn, gate) in impls.items():
            for bwd in (False,) if args.fwd_only else (False, True):
                key = f"{B}x{T // 1024}K {'fwd+bwd' if bwd else 'fwd'}"
                ms = time_it(fn, {n: t.detach() for n, t in x.items()}, gate, bwd)
                res["times"].setdefault(key, {})[name] = ms
                print(f"{key:>16} {name:>14}: {ms:9.3f} ms", flush=True)
                if bwd and name != "sdpa":
                    gib = saved_gib(fn, {n: t.detach() for n, t in x.items()}, gate)
                    res["saved_gib"].setdefault(f"{B}x{T // 1024}K", {})[name] = gib
                    print(f"{key:>16} {name:>14}: {gib:9.3f} GiB kept for the backward", flush=True)
                save(res, args.out)
        del x
        torch.cuda.empty_cache()
    if not (args.quick or args.no_million):
        for name in impls:
            if not name.endswith("-bounded"):
                continue
            torch.cuda.empty_cache()
            x = make(1, 1 << 20)
            fn, gate = impls[name]
            ms, gib, ok = peak_forward(fn, x, gate)
            res["million"][name] = dict(ms=ms, peak_gib=gib, finite=ok)
            print(f"1M fwd {name}: {ms:.1f} ms, peak {gib:.1f} GiB, finite={ok}", flush=True)
            del x
    # table
    names = list(impls)
    print("\n| shape (ms) | " + " | ".join(names) + " | speed-up vs fla-bounded | bounded vs softplus |")
    print("|---" * (len(names) + 3) + "|")
    for key, row in res["times"].items():
        ours = row.get("ours-bounded", float("nan"))
        vs_fla = row.get("fla-bounded", float("nan")) / ours
        vs_softplus = row.get("ours-softplus", float("nan")) / ours
        cells = " | ".join(f"{row[n]:.2f}" if n in row else "—" for n in names)
        print(f"| {key} | {cells} | {vs_fla:.2f}x | {vs_softplus:.2f}x |")
    for key, row in res["saved_gib"].items():
        print(f"| {key} GiB kept for the backward | " + " | ".join(f"{row[n]:.2f}" if n in row else "—" for n in names)
              + " | | |")
    for name, m in res["million"].items():
        print(f"| 1M fwd {name} | {m['ms']:.1f} ms | {m['peak_gib']:.1f} GiB | finite={m['finite']} |")
    save(res, args.out)


def save(res, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

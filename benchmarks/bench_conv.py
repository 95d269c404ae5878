"""KDA's short convolution + SiLU: our Triton kernels at candidate launches against flash-linear-attention's
`causal_conv1d` and a copy of the same bytes, in one run (GPU).

The shape is the twin's KDA layer (bench_model.py): B x T tokens of C = 3 x 1024 channels (q | k | v), read as the
column slice of a wider projection the layer passes, bf16, width 4; plain rows, and packed documents of `--doc`
tokens. Each candidate launch of each kernel in `short_conv.LAUNCH` (tile, warps, program order; persistent
programs per SM) is checked before it is timed: its output and dx bit-identical to the default launch's, dweight
within 1e-3 of it (its fp32 partial sums group differently and the bf16 result rounds apart, ~4e-5 on the GPU; the
default's own error against float64 is ~2e-3). A backward kernel is timed as the whole backward with the others
at their defaults. Table: ms (`triton.testing.do_bench` median), the bytes a pass must move at the least over its
time (forward: read x, write y; backward: read x and dy, write dx), and that rate as a share of a device-to-device
copy's in the same run. The default launch is also checked against the float64 torch reference. Peers, forward and
forward+backward: fla's `causal_conv1d(activation="silu")` on the same values (a contiguous x, the layout it takes;
its backward recomputes the pre-activation, as ours does), and with `--alt NAME=PATH` the `short_conv.py` of
another copy of the model folder at its default launch (y, dx and dweight within 1e-3 of ours: another version
may sum in another order), for an A/B of two versions.

    python benchmarks/bench_conv.py --out conv_h200.json [--alt NAME=PATH ...]
    TRITON_INTERPRET=1 python benchmarks/bench_conv.py --smoke        # CPU: checks that everything runs
"""

import argparse
import itertools
import json
import statistics
import time

import torch
from model_folder import import_model_folder

from kdamoe.model import short_conv


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--channels", type=int, default=3 * 1024)
    p.add_argument("--doc", type=int, default=1024, help="document length of the packed rows")
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                   help="also time the short_conv.py of another copy of the model folder at PATH; repeatable")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and two candidates a kernel (CPU, interpreter)")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq, args.channels, args.doc = 2, 40, 48, 16
    return args


def candidates(role, smoke):
    """Launches to try for one role: the default first, then tiles of 8 or 16 values a thread at 4 or 8 warps in both
    program orders; for a persistent kernel also the default tile at other programs per SM."""
    default = dict(short_conv.LAUNCH[role])
    if smoke:
        return [default, dict(default, BT=8, BD=16, num_warps=1, channels_first=not default["channels_first"])]
    out = [default]
    for bt, bd, warps, first in itertools.product((16, 32, 64), (32, 64, 128, 256), (4, 8), (False, True)):
        if bt * bd // (32 * warps) in (8, 16):
            out.append(dict(default, BT=bt, BD=bd, num_warps=warps, channels_first=first))
    if "programs_per_sm" in default:
        out += [dict(default, programs_per_sm=p, channels_first=first) for p in (4, 8, 32) for first in (False, True)]
    return [cfg for i, cfg in enumerate(out) if cfg not in out[:i]]


def timer(device):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100)

    def wall(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer in this run
        print(f"fla is not importable ({type(e).__name__}: {e}); ours only")
        return None
    return causal_conv1d


def run_case(name, x, weight, cu, dy, bench, smoke, gbps_copy):
    """Every candidate of the three kernels on one input; returns the rows and the best launch per role."""
    n, c = x.shape[0] * x.shape[1], x.shape[2]
    elem = x.element_size()
    fwd_bytes, bwd_bytes = 2 * n * c * elem, 3 * n * c * elem  # see the module docstring
    saved = {role: dict(cfg) for role, cfg in short_conv.LAUNCH.items()}
    ref_y = short_conv.conv_silu_fwd(x, weight, cu, None)
    ref_dx, ref_dw = short_conv.conv_silu_bwd(x, weight, cu, None, dy)
    rows, best = [], {}
    for role in [r for r in saved if r != "state"]:
        timed = []
        for cfg in candidates(role, smoke):
            short_conv.LAUNCH.update({r: dict(v) for r, v in saved.items()})
            short_conv.LAUNCH[role] = cfg
            if role == "fwd":
                fn = lambda: short_conv.conv_silu_fwd(x, weight, cu, None)  # noqa: E731
                y = fn()
                ok, err = torch.equal(y, ref_y), 0.0
                moved = fwd_bytes
            else:
                fn = lambda: short_conv.conv_silu_bwd(x, weight, cu, None, dy)  # noqa: E731
                dx, dw = fn()
                err = rel(dw, ref_dw)
                ok = torch.equal(dx, ref_dx) and err < 1e-3
                moved = bwd_bytes
            if not ok:
                raise SystemExit(f"{name} {role} {cfg}: result differs from the default launch (dweight {err:.1e})")
            ms = bench(fn)
            tbps = moved / ms / 1e9
            timed.append((ms, cfg))
            rows.append(dict(case=name, role=role, launch=cfg, ms=ms, tb_per_s=tbps, of_copy=tbps * 1e3 / gbps_copy,
                             dweight_rel_to_default=err))
        timed.sort(key=lambda t: t[0])
        best[role] = timed[0][1]
        print(f"\n{name}, {role} ({'x -> y' if role == 'fwd' else 'whole backward, the other kernel at default'})")
        print("| ms | TB/s | of copy | launch |")
        print("|---|---|---|---|")
        for r in sorted((r for r in rows if r["case"] == name and r["role"] == role), key=lambda r: r["ms"])[:8]:
            print(f"| {r['ms']:.3f} | {r['tb_per_s']:.2f} | {r['of_copy']:.0%} | {r['launch']} |")
    short_conv.LAUNCH.update({r: dict(v) for r, v in saved.items()})
    return rows, best


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = timer(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T, C, W = args.batch, args.seq, args.channels, args.width
    wide = torch.randn(B, T, C + 64, generator=gen).to(device, dtype)
    x = wide[..., :C]  # rows C + 64 apart, as the layer's column slice of its projection
    weight = (torch.randn(C, W, generator=gen) * 0.5).to(device, dtype)
    dy = torch.randn(B, T, C, generator=gen).to(device, dtype)
    n_docs = B * T // args.doc
    cu = (torch.arange(n_docs + 1, dtype=torch.int32) * args.doc).to(device)

    copy_dst = torch.empty_like(dy)
    copy_ms = bench(lambda: copy_dst.copy_(dy))
    gbps_copy = 2 * dy.numel() * dy.element_size() / copy_ms / 1e6
    print(f"copy of {tuple(dy.shape)} {dtype}: {copy_ms:.3f} ms, {gbps_copy / 1e3:.2f} TB/s")

    # the default launch against float64
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    errors = {}
    for name, c in (("plain", None), ("packed", cu)):
        xs, cs = (x, c) if c is None else (x.reshape(1, B * T, C), c)
        y64 = short_conv.short_conv_silu_torch(x64 if c is None else x64.reshape(1, B * T, C), w64, cs)
        dx64, dw64 = torch.autograd.grad(y64, [x64, w64], dy.double().reshape(y64.shape))
        y = short_conv.conv_silu_fwd(xs, weight, cs, None)
        dx, dw = short_conv.conv_silu_bwd(xs, weight, cs, None, dy.reshape(y.shape))
        errors[name] = dict(y=rel(y, y64), dx=rel(dx, dx64.reshape(dx.shape)), dweight=rel(dw, dw64))
        print(f"{name}: default launch vs float64: y {errors[name]['y']:.1e}, dx {errors[name]['dx']:.1e}, "
              f"dweight {errors[name]['dweight']:.1e}")

    rows, best = [], {}
    for name, c in (("plain", None), ("packed", cu)):
        xs = x if c is None else x.reshape(1, B * T, C)
        r, b = run_case(name, xs, weight, c, dy.reshape(xs.shape), bench, args.smoke, gbps_copy)
        rows += r
        best[name] = b

    impls = {"ours": short_conv}
    for spec in args.alt:
        label, path = spec.split("=", 1)
        impls[label] = import_model_folder(label, path, "short_conv")
    causal_conv1d = fla_conv() if device.type == "cuda" else None  # its autotuner needs a GPU driver
    peer = {}
    for name, c in (("plain", None), ("packed", cu)):
        xs = x if c is None else x.reshape(1, B * T, C)
        dys = dy.reshape(xs.shape)
        peer[name] = {}
        ref = None
        for label, module in impls.items():
            y = module.conv_silu_fwd(xs, weight, c, None)
            dx, dw = module.conv_silu_bwd(xs, weight, c, None, dys)
            if ref is None:
                ref = y, dx, dw
            elif max(rel(y, ref[0]), rel(dx, ref[1]), rel(dw, ref[2])) >= 1e-3:
                raise SystemExit(f"{name}: {label}'s results differ from ours by 1e-3 or more")
            peer[name][label] = dict(
                fwd=bench(lambda: module.conv_silu_fwd(xs, weight, c, None)),
                bwd=bench(lambda: module.conv_silu_bwd(xs, weight, c, None, dys)))
        if causal_conv1d is not None:
            xc = xs.contiguous().requires_grad_()
            wf = weight.detach().requires_grad_()
            kw = dict(activation="silu") | ({} if c is None else dict(cu_seqlens=c))
            fwd = bench(lambda: causal_conv1d(xc, wf, **kw))
            both = bench(lambda: torch.autograd.grad(causal_conv1d(xc, wf, **kw)[0], [xc, wf], dys))
            peer[name]["fla"] = dict(fwd=fwd, bwd=both - fwd, rel_to_ours=rel(causal_conv1d(xc, wf, **kw)[0], ref[0]))
        print(f"\n{name}, default launches: ms (fla's backward: its forward+backward less its forward)")
        print("| impl | fwd | bwd | fwd+bwd |")
        print("|---|---|---|---|")
        for label, t in peer[name].items():
            print(f"| {label} | {t['fwd']:.3f} | {t['bwd']:.3f} | {t['fwd'] + t['bwd']:.3f} |")
    for name, b in best.items():
        print(f"{name}: best launches {b}")

    if args.out:
        env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   shape=dict(B=B, T=T, C=C, W=W, doc=args.doc, dtype=str(dtype)))
        with open(args.out, "w") as f:
            json.dump(dict(environment=env, copy_ms=copy_ms, copy_tb_per_s=gbps_copy / 1e3, default_vs_float64=errors,
                           rows=rows, best=best, peer=peer), f, indent=1)


if __name__ == "__main__":
    main()

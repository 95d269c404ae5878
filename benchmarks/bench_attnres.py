"""Block AttnRes' depth attention as a sublayer of the model calls it, at candidate launches of its kernels, against
flash-linear-attention's `fused_attnres` and a copy of the same bytes, in one run (GPU).

The shape is the twin's (bench_model.py): B x T tokens of hidden 1024, bf16 sources and parameters, S sources (the
twin's sublayers read 1 to 5, 3.4 on average), through `DepthAttention(sources, norm=(weight, eps))`: the autograd
function with the sublayer's RMSNorm in the kernels, every source but the newest marked with a gradient sink that an
earlier reader (in backward order) has filled, so the backward adds to it in place, as the model's completed
sources do; the gradients of the sources and of the three parameters. Each candidate launch
(`attnres_triton.LAUNCH`: values per program tile and per thread, programs per SM of the persistent backward;
`HOLD_REGISTERS`) is checked against float64 before it is timed (the torch path of `attnres.py` and its RMSNorm,
autograd for the gradients): the output and every source's gradient within 2e-2 relative. Table: ms
(`triton.testing.do_bench` median; the backward as forward+backward less forward), the bytes a pass must move at
the least over its time (forward: read S sources, write the output; backward: read S sources and dout, read S - 1
sinks, write S gradients), and that rate as a share of a device-to-device copy's in the same run. Peers at each S:
fla's `fused_attnres(query, sources, key norm weight, output_rms_weight=norm weight)`, the model's RMSNorm forward
and backward alone (what the standard residual pays in its place), and with `--alt NAME=PATH` the `attnres.py` of
another copy of the model folder at its default launch.

    python benchmarks/bench_attnres.py --out attnres_h200.json [--alt NAME=PATH ...]
    TRITON_INTERPRET=1 python benchmarks/bench_attnres.py --smoke        # CPU: checks that everything runs
"""

import argparse
import itertools
import json

import torch
from bench_conv import rel, timer
from model_folder import import_model_folder

from kdamoe.model import attnres, attnres_triton
from kdamoe.model.fused_norm import rms_norm, rms_norm_torch

EPS = 1e-6


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--sweep", default="3,5", help="comma-separated source counts whose launches are swept")
    p.add_argument("--peers", default="2,3,4,5", help="comma-separated source counts timed at the default launch")
    p.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                   help="also time the attnres_triton.py of another copy of the model folder at PATH; repeatable")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and two candidates a pass (CPU, interpreter)")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.seq, args.hidden, args.sweep, args.peers = 2, 8, 64, "3", "2"
    args.sweep = [int(s) for s in args.sweep.split(",") if s]
    args.peers = [int(s) for s in args.peers.split(",") if s]
    return args


def candidates(default, smoke):
    """`(launch, hold_registers)` to try for one pass from its `default` pair: the default first, then program tiles of 1 to 4 rows of 1024
    at 2 to 16 values a thread (4 to 16 warps), tiles held in registers or loaded where used; for the persistent
    backward also the default tile at other programs per SM."""
    if smoke:
        return [default, (dict(default[0], tile=128, values_per_thread=1), 0)]
    out = [default]
    for tile, vpt, hold in itertools.product((1024, 2048, 4096), (2, 4, 8, 16), (0, 64, 128)):
        if 4 <= tile // (32 * vpt) <= 16:
            out.append((dict(default[0], tile=tile, values_per_thread=vpt), hold))
    if "programs_per_sm" in default[0]:
        out += [(dict(default[0], programs_per_sm=p), default[1]) for p in (4, 8, 16, 24)]
    return [c for i, c in enumerate(out) if c not in out[:i]]


class Case:
    """S sources of [B, T, D] (leaves), a cotangent, and the float64 reference of one sublayer's depth attention
    with its norm: the output and every source's gradient."""

    def __init__(self, S, B, T, D, device, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        scales = torch.linspace(0.5, 2.0, S)  # sources of different magnitudes, as the sums of blocks are
        self.sources = [(torch.randn(B, T, D, generator=gen) * c).to(device, dtype).requires_grad_() for c in scales]
        self.params = [(torch.randn(D, generator=gen) * 0.05).to(device, dtype),  # query, key norm gain, norm weight
                       (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype),
                       (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)]
        self.dout = torch.randn(B, T, D, generator=gen).to(device, dtype)
        ref = Impl(attnres, self, torch.float64)
        wide = [v.detach().double().requires_grad_() for v in self.sources]
        out = rms_norm_torch(ref.module(wide, backend="torch"), ref.norm_weight, EPS)
        self.ref_out = out.detach()
        self.ref_grads = torch.autograd.grad(out, wide, self.dout.double())

    def bytes_moved(self):
        S, n, elem = len(self.sources), self.sources[0].numel(), self.sources[0].element_size()
        return (S + 1) * n * elem, (S + 1 + S - 1 + S) * n * elem


class Impl:
    """A model folder's `DepthAttention` on a case's sources as a sublayer of the model reads them: the parameters
    of the case, every source but the newest marked with a gradient sink that an earlier reader (in backward order)
    has filled, so the backward adds to it in place."""

    def __init__(self, module, case, dtype=None):
        query, gamma, norm_weight = (p.to(dtype) if dtype else p for p in case.params)
        self.case = case
        self.module = module.DepthAttention(query.numel(), EPS).to(query.device, query.dtype)
        with torch.no_grad():
            self.module.query.copy_(query)
            self.module.key_norm_weight.copy_(gamma)
        self.norm_weight = norm_weight.detach().clone().requires_grad_()
        self.params = [self.module.query, self.module.key_norm_weight, self.norm_weight]
        if dtype is None:
            self.marked = [module.with_gradient_sink(v) for v in case.sources[:-1]] + case.sources[-1:]
            self.sinks = [torch.zeros_like(v) for v in case.sources[:-1]]

    def fwd(self):
        return self.module(self.marked, backend="triton", norm=(self.norm_weight, EPS))

    def fwd_bwd(self, sinks=None):
        """The gradients of the sources (each the sink's buffer plus this reader's part) and parameters."""
        for v, buf in zip(self.marked, sinks or self.sinks):
            v._gradient_sink.grad = buf
        return torch.autograd.grad(self.fwd(), self.case.sources + self.params, self.case.dout, retain_graph=True)

    def error(self):
        """The largest relative error against float64 of the output and of the sources' gradients."""
        grads = self.fwd_bwd([torch.zeros_like(v) for v in self.sinks])
        return max([rel(self.fwd(), self.case.ref_out)] + [rel(g, r) for g, r in zip(grads, self.case.ref_grads)])

    def times(self, bench):
        fwd = bench(self.fwd)
        return fwd, bench(self.fwd_bwd) - fwd


def sweep(case, bench, smoke, copy_rate):
    """Every candidate of both passes; returns the rows (ms, TB/s, share of the copy's rate, error)."""
    S = len(case.sources)
    fwd_bytes, bwd_bytes = case.bytes_moved()
    saved_launch, saved_hold = {r: dict(c) for r, c in attnres_triton.LAUNCH.items()}, attnres_triton.HOLD_REGISTERS
    impl = Impl(attnres, case)
    rows = []
    for role in ("fwd", "bwd"):
        seen = []
        for cfg, hold in candidates((saved_launch[role], saved_hold), smoke):
            attnres_triton.LAUNCH.update({r: dict(c) for r, c in saved_launch.items()})
            attnres_triton.LAUNCH[role], attnres_triton.HOLD_REGISTERS = cfg, hold
            launch = (attnres_triton._launch(case.sources, cfg), cfg.get("programs_per_sm"))
            if launch in seen:  # the same kernel as an earlier candidate (HOLD is decided per S)
                continue
            seen.append(launch)
            err = impl.error()
            if not err < 2e-2:
                raise SystemExit(f"S={S} {role} {cfg} hold {hold}: error {err:.1e} against float64")
            ms = impl.times(bench)[role == "bwd"]
            rate = (bwd_bytes if role == "bwd" else fwd_bytes) / ms / 1e9
            rows.append(dict(sources=S, role=role, launch=cfg, hold_registers=hold, ms=ms, tb_per_s=rate,
                             of_copy=rate / copy_rate, error=err))
        print(f"\nS = {S}, {role}: the 6 fastest launches")
        print("| ms | TB/s | of copy | error | launch | hold |")
        print("|---|---|---|---|---|---|")
        for r in sorted((r for r in rows if r["role"] == role), key=lambda r: r["ms"])[:6]:
            print(f"| {r['ms']:.3f} | {r['tb_per_s']:.2f} | {r['of_copy']:.0%} | {r['error']:.1e} | {r['launch']} | "
                  f"{r['hold_registers']} |")
        default = next(r for r in rows if r["role"] == role)
        print(f"default: {default['ms']:.3f} ms, {default['of_copy']:.0%} of copy")
    attnres_triton.LAUNCH.update(saved_launch)
    attnres_triton.HOLD_REGISTERS = saved_hold
    return rows


def fla_attnres():
    try:
        from fla.ops.attnres import fused_attnres
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer in this run
        print(f"fla is not importable ({type(e).__name__}: {e}); ours only")
        return None
    return fused_attnres


def peers(case, bench, folders, fused_attnres):
    """ms of the forward and backward of each model folder's `DepthAttention` (`folders`: label -> its `attnres`
    module) at its default launch, of fla's `fused_attnres` and of the model's RMSNorm alone."""
    out = {}
    for label, module in folders.items():
        impl = Impl(module, case)
        fwd, bwd = impl.times(bench)
        out[label] = dict(fwd=fwd, bwd=bwd, error=impl.error())
    x = case.sources[-1]
    w = case.params[2].detach().requires_grad_()
    fwd = bench(lambda: rms_norm(x, w, EPS))
    out["rmsnorm alone"] = dict(fwd=fwd, bwd=bench(lambda: torch.autograd.grad(rms_norm(x, w, EPS), [x, w],
                                                                                 case.dout)) - fwd)
    if fused_attnres is not None:
        q, g, nw = (p.detach().requires_grad_() for p in case.params)
        call = lambda: fused_attnres(q, case.sources, g, output_rms_weight=nw, rms_eps=EPS)  # noqa: E731
        fwd = bench(call)
        both = bench(lambda: torch.autograd.grad(call(), case.sources + [q, g, nw], case.dout))
        out["fla"] = dict(fwd=fwd, bwd=both - fwd, error=rel(call(), case.ref_out))
    return out


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = timer(device)
    B, T, D = args.batch, args.seq, args.hidden
    probe = torch.randn(B, T, D, device=device, dtype=dtype)
    copy_dst = torch.empty_like(probe)
    copy_ms = bench(lambda: copy_dst.copy_(probe))
    copy_rate = 2 * probe.numel() * probe.element_size() / copy_ms / 1e9
    print(f"copy of {tuple(probe.shape)} {dtype}: {copy_ms:.3f} ms, {copy_rate:.2f} TB/s")

    rows = []
    for S in args.sweep:
        rows += sweep(Case(S, B, T, D, device, dtype, seed=S), bench, args.smoke, copy_rate)

    folders = {"ours": attnres}
    for spec in args.alt:
        label, path = spec.split("=", 1)
        folders[label] = import_model_folder(label, path, "attnres")
    fused_attnres = fla_attnres() if device.type == "cuda" else None
    peer = {}
    print("\ndefault launches: ms (fla's backward: its forward+backward less its forward)")
    print("| S | impl | fwd | bwd | fwd+bwd |")
    print("|---|---|---|---|---|")
    for S in args.peers:
        peer[S] = peers(Case(S, B, T, D, device, dtype, seed=S), bench, folders, fused_attnres)
        for label, t in peer[S].items():
            print(f"| {S} | {label} | {t['fwd']:.3f} | {t['bwd']:.3f} | {t['fwd'] + t['bwd']:.3f} |")

    if args.out:
        env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                   shape=dict(B=B, T=T, D=D, dtype=str(dtype)))
        with open(args.out, "w") as f:
            json.dump(dict(environment=env, copy_ms=copy_ms, copy_tb_per_s=copy_rate, rows=rows, peer=peer), f,
                      indent=1)


if __name__ == "__main__":
    main()

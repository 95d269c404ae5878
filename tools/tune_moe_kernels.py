"""Block sizes of the MoE token kernels (moe_triton.py) at the bench_moe shape: the combine's gather-sum and its
backward, the SiTU-GLU forward and backward (`SITU_LAUNCH`) on the routed experts' packed `[N*k, 2I]`
projection, and the token permutation's row gather (`GATHER_LAUNCH`) against `index_select`; each configuration
checked against torch and timed (do_bench median). Prints a table, writes JSON; the launch tables are left as
they were.

    PYTHONPATH=src python tools/tune_moe_kernels.py [--kernels combine,situ_glu,gather_rows]
"""

import argparse
import json
import os

import torch
import triton
from triton.testing import do_bench

from kdamoe.model import moe_triton
from kdamoe.model.moe import _situ_glu_backward, _situ_glu_forward
from kdamoe.model.moe_triton import _combine_bwd_kernel, _gather_sum_kernel

N, K, D, I = 16384, 8, 2048, 768


def tune_gather_rows():
    """Row gather `x[p] = hidden[p // k]`-style (random token order) under each `GATHER_LAUNCH` candidate."""
    hidden = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    index = torch.randperm(N * K, device="cuda") // K
    want = hidden.index_select(0, index)
    out = torch.empty_like(want)
    byts = 2 * N * K * D * 2  # rows read + rows written
    ms = do_bench(lambda: hidden.index_select(0, index), warmup=20, rep=200, return_mode="median")
    rows = [dict(impl="index_select", ms=ms, tbs=byts / ms / 1e9)]
    print(f"gather index_select: {ms:.3f} ms ({byts / ms / 1e9:.2f} TB/s)", flush=True)
    for block_d in (512, 1024, 2048):
        for elems in (4096, 8192, 16384):
            for warps in (4, 8):
                moe_triton.GATHER_LAUNCH.update(block_d=block_d, elems=elems, num_warps=warps)
                fn = lambda: moe_triton.gather_rows_triton(hidden, index, out)  # noqa: E731
                fn()
                assert torch.equal(out, want)
                ms = do_bench(fn, warmup=20, rep=200, return_mode="median")
                rows.append(dict(block_d=block_d, elems=elems, warps=warps, ms=ms, tbs=byts / ms / 1e9))
                print(f"gather block_d {block_d:5d} elems {elems:6d} warps {warps}: {ms:.3f} ms "
                      f"({byts / ms / 1e9:.2f} TB/s)", flush=True)
    return rows


def tune_situ_glu():
    """SiTU-GLU forward / backward under each `SITU_LAUNCH` candidate; bytes moved per call over the time."""
    gate_up = torch.randn(N * K, 2 * I, device="cuda", dtype=torch.bfloat16) * 4
    g, u = gate_up.chunk(2, dim=-1)
    dh = torch.randn(N * K, I, device="cuda", dtype=torch.bfloat16)
    want = _situ_glu_forward(g, u).float()
    want_dg, want_du = (t.float() for t in _situ_glu_backward(g, u, dh))
    h = torch.empty(N * K, I, device="cuda", dtype=torch.bfloat16)
    dgu = torch.empty_like(gate_up)
    dg, du = dgu.chunk(2, dim=-1)
    elem = N * K * I * 2  # bytes of one [N*k, I] bf16 tensor
    rows = []
    for block_n in (128, 256, 1024):
        for elems in (2048, 4096, 8192, 16384):
            for warps in (4, 8):
                moe_triton.SITU_LAUNCH.update(block_n=block_n, elems=elems, num_warps=warps)
                fwd = lambda: moe_triton.situ_glu_fwd_triton(g, u, h)  # noqa: E731
                bwd = lambda: moe_triton.situ_glu_bwd_triton(g, u, dh, dg, du)  # noqa: E731
                fwd()
                bwd()
                err = max(((a.float() - b).norm() / b.norm()).item() for a, b in ((h, want), (dg, want_dg),
                                                                                  (du, want_du)))
                ms_f = do_bench(fwd, warmup=20, rep=200, return_mode="median")
                ms_b = do_bench(bwd, warmup=20, rep=200, return_mode="median")
                rows.append(dict(block_n=block_n, elems=elems, warps=warps, fwd_ms=ms_f, fwd_tbs=3 * elem / ms_f / 1e9,
                                 bwd_ms=ms_b, bwd_tbs=5 * elem / ms_b / 1e9, err=err))
                print(f"SiTU-GLU block_n {block_n:5d} elems {elems:6d} warps {warps}: fwd {ms_f:.3f} ms "
                      f"({3 * elem / ms_f / 1e9:.2f} TB/s), bwd {ms_b:.3f} ms ({5 * elem / ms_b / 1e9:.2f} TB/s), "
                      f"err {err:.1e}", flush=True)
    return rows


def tune_combine():
    """The combine's gather-sum and its backward under each (BLOCK_D, num_warps)."""
    y = torch.randn(N * K, D, device="cuda", dtype=torch.bfloat16)
    inverse = torch.randperm(N * K, device="cuda")
    w = torch.rand(N, K, device="cuda")
    g = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    want = (y[inverse].view(N, K, D).float() * w[..., None]).sum(1)
    want_dw = (y[inverse].view(N, K, D).float() * g[:, None].float()).sum(-1)
    byts = 2 * (N * K * D + N * D)
    rows = []
    for block_d in (256, 512, 1024, 2048):
        for warps in (2, 4, 8):
            out = torch.empty(N, D, device="cuda", dtype=torch.bfloat16)

            def fwd():
                _gather_sum_kernel[(N, triton.cdiv(D, block_d))](y, w, inverse, out, D, y.stride(0), out.stride(0),
                                                               K=K, BLOCK_K=K, BLOCK_D=block_d, HAS_W=True,
                                                               num_warps=warps)
            fwd()
            err = ((out.float() - want).norm() / want.norm()).item()
            ms = do_bench(fwd, warmup=20, rep=200, return_mode="median")
            dy = torch.empty_like(y)
            dw = torch.empty(N, K, device="cuda")

            def bwd():
                _combine_bwd_kernel[(N,)](g, y, w, inverse, dy, dw, D, g.stride(0), y.stride(0), dy.stride(0), K=K,
                                          BLOCK_K=K, BLOCK_D=block_d, NEED_DW=True, num_warps=warps)
            bwd()
            err_b = ((dw - want_dw).norm() / want_dw.norm()).item()
            ms_b = do_bench(bwd, warmup=20, rep=200, return_mode="median")
            rows.append(dict(block_d=block_d, warps=warps, gather_sum_ms=ms, gather_sum_tbs=byts / ms / 1e9,
                             gather_sum_err=err, combine_bwd_ms=ms_b, combine_bwd_err=err_b))
            print(f"BLOCK_D {block_d:5d} warps {warps}: gather-sum {ms:.3f} ms ({byts / ms / 1e9:.2f} TB/s, "
                  f"err {err:.1e}); combine bwd {ms_b:.3f} ms (dw err {err_b:.1e})", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="combine,situ_glu,gather_rows", help="comma-separated")
    args = ap.parse_args()
    torch.manual_seed(0)
    tuners = dict(combine=tune_combine, situ_glu=tune_situ_glu, gather_rows=tune_gather_rows)
    kept = dict(moe_triton.SITU_LAUNCH), dict(moe_triton.GATHER_LAUNCH)
    res = {name: tuners[name]() for name in args.kernels.split(",")}
    moe_triton.SITU_LAUNCH.update(kept[0])
    moe_triton.GATHER_LAUNCH.update(kept[1])
    with open(os.path.join(os.environ.get("OUT", "."), "tune_moe_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

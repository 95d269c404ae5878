"""Block sizes of the MoE token kernels (moe_triton.py) at the bench_moe shape: the combine's gather-sum and its
backward, each configuration checked against torch and timed (do_bench median). Prints a table, writes JSON.

    PYTHONPATH=src python benchmarks/tune_moe_kernels.py
"""

import json
import os

import torch
import triton
from triton.testing import do_bench

from kdamoe.model.moe_triton import _combine_bwd_kernel, _gather_sum_kernel

N, K, D = 16384, 8, 2048


def main():
    torch.manual_seed(0)
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
    with open(os.path.join(os.environ.get("OUT", "."), "tune_moe_kernels.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

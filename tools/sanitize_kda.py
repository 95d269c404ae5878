"""A small forward+backward through every path of the KDA Triton kernels, for NVIDIA's compute-sanitizer:

    compute-sanitizer --tool memcheck python3 tools/sanitize_kda.py    # expect "ERROR SUMMARY: 0 errors"

Paths: bf16 with both gates (dense and safe diagonal blocks), fp32 at head dim 64 with varlen documents, fp16 with
a partial last chunk, one bf16 sequence of 300 tokens in slabs of 128 (the chunk loops on a second stream); each with
an initial state and the final state. Prints whether every gradient is finite.
(DEV=cpu with TRITON_INTERPRET=1 runs the same on the CPU.)
"""
import os

import torch

from kdamoe.model import kda_launch
from kdamoe.model.kda_chunk import chunk_kda_triton

DEV = os.environ.get("DEV", "cuda")
CASES = [  # head dim, dtype, gate, cu_seqlens, slab tokens
    (128, torch.bfloat16, "bounded", None, None),
    (128, torch.bfloat16, "softplus", None, None),
    (64, torch.float32, "bounded", [0, 70, 200, 333], None),
    (128, torch.float16, "bounded", [0, 130, 257], None),
    (128, torch.bfloat16, "bounded", None, 128),
]


def main():
    torch.manual_seed(0)
    for K, dt, gate, cu, slab in CASES:
        kda_launch.SLAB_TOKENS = slab
        B, T, H = (1, cu[-1], 2) if cu else (1, 300, 2) if slab else (2, 200, 2)
        q = torch.randn(B, T, H, K, device=DEV, dtype=dt, requires_grad=True)
        k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=DEV), dim=-1).to(dt).requires_grad_()
        v = torch.randn(B, T, H, K, device=DEV, dtype=dt, requires_grad=True)
        g = (-5 * torch.rand(B, T, H, K, device=DEV)).requires_grad_()
        beta = torch.rand(B, T, H, device=DEV, dtype=dt).requires_grad_()
        h0 = torch.randn(len(cu) - 1 if cu else B, H, K, K, device=DEV, requires_grad=True)
        cus = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu else None
        o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cus,
                                 gate=gate)
        (o.float().square().sum() + ht.square().sum()).backward()
        finite = all(t.grad.isfinite().all().item() for t in (q, k, v, g, beta, h0))
        print(f"K={K} {dt} {gate} cu_seqlens={cu} slabs of {slab}: gradients finite: {finite}")


if __name__ == "__main__":
    main()

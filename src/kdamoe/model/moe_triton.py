"""Fused Triton kernels for the SiTU-GLU activation (forward and backward); imported only when triton is there.

`h = [4 tanh(g/4) sigmoid(g)] * [25 tanh(u/25)]`, computed in fp32 from 2-D row-strided views `[M, I]` (unit
column stride), so the gate and up halves of a packed `[M, 2I]` projection are read in place and the backward
writes both halves of one packed gradient.
"""

import torch

try:  # inside try so that transformers' remote-code import check does not demand triton; moe.py catches this
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the fused SiTU-GLU kernels need triton") from error


@triton.jit
def _tanh(x):
    # tanh(x) = 2 sigmoid(2x) - 1 (absolute error ~1e-7 in fp32; works in the interpreter too)
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_glu_fwd_kernel(g_ptr, u_ptr, h_ptr, M, N, stride_g, stride_u, stride_h,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    rows = rows.to(tl.int64)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a = 4.0 * _tanh(0.25 * g) * tl.sigmoid(g)
    b = 25.0 * _tanh(0.04 * u)
    tl.store(h_ptr + rows * stride_h + cols, (a * b).to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_bwd_kernel(g_ptr, u_ptr, dh_ptr, dg_ptr, du_ptr, M, N, stride_g, stride_u, stride_dh, stride_dg,
                         stride_du, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M) & (cols < N)
    rows = rows.to(tl.int64)
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + rows * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    tg = _tanh(0.25 * g)
    sg = tl.sigmoid(g)
    tu = _tanh(0.04 * u)
    a = 4.0 * tg * sg
    b = 25.0 * tu
    da = (1.0 - tg * tg) * sg + a * (1.0 - sg)
    db = 1.0 - tu * tu
    tl.store(dg_ptr + rows * stride_dg + cols, (dh * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows * stride_du + cols, (dh * a * db).to(du_ptr.dtype.element_ty), mask=mask)


def _grid(M: int, N: int) -> tuple[tuple[int, int], int, int]:
    block_n = min(1024, triton.next_power_of_2(N))
    block_m = max(1, 4096 // block_n)
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n


def situ_glu_fwd_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write `situ_glu(gate, up)` into `out`; all three `[M, I]` with unit column stride."""
    M, N = gate.shape
    grid, block_m, block_n = _grid(M, N)
    _situ_glu_fwd_kernel[grid](gate, up, out, M, N, gate.stride(0), up.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n)
    return out


def situ_glu_bwd_triton(gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor, grad_gate: torch.Tensor,
                        grad_up: torch.Tensor) -> None:
    """Write the gradients of `situ_glu` w.r.t. gate and up into `grad_gate`, `grad_up` (all `[M, I]`)."""
    M, N = gate.shape
    grid, block_m, block_n = _grid(M, N)
    _situ_glu_bwd_kernel[grid](gate, up, grad_h, grad_gate, grad_up, M, N, gate.stride(0), up.stride(0),
                               grad_h.stride(0), grad_gate.stride(0), grad_up.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n)

"""Fused Triton kernels of the MoE expert path; imported only when triton is there.

- SiTU-GLU forward and backward: `h = [4 tanh(g/4) sigmoid(g)] * [25 tanh(u/25)]`, computed in fp32 from 2-D
  row-strided views `[M, I]` (unit column stride), so the gate and up halves of a packed `[M, 2I]` projection are
  read in place and the backward writes both halves of one packed gradient.
- Token permutation: `out[p] = src[index[p]]`, rows copied in tiles (faster than torch's `index_select` for the
  expert path's shapes).
- Token combine: `out[n] = sum_j w[n, j] * y[inverse[n*k + j]]` (the weighted combine of the expert outputs, and
  with `w = 1` the backward of the token permutation) and its backward. One program per token: the k rows are
  summed in a fixed order in fp32 (no atomics), and every row of `dy` is written by exactly one program.

Offsets: a row index times its row stride is int64 (1M tokens x top-8 routed rows x 1024 values pass 2^31), and so
is a token's first slot n·k; row indices are int32 (routed rows stay below 2^31: 64M at 4M tokens x top-16).
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


# SiTU-GLU tiles: at most `block_n` columns, `elems` elements per program, chosen on an H200 at [131072, 768] bf16
# by tools/tune_moe_kernels.py (narrow tiles: a power-of-two tile over 768 columns would leave a quarter masked)
SITU_LAUNCH = dict(block_n=256, elems=2048, num_warps=8)


def _tiles(M: int, N: int, max_block_n: int, elems: int) -> tuple[tuple[int, int], int, int]:
    """Grid, rows and columns of `[M, N]` tiles of at most `max_block_n` columns and `elems` elements."""
    block_n = min(max_block_n, triton.next_power_of_2(N))
    block_m = max(1, elems // block_n)
    return (triton.cdiv(M, block_m), triton.cdiv(N, block_n)), block_m, block_n


def _situ_tiles(M: int, N: int) -> tuple[tuple[int, int], int, int]:
    return _tiles(M, N, SITU_LAUNCH["block_n"], SITU_LAUNCH["elems"])


def situ_glu_fwd_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write `situ_glu(gate, up)` into `out`; all three `[M, I]` with unit column stride."""
    M, N = gate.shape
    grid, block_m, block_n = _situ_tiles(M, N)
    _situ_glu_fwd_kernel[grid](gate, up, out, M, N, gate.stride(0), up.stride(0), out.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, num_warps=SITU_LAUNCH["num_warps"])
    return out


def situ_glu_bwd_triton(gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor, grad_gate: torch.Tensor,
                        grad_up: torch.Tensor) -> None:
    """Write the gradients of `situ_glu` w.r.t. gate and up into `grad_gate`, `grad_up` (all `[M, I]`)."""
    M, N = gate.shape
    grid, block_m, block_n = _situ_tiles(M, N)
    _situ_glu_bwd_kernel[grid](gate, up, grad_h, grad_gate, grad_up, M, N, gate.stride(0), up.stride(0),
                               grad_h.stride(0), grad_gate.stride(0), grad_up.stride(0),
                               BLOCK_M=block_m, BLOCK_N=block_n, num_warps=SITU_LAUNCH["num_warps"])


# ----------------------------------------------------------------------------------------------- token permutation


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, out_ptr, M, D, stride_src, stride_out, BLOCK_M: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < M
    src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    mask = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(src_ptr + src[:, None] * stride_src + cols[None, :], mask=mask)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], x, mask=mask)


# row-gather tiles: at most `block_d` columns, `elems` elements per program, chosen on an H200 at [16384, 2048] ->
# [131072, 2048] bf16 by tools/tune_moe_kernels.py
GATHER_LAUNCH = dict(block_d=512, elems=4096, num_warps=8)


def gather_rows_triton(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write `out[p] = src[index[p]]` (`src [N, D]`, `out [M, D]` with unit column stride, `index [M]`)."""
    M, D = out.shape
    grid, block_m, block_d = _tiles(M, D, GATHER_LAUNCH["block_d"], GATHER_LAUNCH["elems"])
    _gather_rows_kernel[grid](
        src, index, out, M, D, src.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_D=block_d,
        num_warps=GATHER_LAUNCH["num_warps"])
    return out


# ----------------------------------------------------------------------------------------------- token combine


@triton.jit
def _gather_sum_kernel(y_ptr, w_ptr, inv_ptr, out_ptr, D, stride_y, stride_out, K: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_W: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    slots = tl.arange(0, BLOCK_K)
    kmask = slots < K
    rows = tl.load(inv_ptr + n * K + slots, mask=kmask, other=0).to(tl.int64)
    mask = kmask[:, None] & (cols < D)[None, :]
    y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + n * K + slots, mask=kmask, other=0.0).to(tl.float32)
        y = y * w[:, None]
    tl.store(out_ptr + n * stride_out + cols, tl.sum(y, axis=0).to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _combine_bwd_kernel(dout_ptr, y_ptr, w_ptr, inv_ptr, dy_ptr, dw_ptr, D, stride_dout, stride_y, stride_dy,
                        K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, NEED_DW: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    kmask = slots < K
    rows = tl.load(inv_ptr + n * K + slots, mask=kmask, other=0).to(tl.int64)
    w = tl.load(w_ptr + n * K + slots, mask=kmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = kmask[:, None] & cmask[None, :]
        g = tl.load(dout_ptr + n * stride_dout + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(dy_ptr + rows[:, None] * stride_dy + cols[None, :],
                 (w[:, None] * g[None, :]).to(dy_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            y = tl.load(y_ptr + rows[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(y * g[None, :], axis=1)
    if NEED_DW:
        tl.store(dw_ptr + n * K + slots, acc.to(dw_ptr.dtype.element_ty), mask=kmask)


def _combine_blocks(k: int, D: int) -> tuple[int, int]:
    """`(BLOCK_K, BLOCK_D)`: tiles of ~8K elements for 4 warps (twice the 4K-element tiles' rate on an H200 at k=8,
    D=2048; tools/tune_moe_kernels.py)."""
    block_k = triton.next_power_of_2(k)
    return block_k, min(triton.next_power_of_2(D), max(16, 8192 // block_k))


def gather_sum_triton(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None,
                      out: torch.Tensor) -> torch.Tensor:
    """Write `out[n] = sum_j weights[n, j] * y[inverse[n*k + j]]` (weights 1 when None) into `out [N, D]`.

    `y [M, D]` and `out` with unit column stride, `inverse [N*k]` and `weights [N, k]` contiguous.
    """
    (N, D), k = out.shape, inverse.numel() // out.shape[0]
    block_k, block_d = _combine_blocks(k, D)
    _gather_sum_kernel[(N, triton.cdiv(D, block_d))](
        y, y if weights is None else weights, inverse, out, D, y.stride(0), out.stride(0),
        K=k, BLOCK_K=block_k, BLOCK_D=block_d, HAS_W=weights is not None, num_warps=4)
    return out


def combine_bwd_triton(grad_out: torch.Tensor, y: torch.Tensor | None, weights: torch.Tensor,
                       inverse: torch.Tensor, grad_y: torch.Tensor, grad_weights: torch.Tensor | None) -> None:
    """Backward of `gather_sum_triton` with weights: `grad_y[inverse[n*k + j]] = weights[n, j] * grad_out[n]` and,
    when `grad_weights [N, k]` is given, `grad_weights[n, j] = <y[inverse[n*k + j]], grad_out[n]>` (needs `y`)."""
    (N, D), k = grad_out.shape, weights.shape[1]
    block_k, block_d = _combine_blocks(k, D)
    need_dw = grad_weights is not None
    _combine_bwd_kernel[(N,)](
        grad_out, y if need_dw else grad_out, weights, inverse, grad_y, grad_weights if need_dw else weights, D,
        grad_out.stride(0), y.stride(0) if need_dw else 0, grad_y.stride(0),
        K=k, BLOCK_K=block_k, BLOCK_D=block_d, NEED_DW=need_dw, num_warps=4)

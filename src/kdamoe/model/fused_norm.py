"""Fused RMSNorm, gated RMSNorm and L2 norm: Triton kernels (one launch forward, one backward) with torch references.

- ``rms_norm(x [..., D], weight [D], eps)``: ``KDAMoERMSNorm`` exactly: ``weight · x · rsqrt(mean(x²) + eps)``
  in fp32, cast back to x's dtype, or to ``out_dtype``: under autocast a norm whose output only feeds projections
  stores it in the autocast dtype, the rounding the projection's own cast would make (no fp32 copy written, cast and
  read back; its gradient arrives in that dtype, as the cast's backward would widen it exactly).
- ``add_rms_norm(residual, x [..., D], weight [D], eps)``: ``h = residual + x`` (rounded to their promoted dtype, as
  torch's add rounds it) and ``rms_norm(h)``, returning both: a residual add and the next sublayer's norm. The
  forward writes h beside the norm's output; the backward adds the gradient h receives from later sublayers into the
  norm's gradient of h. Against the unfused ops this saves a read of h forward and a read and write backward (the
  separate add of the two gradients), and a launch each way.
- ``gated_rms_norm(o [..., H, V], weight [V], gate [..., H, V], eps)``: KDA's output path
  ``o_norm(o) * out_gate.sigmoid()``, with the unfused expression's roundings kept: the norm's output is rounded
  to o's dtype and the sigmoid to gate's dtype before the product, which is rounded to their promoted dtype. With
  fp32 o (KDA's output under autocast) the only rounding that differs from an all-fp32 fusion is the sigmoid's, to
  the gate's bf16 (relative <= 2^-8); keeping it makes the fused output equal the unfused one but for last-bit flips
  from the fp32 sums' order (tests/test_fused_ops.py measures both).
- ``l2norm(x [..., D], eps)``: ``x · rsqrt(Σ x² + eps)`` in fp32, back in x's dtype (q and k of KDA). Reads any
  ``[N, H, D]``-strided view (the q / k slices of the conv output) without a copy.

Dispatch: the Triton path for CUDA tensors when triton imports, else torch; ``backend="torch" | "triton"`` forces
one (the tests run the Triton path on CPU tensors under ``TRITON_INTERPRET=1``). The torch paths are plain autograd
code and the reference. Every kernel computes in fp32.

Launches: rows are ``[BLOCK_R, BLOCK_D]`` tiles, ``BLOCK_D`` the next power of 2 of D (the whole row in registers,
so the reduction is one ``tl.sum``, up to ``MAX_BLOCK_D``) and ``BLOCK_R`` rows so a tile holds ``TILE_ELEMENTS``
values (a 128-wide head norm then takes 32 rows per program instead of one). Row offsets are int64 (rows x D passes
2^31 at 1M tokens x 4096 channels); row indices are int32 (rows are tokens or token-heads: 2^28 at 4M x 64). The
forwards run one program per tile; the RMSNorm backward runs a persistent grid of ``BWD_PROGRAMS_PER_SM`` programs
per SM, each looping over tiles and keeping its weight-gradient partial sum in registers, stored as one row of a
``[P, D]`` fp32 buffer summed in torch after: deterministic, no atomics. The forwards save rstd ``[R]`` fp32 so no
backward recomputes the reduction. Tile and warp choices (``_row_tile``; the RMSNorm backward at twice the forward's
warps, as it holds more tiles) follow from register counts, not timings, for these memory-bound kernels; compiled
for sm_90 (triton 3.9, D = 128 / 1024 / 4096) they take 56-77 registers forward, 76-99 backward, no spills.
"""

import functools

import torch

from .kda_common import L2NORM_EPS
from .kda_common import l2norm as kda_l2norm

try:  # inside try: the module (and transformers' remote-code import check) must work without triton
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BACKENDS = ("torch", "triton")
TILE_ELEMENTS = 4096  # values per program tile (rows x next power of 2 of D)
MAX_BLOCK_D = 16384  # longest row a program holds in registers
BWD_PROGRAMS_PER_SM = 4  # persistent backward grids: programs per SM (over all column blocks)
INTERPRETER_PROGRAMS = 3  # persistent grids on the CPU interpreter: few programs, several tiles each (tests the loop)


# ---------------------------------------------------------------------------------------------------------------------
# torch references
# ---------------------------------------------------------------------------------------------------------------------


def rms_norm_torch(x, weight, eps):
    """``KDAMoERMSNorm.forward``: fp32 compute (fp64 for fp64 x), output in x's dtype."""
    dtype, wide = x.dtype, torch.promote_types(x.dtype, torch.float32)
    x = x.to(wide)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(wide) * x).to(dtype)


def add_rms_norm_torch(residual, x, weight, eps):
    """``(h, rms_norm(h))`` with ``h = residual + x``: the residual add and the next sublayer's norm."""
    h = residual + x
    return h, rms_norm_torch(h, weight, eps)


def gated_rms_norm_torch(o, weight, gate, eps):
    """The KDA output path ``o_norm(o) * out_gate.sigmoid()``; output in ``promote_types(o.dtype, gate.dtype)``."""
    return rms_norm_torch(o, weight, eps) * gate.sigmoid()


def l2norm_torch(x, eps=L2NORM_EPS):
    """``x · rsqrt(Σ x² + eps)`` over the last dim in fp32 (fp64 for fp64 x), back in x's dtype."""
    return kda_l2norm(x, eps).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch and launch helpers (shared with short_conv.py)
# ---------------------------------------------------------------------------------------------------------------------


def use_triton(backend, x):
    """True to run the Triton path: forced by ``backend``, else for CUDA tensors when triton is installed."""
    if backend is None:
        return triton is not None and x.is_cuda
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and triton is None:
        raise RuntimeError("backend='triton' needs triton, which is not installed")
    return backend == "triton"


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device, n_tiles, n_columns=1, per_sm=BWD_PROGRAMS_PER_SM):
    """Programs along axis 0 of a persistent backward grid: ``per_sm`` per SM shared by ``n_columns`` column blocks
    on CUDA, ``INTERPRETER_PROGRAMS`` on the CPU; at least 1 (it stores the zero partial sums of an empty input), at
    most one per tile."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target = per_sm * _sm_count(index) // n_columns
    else:
        target = INTERPRETER_PROGRAMS
    return max(1, min(n_tiles, target))


def _row_tile(D):
    """``(BLOCK_R, BLOCK_D, num_warps)`` for rows of D values (see the module docstring)."""
    block_d = triton.next_power_of_2(D)
    if block_d > MAX_BLOCK_D:
        raise ValueError(f"the fused norms hold a row in registers: D must be <= {MAX_BLOCK_D}, got {D}")
    block_r = max(1, TILE_ELEMENTS // block_d)
    return block_r, block_d, min(16, max(4, block_r * block_d // 1024))


def _check_norm(x, weight, gate=None):
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape [{x.shape[-1]}], got {tuple(weight.shape)}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate must have the shape of o {tuple(x.shape)}, got {tuple(gate.shape)}")


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_fwd_kernel(X, G, Wt, Y, RSTD, RES, H, R, D, eps,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
                        HAS_RES: tl.constexpr):
        """One tile of rows: y = w · x · rstd (then, HAS_GATE, rounded as o_norm's output times sigmoid(g)); with
        HAS_RES x is first ``h = res + x`` rounded to H's dtype (as torch's add rounds it), stored into H."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m_r, m_d = rows < R, cols < D
        mask = m_r[:, None] & m_d[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            h = (tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32) + x).to(H.dtype.element_ty)
            tl.store(H + offs, h, mask=mask)
            x = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        w = tl.load(Wt + cols, mask=m_d, other=0.0).to(tl.float32)
        y = w[None, :] * (x * rstd[:, None])
        if HAS_GATE:
            s = tl.sigmoid(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32))
            y = y.to(X.dtype.element_ty).to(tl.float32) * s.to(G.dtype.element_ty).to(tl.float32)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=m_r)

    @triton.jit
    def _rms_bwd_kernel(X, G, Wt, DY, DX, DG, RSTD, DW, DRES, R, D, n_tiles,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
                        HAS_DRES: tl.constexpr):
        """Persistent: tiles pid, pid + P, ...; dx = rstd (w dy − x̂ mean(w dy x̂)) (HAS_DRES: plus DRES, the
        gradient that reaches x by the residual path), dg = dout · y · s(1 − s); this program's Σ dy · x̂ goes to row
        pid of DW [P, D]."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        m_d = cols < D
        w = tl.load(Wt + cols, mask=m_d, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for tile in range(pid, n_tiles, tl.num_programs(0)):
            rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            m_r = rows < R
            mask = m_r[:, None] & m_d[None, :]
            offs = rows[:, None] * D + cols[None, :]
            rstd = tl.load(RSTD + rows, mask=m_r, other=0.0)
            xhat = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                s = tl.sigmoid(tl.load(G + offs, mask=mask, other=0.0).to(tl.float32))
                s = s.to(G.dtype.element_ty).to(tl.float32)
                y = (w[None, :] * xhat).to(X.dtype.element_ty).to(tl.float32)
                tl.store(DG + offs, (dy * y * s * (1.0 - s)).to(DG.dtype.element_ty), mask=mask)
                dy = dy * s
            dw += dy * xhat
            wdy = dy * w[None, :]
            dx = (wdy - xhat * (tl.sum(wdy * xhat, axis=1) / D)[:, None]) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DW + pid * D + cols, tl.sum(dw, axis=0), mask=m_d)

    @triton.jit
    def _l2_fwd_kernel(X, Y, RSTD, R, H, stride_n, stride_h, D, eps,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row r = n·H + h of an [N, H, D] view (unit last stride) -> contiguous y = x · rstd."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m_r, m_d = rows < R, cols < D
        mask = m_r[:, None] & m_d[None, :]
        src = ((rows // H) * stride_n + (rows % H) * stride_h)[:, None] + cols[None, :]
        x = tl.load(X + src, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) + eps)
        tl.store(Y + rows[:, None] * D + cols[None, :], (x * rstd[:, None]).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=m_r)

    @triton.jit
    def _l2_bwd_kernel(Y, DY, DX, RSTD, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """dx = rstd (dy − y (dy · y)) from the saved output y (contiguous rows)."""
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m_r, m_d = rows < R, cols < D
        mask = m_r[:, None] & m_d[None, :]
        offs = rows[:, None] * D + cols[None, :]
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=m_r, other=0.0)
        dx = (dy - y * tl.sum(dy * y, axis=1)[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# autograd Functions
# ---------------------------------------------------------------------------------------------------------------------


def _rms_fwd(x2, weight, eps, out_dtype, g2=None, r2=None):
    """The forward kernel on ``[R, D]`` rows: ``(y, rstd, h)``; with ``r2`` the rows are ``h = r2 + x2`` (h written,
    in their promoted dtype; else None), with ``g2`` gated."""
    R, D = x2.shape
    h = torch.empty(R, D, dtype=torch.promote_types(r2.dtype, x2.dtype), device=x2.device) if r2 is not None else None
    y = torch.empty(R, D, dtype=out_dtype, device=x2.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x2.device)
    block_r, block_d, num_warps = _row_tile(D)
    if R:
        _rms_fwd_kernel[(triton.cdiv(R, block_r),)](
            x2, x2 if g2 is None else g2, weight, y, rstd, x2 if r2 is None else r2, x2 if h is None else h, R, D,
            eps, BLOCK_R=block_r, BLOCK_D=block_d, HAS_GATE=g2 is not None, HAS_RES=r2 is not None,
            num_warps=num_warps)
    return y, rstd, h


def _rms_bwd(x2, weight, dy2, rstd, g2=None, dres=None):
    """The backward kernel on ``[R, D]`` rows (x2 the normalised input): ``(dx, dweight, dgate or None)``, dx plus
    ``dres`` when given."""
    R, D = x2.shape
    dx = torch.empty_like(x2)
    dg = torch.empty_like(g2) if g2 is not None else None
    block_r, block_d, num_warps = _row_tile(D)
    n_tiles = triton.cdiv(R, block_r)
    programs = persistent_programs(x2.device, n_tiles)
    dw = torch.empty(programs, D, dtype=torch.float32, device=x2.device)
    _rms_bwd_kernel[(programs,)](
        x2, x2 if g2 is None else g2, weight, dy2, dx, dx if dg is None else dg, rstd, dw,
        dx if dres is None else dres, R, D, n_tiles, BLOCK_R=block_r, BLOCK_D=block_d, HAS_GATE=g2 is not None,
        HAS_DRES=dres is not None, num_warps=2 * num_warps)
    return dx, dw.sum(0).to(weight.dtype), dg


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm (``gate`` None) or gated RMSNorm over the last dim, the output in ``out_dtype``; saves x, gate and
    rstd."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps, out_dtype):
        shape, D = x.shape, x.shape[-1]
        x2 = x.reshape(-1, D).contiguous()
        g2 = gate.reshape(-1, D).contiguous() if gate is not None else None
        y, rstd, _ = _rms_fwd(x2, weight, eps, out_dtype, g2=g2)
        ctx.save_for_backward(x2, weight, g2, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, g2, rstd = ctx.saved_tensors
        dx, dw, dg = _rms_bwd(x2, weight, dy.reshape(x2.shape).contiguous(), rstd, g2=g2)
        shape = ctx.shape
        return dx.view(shape), dw, None if dg is None else dg.view(shape), None, None


class _AddRMSNormFn(torch.autograd.Function):
    """``h = residual + x`` and ``RMSNorm(h)`` in one kernel each way: the forward writes h beside the norm's output
    (no separate add reading both back), the backward adds the gradient h receives from later sublayers into the
    norm's (no separate add of two gradients). The norm's output in ``out_dtype``. Saves h and rstd."""

    @staticmethod
    def forward(ctx, residual, x, weight, eps, out_dtype):
        shape, D = x.shape, x.shape[-1]
        x2, r2 = x.reshape(-1, D).contiguous(), residual.reshape(-1, D).contiguous()
        y, rstd, h = _rms_fwd(x2, weight, eps, out_dtype, r2=r2)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.dtypes = shape, (residual.dtype, x.dtype)
        ctx.set_materialize_grads(False)
        return h.view(shape), y.view(shape)

    @staticmethod
    def backward(ctx, dh, dy):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dx, dw = (torch.zeros_like(h) if dh is None else dh.reshape(h.shape)), None
        else:
            dres = dh.reshape(h.shape).contiguous() if dh is not None else None
            dx, dw, _ = _rms_bwd(h, weight, dy.reshape(h.shape).contiguous(), rstd, dres=dres)
        dx = dx.view(ctx.shape)
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw, None, None


def l2norm_fwd(x, eps):
    """The Triton forward: ``(y, rstd)``, y in x's shape and dtype, rstd ``[rows]`` fp32; x read in place when its
    leading dims merge (q / k column slices of the conv output)."""
    shape, D = x.shape, x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, H = x.numel() // max(D, 1), x.shape[-2] if x.dim() > 1 else 1
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    block_r, block_d, num_warps = _row_tile(D)
    if R:
        x3 = x.reshape(-1, H, D)  # [N, H, D]: a view when the leading dims merge
        _l2_fwd_kernel[(triton.cdiv(R, block_r),)](
            x3, y, rstd, R, H, x3.stride(0), x3.stride(1), D, eps,
            BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return y, rstd


def l2norm_bwd(y, rstd, dy):
    """The Triton backward: x's gradient from the output y, rstd and ``dy``."""
    D = y.shape[-1]
    R = rstd.numel()
    dy = dy.contiguous()
    dx = torch.empty_like(y)
    block_r, block_d, num_warps = _row_tile(D)
    if R:
        _l2_bwd_kernel[(triton.cdiv(R, block_r),)](
            y, dy, dx, rstd, R, D, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return dx


class _L2NormFn(torch.autograd.Function):
    """L2 norm over the last dim; saves the output y (which KDA keeps anyway as its q / k input) and rstd, not x
    (that would keep the whole conv output alive)."""

    @staticmethod
    def forward(ctx, x, eps):
        y, rstd = l2norm_fwd(x, eps)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return l2norm_bwd(y, rstd, dy), None


# ---------------------------------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------------------------------


def rms_norm(x, weight, eps=1e-6, backend=None, out_dtype=None):
    """RMSNorm over the last dim, ``x: [..., D]``, ``weight: [D]`` -> ``[..., D]`` in x's dtype or ``out_dtype``
    (fp32 compute, rounded once to the output's dtype)."""
    _check_norm(x, weight)
    if use_triton(backend, x):
        return _RMSNormFn.apply(x, weight, None, eps, out_dtype or x.dtype)
    y = rms_norm_torch(x, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def add_rms_norm(residual, x, weight, eps=1e-6, backend=None, out_dtype=None):
    """``(h, RMSNorm(h))`` with ``h = residual + x`` (``[..., D]``, h in their promoted dtype, the norm's output in
    h's or ``out_dtype``): a sublayer's residual add and the next sublayer's norm, one kernel each way on the Triton
    path."""
    _check_norm(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if use_triton(backend, x):
        return _AddRMSNormFn.apply(residual, x, weight, eps, out_dtype or torch.promote_types(residual.dtype, x.dtype))
    h, y = add_rms_norm_torch(residual, x, weight, eps)
    return h, y if out_dtype is None else y.to(out_dtype)


def gated_rms_norm(o, weight, gate, eps=1e-6, backend=None):
    """``rms_norm(o) * sigmoid(gate)``, ``o, gate: [..., H, V]``, ``weight: [V]`` -> ``[..., H, V]`` in
    ``promote_types(o.dtype, gate.dtype)``, rounded as the unfused expression (module docstring)."""
    _check_norm(o, weight, gate)
    if use_triton(backend, o):
        return _RMSNormFn.apply(o, weight, gate, eps, torch.promote_types(o.dtype, gate.dtype))
    return gated_rms_norm_torch(o, weight, gate, eps)


def l2norm(x, eps=L2NORM_EPS, backend=None):
    """L2 norm over the last dim, ``x: [..., D]`` (any strides; the Triton path reads it in place) -> ``[..., D]`` in
    x's dtype."""
    if use_triton(backend, x):
        return _L2NormFn.apply(x, eps)
    return l2norm_torch(x, eps)

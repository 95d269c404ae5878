"""The KDA gate in Triton: the log-decay from the raw gate input with its within-chunk cumulative sum Γ (forward),
and dg from dΓ by suffix sums, through the gate's chain rule (backward)."""

import triton
import triton.language as tl

from .kda_kernel_utils import CHUNK


@triton.jit
def _gate(x, a, lower_bound, GATE: tl.constexpr):
    """Log-decay from ``x = raw + dt_bias`` and ``a = exp(A_log)``: 1 bounded ``lb σ(a x)``, 2 ``−a softplus(x)``."""
    if GATE == 1:
        return tl.cast(lower_bound, tl.float32) * tl.sigmoid(a * x)  # Inductor may pass the float as fp64
    # softplus(x) = max(x, 0) + log(1 + e^-|x|), with log(1 + y) ~ y (1 - y/2) for small y
    y = tl.exp(-tl.abs(x))
    return -a * (tl.maximum(x, 0.0) + tl.where(y < 1e-4, y * (1.0 - 0.5 * y), tl.log(1.0 + y)))


@triton.jit
def _gate_cumsum_kernel(g_ptr, a_ptr, dtb_ptr, gam_ptr, cstart_ptr, cend_ptr, lower_bound, H, K: tl.constexpr,
                        BK: tl.constexpr, GATE: tl.constexpr):
    """Γ = within-chunk cumsum of the log-decay (computed here from the raw input when GATE != 0), head-dim
    columns in blocks of BK (program axis 2)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    ck = tl.program_id(2) * BK + tl.arange(0, BK)
    mk = ck < K
    m2 = (r < e - s)[:, None] & mk[None, :]
    offk = r[:, None] * (H * K) + ck[None, :]  # int32 offsets from the chunk's first row (fewer registers)
    base = s * (H * K) + h * K
    g = tl.load(g_ptr + base + offk, mask=m2, other=0.0).to(tl.float32)
    if GATE != 0:  # fused gate: g holds the raw input
        x = g + tl.load(dtb_ptr + h * K + ck, mask=mk, other=0.0)[None, :]
        g = tl.where(m2, _gate(x, tl.load(a_ptr + h), lower_bound, GATE), 0.0)
    tl.store(gam_ptr + base + offk, tl.cumsum(g, axis=0), mask=m2)


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _bwd_dg_kernel(dgam_ptr, dge_ptr, g_ptr, a_ptr, dtb_ptr, dg_ptr, da_ptr, ddtb_ptr, cstart_ptr, cend_ptr,
                   lower_bound, H, K: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr):
    """dg = suffix sums of dΓ within the chunk plus the prefix terms; with the fused gate (GATE != 0) the chain
    rule through it: the raw input's gradient, and per-chunk partial sums for A_log (``Σ dx·x`` bounded,
    ``Σ dg·g`` softplus) and dt_bias (``Σ_t dx``)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    ck = tl.arange(0, BK)
    mk = ck < K
    m2 = (r < e - s)[:, None] & mk[None, :]
    off = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
    dgam = tl.load(dgam_ptr + off, mask=m2, other=0.0)
    dg = tl.sum(dgam, axis=0)[None, :] - tl.cumsum(dgam, axis=0) + dgam + tl.load(dge_ptr + off, mask=m2, other=0.0)
    if GATE != 0:
        dg = tl.where(m2, dg, 0.0)
        x = tl.load(g_ptr + off, mask=m2, other=0.0).to(tl.float32) + tl.load(dtb_ptr + h * K + ck, mask=mk,
                                                                                other=0.0)[None, :]
        a = tl.load(a_ptr + h)
        if GATE == 1:
            y = tl.sigmoid(a * x)
            dg = dg * (lower_bound * a) * y * (1.0 - y)
            da = dg * x
        else:
            da = dg * _gate(x, a, lower_bound, GATE)
            dg = -a * dg * tl.sigmoid(x)
        tl.store(da_ptr + c * H + h, tl.sum(tl.sum(da, axis=1), axis=0))
        tl.store(ddtb_ptr + (c * H + h).to(tl.int64) * K + ck, tl.sum(dg, axis=0), mask=mk)
    tl.store(dg_ptr + off, dg.to(dg_ptr.dtype.element_ty), mask=m2)

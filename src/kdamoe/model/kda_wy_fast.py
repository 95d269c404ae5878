"""The WY representation of a KDA chunk: ``W = T (β K e^Γ)`` and ``U0 = T (β V)`` with the chunk loops' operands
(forward), and the chunk-wide reductions of its backward (``dA = −Tᵀ dT Tᵀ``, ``Tᵀ dW``, dg's prefix sums)."""

import triton
import triton.language as tl

from .kda_kernel_utils import CHUNK, _dot16, _exp, _lp_dot


@triton.jit
def _wu_kernel(q_ptr, k_ptr, v_ptr, b_ptr, gam_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, dl_ptr, hs_ptr, rq_ptr,
               rk_ptr, cstart_ptr, cend_ptr, scale, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, STORE_QG: tl.constexpr, U_FROM_STATES: tl.constexpr, LP: tl.constexpr,
               FTZ: tl.constexpr, NORM: tl.constexpr):
    """``W = T (β K e^Γ)``, ``U0 = T (β V)``, and for the chunk loops ``K e^{Γ_C − Γ}``, ``e^{Γ_C}`` and (STORE_QG,
    for the backward) ``scale Q e^Γ``; the columns in slices of BK (K) and BV (V), T kept in registers.
    U_FROM_STATES (the backward, with the per-chunk states S0 that the forward kept): ``U = U0 − W S0`` in place of
    U0, as the forward loop computes it (the stored 16-bit W; on a GPU 16-bit S0 and tensor cores), so that no
    chunk loop runs again. NORM: the rows of q, k times their L2-norm factors rq, rk (``[B*T, H]``)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    rv = r < e - s
    base = s * (H * K) + h * K
    q_ptr += base
    k_ptr += base
    gam_ptr += base
    w_ptr += base
    qg_ptr += base
    kd_ptr += base
    tinv16 = tl.load(tinv_ptr + s * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :], mask=rv[:, None],
                     other=0.0)  # T as stored: bf16 with bf16 inputs
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    if NORM:
        rk = tl.load(rk_ptr + s * H + r * H + h, mask=rv, other=0.0)
        rq = tl.load(rq_ptr + s * H + r * H + h, mask=rv, other=0.0)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = ck < K
        m2 = rv[:, None] & mk[None, :]
        offk = r[:, None] * (H * K) + ck[None, :]
        gam = tl.load(gam_ptr + offk, mask=m2, other=0.0)
        glast = tl.load(gam_ptr + (e - 1 - s) * (H * K) + ck, mask=mk, other=0.0)
        kk = tl.load(k_ptr + offk, mask=m2, other=0.0).to(tl.float32)
        if NORM:
            kk *= rk[:, None]
        tl.store(kd_ptr + offk, (kk * _exp(glast[None, :] - gam, FTZ)).to(kd_ptr.dtype.element_ty), mask=m2)
        eg = _exp(gam, FTZ)
        # W (stored in 16 bits) on 16-bit tensor cores: it adds nothing measurable to any error (docs/kda_kernels.md)
        tl.store(w_ptr + offk, _lp_dot(tinv16, kk * eg * beta[:, None], LP).to(w_ptr.dtype.element_ty), mask=m2)
        if STORE_QG:
            qq = tl.load(q_ptr + offk, mask=m2, other=0.0).to(tl.float32)
            if NORM:
                qq *= rq[:, None]
            tl.store(qg_ptr + offk, (qq * eg * scale).to(qg_ptr.dtype.element_ty), mask=m2)
        tl.store(dl_ptr + (c * H + h).to(tl.int64) * K + ck, _exp(glast, FTZ), mask=mk)
    if U_FROM_STATES:
        tl.debug_barrier()  # W, stored above by all of this program's threads, is read back below
    for iv in range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mv = cv < V
        offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
        mv2 = rv[:, None] & mv[None, :]
        vv = tl.load(v_ptr + offv, mask=mv2, other=0.0).to(tl.float32)
        if U_FROM_STATES:  # the backward: U as the forward loop had it, from T widened to fp32
            u = tl.dot(tinv16.to(tl.float32), vv * beta[:, None])
            for k0 in range(0, K, BK):
                ck = k0 + tl.arange(0, BK)
                mk = ck < K
                w = tl.load(w_ptr + r[:, None] * (H * K) + ck[None, :], mask=rv[:, None] & mk[None, :], other=0.0)
                s0 = tl.load(hs_ptr + (c * H + h).to(tl.int64) * (K * V) + ck[:, None] * V + cv[None, :],
                             mask=mk[:, None] & mv[None, :], other=0.0)
                u -= _lp_dot(w, s0, LP)
        else:  # the forward: T (βV) on 16-bit tensor cores, as fla-core
            u = _lp_dot(tinv16, vv * beta[:, None], LP)
        tl.store(u_ptr + offv, u.to(u_ptr.dtype.element_ty), mask=mv2)


@triton.jit
def _bwd_da_kernel(k_ptr, b_ptr, gam_ptr, tinv_ptr, dw_ptr, dkd_ptr, da_ptr, xpre_ptr, rk_ptr, cstart_ptr, cend_ptr, H,
                   K: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, FTZ: tl.constexpr, LPS: tl.constexpr,
                   NORM: tl.constexpr):
    """The chunk-wide reductions that the per-row kernel ``_bwd_intra_kernel`` needs: ``dT += dW (β K e^Γ)ᵀ``, then
    ``dA = −Tᵀ dT Tᵀ`` (strictly lower, in place of dT); ``Tᵀ dW`` (in place of dW); and the sums ``Σ_{s<16 I}
    k_s dKd_s e^{Γ_C − Γ_s}`` for row blocks I = 1, 2, 3 (``xpre [chunks, H, 3, K]``: the prefix terms of dg that
    reach a block from earlier ones). LPS: the dT and Tᵀ dW products on bf16 tensor cores (dW and β K e^Γ rounded
    to bf16; T is stored so); the gradients' error does not move. NORM: k's rows times their L2-norm factors rk."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    rv = r < e - s
    offc = s * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :]
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    dt = tl.load(da_ptr + offc, mask=rv[:, None], other=0.0)
    tinv = tl.load(tinv_ptr + offc, mask=rv[:, None], other=0.0)
    if NORM:
        rk = tl.load(rk_ptr + s * H + r * H + h, mask=rv, other=0.0)
    for kh in range(0, BK, KB):
        ck = kh + tl.arange(0, KB)
        mk = ck < K
        m2 = rv[:, None] & mk[None, :]
        offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
        kk = tl.load(k_ptr + offk, mask=m2, other=0.0).to(tl.float32)
        if NORM:
            kk *= rk[:, None]
        gam = tl.load(gam_ptr + offk, mask=m2, other=0.0)
        dw = tl.load(dw_ptr + offk, mask=m2, other=0.0)
        dt += _dot16(dw, tl.trans(kk * _exp(gam, FTZ) * beta[:, None]), LPS)
        tl.store(dw_ptr + offk, _dot16(tl.trans(tinv), dw, LPS), mask=m2)
        glast = tl.load(gam_ptr + s * (H * K) + h * K + (e - 1 - s) * (H * K) + ck, mask=mk, other=0.0)
        x = kk * tl.load(dkd_ptr + offk, mask=m2, other=0.0) * _exp(tl.where(m2, glast[None, :] - gam, 0.0), FTZ)
        # inclusive sums at rows 15, 31, 47 = the sums over the rows before blocks 1, 2, 3
        tl.store(xpre_ptr + ((c * H + h).to(tl.int64) * 3 + r[:, None] // 16) * K + ck[None, :], tl.cumsum(x, axis=0),
                 mask=((r % 16 == 15) & (r < 48))[:, None] & mk[None, :])
    # dA's two products stay tf32 (in bf16 they are no faster)
    tinv = tinv.to(tl.float32)
    da = -tl.dot(tl.trans(tinv), tl.dot(dt, tl.trans(tinv)))
    tl.store(da_ptr + offc, tl.where(r[:, None] > r[None, :], da, 0.0), mask=rv[:, None])

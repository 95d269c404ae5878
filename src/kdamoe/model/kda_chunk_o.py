"""The output of a KDA chunk, ``O = (scale Q e^Γ) S0 + P U`` from the per-chunk states (forward), and the
backward's products with dO and dU summed over V (``dU0 = Pᵀ dO``; dQg, dKd, dW, dP, dT, dv, dβ)."""

import triton
import triton.language as tl

from .kda_kernel_utils import CHUNK, _chunk_vblock, _dot16, _exp, _lp_dot


@triton.jit
def _fwd_o_kernel(q_ptr, gam_ptr, aqk_ptr, hs_ptr, us_ptr, o_ptr, rq_ptr, cstart_ptr, cend_ptr, scale, H,
                  K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FTZ: tl.constexpr,
                  LP: tl.constexpr, NORM: tl.constexpr):
    """``O = (scale Q e^Γ) S0 + P U`` of one chunk and V block, from the states stored by the chunk loop; Q e^Γ is
    formed here, the head dim in BK-wide slices, so that a forward without autograd neither writes nor reads it.
    NORM: Q's rows times their L2-norm factors rq (``[B*T, H]``)."""
    c, h, cv, s, r, rv = _chunk_vblock(cstart_ptr, cend_ptr, V, BV)
    mv = cv < V
    mv2 = rv[:, None] & mv[None, :]
    aqk = tl.load(aqk_ptr + s * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :], mask=rv[:, None], other=0.0)
    offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
    u = tl.load(us_ptr + offv, mask=mv2, other=0.0)
    # P U as stored (both bf16 with bf16 inputs: products exact, as in tf32)
    o = _lp_dot(aqk, u, LP)
    hs_ptr += (c * H + h).to(tl.int64) * (K * V)
    if NORM:
        rq = tl.load(rq_ptr + s * H + r * H + h, mask=rv, other=0.0)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = ck < K
        offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
        m2 = rv[:, None] & mk[None, :]
        eg = _exp(tl.load(gam_ptr + offk, mask=m2, other=0.0), FTZ) * scale
        qq = tl.load(q_ptr + offk, mask=m2, other=0.0).to(tl.float32)
        if NORM:
            qq *= rq[:, None]
        qg = (qq * eg).to(q_ptr.dtype.element_ty)
        s0 = tl.load(hs_ptr + ck[:, None] * V + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        # Q e^Γ S0 in 16 bits costs no measurable error (docs/kda_kernels.md)
        o += _lp_dot(qg, s0, LP)
    tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv2)


@triton.jit
def _bwd_du0_kernel(aqk_ptr, do_ptr, dus_ptr, cstart_ptr, cend_ptr, H, V: tl.constexpr, BV: tl.constexpr):
    """``dU0 = Pᵀ dO`` of one chunk and V block: the part of dU that does not depend on the reverse recurrence,
    out of the sequential loop."""
    c, h, cv, s, r, rv = _chunk_vblock(cstart_ptr, cend_ptr, V, BV)
    mv2 = rv[:, None] & (cv < V)[None, :]
    aqk = tl.load(aqk_ptr + s * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :], mask=rv[:, None],
                  other=0.0).to(tl.float32)
    offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
    do = tl.load(do_ptr + offv, mask=mv2, other=0.0).to(tl.float32)
    tl.store(dus_ptr + offv, tl.dot(tl.trans(aqk), do), mask=mv2)


@triton.jit
def _bwd_v_kernel(v_ptr, b_ptr, tinv_ptr, hs_ptr, dhs_ptr, us_ptr, dus_ptr, do_ptr, dv_ptr, dqg_ptr, dkd_ptr, dw_ptr,
                  dt_ptr, dp_ptr, db_ptr, dgc_ptr, cstart_ptr, cend_ptr, scale, H, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, LPS: tl.constexpr):
    """Per chunk, the sums over V: ``dQg = dO S0ᵀ``, ``dKd = U dS_Cᵀ``, ``dW = −dU S0ᵀ``, ``dP = dO Uᵀ`` (times
    scale, lower), ``dT = dU (β V)ᵀ``, ``dv = β Tᵀ dU`` (final), ``dβ = Σ V Tᵀ dU`` and ``Σ_v S0 dS_C``. LPS: every dot
    on bf16 tensor cores (U, dU and βV rounded to bf16; dO, the states and T are stored so), which leaves the
    gradients' error below fla-core's (docs/kda_kernels.md)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    rv = r < e - s
    ck = tl.arange(0, BK)
    mk = ck < K
    m2 = rv[:, None] & mk[None, :]
    offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
    offc = s * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :]
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    tinv = tl.load(tinv_ptr + offc, mask=rv[:, None], other=0.0)
    state_off = (c * H + h).to(tl.int64) * (K * V)
    dqg = tl.zeros((CHUNK, BK), dtype=tl.float32)
    dkd = tl.zeros((CHUNK, BK), dtype=tl.float32)
    dw = tl.zeros((CHUNK, BK), dtype=tl.float32)
    dp = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    dt = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
    dbeta = tl.zeros((CHUNK,), dtype=tl.float32)
    dgc = tl.zeros((BK,), dtype=tl.float32)
    for iv in range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mv = cv < V
        mv2 = rv[:, None] & mv[None, :]
        ms = mk[:, None] & mv[None, :]
        offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
        offs_s = ck[:, None] * V + cv[None, :]
        s0 = tl.load(hs_ptr + state_off + offs_s, mask=ms, other=0.0)
        dsc = tl.load(dhs_ptr + state_off + offs_s, mask=ms, other=0.0)
        do = tl.load(do_ptr + offv, mask=mv2, other=0.0)
        u = tl.load(us_ptr + offv, mask=mv2, other=0.0).to(tl.float32)
        du = tl.load(dus_ptr + offv, mask=mv2, other=0.0)
        vv = tl.load(v_ptr + offv, mask=mv2, other=0.0).to(tl.float32)
        dqg += _dot16(do, tl.trans(s0), LPS)
        dp += _dot16(do, tl.trans(u), LPS)
        dkd += _dot16(u, tl.trans(dsc), LPS)
        dw -= _dot16(du, tl.trans(s0), LPS)
        tdu = _dot16(tl.trans(tinv), du, LPS)
        tl.store(dv_ptr + offv, (tdu * beta[:, None]).to(dv_ptr.dtype.element_ty), mask=mv2)
        dbeta += tl.sum(vv * tdu, axis=1)
        dt += _dot16(du, tl.trans(vv * beta[:, None]), LPS)
        dgc += tl.sum(s0.to(tl.float32) * dsc.to(tl.float32), axis=1)
    tl.store(dqg_ptr + offk, dqg, mask=m2)
    tl.store(dkd_ptr + offk, dkd, mask=m2)
    tl.store(dw_ptr + offk, dw, mask=m2)
    tl.store(dt_ptr + offc, dt, mask=rv[:, None])
    tl.store(dp_ptr + offc, tl.where(r[:, None] >= r[None, :], dp, 0.0) * scale, mask=rv[:, None])
    tl.store(db_ptr + s * H + r * H + h, dbeta, mask=rv)
    tl.store(dgc_ptr + (c * H + h).to(tl.int64) * K + ck, dgc, mask=mk)

"""The sequential chunk loops of KDA: the state recurrence ``S ← e^{Γ_C} S + (K e^{Γ_C − Γ})ᵀ U`` with ``U = U0 −
W S`` (forward) and the reverse loop carrying dS (backward). One program per sequence, head and V block (grid
``(V/BV · sequences, H)``, ``_loop_program``); every other kernel runs over chunks in parallel."""

import triton
import triton.language as tl

from .kda_kernel_utils import CHUNK, _loop_program, _lp_dot, _state_block


@triton.jit
def _fwd_state_kernel(q_ptr, gam_ptr, aqk_ptr, o_ptr, kd_ptr, dl_ptr, w_ptr, u_ptr, h0_ptr, ht_ptr, hs_ptr, rq_ptr,
                      cu_ptr, coff_ptr, scale, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr,
                      WRITE_O: tl.constexpr, LP: tl.constexpr, NORM: tl.constexpr):
    """The sequential chunk loop of one sequence, head and V block: ``U = U0 − W S`` (overwrites U0 in place),
    ``S ← e^{Γ_C} S + (K e^{Γ_C − Γ})ᵀ U``; with WRITE_O also ``O = (scale Q e^Γ) S + P U`` (the forward: no
    per-chunk states kept; NORM: Q's rows times their L2-norm factors rq), with STORE_H the state entering every chunk
    (the backward)."""
    n, iv, h = _loop_program(V, BV)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, CHUNK)
    r = tl.arange(0, CHUNK)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    offk = r[:, None] * (H * K) + ck[None, :]
    offv = r[:, None] * (H * V) + cv[None, :]
    offs_s, ms, state_off, S = _state_block(h0_ptr, n, h, H, ck, cv, K, V, BK, BV, HAS_H0)
    # e^{Γ_C} of chunk i at dl_at + i H K, loaded a chunk ahead: the pipeliner stages the tiles (W, U0, Kd) through
    # cp.async but leaves this vector (one element per thread) a synchronous load, which on the serial chain stalled
    # every chunk step
    dl_at = dl_ptr + (coff * H + h) * K + ck
    dl = tl.load(dl_at, mask=mk & (0 * ck < nt), other=0.0)
    for i in range(0, nt):
        dl_next = tl.load(dl_at + (i + 1) * (H * K), mask=mk & (i + 1 + 0 * ck < nt), other=0.0)
        t0 = bos + i * CHUNK
        rv = r < eos - t0
        m2 = rv[:, None] & mk[None, :]
        mv2 = rv[:, None] & mv[None, :]
        bk = t0 * (H * K) + h * K
        bv = t0 * (H * V) + h * V
        if STORE_H:
            tl.store(hs_ptr + ((coff + i) * H + h) * (K * V) + offs_s, S.to(hs_ptr.dtype.element_ty), mask=ms)
        w = tl.load(w_ptr + bk + offk, mask=m2, other=0.0)
        u = tl.load(u_ptr + bv + offv, mask=mv2, other=0.0).to(tl.float32) - _lp_dot(w, S, LP)
        tl.store(u_ptr + bv + offv, u.to(u_ptr.dtype.element_ty), mask=mv2)
        if WRITE_O:
            qg = tl.load(q_ptr + bk + offk, mask=m2, other=0.0).to(tl.float32)
            qg *= tl.exp(tl.load(gam_ptr + bk + offk, mask=m2, other=0.0)) * scale
            if NORM:
                qg *= tl.load(rq_ptr + t0 * H + r * H + h, mask=rv, other=0.0)[:, None]
            aqk = tl.load(aqk_ptr + t0 * (H * CHUNK) + h * CHUNK + r[:, None] * (H * CHUNK) + r[None, :], mask=rv[:, None],
                          other=0.0).to(tl.float32)
            o = tl.dot(qg, S) + tl.dot(aqk, u)
            tl.store(o_ptr + bv + offv, o.to(o_ptr.dtype.element_ty), mask=mv2)
        kd = tl.load(kd_ptr + bk + offk, mask=m2, other=0.0)
        S = S * dl[:, None] + _lp_dot(tl.trans(kd), u, LP)
        dl = dl_next
    if STORE_HT:
        tl.store(ht_ptr + state_off + offs_s, S, mask=ms)


@triton.jit
def _bwd_state_kernel(qg_ptr, kd_ptr, dl_ptr, w_ptr, do_ptr, dht_ptr, dh0_ptr, dhs_ptr, dus_ptr,
                      cu_ptr, coff_ptr, H, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                      LP: tl.constexpr, LPS: tl.constexpr):
    """The reverse chunk loop of one sequence, head and V block: ``dU = dU0 + Kd dS`` (dU0 = Pᵀ dO from
    ``_bwd_du0_kernel``, overwritten in place), ``dS ← e^{Γ_C} dS + Qgᵀ dO − Wᵀ dU``; stores the dS entering
    every chunk from its end (16-bit with 16-bit inputs) and, with STORE_DH0, the initial state's gradient. dS is
    carried as two halves of the head dim (``[BK/2, BV]``), Kd, Qg and W loaded as ``[64, BK/2]`` tiles. LP: ``Qgᵀ
    dO`` (both stored 16-bit) on 16-bit tensor cores; LPS: ``Kd dS`` and ``Wᵀ dU`` too, dS and dU rounded to bf16
    (bf16 only: fp16 would flush small gradients)."""
    n, iv, h = _loop_program(V, BV)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, CHUNK)
    r = tl.arange(0, CHUNK)
    ck1 = tl.arange(0, BK // 2)
    ck2 = BK // 2 + tl.arange(0, BK // 2)
    mk1 = ck1 < K
    mk2 = ck2 < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    offs1, ms1, state_off, dS1 = _state_block(dht_ptr, n, h, H, ck1, cv, K, V, BK // 2, BV, HAS_DHT)
    offs2, ms2, state_off, dS2 = _state_block(dht_ptr, n, h, H, ck2, cv, K, V, BK // 2, BV, HAS_DHT)
    for j in range(0, nt):
        i = nt - 1 - j
        # e^{Γ_C}, issued first: not pipelined (a synchronous load, as in the forward loop) and used last
        dl = dl_ptr + ((coff + i) * H + h) * K
        dl1 = tl.load(dl + ck1, mask=mk1, other=0.0)
        dl2 = tl.load(dl + ck2, mask=mk2, other=0.0)
        t0 = bos + i * CHUNK
        rv = r < eos - t0
        m1 = rv[:, None] & mk1[None, :]
        m2 = rv[:, None] & mk2[None, :]
        mv2 = rv[:, None] & mv[None, :]
        off1 = t0 * (H * K) + h * K + r[:, None] * (H * K) + ck1[None, :]
        off2 = t0 * (H * K) + h * K + r[:, None] * (H * K) + ck2[None, :]
        offv = t0 * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
        dhs = dhs_ptr + ((coff + i) * H + h) * (K * V)
        tl.store(dhs + offs1, dS1.to(dhs_ptr.dtype.element_ty), mask=ms1)
        tl.store(dhs + offs2, dS2.to(dhs_ptr.dtype.element_ty), mask=ms2)
        do = tl.load(do_ptr + offv, mask=mv2, other=0.0)
        du = (tl.load(dus_ptr + offv, mask=mv2, other=0.0)
              + _lp_dot(tl.load(kd_ptr + off1, mask=m1, other=0.0), dS1, LPS)
              + _lp_dot(tl.load(kd_ptr + off2, mask=m2, other=0.0), dS2, LPS))
        tl.store(dus_ptr + offv, du, mask=mv2)
        dS1 = (dS1 * dl1[:, None]
               + _lp_dot(tl.trans(tl.load(qg_ptr + off1, mask=m1, other=0.0)), do, LP)
               - _lp_dot(tl.trans(tl.load(w_ptr + off1, mask=m1, other=0.0)), du, LPS))
        dS2 = (dS2 * dl2[:, None]
               + _lp_dot(tl.trans(tl.load(qg_ptr + off2, mask=m2, other=0.0)), do, LP)
               - _lp_dot(tl.trans(tl.load(w_ptr + off2, mask=m2, other=0.0)), du, LPS))
    if STORE_DH0:
        tl.store(dh0_ptr + state_off + offs1, dS1, mask=ms1)
        tl.store(dh0_ptr + state_off + offs2, dS2, mask=ms2)

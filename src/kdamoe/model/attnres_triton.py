"""Triton kernels of the depth attention (``attnres.py``): forward and backward, each reading every source once.

Both compute what ``_DepthAttentionFunction``'s torch code computes, per token row of D values, in fp32:

- forward: ``rstd_s = rsqrt(mean(v_s²) + eps)``, ``logit_s = rstd_s (v_s · u)`` with ``u = query ⊙ γ``, ``out =
  Σ_s softmax_s(logit) v_s`` in the sources' dtype, and the ``[S, rows]`` logits, rstd and weights the backward
  uses. The mix is an online softmax (running max and sum; the accumulator is rescaled when the max grows), so no
  source is needed again once its logit is known.
- backward: ``g_s = dout · v_s``, ``dlogit = w ⊙ (g − Σ_s w g)``, ``a_s = dlogit_s rstd_s``, ``c_s = dlogit_s
  rstd_s² logit_s / D``; ``dv_s = w_s dout + a_s u − c_s v_s`` for the sources that need it (stored, added in
  place to a source's gradient sink, or stored with a gradient lent to the sink added: ``attnres.py``), and
  ``du = Σ_rows Σ_s a_s v_s``, which each program of a persistent grid sums over its tiles in fp32 registers and
  stores as one row of a ``[P, D]`` buffer; a small kernel sums the rows (deterministic, no atomics) and writes the
  parameters' gradients ``du ⊙ γ``, ``du ⊙ query`` in their dtypes. ``u`` is formed in the kernels, so a call runs
  no torch op on the parameters.
- with NORM, the sublayer's RMSNorm in the same kernels: the forward stores ``RMSNorm_w(h)`` of the mix h (h stays
  in registers) and h's ``[rows]`` rstd; the backward recomputes ``h = Σ_s w_s v_s`` from the sources it holds,
  turns the incoming gradient into h's (``rstd (w ⊙ dy − ĥ mean(ĥ ⊙ w ⊙ dy))``, ``ĥ = h·rstd``) and sums the norm
  weight's gradient ``Σ_rows dy ⊙ ĥ`` per program as ``du``.

The sources are ``MAX_SOURCES`` separate pointer arguments (no stacked copy; the unused ones are the first source's
pointer), each of its own dtype (under autocast the embedding is fp32 and a block's first sublayer output bf16), S a
constexpr: the loops over sources are unrolled (``tl.static_range``) and each S compiles its own
kernel. A program tile is ``BLOCK_R`` whole rows of ``BLOCK_D`` (next power of 2 of D, up to ``MAX_D``), so each row
reduction is one ``tl.sum``. With HOLD (a tile's sources fit in ``HOLD_REGISTERS`` per thread) a tile loads all its
sources, and in the backward its dout and statistics, before the first reduction, so they are in flight together,
and the backward's dv pass uses the held values; without it each source is loaded where it is used, and the
backward's second pass reloads it (from L2, mostly: the tile was just read). Offsets are int64 (rows x D passes
2^31 at 1M tokens x 4096 channels).

Launches (``LAUNCH``, ``HOLD_REGISTERS``) are the fastest of ``benchmarks/bench_attnres.py``'s sweep at the twin's
shape (D = 1024, bf16, 3 and 5 sources, with the norm and the sinks): 1024-value tiles at 8 values per thread (4
warps at D = 1024: one row per program), 12 backward programs per SM. Compiled for sm_90 (triton 3.9, bf16, NORM, a
gradient sink on every source but the newest), registers forward / backward at D = 1024: 56 / 114 at S = 2, 95 / 168
at S = 5, 80 / 255 at S = 9, 96 / 255 and 48 bytes of spills at S = 16; D = 2048, S = 6: 107 / 181; from D = 4096
(16 warps, 8 or more values a thread) the backward spills (232 bytes at S = 6).
"""

import torch

from .fused_norm import persistent_programs, triton

if triton is not None:
    import triton.language as tl

MAX_SOURCES = 16  # pointer arguments per kernel; more sources run the torch code
MAX_D = 8192  # longest row a program holds in registers
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAUNCH = {
    "fwd": dict(tile=1024, values_per_thread=8),
    "bwd": dict(tile=1024, values_per_thread=8, programs_per_sm=12),
    # the sum of the backward's P rows of partial sums: 8-column blocks, so that D = 1024 spreads over 128 programs
    # (32-column blocks left most SMs idle), 512 rows a load
    "param_grad": dict(BLOCK_D=8, BLOCK_P=512, num_warps=8),
}
HOLD_REGISTERS = 64  # 32-bit registers per thread that may hold a tile's sources (see `_launch`)


def unsupported(sources):
    """Why the kernels cannot take these sources (a string), or None."""
    s0 = sources[0]
    if len(sources) > MAX_SOURCES:
        return f"{len(sources)} sources, more than MAX_SOURCES = {MAX_SOURCES}"
    bad = [v.dtype for v in sources if v.dtype not in KERNEL_DTYPES]
    if bad:
        return f"sources of dtype {bad[0]}"
    if not 1 <= s0.shape[-1] <= MAX_D:
        return f"rows of {s0.shape[-1]} values (1 to MAX_D = {MAX_D})"
    if any(v.shape != s0.shape or v.device != s0.device for v in sources):
        return "sources of different shapes or devices"
    return None


def _launch(sources, cfg):
    """``(BLOCK_R, BLOCK_D, num_warps, HOLD)``: rows of D values, ``cfg["tile"]`` values per program tile at
    ``cfg["values_per_thread"]`` of them per thread (4 to 16 warps); HOLD when the tile's S sources take at most
    ``HOLD_REGISTERS`` per thread."""
    s0 = sources[0]
    block_d = triton.next_power_of_2(s0.shape[-1])
    block_r = max(1, cfg["tile"] // block_d)
    num_warps = min(16, max(4, block_r * block_d // (32 * cfg["values_per_thread"])))
    return block_r, block_d, num_warps, len(sources) * block_r * block_d // (32 * num_warps) <= HOLD_REGISTERS


def _padded(tensors):
    """The pointer arguments of the kernels: the tensors, then the first one up to ``MAX_SOURCES``."""
    return (*tensors, *(tensors[0],) * (MAX_SOURCES - len(tensors)))


if triton is not None:

    @triton.jit
    def _load(V, s: tl.constexpr, held, offs, mask, HOLD: tl.constexpr):
        """Source s of the tile in fp32: from the held tuple (HOLD) or loaded now."""
        if HOLD:
            v = held[s]
        else:
            v = tl.load(V[s] + offs, mask=mask, other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _hold(V, offs, mask, S: tl.constexpr, HOLD: tl.constexpr):
        """The tile's S sources in their dtype (HOLD: all loads issued before any reduction waits), else ()."""
        held = ()
        if HOLD:
            for s in tl.static_range(S):
                held = held + (tl.load(V[s] + offs, mask=mask, other=0.0),)
        return held

    @triton.jit
    def _add2(a0, a1, b0, b1):
        return a0 + b0, a1 + b1

    @triton.jit
    def _query_key(Q, G, cols, m_d):
        """``u = query ⊙ γ`` as a [1, BLOCK_D] fp32 row (the product rounded once in fp32, as the torch path)."""
        q = tl.load(Q + cols, mask=m_d, other=0.0).to(tl.float32)
        return (q * tl.load(G + cols, mask=m_d, other=0.0).to(tl.float32))[None, :]

    @triton.jit
    def _fwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15,
                    Q, G, OUT, LOGITS, RSTD, WEIGHTS, NW, RSTD_H, R, D, eps, norm_eps,
                    S: tl.constexpr, NORM: tl.constexpr, HOLD: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        """One tile of rows: out, and the [S, R] logits, rstd and weights (source s at s·R + row); with NORM out is
        RMSNorm_NW(h) of the mix h, whose [R] rstd goes to RSTD_H."""
        V = (V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15)
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        m_r, m_d = rows < R, cols < D
        mask = m_r[:, None] & m_d[None, :]
        offs = rows[:, None] * D + cols[None, :]
        held = _hold(V, offs, mask, S, HOLD)
        u = _query_key(Q, G, cols, m_d)
        logits, rstds = (), ()
        for s in tl.static_range(S):
            v = _load(V, s, held, offs, mask, HOLD)
            sumsq, dot = tl.reduce((v * v, v * u), 1, _add2)
            rstd = tl.rsqrt(sumsq / D + eps)
            logit = rstd * dot
            logits, rstds = logits + (logit,), rstds + (rstd,)
            if s == 0:
                m, l, acc = logit, tl.full([BLOCK_R], 1.0, tl.float32), v
            else:  # online softmax: rescale the sum and the accumulator to the new running max
                m_new = tl.maximum(m, logit)
                alpha, p = tl.exp(m - m_new), tl.exp(logit - m_new)
                acc = acc * alpha[:, None] + p[:, None] * v
                l = l * alpha + p
                m = m_new
        out = acc / l[:, None]
        if NORM:  # h stays in registers: only the normalised row is written
            rstd_h = tl.rsqrt(tl.sum(out * out, axis=1) / D + norm_eps)
            out = out * rstd_h[:, None] * tl.load(NW + cols, mask=m_d, other=0.0).to(tl.float32)[None, :]
            tl.store(RSTD_H + rows, rstd_h, mask=m_r)
        tl.store(OUT + offs, out.to(OUT.dtype.element_ty), mask=mask)
        stat = rows
        for s in tl.static_range(S):
            tl.store(LOGITS + stat, logits[s], mask=m_r)
            tl.store(RSTD + stat, rstds[s], mask=m_r)
            tl.store(WEIGHTS + stat, tl.exp(logits[s] - m) / l, mask=m_r)
            stat += R

    @triton.jit
    def _bwd_kernel(V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15,
                    DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15,
                    Q, G, DOUT, LOGITS, RSTD, WEIGHTS, DU, NW, RSTD_H, DNW, ADDEND, R, D, n_tiles,
                    S: tl.constexpr, NEEDS: tl.constexpr, ACC: tl.constexpr, ADD_S: tl.constexpr,
                    NORM: tl.constexpr, HOLD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Persistent: tiles pid, pid + P, ...; dv_s for the sources whose bit is set in NEEDS, added to what DV_s
        holds where the bit of ACC is set too (a gradient sink: one buffer that every reader of a source adds to,
        in place of one tensor per reader that autograd sums after), and for source ADD_S (-1: none) to ADDEND,
        read, not written (a gradient that other nodes hold); this program's
        Σ_rows Σ_s a_s v_s goes to row pid of DU [P, D]. With NORM, DOUT is the gradient of RMSNorm_NW(h): h = Σ_s
        w_s v_s is recomputed from the tile's sources, taken through the norm's backward, and this program's
        Σ_rows dout ⊙ h·rstd_h goes to row pid of DNW [P, D]."""
        V = (V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11, V12, V13, V14, V15)
        DV = (DV0, DV1, DV2, DV3, DV4, DV5, DV6, DV7, DV8, DV9, DV10, DV11, DV12, DV13, DV14, DV15)
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        m_d = cols < D
        u = _query_key(Q, G, cols, m_d)
        du = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        dnw = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        if NORM:
            nw = tl.load(NW + cols, mask=m_d, other=0.0).to(tl.float32)[None, :]
        for tile in range(pid, n_tiles, tl.num_programs(0)):
            rows = (tile * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            m_r = rows < R
            mask = m_r[:, None] & m_d[None, :]
            offs = rows[:, None] * D + cols[None, :]
            held = _hold(V, offs, mask, S, HOLD)
            dout = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
            stat, w, rstd, logit = rows, (), (), ()  # per source: [BLOCK_R] vectors, 0 on masked rows
            for s in tl.static_range(S):  # all loaded before the first store (which might alias them)
                w = w + (tl.load(WEIGHTS + stat, mask=m_r, other=0.0),)
                rstd = rstd + (tl.load(RSTD + stat, mask=m_r, other=0.0),)
                logit = logit + (tl.load(LOGITS + stat, mask=m_r, other=0.0),)
                stat += R
            if NORM:  # dout = ∂L/∂h through h -> h·rstd_h·nw, with h recomputed from the sources and weights
                h = w[0][:, None] * _load(V, 0, held, offs, mask, HOLD)
                for s in tl.static_range(1, S):
                    h += w[s][:, None] * _load(V, s, held, offs, mask, HOLD)
                rstd_h = tl.load(RSTD_H + rows, mask=m_r, other=0.0)[:, None]
                xh = h * rstd_h
                dnw += dout * xh
                gdn = dout * nw
                dout = rstd_h * (gdn - xh * (tl.sum(xh * gdn, axis=1) / D)[:, None])
            wgs, wg = (), tl.zeros([BLOCK_R], tl.float32)
            for s in tl.static_range(S):
                wgs = wgs + (w[s] * tl.sum(dout * _load(V, s, held, offs, mask, HOLD), axis=1),)  # w_s g_s
                wg += wgs[s]
            for s in tl.static_range(S):
                v = _load(V, s, held, offs, mask, HOLD)
                dlogit = wgs[s] - w[s] * wg  # w_s (g_s − Σ w g)
                a = (dlogit * rstd[s])[:, None]
                du += a * v
                if (NEEDS >> s) & 1:
                    c = (dlogit * rstd[s] * rstd[s] * logit[s] / D)[:, None]
                    dv = w[s][:, None] * dout + a * u - c * v
                    if (ACC >> s) & 1:
                        dv += tl.load(DV[s] + offs, mask=mask, other=0.0).to(tl.float32)
                    if s == ADD_S:
                        dv += tl.load(ADDEND + offs, mask=mask, other=0.0).to(tl.float32)
                    tl.store(DV[s] + offs, dv.to(DV[s].dtype.element_ty), mask=mask)
        tl.store(DU + pid * D + cols, tl.sum(du, axis=0), mask=m_d)
        if NORM:
            tl.store(DNW + pid * D + cols, tl.sum(dnw, axis=0), mask=m_d)

    @triton.jit
    def _param_grad_kernel(DU, DNW, Q, G, DQ, DG, DN, P, D, NORM: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        """A block of columns of the parameters' gradients from the backward's per-program rows: ``du = Σ_p DU[p]``,
        ``dquery = du ⊙ γ``, ``dγ = du ⊙ query``, and with NORM ``dnorm_weight = Σ_p DNW[p]``, each stored in its
        parameter's dtype."""
        cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = cols < D
        du = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
        dnw = tl.zeros([BLOCK_P, BLOCK_D], tl.float32)
        for start in range(0, P, BLOCK_P):
            rows = start + tl.arange(0, BLOCK_P)
            offs = rows[:, None] * D + cols[None, :]
            mask = (rows < P)[:, None] & m_d[None, :]
            du += tl.load(DU + offs, mask=mask, other=0.0)
            if NORM:
                dnw += tl.load(DNW + offs, mask=mask, other=0.0)
        du_col = tl.sum(du, axis=0)
        q = tl.load(Q + cols, mask=m_d, other=0.0)
        g = tl.load(G + cols, mask=m_d, other=0.0)
        tl.store(DQ + cols, (du_col * g.to(tl.float32)).to(DQ.dtype.element_ty), mask=m_d)
        tl.store(DG + cols, (du_col * q.to(tl.float32)).to(DG.dtype.element_ty), mask=m_d)
        if NORM:
            tl.store(DN + cols, tl.sum(dnw, axis=0).to(DN.dtype.element_ty), mask=m_d)


def depth_attention_fwd(sources, query, gamma, eps, norm=None, out_dtype=None):
    """``(out [..., D] in the first source's dtype or out_dtype, logits, rstd, weights [S, ...] fp32, rstd_h [...] fp32
    or None)`` of contiguous sources of one shape ``[..., D]`` and device (``unsupported`` is None), the pseudo-query
    and key-norm gain ``[D]`` (``u = query ⊙ γ`` formed in the kernel). ``norm = (weight [D], eps)``: out is
    ``RMSNorm_weight(h)`` of the mix h (never written), and rstd_h its ``rsqrt(mean(h²) + eps)``."""
    s0, S = sources[0], len(sources)
    R, D = s0.numel() // s0.shape[-1], s0.shape[-1]
    out = torch.empty(s0.shape, dtype=out_dtype or s0.dtype, device=s0.device)
    logits, rstd, weights = (torch.empty(S, *s0.shape[:-1], dtype=torch.float32, device=s0.device)
                             for _ in range(3))
    rstd_h = torch.empty(s0.shape[:-1], dtype=torch.float32, device=s0.device) if norm is not None else None
    block_r, block_d, num_warps, hold = _launch(sources, LAUNCH["fwd"])
    if R:
        _fwd_kernel[(triton.cdiv(R, block_r),)](
            *_padded(sources), query.contiguous(), gamma.contiguous(), out, logits, rstd, weights,
            norm[0].contiguous() if norm is not None else query, rstd_h if norm is not None else logits, R, D, eps,
            norm[1] if norm is not None else 0.0, S=S, NORM=norm is not None, HOLD=hold, BLOCK_R=block_r,
            BLOCK_D=block_d, num_warps=num_warps)
    return out, logits, rstd, weights, rstd_h


def depth_attention_bwd(dout, sources, query, gamma, logits, rstd, weights, needs_grad, norm=None, rstd_h=None,
                        accumulate=None, addend=None):
    """``(dquery, dgamma, [dv_s or None], dnorm_weight or None)`` from the sources and statistics of
    ``depth_attention_fwd``, each parameter's gradient in its dtype; ``dv_s`` (in the sources' dtype) only where
    ``needs_grad[s]``. With ``norm`` (and its ``rstd_h``), ``dout`` is the gradient of the normalised output.
    ``accumulate[s]``: None, or a tensor like source s (not one of the sources) that dv_s is added to in place (to a
    contiguous copy of it when it is not contiguous) and returned as dv_s. ``addend``: None, or ``(s, tensor like
    source s)`` added to dv_s out of place (source s needs its gradient and accumulates none)."""
    s0, S = sources[0], len(sources)
    R, D = s0.numel() // s0.shape[-1], s0.shape[-1]
    query, gamma = query.contiguous(), gamma.contiguous()
    accumulate = accumulate or (None,) * S
    add_s, added = addend if addend is not None else (-1, None)
    if added is not None:
        assert needs_grad[add_s] and accumulate[add_s] is None and added.shape == sources[add_s].shape
        added = added.contiguous()
    dsources = [None if not need else torch.empty_like(v) if acc is None else acc.contiguous()
                for v, need, acc in zip(sources, needs_grad, accumulate)]
    targets = [v if dv is None else dv for v, dv in zip(sources, dsources)]  # a clear NEEDS bit: never written
    cfg = LAUNCH["bwd"]
    block_r, block_d, num_warps, hold = _launch(sources, cfg)
    n_tiles = triton.cdiv(R, block_r)
    programs = persistent_programs(s0.device, n_tiles, per_sm=cfg["programs_per_sm"])
    du = torch.empty(programs, D, dtype=torch.float32, device=s0.device)
    dnw = torch.empty(programs, D, dtype=torch.float32, device=s0.device) if norm is not None else None
    _bwd_kernel[(programs,)](
        *_padded(sources), *_padded(targets), query, gamma, dout.contiguous(), logits, rstd, weights, du,
        norm[0].contiguous() if norm is not None else du, rstd_h if norm is not None else logits,
        dnw if norm is not None else du, du if added is None else added, R, D, n_tiles,
        S=S, NEEDS=sum(1 << s for s, need in enumerate(needs_grad) if need),
        ACC=sum(1 << s for s, (need, acc) in enumerate(zip(needs_grad, accumulate)) if need and acc is not None),
        ADD_S=add_s, NORM=norm is not None, HOLD=hold, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    dquery, dgamma = torch.empty_like(query), torch.empty_like(gamma)
    dnorm = torch.empty_like(norm[0]) if norm is not None else None
    cfg = LAUNCH["param_grad"]
    _param_grad_kernel[(triton.cdiv(D, cfg["BLOCK_D"]),)](
        du, dnw if norm is not None else du, query, gamma, dquery, dgamma, dnorm if norm is not None else dquery,
        programs, D, NORM=norm is not None, BLOCK_P=min(cfg["BLOCK_P"], triton.next_power_of_2(programs)),
        BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"])
    return dquery, dgamma, dsources, dnorm

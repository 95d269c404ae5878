"""Intra-chunk KDA kernels: the scores ``A_qk``, ``A_kk`` of a chunk by 16 x 16 sub-blocks, the solve ``T = (I +
A_kk)^-1`` (forward), and their backward (dq, dk, dβ, dΓ of a 16-row block from dA_qk and dA_kk).

Pairwise factors ``exp(Γ_i − Γ_j)`` are built per 16-token sub-block I of rows with the anchor ``a`` = the
sub-block's first row: ``(k_i e^{Γ_i − Γ_a}) · (k_j e^{Γ_a − Γ_j})``. Columns of earlier sub-blocks give
exponents ``<= 0``; the diagonal sub-block gives ``Γ_a − Γ_j <= 15 · 5 = 75`` nats when every ``g >= -5``
(the bounded gate), finite in fp32, so with ``SAFE=False`` every causal sub-block, the diagonal one
included, is one dense ``tl.dot``. Exponents of later (non-causal) columns are masked to 0 *before* ``exp``,
so nothing overflows and future tokens never reach earlier outputs. With ``SAFE=True`` (the unbounded
softplus gate) the diagonal sub-blocks are computed pair by pair with masked exponents ``<= 0``. The forward
forms each column sub-block J's factor once, anchored at its own first row ``a_J``, and re-anchors it at ``a`` for
each block below by the per-column ``e^{Γ_a − Γ_{a_J}} <= 1`` (one exp per column instead of one per element)."""

import triton
import triton.language as tl

from .kda_kernel_utils import CHUNK, _exp, _put, _row_rstd


@triton.jit
def _dot(a, b, acc):
    """``acc + a b`` for the solve's 16 x 16 blocks near fp32 precision for any storage dtype of T, on tensor cores:
    tf32x3 by hand, each operand split into its tf32 rounding and the remainder, three tf32 products chained through
    the one accumulator (the remainders truncated to tf32 by the tensor cores: ~2^-21 relative). Triton's
    ``input_precision="tf32x3"`` also zeroes NaN products and adds the three apart (T's inputs are finite): its
    one-warp intra kernel runs 6 % longer. The nilpotent product cancels large terms, so on a trained model's
    correlated keys plain tf32 inputs leave T off by ~2 % of its largest entry (tf32x3: ~6e-6, fp32 FMA: ~2e-6; T's
    bf16 storage: 2e-3), which the bf16 chunk-state recurrence can amplify until its states overflow. fp32 FMA
    (``ieee``) runs the intra kernel 1.5x slower."""
    ah, bh = _tf32_hi(a), _tf32_hi(b)
    acc = tl.dot(a - ah, bh, acc, input_precision="tf32")
    acc = tl.dot(ah, b - bh, acc, input_precision="tf32")
    return tl.dot(ah, bh, acc, input_precision="tf32")


@triton.jit
def _tf32_hi(x):
    """fp32 ``x`` rounded to nearest (ties away) at tf32's 10 mantissa bits, as fp32."""
    return ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def _inv_unit_lower(lo):
    """``(I + L)^-1`` of a strictly lower 16 x 16 ``L``: ``(I − L)(I + L²)(I + L⁴)(I + L⁸)``, exact as L^16 = 0."""
    r = tl.arange(0, 16)
    x = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - lo
    zero = tl.zeros((16, 16), dtype=tl.float32)
    l2 = _dot(lo, lo, zero)
    x = _dot(x, l2, x)
    l4 = _dot(l2, l2, zero)
    x = _dot(x, l4, x)
    return _dot(x, _dot(l4, l4, zero), x)


@triton.jit
def _solve(tinv_ptr, a00, a10, a11, a20, a21, a22, a30, a31, a32, a33, s, e, h, H):
    """``T = (I + A_kk)^-1`` of one chunk from the 16 x 16 blocks of its strictly lower ``A_kk`` (times β):
    diagonal blocks by a nilpotent product, then block forward substitution ``T_IJ = −T_II Σ_{J<=M<I} A_IM T_MJ``
    (``_dot``: near fp32 precision on tensor cores; each sum accumulated through the dots). Every block of T is
    written."""
    d0 = _inv_unit_lower(a00)
    d1 = _inv_unit_lower(a11)
    d2 = _inv_unit_lower(a22)
    d3 = _inv_unit_lower(a33)
    zero = tl.zeros((16, 16), dtype=tl.float32)
    t10 = -_dot(d1, _dot(a10, d0, zero), zero)
    t21 = -_dot(d2, _dot(a21, d1, zero), zero)
    t32 = -_dot(d3, _dot(a32, d2, zero), zero)
    t20 = -_dot(d2, _dot(a21, t10, _dot(a20, d0, zero)), zero)
    t31 = -_dot(d3, _dot(a32, t21, _dot(a31, d1, zero)), zero)
    t30 = -_dot(d3, _dot(a32, t20, _dot(a31, t10, _dot(a30, d0, zero))), zero)
    _put(tinv_ptr, d0, s, e, h, H, 0, 0)
    _put(tinv_ptr, zero, s, e, h, H, 0, 1)
    _put(tinv_ptr, zero, s, e, h, H, 0, 2)
    _put(tinv_ptr, zero, s, e, h, H, 0, 3)
    _put(tinv_ptr, t10, s, e, h, H, 1, 0)
    _put(tinv_ptr, d1, s, e, h, H, 1, 1)
    _put(tinv_ptr, zero, s, e, h, H, 1, 2)
    _put(tinv_ptr, zero, s, e, h, H, 1, 3)
    _put(tinv_ptr, t20, s, e, h, H, 2, 0)
    _put(tinv_ptr, t21, s, e, h, H, 2, 1)
    _put(tinv_ptr, d2, s, e, h, H, 2, 2)
    _put(tinv_ptr, zero, s, e, h, H, 2, 3)
    _put(tinv_ptr, t30, s, e, h, H, 3, 0)
    _put(tinv_ptr, t31, s, e, h, H, 3, 1)
    _put(tinv_ptr, t32, s, e, h, H, 3, 2)
    _put(tinv_ptr, d3, s, e, h, H, 3, 3)


@triton.jit
def _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, I: tl.constexpr, ck, mk, rq_ptr, rk_ptr, H, SAFE: tl.constexpr,
                FTZ: tl.constexpr, NORM: tl.constexpr):
    """Columns ck of row block I (rows ``16 I .. 16 I + 15``) of a chunk of n rows, a = the block's first row: the
    row operands ``q_i e^{Γ_i − Γ_a}``, ``k_i e^{Γ_i − Γ_a}`` (factors <= 1), the column operand ``k_i e^{Γ_a − Γ_i}``
    (>= 1; <= e^{75} with the bounded gate; SAFE: not formed, k as loaded), Γ_a, and q, k, Γ as loaded (NORM: q, k
    times their rows' L2-norm factors, from ``rq_ptr``, ``rk_ptr``)."""
    ri = I * 16 + tl.arange(0, 16)
    mi = (ri < n)[:, None] & mk[None, :]
    off = ri[:, None] * HK + ck[None, :]
    ga = tl.load(gam_ptr + tl.minimum(I * 16, n - 1) * HK + ck, mask=mk, other=0.0)
    gi = tl.load(gam_ptr + off, mask=mi, other=0.0)
    ki = tl.load(k_ptr + off, mask=mi, other=0.0).to(tl.float32)
    qi = tl.load(q_ptr + off, mask=mi, other=0.0).to(tl.float32)
    if NORM:
        ki *= tl.load(rk_ptr + ri * H, mask=ri < n, other=0.0)[:, None]
        qi *= tl.load(rq_ptr + ri * H, mask=ri < n, other=0.0)[:, None]
    el = _exp(tl.where(mi, gi - ga[None, :], 0.0), FTZ)  # a masked row's Γ = 0 would give e^{−Γ_a}: overflow
    if SAFE:
        kc = ki
    else:
        kc = ki * _exp(ga[None, :] - gi, FTZ)  # a masked row has k = 0 and e^{Γ_a} <= 1: no `where` needed
    return qi * el, ki * el, kc, ga, qi, ki, gi


@triton.jit
def _intra_diag(akk, aqk, k_ptr, gam_ptr, qr, kr, kc, qi, ki, gi, n, HK, I: tl.constexpr, ck, mk, rk_ptr, H,
                SAFE: tl.constexpr, FTZ: tl.constexpr, NORM: tl.constexpr):
    """Adds columns ck's share of diagonal block (I, I): one dense dot each (both operands anchored at the block's
    first row), or (SAFE, any gate) pair by pair (``e^{Γ_i − Γ_j}`` for ``j <= i`` only; NORM: k_j times its row's
    L2-norm factor)."""
    if SAFE:
        ri = I * 16 + tl.arange(0, 16)
        mi = (ri < n)[:, None] & mk[None, :]
        r16 = tl.arange(0, 16)
        for jj in range(16):
            j = I * 16 + jj
            mj = mk & (j + 0 * ck < n)
            gj = tl.load(gam_ptr + j * HK + ck, mask=mj, other=0.0)
            kj = tl.load(k_ptr + j * HK + ck, mask=mj, other=0.0).to(tl.float32)
            if NORM:
                kj *= tl.load(rk_ptr + j * H, mask=j < n, other=0.0)
            ok = ri >= j
            kd = kj[None, :] * _exp(tl.where(ok[:, None] & mi, gi - gj[None, :], 0.0), FTZ)
            sel = ok[:, None] & (r16[None, :] == jj)
            akk += tl.where(sel, tl.sum(ki * kd, axis=1)[:, None], 0.0)
            aqk += tl.where(sel, tl.sum(qi * kd, axis=1)[:, None], 0.0)
        return akk, aqk
    kct = tl.trans(kc)
    return tl.dot(kr, kct, akk), tl.dot(qr, kct, aqk)


@triton.jit
def _intra_pair(akk, aqk, qr, kr, ga, kc, gaj, kj, gj, SAFE: tl.constexpr, FTZ: tl.constexpr):
    """Adds columns ck's share of block (I, J < I): the row operands (anchored at a, row block I's first row) with
    column block J anchored at a too — J's own column operand (anchored at its first row a_J) times the per-column
    ``e^{Γ_a − Γ_{a_J}}`` (<= 1): one exp per column, not per element (a factor that underflows stands for less than
    e^{−87 + 75} of the block's scale), and one operand scaled per block, not two (the row operands, as loaded, serve
    every block of the row); or with any gate (SAFE) ``k_j e^{Γ_a − Γ_j}`` anew (<= 1). Both anchors are rows <= i:
    row i's entries depend on no later token, bit for bit."""
    if SAFE:
        kc = kj * _exp(ga[None, :] - gj, FTZ)
    else:
        kc = kc * _exp(ga - gaj, FTZ)[None, :]
    kct = tl.trans(kc)
    return tl.dot(kr, kct, akk), tl.dot(qr, kct, aqk)


@triton.jit
def _tril16(x, STRICT: tl.constexpr):
    """A diagonal 16 x 16 block of a lower (STRICT: strictly lower) matrix: the entries above (on) its diagonal 0."""
    r = tl.arange(0, 16)
    if STRICT:
        return tl.where(r[None, :] < r[:, None], x, 0.0)
    return tl.where(r[None, :] <= r[:, None], x, 0.0)


@triton.jit
def _intra_beta(b_ptr, n, H, I: tl.constexpr):
    """β of row block I's rows (0 past the chunk's end) as a column, to scale its A_kk blocks' rows."""
    r = I * 16 + tl.arange(0, 16)
    return tl.load(b_ptr + r * H, mask=r < n, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _qk_rstd_kernel(q_ptr, k_ptr, rq_ptr, rk_ptr, cstart_ptr, cend_ptr, H, K: tl.constexpr, BK: tl.constexpr):
    """The L2-norm factors of one chunk's rows of q and k (``_row_rstd``, K read BK at a time) into rq, rk
    ``[B*T, H]``, which every kernel that loads rows of q or k scales them by."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    n = tl.load(cend_ptr + c).to(tl.int64) - s
    r = tl.arange(0, CHUNK)
    base = s * H * K + h * K
    tl.store(rq_ptr + (s + r) * H + h, _row_rstd(q_ptr + base, r, r < n, H * K, K, BK, CHUNK), mask=r < n)
    tl.store(rk_ptr + (s + r) * H + h, _row_rstd(k_ptr + base, r, r < n, H * K, K, BK, CHUNK), mask=r < n)


@triton.jit
def _intra_kernel(q_ptr, k_ptr, gam_ptr, b_ptr, aqk_ptr, tinv_ptr, rq_ptr, rk_ptr, cstart_ptr, cend_ptr, scale, H,
                  K: tl.constexpr, BK: tl.constexpr, SAFE: tl.constexpr, FTZ: tl.constexpr, NORM: tl.constexpr):
    """``A_qk`` (times scale, lower; its upper blocks 0) and ``T = (I + A_kk)^-1`` (A_kk times β, strictly lower) of
    one chunk by 16 x 16 blocks (I, J <= I): ``(x_i e^{Γ_i − Γ_a}) · (k_j e^{Γ_a − Γ_j})`` with a the first row of
    row block I, summed over head-dim slices of BK in 20 accumulators. In each slice every row block is loaded and
    exponentiated once, and its column operand serves the blocks below it (the column factors once per chunk, not
    once per row block; one operand re-anchored per block, not both). A_kk goes from the accumulators into the
    solve, never through memory. SAFE: the diagonal blocks pair by pair. Blocks past the end of a part-filled last
    chunk compute on masked (zero) rows and store nothing. NORM (q, k as given, not L2-normalised): every loaded row of
    q, k times its L2-norm factor from rq, rk (``_qk_rstd_kernel``), so the products are those of the normalised rows
    (which are never written)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    n = e - s
    HK = H * K
    base = s * HK + h * K
    q_ptr += base
    k_ptr += base
    gam_ptr += base
    b_ptr += s * H + h
    rq_ptr += s * H + h
    rk_ptr += s * H + h
    akk00 = tl.zeros((16, 16), dtype=tl.float32)
    akk10, akk11, akk20, akk21, akk22, akk30, akk31, akk32, akk33 = (akk00, akk00, akk00, akk00, akk00, akk00, akk00,
                                                                      akk00, akk00)
    aqk00, aqk10, aqk11, aqk20, aqk21, aqk22, aqk30, aqk31, aqk32, aqk33 = (akk00, akk00, akk00, akk00, akk00, akk00,
                                                                            akk00, akk00, akk00, akk00)
    for c0 in range(0, K, BK):
        ck = c0 + tl.arange(0, BK)
        mk = ck < K
        qr0, kr0, kc0, ga0, q0, k0, g0 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 0, ck, mk, rq_ptr, rk_ptr, H,
                                                     SAFE, FTZ, NORM)
        akk00, aqk00 = _intra_diag(akk00, aqk00, k_ptr, gam_ptr, qr0, kr0, kc0, q0, k0, g0, n, HK, 0, ck, mk,
                                   rk_ptr, H, SAFE, FTZ, NORM)
        qr1, kr1, kc1, ga1, q1, k1, g1 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 1, ck, mk, rq_ptr, rk_ptr, H,
                                                     SAFE, FTZ, NORM)
        akk10, aqk10 = _intra_pair(akk10, aqk10, qr1, kr1, ga1, kc0, ga0, k0, g0, SAFE, FTZ)
        akk11, aqk11 = _intra_diag(akk11, aqk11, k_ptr, gam_ptr, qr1, kr1, kc1, q1, k1, g1, n, HK, 1, ck, mk,
                                   rk_ptr, H, SAFE, FTZ, NORM)
        qr2, kr2, kc2, ga2, q2, k2, g2 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 2, ck, mk, rq_ptr, rk_ptr, H,
                                                     SAFE, FTZ, NORM)
        akk20, aqk20 = _intra_pair(akk20, aqk20, qr2, kr2, ga2, kc0, ga0, k0, g0, SAFE, FTZ)
        akk21, aqk21 = _intra_pair(akk21, aqk21, qr2, kr2, ga2, kc1, ga1, k1, g1, SAFE, FTZ)
        akk22, aqk22 = _intra_diag(akk22, aqk22, k_ptr, gam_ptr, qr2, kr2, kc2, q2, k2, g2, n, HK, 2, ck, mk,
                                   rk_ptr, H, SAFE, FTZ, NORM)
        qr3, kr3, kc3, ga3, q3, k3, g3 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 3, ck, mk, rq_ptr, rk_ptr, H,
                                                     SAFE, FTZ, NORM)
        akk30, aqk30 = _intra_pair(akk30, aqk30, qr3, kr3, ga3, kc0, ga0, k0, g0, SAFE, FTZ)
        akk31, aqk31 = _intra_pair(akk31, aqk31, qr3, kr3, ga3, kc1, ga1, k1, g1, SAFE, FTZ)
        akk32, aqk32 = _intra_pair(akk32, aqk32, qr3, kr3, ga3, kc2, ga2, k2, g2, SAFE, FTZ)
        akk33, aqk33 = _intra_diag(akk33, aqk33, k_ptr, gam_ptr, qr3, kr3, kc3, q3, k3, g3, n, HK, 3, ck, mk,
                                   rk_ptr, H, SAFE, FTZ, NORM)
    zero = tl.zeros((16, 16), dtype=tl.float32)  # A_qk's upper blocks: the O kernel reads whole rows
    _put(aqk_ptr, _tril16(aqk00, False) * scale, s, e, h, H, 0, 0)
    _put(aqk_ptr, zero, s, e, h, H, 0, 1)
    _put(aqk_ptr, zero, s, e, h, H, 0, 2)
    _put(aqk_ptr, zero, s, e, h, H, 0, 3)
    _put(aqk_ptr, aqk10 * scale, s, e, h, H, 1, 0)
    _put(aqk_ptr, _tril16(aqk11, False) * scale, s, e, h, H, 1, 1)
    _put(aqk_ptr, zero, s, e, h, H, 1, 2)
    _put(aqk_ptr, zero, s, e, h, H, 1, 3)
    _put(aqk_ptr, aqk20 * scale, s, e, h, H, 2, 0)
    _put(aqk_ptr, aqk21 * scale, s, e, h, H, 2, 1)
    _put(aqk_ptr, _tril16(aqk22, False) * scale, s, e, h, H, 2, 2)
    _put(aqk_ptr, zero, s, e, h, H, 2, 3)
    _put(aqk_ptr, aqk30 * scale, s, e, h, H, 3, 0)
    _put(aqk_ptr, aqk31 * scale, s, e, h, H, 3, 1)
    _put(aqk_ptr, aqk32 * scale, s, e, h, H, 3, 2)
    _put(aqk_ptr, _tril16(aqk33, False) * scale, s, e, h, H, 3, 3)
    # A_kk (strictly lower, times β) straight into the solve: it never goes through memory
    b0, b1, b2, b3 = (_intra_beta(b_ptr, n, H, 0), _intra_beta(b_ptr, n, H, 1), _intra_beta(b_ptr, n, H, 2),
                      _intra_beta(b_ptr, n, H, 3))
    _solve(tinv_ptr, _tril16(akk00, True) * b0, akk10 * b1, _tril16(akk11, True) * b1,
           akk20 * b2, akk21 * b2, _tril16(akk22, True) * b2,
           akk30 * b3, akk31 * b3, akk32 * b3, _tril16(akk33, True) * b3, s, e, h, H)


@triton.jit
def _bwd_intra_kernel(q_ptr, k_ptr, b_ptr, gam_ptr, dqg_ptr, dkd_ptr, tdw_ptr, dp_ptr, da_ptr, dgc_ptr,
                      xpre_ptr, dgam_ptr, dge_ptr, db32_ptr, dq_ptr, dk_ptr, db_ptr, rq_ptr, rk_ptr, cstart_ptr,
                      cend_ptr, scale, H, K: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, SAFE: tl.constexpr,
                      FTZ: tl.constexpr, NORM: tl.constexpr):
    """dq, dk, dβ (final) and dΓ with the prefix terms of dg, of rows ``16 I .. 16 I + 15`` of a chunk, from the
    sums of ``_bwd_v_kernel`` and ``_bwd_da_kernel``. Dense terms, row by row: ``dq = scale dQg e^Γ``, ``dk = dKd
    e^{Γ_C − Γ} + β (Tᵀ dW) e^Γ``, dP's diagonal (kept out of the pairwise terms: it adds exactly 0 to dΓ, and its
    rounding would dominate dg under strong decay). Pairwise terms: row side ``X_i = Σ_{j<i} d[i, j] k_j e^{Γ_i −
    Γ_j}`` and column side ``Y_j = Σ_{i>j} d[i, j] x_i e^{Γ_i − Γ_j}`` for ``d`` = dP, dA, 16 partner rows at a time
    (only the causal blocks are loaded); dense: one dot per block, anchored at the block's first row ``a`` (no later
    token can move the rounding); SAFE: other blocks anchored at the block's first (row side) or last (column side)
    row, the diagonal block pair by pair. The ``Γ_C − Γ_t`` terms add ``Σ_{s<t} k_s dKd_s e^{Γ_C − Γ_s} + e^{Γ_C}
    Σ_v S0 dS_C`` to dg_t: the earlier blocks' sum (``_bwd_da_kernel``) plus an exclusive prefix of the previous
    rows (loaded again), no large term added and taken away again. Head dim in slices of KS (fewer live registers).
    NORM (q, k as given, ``_qk_rstd_kernel`` stored their rows' L2-norm factors rq, rk): every loaded row of q, k times
    its factor, and the L2 norm's backward ``dx = r (dx̂ − x̂ (x̂ · dx̂))`` on dq, dk before they are stored (the head
    dim in one slice: KS >= K)."""
    c = tl.program_id(0) // 4  # the 4 row blocks of a chunk run side by side: its q, k, Γ are read from L2
    h = tl.program_id(1)
    a = tl.program_id(0) % 4 * 16
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    n = e - s
    ri = a + tl.arange(0, 16)
    vi = ri < n
    base = s * (H * K) + h * K
    basec = s * (H * CHUNK) + h * CHUNK
    q_ptr += base
    k_ptr += base
    gam_ptr += base
    rq_ptr += s * H + h
    rk_ptr += s * H + h
    if NORM:
        tl.static_assert(KS >= K, "the L2 norm's backward needs whole rows of dq, dk")
        rqi = tl.load(rq_ptr + ri * H, mask=vi, other=0.0)
        rki = tl.load(rk_ptr + ri * H, mask=vi, other=0.0)
    cc = tl.arange(0, 16)
    dp_diag = tl.load(dp_ptr + basec + ri * (H * CHUNK) + ri, mask=vi, other=0.0)
    bi = tl.load(b_ptr + s * H + ri * H + h, mask=vi, other=0.0).to(tl.float32)
    dbeta = tl.load(db32_ptr + s * H + ri * H + h, mask=vi, other=0.0)
    if SAFE:  # the diagonal block's d[i, j] (row side) and d[j, i] (column side, as [i, j]), pair by pair below
        offd = basec + ri[:, None] * (H * CHUNK) + (a + cc)[None, :]
        offdt = basec + (a + cc)[None, :] * (H * CHUNK) + ri[:, None]
        vd = vi[:, None] & ((a + cc) < n)[None, :]
        dp_r = tl.load(dp_ptr + offd, mask=vd & ((a + cc)[None, :] < ri[:, None]), other=0.0)
        da_r = tl.load(da_ptr + offd, mask=vd, other=0.0)
        bd = tl.load(b_ptr + s * H + (a + cc) * H + h, mask=(a + cc) < n, other=0.0).to(tl.float32)
        dp_t = tl.load(dp_ptr + offdt, mask=vd & ((a + cc)[None, :] > ri[:, None]), other=0.0)
        dm_t = tl.load(da_ptr + offdt, mask=vd, other=0.0) * bd[None, :]
        nrow = a // 16  # row side: earlier blocks as dots
        ncol0 = a // 16 + 1  # column side: later blocks as dots
    else:
        nrow = a // 16 + 1
        ncol0 = a // 16
    prev = (ri >= a + 1)[:, None] & vi[:, None]  # rows of this block with a previous row in it
    for kh in range(0, BK, KS):
        ck = kh + tl.arange(0, KS)
        mk = ck < K
        mi = vi[:, None] & mk[None, :]
        offi = ri[:, None] * (H * K) + ck[None, :]
        glast = tl.load(gam_ptr + (n - 1) * (H * K) + ck, mask=mk, other=0.0)
        ga = tl.load(gam_ptr + a * (H * K) + ck, mask=mk & (a + 0 * ck < n), other=0.0)
        ga = tl.where(a < n, ga, glast)
        gi = tl.where(vi[:, None], tl.load(gam_ptr + offi, mask=mi, other=0.0), glast[None, :])
        ki = tl.load(k_ptr + offi, mask=mi, other=0.0).to(tl.float32)
        qi = tl.load(q_ptr + offi, mask=mi, other=0.0).to(tl.float32)
        if NORM:
            ki *= rki[:, None]
            qi *= rqi[:, None]
        # dense terms
        eg = _exp(gi, FTZ)
        kg = ki * eg
        dkd_i = tl.load(dkd_ptr + base + offi, mask=mi, other=0.0)
        tdw = tl.load(tdw_ptr + base + offi, mask=mi, other=0.0)  # rows of Tᵀ dW
        dkg = tdw * bi[:, None]
        dq = tl.load(dqg_ptr + base + offi, mask=mi, other=0.0) * eg * scale
        dk = dkd_i * _exp(glast[None, :] - gi, FTZ) + dkg * eg + dp_diag[:, None] * qi
        dgam = kg * dkg + qi * dq
        dbeta += tl.sum(kg * tdw, axis=1)
        dq += dp_diag[:, None] * ki
        # prefix terms of dg: earlier blocks' rows, then the previous rows of this block
        xb = tl.load(xpre_ptr + ((c * H + h).to(tl.int64) * 3 + a // 16 - 1) * K + ck, mask=mk & (a + 0 * ck > 0),
                     other=0.0)
        mp = prev & mk[None, :]
        offp = offi - H * K
        kp = tl.load(k_ptr + offp, mask=mp, other=0.0).to(tl.float32)
        if NORM:
            kp *= tl.load(rk_ptr + (ri - 1) * H, mask=vi & (ri >= a + 1), other=0.0)[:, None]
        xp_ = kp * tl.load(dkd_ptr + base + offp, mask=mp, other=0.0) * _exp(
            tl.where(mp, glast[None, :] - tl.load(gam_ptr + offp, mask=mp, other=0.0), 0.0), FTZ)
        dgc = tl.load(dgc_ptr + (c * H + h).to(tl.int64) * K + ck, mask=mk, other=0.0)
        tl.store(dge_ptr + base + offi, tl.cumsum(xp_, axis=0) + (xb + _exp(glast, FTZ) * dgc)[None, :], mask=mi)
        # pairwise terms, row side: blocks up to this one, 16 rows j at a time
        xp = tl.zeros((16, KS), dtype=tl.float32)
        xa = tl.zeros((16, KS), dtype=tl.float32)
        for jb in range(0, nrow):
            rj = jb * 16 + cc
            vj = rj < n
            mj = vj[:, None] & mk[None, :]
            offj = rj[:, None] * (H * K) + ck[None, :]
            gj = tl.where(vj[:, None], tl.load(gam_ptr + offj, mask=mj, other=0.0), glast[None, :])
            krj = tl.load(k_ptr + offj, mask=mj, other=0.0).to(tl.float32) * _exp(ga[None, :] - gj, FTZ)
            if NORM:
                krj *= tl.load(rk_ptr + rj * H, mask=vj, other=0.0)[:, None]
            offij = basec + ri[:, None] * (H * CHUNK) + rj[None, :]
            vij = vi[:, None] & vj[None, :]
            xp += tl.dot(tl.load(dp_ptr + offij, mask=vij & (rj[None, :] < ri[:, None]), other=0.0), krj)
            xa += tl.dot(tl.load(da_ptr + offij, mask=vij, other=0.0), krj)
        el = _exp(gi - ga[None, :], FTZ)
        xp *= el
        xa *= el
        # column side: columns of this block, rows j of this and later blocks
        if SAFE:
            gb = tl.load(gam_ptr + tl.minimum(a + 15, n - 1) * (H * K) + ck, mask=mk, other=0.0)
        else:
            gb = ga
        yp = tl.zeros((16, KS), dtype=tl.float32)
        ym = tl.zeros((16, KS), dtype=tl.float32)
        for jb in range(ncol0, 4):
            rj = jb * 16 + cc
            vj = rj < n
            mj = vj[:, None] & mk[None, :]
            offj = rj[:, None] * (H * K) + ck[None, :]
            gj = tl.where(vj[:, None], tl.load(gam_ptr + offj, mask=mj, other=0.0), glast[None, :])
            erj = _exp(gj - gb[None, :], FTZ)
            offji = basec + rj[None, :] * (H * CHUNK) + ri[:, None]  # d[j, i] as [i, j]
            vij = vi[:, None] & vj[None, :]
            bj = tl.load(b_ptr + s * H + rj * H + h, mask=vj, other=0.0).to(tl.float32)
            qe = tl.load(q_ptr + offj, mask=mj, other=0.0).to(tl.float32) * erj
            if NORM:
                qe *= tl.load(rq_ptr + rj * H, mask=vj, other=0.0)[:, None]
            yp += tl.dot(tl.load(dp_ptr + offji, mask=vij & (rj[None, :] > ri[:, None]), other=0.0), qe)
            ke = tl.load(k_ptr + offj, mask=mj, other=0.0).to(tl.float32) * erj
            if NORM:
                ke *= tl.load(rk_ptr + rj * H, mask=vj, other=0.0)[:, None]
            ym += tl.dot(tl.load(da_ptr + offji, mask=vij, other=0.0) * bj[None, :], ke)
        ej = _exp(gb[None, :] - gi, FTZ)
        yp *= ej
        ym *= ej
        if SAFE:
            for jj in range(16):
                j = a + jj
                mj = mk & (j + 0 * ck < n)
                gj = tl.load(gam_ptr + j * (H * K) + ck, mask=mj, other=0.0)
                gj = tl.where(j < n, gj, glast)
                kj = tl.load(k_ptr + j * (H * K) + ck, mask=mj, other=0.0).to(tl.float32)
                qj = tl.load(q_ptr + j * (H * K) + ck, mask=mj, other=0.0).to(tl.float32)
                if NORM:
                    kj *= tl.load(rk_ptr + j * H, mask=j < n, other=0.0)
                    qj *= tl.load(rq_ptr + j * H, mask=j < n, other=0.0)
                # row side: partner j is an earlier (or the same) token of row i
                ok = ri >= j
                ex = _exp(tl.where(ok[:, None], gi - gj[None, :], 0.0), FTZ) * kj[None, :]
                sel = ok[:, None] & (cc[None, :] == jj)
                xp += tl.sum(tl.where(sel, dp_r, 0.0), axis=1)[:, None] * ex
                xa += tl.sum(tl.where(sel, da_r, 0.0), axis=1)[:, None] * ex
                # column side: partner j is a later (or the same) token of column i
                ok = ri <= j
                ey = _exp(tl.where(ok[:, None], gj[None, :] - gi, 0.0), FTZ)
                sel = ok[:, None] & (cc[None, :] == jj)
                dpj = tl.sum(tl.where(sel, dp_t, 0.0), axis=1)
                dmj = tl.sum(tl.where(sel, dm_t, 0.0), axis=1)
                yp += dpj[:, None] * (ey * qj[None, :])
                ym += dmj[:, None] * (ey * kj[None, :])
        dq += xp
        dk += xa * bi[:, None] + yp + ym
        dgam += qi * xp + ki * xa * bi[:, None] - ki * (yp + ym)
        dbeta += tl.sum(ki * xa, axis=1)
        if NORM:  # the gradients of the normalised rows, through the norm
            dq = (dq - qi * tl.sum(dq * qi, axis=1)[:, None]) * rqi[:, None]
            dk = (dk - ki * tl.sum(dk * ki, axis=1)[:, None]) * rki[:, None]
        tl.store(dq_ptr + base + offi, dq.to(dq_ptr.dtype.element_ty), mask=mi)
        tl.store(dk_ptr + base + offi, dk.to(dk_ptr.dtype.element_ty), mask=mi)
        tl.store(dgam_ptr + base + offi, dgam, mask=mi)
    tl.store(db_ptr + s * H + ri * H + h, dbeta.to(db_ptr.dtype.element_ty), mask=vi)

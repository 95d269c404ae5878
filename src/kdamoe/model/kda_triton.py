"""Triton kernels for KDA (imported only when triton is there): chunked forward/backward and a decode kernel.

Layout and recurrence as in ``kda.py``: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``, ``g: [B, T, H, K]``
(log-decay), ``beta: [B, T, H]``, state ``[N, H, K, V]`` fp32. Per chunk of C = 64 tokens entering with state
``S0`` (``Γ`` = within-chunk cumsum of ``g``)::

    T      = (I + A_kk)^-1,   A_kk[i, j] = β_i Σ_c k_ic k_jc exp(Γ_ic − Γ_jc)   (j < i)
    W      = T (β K e^Γ),     U0 = T (β V),     U = U0 − W S0
    O      = scale (Q e^Γ) S0 + P U,            P[i, j] = scale Σ_c q_ic k_jc exp(Γ_ic − Γ_jc)   (j <= i)
    S_next = e^{Γ_C} S0 + (K e^{Γ_C − Γ})ᵀ U

Pairwise factors ``exp(Γ_i − Γ_j)`` are built per 16-token sub-block I of rows with the anchor ``a`` = the
sub-block's first row: ``(k_i e^{Γ_i − Γ_a}) · (k_j e^{Γ_a − Γ_j})``. Columns of earlier sub-blocks give
exponents ``<= 0``; the diagonal sub-block gives ``Γ_a − Γ_j <= 15 · 5 = 75`` nats when every ``g >= -5``
(the bounded gate), finite in fp32, so with ``safe=False`` every causal sub-block, the diagonal one
included, is one dense ``tl.dot``. Exponents of later (non-causal) columns are masked to 0 *before* ``exp``,
so nothing overflows and future tokens never reach earlier outputs. With ``safe=True`` (the unbounded
softplus gate) the diagonal sub-blocks are computed pair by pair with masked exponents ``<= 0``. The forward
forms each column sub-block J's factor once, anchored at its own first row ``a_J``, and re-anchors it at ``a`` for
each block below by the per-column ``e^{Γ_a − Γ_{a_J}} <= 1`` (one exp per column instead of one per element).

Forward kernels: ``_gate_cumsum`` (fused gate, Γ), ``_intra`` (per chunk A_qk, and T by 16×16 blocks from A_kk kept
in registers), ``_wu`` (W, U0 and the loop's operands), ``_fwd_state`` (per sequence, head and V block: the
sequential chunk loop) and ``_fwd_o`` (O per chunk, in parallel, from the stored states, Q and Γ). Backward: the
autograd forward keeps the inputs, A_qk, T and the per-chunk states (memory linear in T: 1.0 KB per token and head
at K = V = 128 with bf16 inputs, output included; fla-core keeps 0.5 KB and recomputes its states); the backward
recomputes Γ and W, U0 (``_wu`` turns U0 into U from the kept states: no second chunk loop; above
``STATES_LIMIT_BYTES`` of states the loop runs again instead), then ``_bwd_du0`` (Pᵀ dO), ``_bwd_state`` (the
reverse loop carrying dS), ``_bwd_v`` (sums over V), ``_bwd_da`` (dA = −Tᵀ dT Tᵀ, Tᵀ dW), ``_bwd_intra`` (dq, dk, dβ
and dΓ per 16-row block: dense and pairwise terms) and ``_bwd_dg`` (suffix sums of dΓ and the gate's chain rule).
Launch settings per kernel: ``LAUNCH``. The q/k L2 norm runs in torch before the kernels. A single long sequence
runs in slabs (``_slabs``): the chunk loop of a slab on a second CUDA stream beside the parallel kernels of the next
slab (forward) or of the one after it (backward, from the last slab), the state carried between slabs in fp32:
bit-identical to one pass.
"""

import contextlib
import functools

import torch
import triton
import triton.language as tl

CHUNK = 64
GATES = ("bounded", "softplus")
L2NORM_EPS = 1e-6
# The forward keeps per-chunk states (then O runs in a parallel kernel: faster) when they take at most this many
# bytes more than the fp32 Γ (head dim 128: the same bytes; the forward frees Γ before allocating them); else (V > K
# at very long T) the chunk loop writes O itself. The autograd forward keeps the states for the backward when they
# take at most this many bytes (else the backward runs the chunk loop again).
STATES_LIMIT_BYTES = 4 << 30
# Launch settings per kernel on CUDA (the CPU interpreter ignores them), as timed on an H200 by
# benchmarks/tune_kda_kernels.py; the forward loop takes 2 pipeline stages where shared memory allows (BK <= 128).
LAUNCH = {
    "gate_cumsum": dict(num_warps=4),
    # one program per chunk, 16-wide head-dim slices (SLICE): 1 warp as fla-core's intra kernels (its [16, 16] dots
    # need no cross-warp exchange); 2 stages: 4x8K / 1x32K forward 1.55 / 1.78 ms at 3, 1.49 / 1.71 at 2, 1.59 /
    # 1.90 at 2 warps (H200, session 15)
    "intra": dict(num_warps=1, num_stages=2),
    "wu": dict(num_warps=4, num_stages=3),  # 3 stages with U0 on bf16 MMA: 4x8K fwd 1.72 -> 1.68 ms (session 15)
    "fwd_state": dict(num_warps=4),
    "fwd_state_o": dict(num_warps=8),  # the loop writing O (no per-chunk states kept: a 1M-token forward)
    # the O kernel forming scale Q e^Γ at 2 stages (88 KB of shared memory, two programs per SM): 4x8K / 1x32K /
    # 1x128K forward 1.264 / 1.469 / 5.54 ms; at 3 stages (one per SM) 1.348 / 1.517 (H200, session 18)
    "fwd_o": dict(num_warps=4, num_stages=2),
    "bwd_du0": dict(num_warps=2),
    "bwd_state": dict(num_warps=4, num_stages=1),
    "bwd_state_few": dict(num_warps=8, num_stages=2),  # fewer programs than SMs (one long sequence): prefetch
    "bwd_state_lp": dict(num_warps=4, num_stages=3),  # bf16 dots, 64-wide V blocks (fla-core's own tuned setting)
    "bwd_v": dict(num_warps=8, num_stages=2),
    # bf16 dots (half the shared memory of tf32 operands): 3 stages, 4x8K / 1x32K fwd+bwd 6.55 / 7.11 -> 6.32 / 6.96 ms
    "bwd_v_lp": dict(num_warps=8, num_stages=3),
    "bwd_da": dict(num_warps=4, num_stages=1),
    "bwd_intra": dict(num_warps=8, num_stages=1, maxnreg=128),
    "bwd_dg": dict(num_warps=4),
    "recurrent": dict(num_warps=4),
}
# Head-dim columns per program of `_gate_cumsum_kernel`: 64 (two programs per chunk and head at K = 128) took 4x8K /
# 1x32K / 1x128K forward 1.74 / 2.14 / 7.65 -> 1.72 / 2.03 / 7.56 ms (32 at 1 or 2 warps: no gain; H200, session 14).
# Column slices of `_wu_kernel` (head dim, V): whole [64, 128] fp32 tiles spilled at sm_90; with 64-wide slices at
# 4 warps it takes 0.45 instead of 0.51 ms per call (H200, 4x8K), 0.43 with one pipeline stage instead of two
# (tune_kda_h200_s8_bwd_intra.json). The same slices in intra and the O kernel were slower (tune_kda_h200_s7.json).
# `_bwd_intra_kernel` (pairwise terms over 16-row partner blocks) in one 128-wide slice: 1.90 ms at 4x8K (4 warps,
# 1 stage); 64-wide slices 2.56, 32-wide 2.04 (tune_kda_h200_s9_bwd_intra.json). Its launch at 8 warps capped at 128
# registers (1.91 -> 1.86 ms) and `_bwd_v`'s at 2 stages (1.41 -> 1.33) made the whole forward+backward 1.3-1.6 %
# faster at every size in session 11 (tune_kda_h200_s11.json, kda_h200_s11_ab.json); in session 9 the same
# `_bwd_intra` pick, with other kernels then, had made it 2-3 % slower: every pick goes through an A/B.
# Slabs of a single sequence (`_slabs`): about SLABS of them, each of at least SLAB_MIN_TOKEN_HEADS token-heads (the
# forward's and the backward's: a forward slab's 6 launches are less GPU work); SLAB_TOKENS forces a slab length
# (tests: the slabbed paths under the interpreter).
SLABS, SLAB_MIN_TOKEN_HEADS, SLAB_TOKENS = 8, dict(forward=1 << 18, backward=1 << 17), None
SLICE = {"gate_k": 64, "intra_k": 16, "wu_k": 64, "wu_v": 64, "bwd_intra_k": 128, "bwd_da_k": 64, "o_k": 64}


# --------------------------------------------------------------------------------------------------- forward
@triton.jit
def _gate(x, a, lower_bound, GATE: tl.constexpr):
    """Log-decay from ``x = raw + dt_bias`` and ``a = exp(A_log)``: 1 bounded ``lb σ(a x)``, 2 ``−a softplus(x)``."""
    if GATE == 1:
        return lower_bound * tl.sigmoid(a * x)
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
    r = tl.arange(0, 64)
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
def _exp(x, FTZ: tl.constexpr):
    """``e^x``; FTZ (on a GPU): one ``ex2.approx.ftz`` of ``x log2 e``. ``tl.exp`` wraps the same MUFU op in the
    handling of denormal results (three more SASS instructions each), which no factor here needs: one below
    2^-126 stands for less than 1e-38 of a term of order 1 and is flushed to 0. The CPU interpreter runs no inline
    asm: ``tl.exp`` there."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * LOG2E],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.exp(x)


@triton.jit
def _put(ptr, x, s, e, h, H, I: tl.constexpr, J: tl.constexpr):
    r = tl.arange(0, 16)
    ptr += s * (H * 64) + h * 64
    tl.store(ptr + (I * 16 + r)[:, None] * (H * 64) + J * 16 + r[None, :], x, mask=(I * 16 + r < e - s)[:, None])


@triton.jit
def _dot(a, b, TF32: tl.constexpr):
    """The solve's 16 x 16 dots: on tf32 tensor cores when T is stored in 16 bits (tf32 keeps 3 more mantissa bits
    than the stored bf16 T; fla-core's solve runs tf32 too), else fp32 FMA."""
    if TF32:
        return tl.dot(a, b, input_precision="tf32")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _inv_unit_lower(lo, TF32: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower 16 x 16 ``L``: ``(I − L)(I + L²)(I + L⁴)(I + L⁸)``, exact as L^16 = 0."""
    r = tl.arange(0, 16)
    x = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - lo
    l2 = _dot(lo, lo, TF32)
    x += _dot(x, l2, TF32)
    l4 = _dot(l2, l2, TF32)
    x += _dot(x, l4, TF32)
    return x + _dot(x, _dot(l4, l4, TF32), TF32)


@triton.jit
def _solve(tinv_ptr, a00, a10, a11, a20, a21, a22, a30, a31, a32, a33, s, e, h, H, TF32: tl.constexpr):
    """``T = (I + A_kk)^-1`` of one chunk from the 16 x 16 blocks of its strictly lower ``A_kk`` (times β):
    diagonal blocks by a nilpotent product, then block forward substitution ``T_IJ = −T_II Σ_{J<=M<I} A_IM T_MJ``
    (``_dot``: tf32 or fp32 FMA). Every block of T is written."""
    d0 = _inv_unit_lower(a00, TF32)
    d1 = _inv_unit_lower(a11, TF32)
    d2 = _inv_unit_lower(a22, TF32)
    d3 = _inv_unit_lower(a33, TF32)
    t10 = -_dot(d1, _dot(a10, d0, TF32), TF32)
    t21 = -_dot(d2, _dot(a21, d1, TF32), TF32)
    t32 = -_dot(d3, _dot(a32, d2, TF32), TF32)
    t20 = -_dot(d2, _dot(a20, d0, TF32) + _dot(a21, t10, TF32), TF32)
    t31 = -_dot(d3, _dot(a31, d1, TF32) + _dot(a32, t21, TF32), TF32)
    t30 = -_dot(d3, _dot(a30, d0, TF32) + _dot(a31, t10, TF32) + _dot(a32, t20, TF32), TF32)
    zero = tl.zeros((16, 16), dtype=tl.float32)
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
def _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, I: tl.constexpr, ck, mk, SAFE: tl.constexpr, FTZ: tl.constexpr):
    """Columns ck of row block I (rows ``16 I .. 16 I + 15``) of a chunk of n rows, a = the block's first row: the
    row operands ``q_i e^{Γ_i − Γ_a}``, ``k_i e^{Γ_i − Γ_a}`` (factors <= 1), the column operand ``k_i e^{Γ_a − Γ_i}``
    (>= 1; <= e^{75} with the bounded gate; SAFE: not formed, k as loaded), Γ_a, and q, k, Γ as loaded."""
    ri = I * 16 + tl.arange(0, 16)
    mi = (ri < n)[:, None] & mk[None, :]
    off = ri[:, None] * HK + ck[None, :]
    ga = tl.load(gam_ptr + tl.minimum(I * 16, n - 1) * HK + ck, mask=mk, other=0.0)
    gi = tl.load(gam_ptr + off, mask=mi, other=0.0)
    ki = tl.load(k_ptr + off, mask=mi, other=0.0).to(tl.float32)
    qi = tl.load(q_ptr + off, mask=mi, other=0.0).to(tl.float32)
    el = _exp(tl.where(mi, gi - ga[None, :], 0.0), FTZ)  # a masked row's Γ = 0 would give e^{−Γ_a}: overflow
    if SAFE:
        kc = ki
    else:
        kc = ki * _exp(ga[None, :] - gi, FTZ)  # a masked row has k = 0 and e^{Γ_a} <= 1: no `where` needed
    return qi * el, ki * el, kc, ga, qi, ki, gi


@triton.jit
def _intra_diag(akk, aqk, k_ptr, gam_ptr, qr, kr, kc, qi, ki, gi, n, HK, I: tl.constexpr, ck, mk, SAFE: tl.constexpr,
                FTZ: tl.constexpr):
    """Adds columns ck's share of diagonal block (I, I): one dense dot each (both operands anchored at the block's
    first row), or (SAFE, any gate) pair by pair (``e^{Γ_i − Γ_j}`` for ``j <= i`` only)."""
    if SAFE:
        ri = I * 16 + tl.arange(0, 16)
        mi = (ri < n)[:, None] & mk[None, :]
        r16 = tl.arange(0, 16)
        for jj in range(16):
            j = I * 16 + jj
            mj = mk & (j + 0 * ck < n)
            gj = tl.load(gam_ptr + j * HK + ck, mask=mj, other=0.0)
            kj = tl.load(k_ptr + j * HK + ck, mask=mj, other=0.0).to(tl.float32)
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
def _intra_kernel(q_ptr, k_ptr, gam_ptr, b_ptr, aqk_ptr, tinv_ptr, cstart_ptr, cend_ptr, scale, H,
                  K: tl.constexpr, BK: tl.constexpr, SAFE: tl.constexpr, TF32: tl.constexpr, FTZ: tl.constexpr):
    """``A_qk`` (times scale, lower; its upper blocks 0) and ``T = (I + A_kk)^-1`` (A_kk times β, strictly lower) of
    one chunk by 16 x 16 blocks (I, J <= I): ``(x_i e^{Γ_i − Γ_a}) · (k_j e^{Γ_a − Γ_j})`` with a the first row of
    row block I, summed over head-dim slices of BK in 20 accumulators. In each slice every row block is loaded and
    exponentiated once, and its column operand serves the blocks below it (the column factors once per chunk, not
    once per row block: 4x8K `_intra` + `_solve` 538 + 90 -> 514 µs at 3 stages, ~450 at 2; re-anchoring the
    column operand per block instead of both row operands: ~380; H200). A_kk goes from the accumulators into the
    solve, never through memory. SAFE: the diagonal blocks pair by pair. Blocks past the end of a part-filled last
    chunk compute on masked (zero) rows and store nothing."""
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
    akk00 = tl.zeros((16, 16), dtype=tl.float32)
    akk10, akk11, akk20, akk21, akk22, akk30, akk31, akk32, akk33 = (akk00, akk00, akk00, akk00, akk00, akk00, akk00,
                                                                      akk00, akk00)
    aqk00, aqk10, aqk11, aqk20, aqk21, aqk22, aqk30, aqk31, aqk32, aqk33 = (akk00, akk00, akk00, akk00, akk00, akk00,
                                                                            akk00, akk00, akk00, akk00)
    for c0 in range(0, K, BK):
        ck = c0 + tl.arange(0, BK)
        mk = ck < K
        qr0, kr0, kc0, ga0, q0, k0, g0 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 0, ck, mk, SAFE, FTZ)
        akk00, aqk00 = _intra_diag(akk00, aqk00, k_ptr, gam_ptr, qr0, kr0, kc0, q0, k0, g0, n, HK, 0, ck, mk, SAFE, FTZ)
        qr1, kr1, kc1, ga1, q1, k1, g1 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 1, ck, mk, SAFE, FTZ)
        akk10, aqk10 = _intra_pair(akk10, aqk10, qr1, kr1, ga1, kc0, ga0, k0, g0, SAFE, FTZ)
        akk11, aqk11 = _intra_diag(akk11, aqk11, k_ptr, gam_ptr, qr1, kr1, kc1, q1, k1, g1, n, HK, 1, ck, mk, SAFE, FTZ)
        qr2, kr2, kc2, ga2, q2, k2, g2 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 2, ck, mk, SAFE, FTZ)
        akk20, aqk20 = _intra_pair(akk20, aqk20, qr2, kr2, ga2, kc0, ga0, k0, g0, SAFE, FTZ)
        akk21, aqk21 = _intra_pair(akk21, aqk21, qr2, kr2, ga2, kc1, ga1, k1, g1, SAFE, FTZ)
        akk22, aqk22 = _intra_diag(akk22, aqk22, k_ptr, gam_ptr, qr2, kr2, kc2, q2, k2, g2, n, HK, 2, ck, mk, SAFE, FTZ)
        qr3, kr3, kc3, ga3, q3, k3, g3 = _intra_rows(q_ptr, k_ptr, gam_ptr, n, HK, 3, ck, mk, SAFE, FTZ)
        akk30, aqk30 = _intra_pair(akk30, aqk30, qr3, kr3, ga3, kc0, ga0, k0, g0, SAFE, FTZ)
        akk31, aqk31 = _intra_pair(akk31, aqk31, qr3, kr3, ga3, kc1, ga1, k1, g1, SAFE, FTZ)
        akk32, aqk32 = _intra_pair(akk32, aqk32, qr3, kr3, ga3, kc2, ga2, k2, g2, SAFE, FTZ)
        akk33, aqk33 = _intra_diag(akk33, aqk33, k_ptr, gam_ptr, qr3, kr3, kc3, q3, k3, g3, n, HK, 3, ck, mk, SAFE, FTZ)
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
           akk30 * b3, akk31 * b3, akk32 * b3, _tril16(akk33, True) * b3, s, e, h, H, TF32)


@triton.jit
def _wu_kernel(q_ptr, k_ptr, v_ptr, b_ptr, gam_ptr, tinv_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, dl_ptr, hs_ptr,
               cstart_ptr, cend_ptr, scale, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               STORE_QG: tl.constexpr, U_FROM_STATES: tl.constexpr, LP: tl.constexpr, FTZ: tl.constexpr):
    """``W = T (β K e^Γ)``, ``U0 = T (β V)``, and for the chunk loops ``K e^{Γ_C − Γ}``, ``e^{Γ_C}`` and (STORE_QG,
    for the backward) ``scale Q e^Γ``; the columns in slices of BK (K) and BV (V), T kept in registers.
    U_FROM_STATES (the backward, with the per-chunk states S0 that the forward kept): ``U = U0 − W S0`` in place of
    U0, as the forward loop computes it (the stored 16-bit W; on a GPU 16-bit S0 and tensor cores), so that no
    chunk loop runs again."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, 64)
    rv = r < e - s
    base = s * (H * K) + h * K
    q_ptr += base
    k_ptr += base
    gam_ptr += base
    w_ptr += base
    qg_ptr += base
    kd_ptr += base
    tinv16 = tl.load(tinv_ptr + s * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :], mask=rv[:, None],
                     other=0.0)  # T as stored: bf16 with bf16 inputs
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = ck < K
        m2 = rv[:, None] & mk[None, :]
        offk = r[:, None] * (H * K) + ck[None, :]
        gam = tl.load(gam_ptr + offk, mask=m2, other=0.0)
        glast = tl.load(gam_ptr + (e - 1 - s) * (H * K) + ck, mask=mk, other=0.0)
        kk = tl.load(k_ptr + offk, mask=m2, other=0.0).to(tl.float32)
        tl.store(kd_ptr + offk, (kk * _exp(glast[None, :] - gam, FTZ)).to(kd_ptr.dtype.element_ty), mask=m2)
        eg = _exp(gam, FTZ)
        # W (stored in 16 bits) on 16-bit tensor cores: it adds nothing measurable to any error (notes)
        tl.store(w_ptr + offk, _lp_dot(tinv16, kk * eg * beta[:, None], LP).to(w_ptr.dtype.element_ty), mask=m2)
        if STORE_QG:
            qq = tl.load(q_ptr + offk, mask=m2, other=0.0).to(tl.float32)
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
def _state_block(ptr, n, h, H, ck, cv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 LOAD: tl.constexpr):
    """The ``[BK, BV]`` block (rows ck, columns cv) of sequence n, head h in a ``[N, H, K, V]`` state tensor:
    offsets inside one ``[K, V]`` state, mask, the (sequence, head) base offset, and its fp32 value from ``ptr``
    (zeros without LOAD)."""
    offs_s = ck[:, None] * V + cv[None, :]
    ms = (ck < K)[:, None] & (cv < V)[None, :]
    state_off = (n * H + h).to(tl.int64) * (K * V)
    if LOAD:
        S = tl.load(ptr + state_off + offs_s, mask=ms, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)
    return offs_s, ms, state_off, S


@triton.jit
def _lp_dot(a, b, LP: tl.constexpr):
    """``a @ b`` for ``a`` as stored (W, K e^{Γ_C−Γ}, Q e^Γ: 16-bit with 16-bit inputs; A_qk: bf16 with bf16 inputs,
    else fp32): with LP on tensor cores in a's dtype, ``b`` rounded to it; else both widened to fp32 (tf32 on a GPU;
    the CPU interpreter, whose bf16 dot multiplies raw bits in triton 3.9)."""
    if LP:
        return tl.dot(a, b.to(a.dtype))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _fwd_state_kernel(q_ptr, gam_ptr, aqk_ptr, o_ptr, kd_ptr, dl_ptr, w_ptr, u_ptr, h0_ptr, ht_ptr, hs_ptr, cu_ptr,
                      coff_ptr, scale, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr, WRITE_O: tl.constexpr,
                      LP: tl.constexpr):
    """The sequential chunk loop of one sequence, head and V block: ``U = U0 − W S`` (overwrites U0 in place),
    ``S ← e^{Γ_C} S + (K e^{Γ_C − Γ})ᵀ U``; with WRITE_O also ``O = (scale Q e^Γ) S + P U`` (the forward: no
    per-chunk states kept), with STORE_H the state entering every chunk (the backward)."""
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, 64)
    r = tl.arange(0, 64)
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
        t0 = bos + i * 64
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
            aqk = tl.load(aqk_ptr + t0 * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :], mask=rv[:, None],
                          other=0.0).to(tl.float32)
            o = tl.dot(qg, S) + tl.dot(aqk, u)
            tl.store(o_ptr + bv + offv, o.to(o_ptr.dtype.element_ty), mask=mv2)
        kd = tl.load(kd_ptr + bk + offk, mask=m2, other=0.0)
        S = S * dl[:, None] + _lp_dot(tl.trans(kd), u, LP)
        dl = dl_next
    if STORE_HT:
        tl.store(ht_ptr + state_off + offs_s, S, mask=ms)


@triton.jit
def _chunk_vblock(cstart_ptr, cend_ptr, V: tl.constexpr, BV: tl.constexpr):
    """A ``(chunks · V/BV, H)`` grid's program: chunk c, head h, V columns cv, first token s, rows r and the valid
    ones rv. The V blocks of a chunk are adjacent programs, so their shared loads come from L2."""
    c = tl.program_id(0) // tl.cdiv(V, BV)
    cv = tl.program_id(0) % tl.cdiv(V, BV) * BV + tl.arange(0, BV)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    r = tl.arange(0, 64)
    rv = r < tl.load(cend_ptr + c).to(tl.int64) - s
    return c, tl.program_id(1), cv, s, r, rv


@triton.jit
def _fwd_o_kernel(q_ptr, gam_ptr, aqk_ptr, hs_ptr, us_ptr, o_ptr, cstart_ptr, cend_ptr, scale, H, K: tl.constexpr,
                  V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FTZ: tl.constexpr, LP: tl.constexpr):
    """``O = (scale Q e^Γ) S0 + P U`` of one chunk and V block, from the states stored by the chunk loop; Q e^Γ is
    formed here, the head dim in BK-wide slices, so that a forward without autograd neither writes nor reads it."""
    c, h, cv, s, r, rv = _chunk_vblock(cstart_ptr, cend_ptr, V, BV)
    mv = cv < V
    mv2 = rv[:, None] & mv[None, :]
    aqk = tl.load(aqk_ptr + s * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :], mask=rv[:, None], other=0.0)
    offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
    u = tl.load(us_ptr + offv, mask=mv2, other=0.0)
    # P U as stored (both bf16 with bf16 inputs: products exact, as in tf32)
    o = _lp_dot(aqk, u, LP)
    hs_ptr += (c * H + h).to(tl.int64) * (K * V)
    for k0 in range(0, K, BK):
        ck = k0 + tl.arange(0, BK)
        mk = ck < K
        offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
        m2 = rv[:, None] & mk[None, :]
        eg = _exp(tl.load(gam_ptr + offk, mask=m2, other=0.0), FTZ) * scale
        qg = (tl.load(q_ptr + offk, mask=m2, other=0.0).to(tl.float32) * eg).to(q_ptr.dtype.element_ty)
        s0 = tl.load(hs_ptr + ck[:, None] * V + cv[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
        # Q e^Γ S0 in 16 bits costs no measurable error (notes)
        o += _lp_dot(qg, s0, LP)
    tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv2)


# --------------------------------------------------------------------------------------------------- backward
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
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    coff = tl.load(coff_ptr + n).to(tl.int64)
    nt = tl.cdiv(eos - bos, 64)
    r = tl.arange(0, 64)
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
        t0 = bos + i * 64
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


@triton.jit
def _bwd_du0_kernel(aqk_ptr, do_ptr, dus_ptr, cstart_ptr, cend_ptr, H, V: tl.constexpr, BV: tl.constexpr):
    """``dU0 = Pᵀ dO`` of one chunk and V block: the part of dU that does not depend on the reverse recurrence,
    out of the sequential loop."""
    c, h, cv, s, r, rv = _chunk_vblock(cstart_ptr, cend_ptr, V, BV)
    mv2 = rv[:, None] & (cv < V)[None, :]
    aqk = tl.load(aqk_ptr + s * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :], mask=rv[:, None],
                  other=0.0).to(tl.float32)
    offv = s * (H * V) + h * V + r[:, None] * (H * V) + cv[None, :]
    do = tl.load(do_ptr + offv, mask=mv2, other=0.0).to(tl.float32)
    tl.store(dus_ptr + offv, tl.dot(tl.trans(aqk), do), mask=mv2)


@triton.jit
def _dot16(a, b, LP: tl.constexpr):
    """``a @ b`` on bf16 tensor cores (both operands rounded to bf16, fp32 accumulation) with LP, else in fp32
    (tf32 on a GPU): the backward's products of operands that are not all stored in 16 bits (``_lp_dot``: a is);
    bf16 only, as fp16 would flush small gradients."""
    if LP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _bwd_v_kernel(v_ptr, b_ptr, tinv_ptr, hs_ptr, dhs_ptr, us_ptr, dus_ptr, do_ptr, dv_ptr, dqg_ptr, dkd_ptr, dw_ptr,
                  dt_ptr, dp_ptr, db_ptr, dgc_ptr, cstart_ptr, cend_ptr, scale, H, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, LPS: tl.constexpr):
    """Per chunk, the sums over V: ``dQg = dO S0ᵀ``, ``dKd = U dS_Cᵀ``, ``dW = −dU S0ᵀ``, ``dP = dO Uᵀ`` (times
    scale, lower), ``dT = dU (β V)ᵀ``, ``dv = β Tᵀ dU`` (final), ``dβ = Σ V Tᵀ dU`` and ``Σ_v S0 dS_C``. LPS: every dot
    on bf16 tensor cores (U, dU and βV rounded to bf16; dO, the states and T are stored so): 1.04-1.06x faster
    forward+backward, gradients' error 3.1-3.5e-3 -> 3.4-3.8e-3 (fla-core: 4.0-4.4e-3; H200, session 18)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, 64)
    rv = r < e - s
    ck = tl.arange(0, BK)
    mk = ck < K
    m2 = rv[:, None] & mk[None, :]
    offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
    off64 = s * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :]
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    tinv = tl.load(tinv_ptr + off64, mask=rv[:, None], other=0.0)
    state_off = (c * H + h).to(tl.int64) * (K * V)
    dqg = tl.zeros((64, BK), dtype=tl.float32)
    dkd = tl.zeros((64, BK), dtype=tl.float32)
    dw = tl.zeros((64, BK), dtype=tl.float32)
    dp = tl.zeros((64, 64), dtype=tl.float32)
    dt = tl.zeros((64, 64), dtype=tl.float32)
    dbeta = tl.zeros((64,), dtype=tl.float32)
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
    tl.store(dt_ptr + off64, dt, mask=rv[:, None])
    tl.store(dp_ptr + off64, tl.where(r[:, None] >= r[None, :], dp, 0.0) * scale, mask=rv[:, None])
    tl.store(db_ptr + s * H + r * H + h, dbeta, mask=rv)
    tl.store(dgc_ptr + (c * H + h).to(tl.int64) * K + ck, dgc, mask=mk)


@triton.jit
def _bwd_da_kernel(k_ptr, b_ptr, gam_ptr, tinv_ptr, dw_ptr, dkd_ptr, da_ptr, xpre_ptr, cstart_ptr, cend_ptr, H,
                   K: tl.constexpr, BK: tl.constexpr, KB: tl.constexpr, FTZ: tl.constexpr, LPS: tl.constexpr):
    """The chunk-wide reductions that the per-row kernel ``_bwd_intra_kernel`` needs: ``dT += dW (β K e^Γ)ᵀ``, then
    ``dA = −Tᵀ dT Tᵀ`` (strictly lower, in place of dT); ``Tᵀ dW`` (in place of dW); and the sums ``Σ_{s<16 I}
    k_s dKd_s e^{Γ_C − Γ_s}`` for row blocks I = 1, 2, 3 (``xpre [chunks, H, 3, K]``: the prefix terms of dg that
    reach a block from earlier ones). LPS: the dT and Tᵀ dW products on bf16 tensor cores (dW and β K e^Γ rounded
    to bf16; T is stored so): 4x8K / 1x32K fwd+bwd 1.6 / 2.2 % faster, errors unchanged (H200, session 18)."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    r = tl.arange(0, 64)
    rv = r < e - s
    off64 = s * (H * 64) + h * 64 + r[:, None] * (H * 64) + r[None, :]
    beta = tl.load(b_ptr + s * H + r * H + h, mask=rv, other=0.0).to(tl.float32)
    dt = tl.load(da_ptr + off64, mask=rv[:, None], other=0.0)
    tinv = tl.load(tinv_ptr + off64, mask=rv[:, None], other=0.0)
    for kh in range(0, BK, KB):
        ck = kh + tl.arange(0, KB)
        mk = ck < K
        m2 = rv[:, None] & mk[None, :]
        offk = s * (H * K) + h * K + r[:, None] * (H * K) + ck[None, :]
        kk = tl.load(k_ptr + offk, mask=m2, other=0.0).to(tl.float32)
        gam = tl.load(gam_ptr + offk, mask=m2, other=0.0)
        dw = tl.load(dw_ptr + offk, mask=m2, other=0.0)
        dt += _dot16(dw, tl.trans(kk * _exp(gam, FTZ) * beta[:, None]), LPS)
        tl.store(dw_ptr + offk, _dot16(tl.trans(tinv), dw, LPS), mask=m2)
        glast = tl.load(gam_ptr + s * (H * K) + h * K + (e - 1 - s) * (H * K) + ck, mask=mk, other=0.0)
        x = kk * tl.load(dkd_ptr + offk, mask=m2, other=0.0) * _exp(tl.where(m2, glast[None, :] - gam, 0.0), FTZ)
        # inclusive sums at rows 15, 31, 47 = the sums over the rows before blocks 1, 2, 3
        tl.store(xpre_ptr + ((c * H + h).to(tl.int64) * 3 + r[:, None] // 16) * K + ck[None, :], tl.cumsum(x, axis=0),
                 mask=((r % 16 == 15) & (r < 48))[:, None] & mk[None, :])
    # dA's two products stay tf32 (in bf16 too: no clear gain, H200, session 18)
    tinv = tinv.to(tl.float32)
    da = -tl.dot(tl.trans(tinv), tl.dot(dt, tl.trans(tinv)))
    tl.store(da_ptr + off64, tl.where(r[:, None] > r[None, :], da, 0.0), mask=rv[:, None])


@triton.jit
def _bwd_intra_kernel(q_ptr, k_ptr, b_ptr, gam_ptr, dqg_ptr, dkd_ptr, tdw_ptr, dp_ptr, da_ptr, dgc_ptr,
                      xpre_ptr, dgam_ptr, dge_ptr, db32_ptr, dq_ptr, dk_ptr, db_ptr, cstart_ptr, cend_ptr, scale, H,
                      K: tl.constexpr, BK: tl.constexpr, KS: tl.constexpr, SAFE: tl.constexpr, FTZ: tl.constexpr):
    """dq, dk, dβ (final) and dΓ with the prefix terms of dg, of rows ``16 I .. 16 I + 15`` of a chunk, from the
    sums of ``_bwd_v_kernel`` and ``_bwd_da_kernel``. Dense terms, row by row: ``dq = scale dQg e^Γ``, ``dk = dKd
    e^{Γ_C − Γ} + β (Tᵀ dW) e^Γ``, dP's diagonal (kept out of the pairwise terms: it adds exactly 0 to dΓ, and its
    rounding would dominate dg under strong decay). Pairwise terms: row side ``X_i = Σ_{j<i} d[i, j] k_j e^{Γ_i −
    Γ_j}`` and column side ``Y_j = Σ_{i>j} d[i, j] x_i e^{Γ_i − Γ_j}`` for ``d`` = dP, dA, 16 partner rows at a time
    (only the causal blocks are loaded); dense: one dot per block, anchored at the block's first row ``a`` (no later
    token can move the rounding); SAFE: other blocks anchored at the block's first (row side) or last (column side)
    row, the diagonal block pair by pair. The ``Γ_C − Γ_t`` terms add ``Σ_{s<t} k_s dKd_s e^{Γ_C − Γ_s} + e^{Γ_C}
    Σ_v S0 dS_C`` to dg_t: the earlier blocks' sum (``_bwd_da_kernel``) plus an exclusive prefix of the previous
    rows (loaded again), no large term added and taken away again. Head dim in slices of KS (fewer live registers)."""
    c = tl.program_id(0) // 4  # the 4 row blocks of a chunk run side by side: its q, k, Γ are read from L2
    h = tl.program_id(1)
    a = tl.program_id(0) % 4 * 16
    s = tl.load(cstart_ptr + c).to(tl.int64)
    e = tl.load(cend_ptr + c).to(tl.int64)
    n = e - s
    ri = a + tl.arange(0, 16)
    vi = ri < n
    base = s * (H * K) + h * K
    base64 = s * (H * 64) + h * 64
    q_ptr += base
    k_ptr += base
    gam_ptr += base
    cc = tl.arange(0, 16)
    dp_diag = tl.load(dp_ptr + base64 + ri * (H * 64) + ri, mask=vi, other=0.0)
    bi = tl.load(b_ptr + s * H + ri * H + h, mask=vi, other=0.0).to(tl.float32)
    dbeta = tl.load(db32_ptr + s * H + ri * H + h, mask=vi, other=0.0)
    if SAFE:  # the diagonal block's d[i, j] (row side) and d[j, i] (column side, as [i, j]), pair by pair below
        offd = base64 + ri[:, None] * (H * 64) + (a + cc)[None, :]
        offdt = base64 + (a + cc)[None, :] * (H * 64) + ri[:, None]
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
        xp_ = tl.load(k_ptr + offp, mask=mp, other=0.0).to(tl.float32) * tl.load(dkd_ptr + base + offp, mask=mp,
                      other=0.0) * _exp(tl.where(mp, glast[None, :] - tl.load(gam_ptr + offp, mask=mp, other=0.0),
                                                   0.0), FTZ)
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
            offij = base64 + ri[:, None] * (H * 64) + rj[None, :]
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
            offji = base64 + rj[None, :] * (H * 64) + ri[:, None]  # d[j, i] as [i, j]
            vij = vi[:, None] & vj[None, :]
            bj = tl.load(b_ptr + s * H + rj * H + h, mask=vj, other=0.0).to(tl.float32)
            yp += tl.dot(tl.load(dp_ptr + offji, mask=vij & (rj[None, :] > ri[:, None]), other=0.0),
                         tl.load(q_ptr + offj, mask=mj, other=0.0).to(tl.float32) * erj)
            ym += tl.dot(tl.load(da_ptr + offji, mask=vij, other=0.0) * bj[None, :],
                         tl.load(k_ptr + offj, mask=mj, other=0.0).to(tl.float32) * erj)
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
        tl.store(dq_ptr + base + offi, dq.to(dq_ptr.dtype.element_ty), mask=mi)
        tl.store(dk_ptr + base + offi, dk.to(dk_ptr.dtype.element_ty), mask=mi)
        tl.store(dgam_ptr + base + offi, dgam, mask=mi)
    tl.store(db_ptr + s * H + ri * H + h, dbeta.to(db_ptr.dtype.element_ty), mask=vi)


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
    r = tl.arange(0, 64)
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


# --------------------------------------------------------------------------------------------------- decode
@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, scale, H,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    mk = ck < K
    cv = iv * BV + tl.arange(0, BV)
    mv = cv < V
    offs_s, ms, state_off, S = _state_block(h0_ptr, n, h, H, ck, cv, K, V, BK, BV, HAS_H0)
    for t in range(bos, eos):
        offk = t * (H * K) + h * K + ck
        offv = t * (H * V) + h * V + cv
        kt = tl.load(k_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        qt = tl.load(q_ptr + offk, mask=mk, other=0.0).to(tl.float32) * scale
        gt = tl.load(g_ptr + offk, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + offv, mask=mv, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + t * H + h).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        u = (vt - tl.sum(S * kt[:, None], axis=0)) * bt
        S = S + kt[:, None] * u[None, :]
        o = tl.sum(S * qt[:, None], axis=0)
        tl.store(o_ptr + offv, o.to(o_ptr.dtype.element_ty), mask=mv)
    if STORE_HT:
        tl.store(ht_ptr + state_off + offs_s, S, mask=ms)


# --------------------------------------------------------------------------------------------------- host side
def _chunk_tables(B, T, cu_seqlens, device):
    """Sequence and chunk tables: ``cu [N+1]``, ``coff [N+1]`` (first chunk of each sequence), ``cstart, cend [NC]``
    (int32), NC. Fixed-length batches reuse cached tables: a dozen small launches less per call."""
    if cu_seqlens is None:
        return _fixed_chunk_tables(B, T, device)
    return _tables_from_cu(cu_seqlens.to(device=device, dtype=torch.int64), None)


@functools.lru_cache(maxsize=16)
def _fixed_chunk_tables(B, T, device):
    return _tables_from_cu(torch.arange(0, B + 1, device=device, dtype=torch.int64) * T, B * triton.cdiv(T, CHUNK))


def _tables_from_cu(cu, NC):
    """The tables of ``_chunk_tables`` from int64 ``cu``; NC (the number of chunks) is read from the GPU if None."""
    lens = cu[1:] - cu[:-1]
    nt = (lens + CHUNK - 1) // CHUNK
    coff = torch.cat([nt.new_zeros(1), nt.cumsum(0)])
    NC = int(coff[-1]) if NC is None else NC
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), nt, output_size=NC)
    idx = torch.arange(NC, device=cu.device) - coff[seq]
    cstart = cu[seq] + idx * CHUNK
    cend = torch.minimum(cstart + CHUNK, cu[seq + 1])
    i32 = torch.int32
    return cu.to(i32), coff.to(i32), cstart.to(i32), cend.to(i32), NC


def _pow2(n):
    return max(32, triton.next_power_of_2(n))  # 16-wide fp32 tiles hit a shared-memory fault in triton 3.6


def _launch_cfg(K, V):
    BK, BVf = _pow2(K), _pow2(V)
    return BK, BVf, min(BVf, 32)  # V split in 32-wide blocks: more programs for the sequential chunk loop


def _lp(x):
    """Whether the kernels take their GPU-only paths: dots with 16-bit operands on 16-bit tensor cores (`LP`), exps
    as inline asm (`FTZ`). The CPU interpreter widens those dots to fp32 (its bf16 dot multiplies raw bits in triton
    3.9) and runs no inline asm."""
    return x.is_cuda


def _lps(x):
    """Whether the backward's dots round operands that are not stored in 16 bits (dS, dU, U, dW) to bf16 too (the
    kernels' `LPS`): on a GPU with bf16 inputs only, as fp16 would flush small gradients."""
    return _lp(x) and x.dtype == torch.bfloat16


def _few_loop_programs(BV, N, H, V, device):
    """Whether a chunk loop over (V/BV blocks, N sequences, H heads) leaves SMs of a GPU idle (few long sequences)."""
    if device.type != "cuda":
        return False
    return triton.cdiv(V, BV) * N * H < torch.cuda.get_device_properties(device).multi_processor_count


def _fwd_loop_bv(BV, N, H, V, wide, device):
    """V block of the forward chunk loop: 16 when BV-wide blocks leave SMs idle (twice the programs, each with half
    the work per chunk; 16 is only the N dimension of its dots: 1x32K forward 2.89 -> 2.79 ms, 1M 88 -> 85 ms);
    else 64 when ``wide`` (the 3-stage loop, as fla-core's: 4x8K forward 1.71 -> 1.70 ms), else BV (H200, H=16)."""
    if _few_loop_programs(BV, N, H, V, device):
        return 16
    return min(_pow2(V), 64) if wide else BV


def _slabs(B, T, H, device, min_token_heads):
    """Token ranges ``(s0, s1)`` of a single sequence's forward and backward in slabs, or None (one pass). The chunk
    loop of one sequence is latency-bound (a few programs per head); in slabs, the loop of one slab runs on a second
    stream beside the parallel kernels of the next slab (forward) or of the one after it (backward). Same kernels,
    same arithmetic: the results are bit-identical to one pass. About SLABS slabs of at least ``min_token_heads``
    token-heads (a slab's launches cost host time); SLAB_TOKENS forces the length (tests). Batches of several
    sequences run in one pass: in slabs of whole sequences their loops would run one sequence at a time (4x8K:
    1.89 -> 2.20 ms forward, H200)."""
    if B != 1 or T == 0:
        return None
    if SLAB_TOKENS is not None:
        L = SLAB_TOKENS
    elif device.type == "cuda":
        L = triton.cdiv(max(triton.cdiv(min_token_heads, H), triton.cdiv(T, SLABS)), CHUNK) * CHUNK
    else:
        return None
    return [(s0, min(s0 + L, T)) for s0 in range(0, T, L)] if T > L else None


@functools.lru_cache(maxsize=None)
def _loop_stream(device):
    """The stream of the slabbed chunk loops (forward and reverse), at high priority: the loops are the critical
    path, the parallel kernels fill the SMs around them."""
    return torch.cuda.Stream(device, priority=-1)


def _prep(q, k, v, g, beta, gate, scale, safe, tables, aqk, tinv, w, kd, u0, qg, dl, hs_kept, intra, gam=None):
    """The parallel kernels before the chunk loop, over the chunks of ``tables`` (all tensors are views of the same
    rows): Γ (into ``gam``, else a new tensor), with ``intra`` A_qk and T (else given: the backward), then W, U0 (U
    from the per-chunk states ``hs_kept``), K e^{Γ_C − Γ}, e^{Γ_C} and Q e^Γ (into ``qg`` unless None). Returns Γ."""
    TT, H, K = q.shape
    V = v.shape[-1]
    _, _, cstart, cend, NC = tables
    BK, BVf, _ = _launch_cfg(K, V)
    mode, a, dtb, lb = gate
    gam = torch.empty(TT, H, K, device=q.device, dtype=torch.float32) if gam is None else gam
    if NC == 0:
        return gam
    BKg = min(BK, SLICE["gate_k"])
    _gate_cumsum_kernel[(NC, H, triton.cdiv(K, BKg))](g, a, dtb, gam, cstart, cend, lb, H, K, BKg, GATE=mode,
                                                      **LAUNCH["gate_cumsum"])
    if intra:
        _intra_kernel[(NC, H)](q, k, gam, beta, aqk, tinv, cstart, cend, scale, H, K, min(BK, SLICE["intra_k"]),
                               SAFE=safe, TF32=_lp(q) and tinv.element_size() == 2, FTZ=_lp(q),
                               **LAUNCH["intra"])
    _wu_kernel[(NC, H)](q, k, v, beta, gam, tinv, w, u0, qg if qg is not None else w, kd, dl,
                        hs_kept if hs_kept is not None else dl, cstart, cend, scale, H, K, V, min(BK, SLICE["wu_k"]),
                        min(BVf, SLICE["wu_v"]), STORE_QG=qg is not None, U_FROM_STATES=hs_kept is not None,
                        LP=_lp(q), FTZ=_lp(q), **LAUNCH["wu"])
    return gam


def _loop(tables, q, gam, aqk, o, kd, dl, w, u0, h0, ht, hs, scale):
    """The chunk loop over the sequences of ``tables``: U0 → U in place, the per-chunk states into ``hs`` (else O,
    from Q and Γ), the final states into ``ht`` (unless None), from ``h0`` (unless None)."""
    TT, H, K = q.shape
    V = u0.shape[-1]
    cu, coff, *_, NC = tables
    if NC == 0:  # no token (T = 0, or only empty documents): each final state is its initial state
        if ht is not None and h0 is not None:
            ht.copy_(h0)
        elif ht is not None:
            ht.zero_()
        return
    N = cu.numel() - 1
    BK, _, BV = _launch_cfg(K, V)
    # Pipeline stages (chunks prefetched): 3 where the per-chunk states are kept and W, K e^{Γ_C − Γ} are 16-bit
    # [64, BK] tiles of at most 256 B a row (1x32K / 1x128K forward 2.10 -> 1.91 / 7.53 -> 7.33 ms with 64-wide V
    # blocks, H200); 2 otherwise up to BK = 128 (the loop writing O holds more tiles: 3 overflow its shared memory,
    # compile_kda.py), else 1
    stages3 = hs is not None and BK * w.element_size() <= 256
    BVl = _fwd_loop_bv(BV, N, H, V, stages3, q.device)
    dummy = dl
    _fwd_state_kernel[(triton.cdiv(V, BVl), N, H)](
        q, gam if gam is not None else dummy, aqk, o if o is not None else dummy, kd, dl, w, u0,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy, hs if hs is not None else dummy, cu, coff,
        scale, H, K, V, BK, BVl, HAS_H0=h0 is not None, STORE_HT=ht is not None, STORE_H=hs is not None,
        WRITE_O=hs is None, LP=_lp(q), num_stages=3 if stages3 else 2 if BK <= 128 else 1,
        **LAUNCH["fwd_state" if hs is not None else "fwd_state_o"])


def _out(tables, q, gam, aqk, hs, us, o, scale):
    """``O = (scale Q e^Γ) S0 + P U`` of every chunk of ``tables``, in parallel, from the per-chunk states ``hs``."""
    _, _, cstart, cend, NC = tables
    H, K = q.shape[1:]
    V = o.shape[-1]
    BK, BVf, _ = _launch_cfg(K, V)
    BVo = min(BVf, 128)
    if NC > 0:
        _fwd_o_kernel[(NC * triton.cdiv(V, BVo), H)](q, gam, aqk, hs, us, o, cstart, cend, scale, H, K, V,
                                                   min(BK, SLICE["o_k"]), BVo, FTZ=_lp(q), LP=_lp(q), **LAUNCH["fwd_o"])


def _forward(q, k, v, g, beta, gate, scale, h0, tables, safe, output_final_state, for_backward=False,
             keep_prep=False, prep=None, slabs=None):
    """Run the forward kernels on flat ``[TT, H, *]`` tensors; ``gate = (mode, exp(A_log) [H], dt_bias [H*K],
    lower_bound)`` (mode 0: ``g`` is the log-decay; 1 bounded / 2 softplus: ``g`` is the raw gate input).
    ``keep_prep``: also return ``T = (I + A_kk)⁻¹`` (for the autograd forward: its backward then passes ``prep =
    (A_qk, T, states or None)`` back and skips the intra and solve kernels, with the per-chunk states the chunk loop:
    ``_wu_kernel`` then computes U from them). ``slabs``: token ranges (``_slabs``) or None. Returns a dict of
    outputs and intermediates."""
    TT, H, K = q.shape
    V = v.shape[-1]
    cu, *_, NC = tables
    N = cu.numel() - 1
    f32 = dict(device=q.device, dtype=torch.float32)
    x = (q, k, v, g, beta)
    # allocated in order of use and freed early: a 1M-token forward keeps only what the chunk loop reads
    aqk, tinv, hs_kept = prep if prep is not None else (None, None, None)
    # T and A_qk in bf16 with bf16 inputs (as fla-core's A_kk⁻¹ and A_qk): half their bytes in the kernels that read
    # them and kept for the backward; every dot reading them widens them to fp32
    t16 = dict(device=q.device, dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    if prep is None:
        aqk = torch.empty(TT, H, 64, **t16)
    # W, K e^{Γ_C − Γ}, Q e^Γ and the per-chunk states (and their gradients) are stored in the inputs' 16-bit dtype:
    # half the bytes the loops read, 1.2-1.3x faster fwd+bwd (H200). P stays fp32, and so does U (U0, overwritten
    # with U by the loop) for the backward: their rounding is what reaches the output and gradients
    # (notes/kda_kernel_notes.md). The output's own forward stores U in 16 bits: 4-5 % faster, o's error 2.9e-3 ->
    # 3.6e-3 (fla-core: 4.1e-3; H200, 4x8K); in the backward they cost more than they saved. The forward loop and
    # `_wu`'s W multiply on 16-bit tensor cores (on a GPU), and so does the forward's U0 = T (βV) since session 15
    # (o 3.8e-3 -> 4.1e-3, fla-core's; with `_wu` at 3 stages ~2 % of the forward); the other dots widen their
    # operands to fp32 (tf32).
    lp = dict(device=q.device, dtype=q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32)
    w, kd = torch.empty(TT, H, K, **lp), torch.empty(TT, H, K, **lp)
    u0 = torch.empty(TT, H, V, **(f32 if for_backward else lp))
    # Per-chunk states: kept when the backward needs them, or when they take at most Γ's bytes plus
    # STATES_LIMIT_BYTES; then O runs in a parallel kernel and the loop prefetches.
    keep_states = for_backward or NC * H * K * V * w.element_size() <= STATES_LIMIT_BYTES + TT * H * K * 4
    # Q e^Γ (times scale) for the backward (16 bits); a forward without autograd forms it in the O kernel
    qg = torch.empty(TT, H, K, **lp) if for_backward else None
    dl = torch.empty(max(NC, 1), H, K, **f32)
    out = dict(aqk=aqk, w=w, qg=qg, kd=kd, dl=dl)
    keep_tinv = for_backward or keep_prep or prep is not None
    if slabs is not None and keep_states and hs_kept is None:
        # slabs: Γ (and T unless kept) per slab; the loop of slab j beside the parallel kernels of slab j+1
        gam = torch.empty(TT, H, K, **f32) if for_backward else None
        if prep is None and keep_tinv:
            tinv = torch.empty(TT, H, 64, **t16)
        ht = torch.empty(N, H, K, V, **f32) if (output_final_state and not for_backward) else None
        hs = torch.empty(max(NC, 1), H, K, V, **lp)
        o = None if for_backward else torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
        _slabbed_forward(slabs, x, gate, scale, safe, prep is None, aqk, tinv, w, kd, u0, qg, dl, hs, o, h0, ht, gam,
                         t16)
        out.update(tinv=tinv if keep_tinv else None, gam=gam, o=o, ht=ht, hs=hs, us=u0)
        return out
    if prep is None:
        tinv = torch.empty(TT, H, 64, **t16)
    gam = _prep(*x, gate, scale, safe, tables, aqk, tinv, w, kd, u0, qg, dl, hs_kept, intra=prep is None)
    out["tinv"] = tinv if keep_tinv else None
    del tinv
    out["gam"] = gam if for_backward else None
    if hs_kept is not None:  # the backward, with the forward's states: _wu_kernel computed U, no loop
        out.update(o=None, ht=None, hs=hs_kept, us=u0)
        return out
    ht = torch.empty(N, H, K, V, **f32) if (output_final_state and not for_backward) else None
    hs = torch.empty(max(NC, 1), H, K, V, **lp) if keep_states else None
    o = None if for_backward else torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
    _loop(tables, q, gam, aqk, o, kd, dl, w, u0, h0, ht, hs, scale)
    if o is not None and keep_states:
        _out(tables, q, gam, aqk, hs, u0, o, scale)
    out.update(o=o, ht=ht, hs=hs, us=u0)  # U0 was overwritten with U
    return out


def _slabbed_forward(slabs, x, gate, scale, safe, intra, aqk, tinv, w, kd, u0, qg, dl, hs, o, h0, ht, gam, t16):
    """The forward of one sequence in ``slabs``, each a sequence of its own whose initial state is the previous
    slab's final state (fp32, as the loop carries it): a slab's parallel kernels, then its loop on the loop stream,
    then its O kernel (none for the backward's forward). ``tinv``, ``gam``: None to allocate them per slab."""
    q = x[0]
    H, K = q.shape[1:]
    V = u0.shape[-1]
    carry = [torch.empty(1, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2)]

    gams = {}  # a forward without autograd: each slab's Γ, until its O kernel

    def prep(j, tab, R, C):
        tinv_j = torch.empty(R.stop - R.start, H, 64, **t16) if tinv is None else tinv[R]
        gams[j] = _prep(*(t[R] for t in x), gate, scale, safe, tab, aqk[R], tinv_j, w[R], kd[R], u0[R],
                        None if qg is None else qg[R], dl[C], None, intra, gam=None if gam is None else gam[R])

    def loop(j, tab, R, C):
        h_in = h0 if j == 0 else carry[(j - 1) % 2]
        h_out = ht if j == len(slabs) - 1 else carry[j % 2]
        _loop(tab, q[R], None, aqk[R], None if o is None else o[R], kd[R], dl[C], w[R], u0[R], h_in, h_out, hs[C],
              scale)

    def out(j, tab, R, C):
        if o is not None:
            _out(tab, q[R], gams.pop(j), aqk[R], hs[C], u0[R], o[R], scale)

    _pipeline(q.device, slabs, range(len(slabs)), prep, loop, out, wait_each=True)


def _pipeline(device, slabs, order, before, loop, after, wait_each):
    """Slab j of ``slabs`` (in ``order``): ``before`` on the current stream, ``loop`` on ``_loop_stream`` once the
    current stream's work so far is done (with ``wait_each`` False only for the first slab: the loops then need
    nothing the current stream does later), and ``after`` on the current stream once that loop is done and the
    next slab's loop is enqueued. Each is called with (j, tables, token rows, chunks); None skips ``before``. On
    the CPU (the interpreter) all in order on the one stream."""
    cuda = device.type == "cuda"
    main, side = (torch.cuda.current_stream(device), _loop_stream(device)) if cuda else (None, None)

    def finish(done, args):
        if done is not None:
            main.wait_event(done)
        after(*args)

    pending = None
    for j in order:
        s0, s1 = slabs[j]
        args = (j, _fixed_chunk_tables(1, s1 - s0, device), slice(s0, s1), slice(s0 // CHUNK, triton.cdiv(s1, CHUNK)))
        if before is not None:
            before(*args)
        if cuda and (wait_each or pending is None):
            side.wait_stream(main)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            loop(*args)
            done = side.record_event() if cuda else None
        if pending is not None:
            finish(*pending)
        pending = (done, args)
    finish(*pending)
    if cuda:
        main.wait_stream(side)


def _backward(q, k, v, g, beta, gate, scale, h0, tables, safe, do, dht, prep, slabs=None):
    TT, H, K = q.shape
    V = v.shape[-1]
    cu, _, cstart, cend, NC = tables
    N = cu.numel() - 1
    BVf = _launch_cfg(K, V)[1]
    fw = _forward(q, k, v, g, beta, gate, scale, h0, tables, safe, False, for_backward=True, prep=prep, slabs=slabs)
    f32 = dict(device=q.device, dtype=torch.float32)
    dhs = torch.empty_like(fw["hs"])  # 16-bit with 16-bit inputs, as the states
    dus = torch.empty(TT, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    do = do.contiguous()
    if NC > 0:
        BVo = min(BVf, 64)
        _bwd_du0_kernel[(NC * triton.cdiv(V, BVo), H)](fw["aqk"], do, dus, cstart, cend, H, V, BVo,
                                                      **LAUNCH["bwd_du0"])
    mode = gate[0]
    dq, dk, dv, dg, db = (torch.empty_like(t) for t in (q, k, v, g, beta))
    # the fused gate's per-chunk partial gradients of A_log and dt_bias (zeros when there is no chunk)
    parts = (torch.zeros(max(NC, 1), H, **f32), torch.zeros(max(NC, 1), H, K, **f32)) if mode else None
    grads = (dq, dk, dv, dg, db)
    x = (q, k, v, g, beta)
    if slabs is not None:
        _slabbed_backward(slabs, x, gate, scale, safe, fw, do, dht, dh0, dhs, dus, grads, parts)
    else:
        _rev_loop(tables, fw, do, dht, dh0, dhs, dus)
        _bwd_chunks(tables, slice(None), slice(None), x, gate, scale, safe, fw, do, dhs, dus, grads, parts)
    dgate = (parts[0].sum(0), parts[1].sum(0)) if mode else None
    return dq, dk, dv, dg, db, dh0, dgate


def _rev_loop(tables, fw, do, dht, dh0, dhs, dus):
    """The reverse chunk loop over the sequences of ``tables`` (tensors: views of the same rows and chunks),
    carrying dS from ``dht`` (unless None) into ``dh0`` (unless None): dS entering every chunk into ``dhs``, dU
    completed in ``dus``."""
    cu, coff = tables[:2]
    N = cu.numel() - 1
    w = fw["w"]
    H, K = w.shape[1:]
    V = do.shape[-1]
    BK, BVf, BV = _launch_cfg(K, V)
    # with bf16 dots (LPS) the reverse loop is built and launched as fla-core's: 64-wide V blocks, 4 warps, 3 stages
    # (its loads then feed the dots and are pipelined: 197 KB of shared memory at K = V = 128, compile_kda.py).
    # Otherwise 32-wide blocks: at 16 it was slower, and wrong at 8 warps in triton 3.6 (H200)
    lps = _lps(w)
    BVr = min(BVf, 64) if lps else BV
    few = _few_loop_programs(BVr, N, H, V, w.device)
    # 2 stages only when the [64, BK] tiles it prefetches are at most 256 B a row (16-bit at BK <= 128): fp32 inputs
    # at head dim 128 overflowed the H200's shared memory
    launch = dict(LAUNCH["bwd_state_lp" if lps else "bwd_state_few" if few else "bwd_state"],
                  **({"num_stages": 1} if BK * w.element_size() > 256 else {}))
    _bwd_state_kernel[(triton.cdiv(V, BVr), N, H)](
        fw["qg"], fw["kd"], fw["dl"], w, do, dht if dht is not None else dhs, dh0 if dh0 is not None else dhs, dhs,
        dus, cu, coff, H, K, V, BK, BVr, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, LP=_lp(w), LPS=lps,
        **launch)


def _bwd_chunks(tables, R, C, x, gate, scale, safe, fw, do, dhs, dus, grads, parts):
    """The backward's parallel kernels after the reverse loop, over the chunks of ``tables``: token rows R and
    chunks C of the full tensors. Writes the rows R of ``grads`` (dq, dk, dv, dg, dβ) and the chunks C of the gate's
    partial gradients ``parts``."""
    _, _, cstart, cend, NC = tables
    if NC == 0:
        return
    q, k, v, g, beta = (t[R] for t in x)
    dq, dk, dv, dg, db = (t[R] for t in grads)
    do, dus, us, tinv, gam = do[R], dus[R], fw["us"][R], fw["tinv"][R], fw["gam"][R]
    hs, dhs = fw["hs"][C], dhs[C]
    TT, H, K = q.shape
    V = v.shape[-1]
    BK, _, BV = _launch_cfg(K, V)
    mode, a, dtb, lb = gate
    f32 = dict(device=q.device, dtype=torch.float32)
    lps = _lps(q)
    dqg, dkd, dw, dgam, dge = (torch.empty(TT, H, K, **f32) for _ in range(5))
    da = torch.empty(TT, H, 64, **f32)  # dT from _bwd_v, then dA in place (_bwd_da); dw becomes Tᵀ dW there
    dp = torch.empty(TT, H, 64, **f32)
    db32 = torch.empty(TT, H, **f32)
    dgc = torch.empty(NC, H, K, **f32)
    _bwd_v_kernel[(NC, H)](v, beta, tinv, hs, dhs, us, dus, do, dv, dqg, dkd, dw, da, dp, db32, dgc, cstart, cend,
                           scale, H, K, V, BK, BV, LPS=lps,
                           **LAUNCH["bwd_v_lp" if lps else "bwd_v"])
    xpre = torch.empty(NC, H, 3, K, **f32)
    _bwd_da_kernel[(NC, H)](k, beta, gam, tinv, dw, dkd, da, xpre, cstart, cend, H, K, BK,
                            min(BK, SLICE["bwd_da_k"]), FTZ=_lp(q), LPS=lps, **LAUNCH["bwd_da"])
    _bwd_intra_kernel[(NC * 4, H)](q, k, beta, gam, dqg, dkd, dw, dp, da, dgc, xpre, dgam, dge, db32, dq, dk, db,
                                  cstart, cend, scale, H, K, BK, min(BK, SLICE["bwd_intra_k"]), SAFE=safe,
                                  FTZ=_lp(q), **LAUNCH["bwd_intra"])
    da_part, ddtb_part = (parts[0][C], parts[1][C]) if mode else (dg, dg)
    _bwd_dg_kernel[(NC, H)](dgam, dge, g, a, dtb, dg, da_part, ddtb_part, cstart, cend, lb, H, K, BK, GATE=mode,
                            **LAUNCH["bwd_dg"])


def _slabbed_backward(slabs, x, gate, scale, safe, fw, do, dht, dh0, dhs, dus, grads, parts):
    """The backward of one sequence after the recomputed forward, in ``slabs`` from the last: the reverse loop of a
    slab on the loop stream (dS carried between slabs in fp32), the slab's parallel kernels after it, beside the
    reverse loop of the slab before."""
    q = x[0]
    H, K = q.shape[1:]
    V = do.shape[-1]
    carry = [torch.empty(1, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2)]

    def loop(j, tab, R, C):
        view = dict(qg=fw["qg"][R], kd=fw["kd"][R], dl=fw["dl"][C], w=fw["w"][R])
        d_in = dht if j == len(slabs) - 1 else carry[(j + 1) % 2]
        d_out = dh0 if j == 0 else carry[j % 2]
        _rev_loop(tab, view, do[R], d_in, d_out, dhs[C], dus[R])

    def chunks(j, tab, R, C):
        _bwd_chunks(tab, R, C, x, gate, scale, safe, fw, do, dhs, dus, grads, parts)

    # the reverse loops need only the recomputed forward and dU0: one wait, before the first
    _pipeline(q.device, slabs, reversed(range(len(slabs))), None, loop, chunks, wait_each=False)


class _ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, h0, output_final_state, cu_seqlens, safe, mode, lb,
                grad):
        B, T, H, K = q.shape
        V = v.shape[-1]
        tables = _chunk_tables(B, T, cu_seqlens, q.device)
        slabs = _slabs(B, T, H, q.device, SLAB_MIN_TOKEN_HEADS["forward"]) if cu_seqlens is None else None
        flat = _flatten(q, k, v, g, beta)
        h0c = None if h0 is None else h0.contiguous()
        fw = _forward(*flat, _gate_args(mode, A_log, dt_bias, lb, H, K, q.device), scale, h0c, tables, safe,
                      output_final_state, keep_prep=grad, slabs=slabs)
        # A_qk and T (bf16 with bf16 inputs), [B*T, H, 64] each, are kept for the backward: it skips the intra
        # and solve kernels; and the per-chunk states (16-bit with 16-bit inputs, [chunks, H, K, V]: 512 B per token
        # and head at K = V = 128) when they take at most STATES_LIMIT_BYTES: it skips the chunk loop too. Γ (fp32,
        # 512 B per token and head) is not: the gate kernel runs again (0.13 ms at 4x8K, H200) where the loop took
        # 0.36-1 ms
        hs = fw["hs"]
        hs = hs if hs is not None and hs.numel() * hs.element_size() <= STATES_LIMIT_BYTES else None
        prep = (fw["aqk"], fw["tinv"], hs) if grad else (None, None, None)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, *prep)
        ctx.slabs = _slabs(B, T, H, q.device, SLAB_MIN_TOKEN_HEADS["backward"]) if cu_seqlens is None else None
        ctx.tables, ctx.scale, ctx.safe, ctx.mode, ctx.lb = tables, scale, safe, mode, lb
        return fw["o"].reshape(B, T, H, V), fw["ht"]

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *prep = ctx.saved_tensors
        B, T, H, K = q.shape
        V = v.shape[-1]
        flat = _flatten(q, k, v, g, beta)
        if do is None:
            do = torch.zeros_like(v)
        dht = None if dht is None else dht.float().contiguous()
        h0c = None if h0 is None else h0.float().contiguous()
        gate = _gate_args(ctx.mode, A_log, dt_bias, ctx.lb, H, K, q.device)
        dq, dk, dv, dg, db, dh0, dgate = _backward(*flat, gate, ctx.scale, h0c, ctx.tables, ctx.safe,
                                                   do.reshape(B * T, H, V), dht, prep=tuple(prep), slabs=ctx.slabs)
        dA_log = ddt_bias = None
        if A_log is not None:  # the gate's chain rule ran in the last backward kernel
            dA_log = dgate[0].reshape(A_log.shape).to(A_log.dtype)
        if dt_bias is not None:
            ddt_bias = dgate[1].reshape(dt_bias.shape).to(dt_bias.dtype)
        dh0 = None if dh0 is None else dh0.to(h0.dtype)
        return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
                db.reshape(beta.shape), dA_log, ddt_bias, None, dh0, None, None, None, None, None, None)


def _gate_args(mode, A_log, dt_bias, lb, H, K, device):
    """Kernel arguments of the fused gate: ``(mode, exp(A_log) [H] fp32, dt_bias [H*K] fp32, lower_bound)``."""
    if mode == 0:
        dummy = torch.empty(1, device=device, dtype=torch.float32)
        return 0, dummy, dummy, 0.0
    a = torch.ones(H, device=device) if A_log is None else A_log.detach().float().exp().contiguous()
    dtb = torch.zeros(H * K, device=device) if dt_bias is None else dt_bias.detach().float().reshape(H * K).contiguous()
    return mode, a, dtb, float(lb)


def _gate_torch(g_raw, A_log, dt_bias, mode, lb):
    """The gate in torch (fp32): mode 1 ``lb * sigmoid(exp(A_log) * x)``, mode 2 ``-exp(A_log) * softplus(x)``,
    ``x = g_raw + dt_bias``."""
    H, K = g_raw.shape[-2:]
    x = g_raw.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(H, K)
    a = A_log.float().exp().reshape(H, 1) if A_log is not None else 1.0
    return lb * torch.sigmoid(a * x) if mode == 1 else -a * torch.nn.functional.softplus(x)


def _check(q, k, v, g, beta, initial_state, cu_seqlens, gate):
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share the shape [B, T, H, K], "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if K > 256 or v.shape[-1] > 256:
        raise ValueError(f"head dims up to 256 are supported, got K={K}, V={v.shape[-1]}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must have shape [{N}, {H}, {K}, {v.shape[-1]}], "
                         f"got {tuple(initial_state.shape)}")


def _l2norm(q, k):
    """q/k L2 norm over the head dim (eps 1e-6), in fp32, back in the input dtype; autograd-differentiable."""
    return tuple((x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
                 for x in (q, k))


def _flatten(q, k, v, g, beta):
    """``[B, T, H, *]`` inputs as the contiguous ``[B*T, H, *]`` rows the kernels index (β: ``[B*T, H]``); explicit
    sizes, so T = 0 works too."""
    B, T, H = q.shape[:3]
    return [x.contiguous().reshape(B * T, H, *x.shape[3:]) for x in (q, k, v, g, beta)]


def _safe_path(gate, lower_bound):
    """Dense diagonal sub-blocks need every g >= -5 (a 16-token sub-block then spans <= 75 nats)."""
    if gate == "softplus":
        return True
    return lower_bound is not None and float(lower_bound) < -5.0


def chunk_kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                     lower_bound=None, gate="bounded"):
    """Chunked KDA on Triton, differentiable (Triton forward and backward).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; g: ``[B, T, H, K]`` log-decay, or the
            raw gate input when ``use_gate_in_kernel``. With ``gate="bounded"`` the caller guarantees
            ``g >= -5`` (the dense diagonal path); ``gate="softplus"`` takes the safe path for any ``g <= 0``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None; N = B, or the number of documents with ``cu_seqlens``.
        output_final_state: also return the final state ``[N, H, K, V]`` fp32.
        cu_seqlens: ``[N+1]`` document boundaries packed in one row (B must be 1).
        use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, gate: as ``kda.chunk_kda``.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, gate)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    safe = _safe_path(gate, lower_bound)
    mode, lb = 0, 0.0
    if use_gate_in_kernel:  # computed inside the prep kernel from the raw input
        mode = 1 if gate == "bounded" else 2
        lb = -5.0 if lower_bound is None else float(lower_bound)
    else:
        A_log = dt_bias = None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    return _ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                   cu_seqlens, safe, mode, lb, grad)


def recurrent_kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                         *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                         lower_bound=None, gate="bounded"):
    """Token-by-token KDA on Triton for decoding (no autograd). Arguments and returns as ``chunk_kda_triton``.

    When ``initial_state`` is a contiguous fp32 tensor and ``output_final_state`` is set, the final state is
    written into ``initial_state`` in place and that same tensor is returned.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens, gate)
    with torch.no_grad():
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q, k)
        if use_gate_in_kernel:
            lb = -5.0 if lower_bound is None else float(lower_bound)
            g = _gate_torch(g, A_log, dt_bias, 1 if gate == "bounded" else 2, lb)
        B, T, H, K = q.shape
        V = v.shape[-1]
        scale = K ** -0.5 if scale is None else float(scale)
        if cu_seqlens is None:
            cu = torch.arange(0, B + 1, device=q.device, dtype=torch.int32) * T
        else:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        N = cu.numel() - 1
        flat = _flatten(q, k, v, g, beta)
        h0 = initial_state
        if h0 is not None and not (h0.dtype == torch.float32 and h0.is_contiguous()):
            h0 = h0.float().contiguous()
        ht = None
        if output_final_state:
            ht = h0 if h0 is not None else torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
        o = torch.empty(B * T, H, V, device=q.device, dtype=q.dtype)
        BK, _, BV = _launch_cfg(K, V)
        _recurrent_kernel[(triton.cdiv(V, BV), N, H)](
            *flat, o, h0 if h0 is not None else o, ht if ht is not None else o, cu, scale, H, K, V, BK, BV,
            HAS_H0=h0 is not None, STORE_HT=ht is not None, **LAUNCH["recurrent"])
    return o.reshape(B, T, H, V), ht

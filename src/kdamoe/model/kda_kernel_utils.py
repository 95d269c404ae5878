"""Triton helpers shared by the KDA kernels: the chunk tile, the exp, the 16-bit dots and the offsets of the
per-chunk and per-state tensors. Rows are tokens of ``[B*T, H, *]`` tensors; the per-chunk tables ``A_qk`` and
``T`` are ``[B*T, H, CHUNK]`` (row t holds its chunk's row t).

Offsets in the KDA kernels: a token row times its row width (``H K``, ``H V``, ``H CHUNK``; 2^20 tokens x 2048 is
2^31) and a chunk or sequence index times a state's ``K V`` (16K chunks x 16 heads x 16K values at 1M tokens) are
int64 (the int32 chunk tables' entries are widened as they are loaded); offsets inside one chunk's rows or one
state, and chunk x head products, are int32: ``check_triton_inputs`` keeps tokens x heads below 2^31, and there are
no more chunks than tokens. Programs run over chunks on grid axis 0 (up to 2^31 - 1 of them); the chunk loops put
(sequence, V block) there too, as CUDA allows 65535 programs on axes 1 and 2 and a packed batch can hold more
documents."""

import triton
import triton.language as tl

from .kda_common import CHUNK_SIZE, L2NORM_EPS

CHUNK = tl.constexpr(CHUNK_SIZE)
LOG2E = tl.constexpr(1.4426950408889634)
L2EPS = tl.constexpr(L2NORM_EPS)


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
def _row_rstd(x_ptr, rows, valid, HK, K: tl.constexpr, BK: tl.constexpr, R: tl.constexpr):
    """The L2 norm's ``1 / sqrt(Σ x² + eps)`` of the R rows ``rows`` (where ``valid``) of a ``[*, HK]`` tensor, its
    head's K columns read BK at a time (as ``fused_norm``'s kernel computes it, in fp32)."""
    ss = tl.zeros((R,), dtype=tl.float32)
    for c0 in range(0, K, BK):
        ck = c0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * HK + ck[None, :], mask=valid[:, None] & (ck < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return tl.rsqrt(ss + L2EPS)


@triton.jit
def _put(ptr, x, s, e, h, H, I: tl.constexpr, J: tl.constexpr):
    r = tl.arange(0, 16)
    ptr += s * (H * CHUNK) + h * CHUNK
    tl.store(ptr + (I * 16 + r)[:, None] * (H * CHUNK) + J * 16 + r[None, :], x, mask=(I * 16 + r < e - s)[:, None])


@triton.jit
def _lp_dot(a, b, LP: tl.constexpr):
    """``a @ b`` for ``a`` as stored (W, K e^{Γ_C−Γ}, Q e^Γ: 16-bit with 16-bit inputs; A_qk: bf16 with bf16 inputs,
    else fp32): with LP on tensor cores in a's dtype, ``b`` rounded to it; else both widened to fp32 (tf32 on a GPU;
    the CPU interpreter, whose bf16 dot multiplies raw bits in triton 3.9)."""
    if LP:
        return tl.dot(a, b.to(a.dtype))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


@triton.jit
def _dot16(a, b, LP: tl.constexpr):
    """``a @ b`` on bf16 tensor cores (both operands rounded to bf16, fp32 accumulation) with LP, else in fp32
    (tf32 on a GPU): the backward's products of operands that are not all stored in 16 bits (``_lp_dot``: a is);
    bf16 only, as fp16 would flush small gradients."""
    if LP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return tl.dot(a.to(tl.float32), b.to(tl.float32))


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
def _loop_program(V: tl.constexpr, BV: tl.constexpr):
    """A chunk loop's ``(V/BV · sequences, H)`` grid's program: sequence n, V block iv, head h (the V blocks of a
    sequence and head are adjacent programs)."""
    return tl.program_id(0) // tl.cdiv(V, BV), tl.program_id(0) % tl.cdiv(V, BV), tl.program_id(1)


@triton.jit
def _chunk_vblock(cstart_ptr, cend_ptr, V: tl.constexpr, BV: tl.constexpr):
    """A ``(chunks · V/BV, H)`` grid's program: chunk c, head h, V columns cv, first token s, rows r and the valid
    ones rv. The V blocks of a chunk are adjacent programs, so their shared loads come from L2."""
    c = tl.program_id(0) // tl.cdiv(V, BV)
    cv = tl.program_id(0) % tl.cdiv(V, BV) * BV + tl.arange(0, BV)
    s = tl.load(cstart_ptr + c).to(tl.int64)
    r = tl.arange(0, CHUNK)
    rv = r < tl.load(cend_ptr + c).to(tl.int64) - s
    return c, tl.program_id(1), cv, s, r, rv

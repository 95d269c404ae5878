"""KDA's causal depthwise short convolution + SiLU: Triton forward and backward, a torch reference, and the
decode-state update of the cache.

``y[t, c] = silu(Σ_{s=0}^{W-1} weight[c, W-1-s] · x[t-s, c])`` for ``x: [B, T, C]``, ``weight: [C, W]``: taps that
reach before the start of t's document are dropped (packed documents, ``cu_seqlens``: ``[N + 1]`` int32/int64
offsets of the documents in the flattened ``B·T`` tokens, every row starting one, as ``PackedDocuments`` builds them)
or, for plain batches, read from ``context: [B, W-1, C]`` (the inputs before x when decoding; zeros without it).
The KDA layer runs it on its q, k, v projections. The output dtype is ``promote_types(x.dtype, weight.dtype)`` (fp32
for bf16 activations and an fp32 weight under autocast); the sum is fp32 (fp64 for fp64 inputs on the torch path).

Kernels (the flattened ``[B·T, C]`` input, whose rows may lie further apart than C, as in a column slice of a
wider projection; a 1-D grid of (token block, channel block) tiles, as CUDA allows 2^31 − 1 programs on axis 0 and
65535 on axes 1 and 2, which would stop at 4M tokens; ``channels_first`` in ``LAUNCH`` orders the programs channel
blocks fastest, so the programs that run together read whole rows, else token blocks fastest; int64 offsets, as 1M
tokens x 6144 channels pass 2^31):

- forward: one program per ``[BT, BD]`` tile; each token's document bounds come from a vectorised binary search of
  ``cu_seqlens`` (``ceil(log2(N + 1))`` gathers from a table of N + 1 entries that stays in L1; no host
  synchronisation, no mask tensor) or ``t − t mod T`` for plain batches; W shifted masked loads summed in fp32.
- backward, two kernels: ``dpre = dy · silu'(pre)`` with ``pre`` recomputed from x (x is all the autograd graph
  keeps, no ``[B·T, C]`` pre-activation; the W taps of a tile in one ``[BT, W, BD]`` load) into a buffer in x's
  dtype, with ``dweight[tap] = Σ_t dpre[t] · x[t − (W−1−tap)]`` summed per program of a persistent grid along time
  in fp32 — per token row of the tile in registers, over the rows once after the program's last tile — and stored
  as a ``[P, W, C]`` partial reduced in torch after (deterministic, no atomics); then ``dx[t] = Σ_s weight[W-1-s] ·
  dpre[t+s]`` over the outputs ``t + s`` in t's document. Each pass reads its inputs once (the shifted tiles come
  from L1 / L2). One kernel without the dpre buffer runs slower: recomputing dpre at each of the W shifts (an
  H200), or shifting the tile's rows in registers (``tl.gather`` or a shift matrix: two to four times the dpre
  kernel's instructions, compiled for sm_90).
- ``short_conv_state``: one program per (row, channel block) gathers the row's last W inputs.

Tile sizes and program order (``LAUNCH``): the forward's is the fastest of ``benchmarks/bench_conv.py``'s sweep on an
H200 (BENCHMARKS.md); the backward's dpre launch (166 registers for sm_90, no spill) is within 2 % of the best of the
sweep on an H100, the dx launch the fastest of the sweep on an H200.
"""

import torch
import torch.nn.functional as F

from .fused_norm import persistent_programs, triton, use_triton

if triton is not None:
    import triton.language as tl

LAUNCH = {
    "fwd": dict(BT=16, BD=128, num_warps=4, channels_first=False),
    "dpre": dict(BT=32, BD=32, num_warps=4, programs_per_sm=16, channels_first=False),
    "dx": dict(BT=16, BD=128, num_warps=4, channels_first=False),
    "state": dict(BD=128, num_warps=4),
}


# ---------------------------------------------------------------------------------------------------------------------
# torch references
# ---------------------------------------------------------------------------------------------------------------------


def _doc_starts(cu_seqlens, n_tokens):
    """``[n_tokens]`` flat index of each token's document start."""
    cu = cu_seqlens.to(torch.int64)
    positions = torch.arange(n_tokens, device=cu.device)
    return cu[torch.searchsorted(cu, positions, right=True) - 1]


def short_conv_silu_torch(x, weight, cu_seqlens=None, context=None):
    """Reference: the taps one by one in fp32 (fp64 for fp64 inputs), as the kernels sum them, SiLU."""
    batch, seq_len, channels = x.shape
    width = weight.shape[1]
    wide = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    xf, wf = x.to(wide), weight.to(wide)
    if context is None:
        context = xf.new_zeros(batch, width - 1, channels)
    padded = torch.cat([context.to(wide), xf], dim=1)  # [B, T + W - 1, C]
    if cu_seqlens is not None:
        starts = _doc_starts(cu_seqlens, batch * seq_len).view(batch, seq_len)
        positions = torch.arange(batch * seq_len, device=x.device).view(batch, seq_len)
    out = xf * wf[:, width - 1]
    for tap in range(width - 1):
        shift = width - 1 - tap
        term = padded[:, tap : tap + seq_len] * wf[:, tap]
        if cu_seqlens is not None:
            term = torch.where((positions - shift >= starts).unsqueeze(-1), term, 0.0)
        out = out + term
    return F.silu(out).to(torch.promote_types(x.dtype, weight.dtype))


def short_conv_state_torch(x, width, state=None, cu_seqlens=None):
    """Reference of ``short_conv_state``: the last ``width`` inputs of each row after ``state``, channels first."""
    batch, seq_len, channels = x.shape
    if state is None:
        state = x.new_zeros(batch, channels, width)
    tail = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)[..., -width:]
    if cu_seqlens is not None:
        row_ends = torch.arange(1, batch + 1, device=x.device) * seq_len - 1
        last_start = _doc_starts(cu_seqlens, batch * seq_len)[row_ends]
        positions = row_ends[:, None] - width + 1 + torch.arange(width, device=x.device)
        tail = torch.where((positions >= last_start[:, None]).unsqueeze(1), tail, 0)
    return tail


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _doc_bounds(t, cu, n_docs, n_steps, T, VARLEN: tl.constexpr):
        """``(bos, eos)`` int64 of the documents of the flat token indices ``t``: the largest j with ``cu[j] <= t``
        (so empty documents are skipped) by ``n_steps`` halvings; rows of T tokens without VARLEN."""
        if VARLEN:
            lo = tl.zeros_like(t)
            hi = lo + n_docs
            for _ in range(n_steps):
                mid = (lo + hi + 1) // 2
                take = tl.load(cu + mid).to(tl.int64) <= t
                lo = tl.where(take, mid, lo)
                hi = tl.where(take, hi, mid - 1)
            bos = tl.load(cu + lo).to(tl.int64)
            eos = tl.load(cu + tl.minimum(lo + 1, n_docs)).to(tl.int64)
        else:
            bos = (t // T) * T
            eos = bos + T
        return bos, eos

    @triton.jit
    def _tile(pid, n_rows, n_cols, CHANNELS_FIRST: tl.constexpr):
        """``(row, col)`` of program pid in an ``n_rows x n_cols`` grid of tiles (rows: token blocks or persistent
        programs along time; cols: channel blocks), cols fastest with CHANNELS_FIRST, else rows fastest."""
        if CHANNELS_FIRST:
            return pid // n_cols, pid % n_cols
        return pid % n_rows, pid // n_rows

    @triton.jit
    def _conv_pre(x, w, ctx, u, bos, cbase, m_u, d, m_d, SX, s_cj, s_cc, W: tl.constexpr, HAS_CTX: tl.constexpr):
        """Pre-activation ``[BT, BD]`` fp32 at the flat tokens u (document start bos; x's rows SX elements apart):
        taps before bos are 0, or (HAS_CTX, plain rows) read from ctx ``[B, W-1, C]`` at ``cbase + src · s_cj``
        (``_ctx_base``)."""
        m_x = m_u[:, None] & m_d[None, :]
        acc = tl.load(x + u[:, None] * SX + d[None, :], mask=m_x, other=0.0).to(tl.float32)
        acc = acc * tl.load(w + d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)[None, :]
        for tap in tl.static_range(W - 1):
            src = u - (W - 1 - tap)
            inside = src >= bos
            xv = tl.load(x + src[:, None] * SX + d[None, :], mask=m_x & inside[:, None], other=0.0).to(tl.float32)
            if HAS_CTX:
                xv += tl.load(ctx + (cbase + src * s_cj)[:, None] + d[None, :] * s_cc, mask=m_x & ~inside[:, None],
                              other=0.0).to(tl.float32)
            acc += xv * tl.load(w + d * W + tap, mask=m_d, other=0.0).to(tl.float32)[None, :]
        return acc

    @triton.jit
    def _third(t, cb, d, C, BD: tl.constexpr):
        """``(part, offsets)`` of channel block cb (inside one third of C: the launcher checks that BD divides C/3)
        in three ``[L, C/3]`` tensors (q | k | v kept apart): its part (0, 1, 2) and the offsets of tokens t,
        channels d within that part's tensor ``[BT, BD]``."""
        third = C // 3
        part = (cb * BD) // third
        return part, t[:, None] * third + (d - part * third)[None, :]

    @triton.jit
    def _ctx_base(bos, T, s_cb, s_cj, W: tl.constexpr):
        """Offset such that ``_ctx_base + src · s_cj`` addresses context row ``W − 1 + src − bos`` of the batch row
        starting at bos (plain rows): one int64 division per tile, not one per tap."""
        return (bos // T) * s_cb + (W - 1 - bos) * s_cj

    @triton.jit
    def _conv_fwd_kernel(x, w, ctx, cu, y, y1, y2, L, T, C, SX, n_docs, n_steps, s_cb, s_cj, s_cc, n_tblocks,
                         n_cblocks, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr,
                         HAS_CTX: tl.constexpr, CHANNELS_FIRST: tl.constexpr, SPLIT: tl.constexpr):
        """``silu(pre)`` of a tile into y ``[L, C]``, or with SPLIT into y, y1, y2 ``[L, C/3]`` by thirds of C."""
        tb, cb = _tile(tl.program_id(0), n_tblocks, n_cblocks, CHANNELS_FIRST)
        t = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        d = cb * BD + tl.arange(0, BD)
        m_t, m_d = t < L, d < C
        bos, _ = _doc_bounds(t, cu, n_docs, n_steps, T, VARLEN)
        cbase = _ctx_base(bos, T, s_cb, s_cj, W) if HAS_CTX else bos
        pre = _conv_pre(x, w, ctx, t, bos, cbase, m_t, d, m_d, SX, s_cj, s_cc, W, HAS_CTX)
        out = (pre * tl.sigmoid(pre)).to(y.dtype.element_ty)
        mask = m_t[:, None] & m_d[None, :]
        if SPLIT:
            part, offs = _third(t, cb, d, C, BD)
            if part == 0:
                tl.store(y + offs, out, mask=mask)
            elif part == 1:
                tl.store(y1 + offs, out, mask=mask)
            else:
                tl.store(y2 + offs, out, mask=mask)
        else:
            tl.store(y + t[:, None] * C + d[None, :], out, mask=mask)

    @triton.jit
    def _conv_taps(x, ctx, u, bos, cbase, m_u, d, m_d, SX, s_cj, s_cc, W: tl.constexpr, WP: tl.constexpr,
                   HAS_CTX: tl.constexpr):
        """The W inputs each of the flat tokens u reads, ``[BT, WP, BD]`` fp32: tap j holds ``x[u − (W−1−j)]`` (0
        past W, and before bos, or with HAS_CTX read from ctx as ``_conv_pre`` does), one load for all taps."""
        taps = tl.arange(0, WP)
        src = u[:, None] - (W - 1 - taps)[None, :]  # [BT, WP]
        live = m_u[:, None] & (taps < W)[None, :]
        inside = src >= bos[:, None]
        m3 = m_d[None, None, :]
        xv = tl.load(x + src[:, :, None] * SX + d[None, None, :], mask=(live & inside)[:, :, None] & m3,
                     other=0.0).to(tl.float32)
        if HAS_CTX:
            xv += tl.load(ctx + (cbase[:, None] + src * s_cj)[:, :, None] + d[None, None, :] * s_cc,
                          mask=(live & ~inside)[:, :, None] & m3, other=0.0).to(tl.float32)
        return xv

    @triton.jit
    def _conv_dpre_kernel(x, w, ctx, cu, dy, dy1, dy2, dpre, dw, L, T, C, SX, n_docs, n_steps, n_blocks, s_cb, s_cj,
                          s_cc, n_programs, n_cblocks, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                          BD: tl.constexpr, VARLEN: tl.constexpr, HAS_CTX: tl.constexpr, CHANNELS_FIRST: tl.constexpr,
                          SPLIT: tl.constexpr):
        """Persistent over token blocks pid, pid + P, ...: ``dpre = dy · silu'(pre)`` of the block into ``dpre``
        (pre recomputed from the block's taps, ``_conv_taps``), and this program's weight-gradient partial sums
        ``Σ_t dpre[t] · x[t − (W−1−tap)]`` into ``dw[pid, tap, channel]`` (``[P, W, C]``): accumulated per token
        row in registers and summed over the rows once, after the last block (no cross-thread reduction per
        block). dy is ``[L, C]``, or with SPLIT dy, dy1, dy2 ``[L, C/3]`` by thirds of C."""
        pid, cb = _tile(tl.program_id(0), n_programs, n_cblocks, CHANNELS_FIRST)
        d = cb * BD + tl.arange(0, BD)
        m_d = d < C
        taps = tl.arange(0, WP)
        wt = tl.load(w + d[None, :] * W + taps[:, None], mask=(taps < W)[:, None] & m_d[None, :],
                     other=0.0).to(tl.float32)  # [WP, BD]
        dw_acc = tl.zeros([BT, WP, BD], dtype=tl.float32)
        for blk in range(pid, n_blocks, n_programs):
            t = (blk * BT + tl.arange(0, BT)).to(tl.int64)
            m_t = t < L
            m_x = m_t[:, None] & m_d[None, :]
            bos, _ = _doc_bounds(t, cu, n_docs, n_steps, T, VARLEN)
            cbase = _ctx_base(bos, T, s_cb, s_cj, W) if HAS_CTX else bos
            xv = _conv_taps(x, ctx, t, bos, cbase, m_t, d, m_d, SX, s_cj, s_cc, W, WP, HAS_CTX)
            pre = tl.sum(xv * wt[None, :, :], axis=1)
            sig = tl.sigmoid(pre)
            if SPLIT:
                part, offs = _third(t, cb, d, C, BD)
                if part == 0:
                    g = tl.load(dy + offs, mask=m_x, other=0.0).to(tl.float32)
                elif part == 1:
                    g = tl.load(dy1 + offs, mask=m_x, other=0.0).to(tl.float32)
                else:
                    g = tl.load(dy2 + offs, mask=m_x, other=0.0).to(tl.float32)
            else:
                g = tl.load(dy + t[:, None] * C + d[None, :], mask=m_x, other=0.0).to(tl.float32)
            dp = g * sig * (1.0 + pre * (1.0 - sig))
            tl.store(dpre + t[:, None] * C + d[None, :], dp.to(dpre.dtype.element_ty), mask=m_x)
            dw_acc += dp[:, None, :] * xv
        tl.store(dw + pid * W * C + taps[:, None] * C + d[None, :], tl.sum(dw_acc, axis=0),
                 mask=(taps < W)[:, None] & m_d[None, :])

    @triton.jit
    def _conv_dx_kernel(w, cu, dpre, dx, L, T, C, n_docs, n_steps, n_tblocks, n_cblocks, W: tl.constexpr,
                        BT: tl.constexpr, BD: tl.constexpr, VARLEN: tl.constexpr, CHANNELS_FIRST: tl.constexpr):
        """``dx[t] = Σ_s weight[W−1−s] · dpre[t + s]`` over the outputs ``t + s`` of t's document."""
        tb, cb = _tile(tl.program_id(0), n_tblocks, n_cblocks, CHANNELS_FIRST)
        t = (tb * BT + tl.arange(0, BT)).to(tl.int64)
        d = cb * BD + tl.arange(0, BD)
        m_t, m_d = t < L, d < C
        _, eos = _doc_bounds(t, cu, n_docs, n_steps, T, VARLEN)
        acc = tl.zeros([BT, BD], dtype=tl.float32)
        for s in tl.static_range(W):
            u = t + s
            m_u = m_t & (u < eos)
            dp = tl.load(dpre + u[:, None] * C + d[None, :], mask=m_u[:, None] & m_d[None, :], other=0.0)
            acc += dp.to(tl.float32) * tl.load(w + d * W + (W - 1 - s), mask=m_d, other=0.0).to(tl.float32)[None, :]
        tl.store(dx + t[:, None] * C + d[None, :], acc.to(dx.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])

    @triton.jit
    def _state_kernel(x, state, cu, out, T, C, SX, n_docs, n_steps, s_sb, s_sc, s_sw,
                      W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr,
                      VARLEN: tl.constexpr, HAS_STATE: tl.constexpr):
        """Row b, channels d: ``out[b, d, j]`` = the input at row position T − W + j (from state when negative),
        0 when it lies before the document the row ends in."""
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BD + tl.arange(0, BD)
        m_d = d < C
        j = tl.arange(0, WP)
        p = T - W + j
        last = tl.zeros_like(p.to(tl.int64)) + b * T + T - 1
        bos, _ = _doc_bounds(last, cu, n_docs, n_steps, T, VARLEN)
        flat = b * T + p
        m_j = j < W
        v = tl.load(x + flat[None, :] * SX + d[:, None], mask=(m_j & (p >= 0) & (flat >= bos))[None, :] & m_d[:, None],
                    other=0.0)
        if HAS_STATE:
            v += tl.load(state + b * s_sb + d[:, None] * s_sc + (W + p)[None, :] * s_sw,
                         mask=(m_j & (p < 0))[None, :] & m_d[:, None], other=0.0).to(v.dtype)
        tl.store(out + (b * C + d[:, None]) * W + j[None, :], v.to(out.dtype.element_ty),
                 mask=m_j[None, :] & m_d[:, None])


def _rows(x):
    """x ``[B, T, C]`` as the kernels read it: channels contiguous and the B·T rows evenly spaced (``x.stride(1)``
    apart), so a column slice of a wider projection is read in place; anything else is copied."""
    if x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1] * x.stride(1)):
        return x
    return x.contiguous()


def _doc_args(x, cu_seqlens):
    """``(cu, n_docs, n_steps)`` kernel arguments: n_steps = ceil(log2(N + 1)) halvings find a document among N + 1
    offsets; x stands in for the absent table."""
    if cu_seqlens is None:
        return x, 0, 0
    n_docs = cu_seqlens.numel() - 1
    return cu_seqlens, n_docs, n_docs.bit_length()


def conv_silu_fwd(x, weight, cu_seqlens, context, split=False):
    """The Triton forward: ``silu(conv(x))`` ``[B, T, C]`` (x as ``_rows`` reads it, weight contiguous); with
    ``split`` its thirds along C as three contiguous ``[B, T, C/3]`` tensors (the KDA layer's q, k, v: no copy to
    make one of them contiguous)."""
    batch, seq_len, channels = x.shape
    if split and (channels // 3) % LAUNCH["fwd"]["BD"]:  # a tile would straddle two thirds
        return tuple(t.contiguous() for t in conv_silu_fwd(x, weight, cu_seqlens, context).split(channels // 3, -1))
    width = weight.shape[1]
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if split:
        ys = [torch.empty(batch, seq_len, channels // 3, dtype=dtype, device=x.device) for _ in range(3)]
    else:
        ys = [torch.empty(x.shape, dtype=dtype, device=x.device)] * 3
    n_tokens = batch * seq_len
    cfg = LAUNCH["fwd"]
    cu, n_docs, n_steps = _doc_args(x, cu_seqlens)
    n_tblocks, n_cblocks = triton.cdiv(n_tokens, cfg["BT"]), triton.cdiv(channels, cfg["BD"])
    if n_tokens and channels:
        _conv_fwd_kernel[(n_tblocks * n_cblocks,)](
            x, weight, x if context is None else context, cu, *ys, n_tokens, seq_len, channels, x.stride(1), n_docs,
            n_steps, *(context.stride() if context is not None else (0, 0, 0)), n_tblocks, n_cblocks, W=width,
            BT=cfg["BT"], BD=cfg["BD"], VARLEN=cu_seqlens is not None, HAS_CTX=context is not None,
            CHANNELS_FIRST=cfg["channels_first"], SPLIT=split, num_warps=cfg["num_warps"])
    return tuple(ys) if split else ys[0]


def conv_silu_bwd(x, weight, cu_seqlens, context, dy):
    """The Triton backward: ``(dx, dweight)`` from the forward's inputs and ``dy`` ``[B, T, C]``, or its thirds along
    C as three ``[B, T, C/3]`` tensors (as ``conv_silu_fwd(..., split=True)`` returns them), the pre-activation
    recomputed."""
    batch, seq_len, channels = x.shape
    width = weight.shape[1]
    split = isinstance(dy, (tuple, list))
    if split and (channels // 3) % LAUNCH["dpre"]["BD"]:  # a tile would straddle two thirds
        dy, split = torch.cat(list(dy), dim=-1), False
    dys = [t.contiguous() for t in dy] if split else [dy.contiguous()] * 3
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dpre = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # the pre-activation's gradient, in x's dtype
    n_tokens = batch * seq_len
    cfg, cfg_dx = LAUNCH["dpre"], LAUNCH["dx"]
    n_blocks, n_cblocks = triton.cdiv(n_tokens, cfg["BT"]), triton.cdiv(channels, cfg["BD"])
    programs = persistent_programs(x.device, n_blocks, max(n_cblocks, 1), per_sm=cfg["programs_per_sm"])
    dw = torch.zeros(programs, width, channels, dtype=torch.float32, device=x.device)
    cu, n_docs, n_steps = _doc_args(x, cu_seqlens)
    if channels:
        _conv_dpre_kernel[(programs * n_cblocks,)](
            x, weight, x if context is None else context, cu, *dys, dpre, dw, n_tokens, seq_len, channels,
            x.stride(1), n_docs, n_steps, n_blocks, *(context.stride() if context is not None else (0, 0, 0)),
            programs, n_cblocks, W=width, WP=triton.next_power_of_2(width), BT=cfg["BT"], BD=cfg["BD"],
            VARLEN=cu_seqlens is not None, HAS_CTX=context is not None, CHANNELS_FIRST=cfg["channels_first"],
            SPLIT=split, num_warps=cfg["num_warps"])
    n_tblocks, n_cblocks = triton.cdiv(n_tokens, cfg_dx["BT"]), triton.cdiv(channels, cfg_dx["BD"])
    if n_tokens and channels:
        _conv_dx_kernel[(n_tblocks * n_cblocks,)](
            weight, cu, dpre, dx, n_tokens, seq_len, channels, n_docs, n_steps, n_tblocks, n_cblocks, W=width,
            BT=cfg_dx["BT"], BD=cfg_dx["BD"], VARLEN=cu_seqlens is not None, CHANNELS_FIRST=cfg_dx["channels_first"],
            num_warps=cfg_dx["num_warps"])
    return dx, dw.sum(0).t().to(weight.dtype)


class _ShortConvSiLUFn(torch.autograd.Function):
    """Saves x, weight, cu_seqlens and context; the backward recomputes the pre-activation."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, context):
        x, weight = _rows(x), weight.contiguous()
        ctx.save_for_backward(x, weight, cu_seqlens, context)
        return conv_silu_fwd(x, weight, cu_seqlens, context)

    @staticmethod
    def backward(ctx, dy):
        x, weight, cu_seqlens, context = ctx.saved_tensors
        return *conv_silu_bwd(x, weight, cu_seqlens, context, dy), None, None


def _check_conv(x, weight, cu_seqlens, context):
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"x must be [B, T, C] and weight [C, W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if context is not None:
        if cu_seqlens is not None:
            raise ValueError("context (decoding) and cu_seqlens (packed documents) are exclusive")
        expected = (x.shape[0], weight.shape[1] - 1, x.shape[2])
        if tuple(context.shape) != expected:
            raise ValueError(f"context must have shape {list(expected)}, got {tuple(context.shape)}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2):
        raise ValueError(f"cu_seqlens must be [N + 1] offsets with N >= 1, got shape {tuple(cu_seqlens.shape)}")


def _on_device(cu_seqlens, x):
    """cu_seqlens on x's device. A host table (PackedDocuments keeps one for the KDA chunk tables) is copied on every
    call, and CUDA may stage a pageable one synchronously: pass a device copy made once per forward instead."""
    if cu_seqlens is None or cu_seqlens.device == x.device:
        return cu_seqlens
    return cu_seqlens.to(x.device, non_blocking=True)


def short_conv_silu(x, weight, cu_seqlens=None, context=None, backend=None):
    """``silu(causal depthwise conv(x))``, ``x: [B, T, C]``, ``weight: [C, W]`` -> ``[B, T, C]`` in
    ``promote_types(x.dtype, weight.dtype)`` (module docstring). ``cu_seqlens[-1]`` must be ``B·T`` (not checked: it
    would synchronise). ``context`` is decoding's cache: the Triton path gives it no gradient (it raises when
    context requires one)."""
    _check_conv(x, weight, cu_seqlens, context)
    cu_seqlens = _on_device(cu_seqlens, x)
    if use_triton(backend, x):
        if context is not None and context.requires_grad and torch.is_grad_enabled():
            raise ValueError("the Triton short convolution does not differentiate the decoding context")
        return _ShortConvSiLUFn.apply(x, weight, cu_seqlens, context)
    return short_conv_silu_torch(x, weight, cu_seqlens, context)


def short_conv_state(x, width, state=None, cu_seqlens=None, backend=None):
    """The conv state to cache after ``x: [B, T, C]``: ``[B, C, width]`` (the stock cache's layout) holding the last
    ``width`` inputs of each row, channels first, preceded by the previous ``state: [B, C, width]`` when decoding
    (``T < width``), zeros before the start of the document the row ends in (``cu_seqlens`` as in
    ``short_conv_silu``, exclusive with ``state``) or before the first token. Only the last ``width − 1`` are read
    by the next step (``short_conv_silu``'s context is ``state[..., 1:].transpose(1, 2)``). No gradient."""
    if state is not None and cu_seqlens is not None:
        raise ValueError("state (decoding) and cu_seqlens (packed documents) are exclusive")
    batch, seq_len, channels = x.shape
    if state is not None and tuple(state.shape) != (batch, channels, width):
        raise ValueError(f"state must have shape {[batch, channels, width]}, got {tuple(state.shape)}")
    cu_seqlens = _on_device(cu_seqlens, x)
    if not use_triton(backend, x):
        return short_conv_state_torch(x, width, state, cu_seqlens)
    x = _rows(x)
    out = torch.empty(batch, channels, width, dtype=x.dtype, device=x.device)
    cfg = LAUNCH["state"]
    cu, n_docs, n_steps = _doc_args(x, cu_seqlens)
    if batch and channels:
        _state_kernel[(batch, triton.cdiv(channels, cfg["BD"]))](
            x, x if state is None else state, cu, out, seq_len, channels, x.stride(1), n_docs, n_steps,
            *(state.stride() if state is not None else (0, 0, 0)), W=width, WP=triton.next_power_of_2(width),
            BD=cfg["BD"], VARLEN=cu_seqlens is not None, HAS_STATE=state is not None, num_warps=cfg["num_warps"])
    return out

"""One decoding step of a KDA layer (one new token per row, from the cached states), from the layer's projections to
the input of its output projection; the states are updated in place.

Per row and head h, with the conv state ``[C, W]`` (the last W inputs of the q | k | v projections, ``C = 2·H·K +
H·V``; the step reads its last W − 1 as context and shifts the new input in)::

    q, k, v = silu(depthwise causal conv of the state's last W − 1 inputs and the new projections)
    q, k    = L2-normalised per head (eps 1e-6)
    g       = the KDA gate of g_raw + dt_bias (bounded or softplus, ``kda_common.kda_gate``); β = sigmoid(β_raw)
    S       ← e^g S;  S ← S + β k (v − Sᵀ k)ᵀ;  o = Sᵀ q · scale
    out     = RMSNorm(o) · w · sigmoid(out_gate)

``kda_decode_step_torch`` composes the model's torch references (``short_conv_silu_torch``, ``l2norm_torch``,
``recurrent_kda``, ``gated_rms_norm_torch``): it computes what the layer's general path computes, bit for bit, and
is the CPU path. The Triton kernel does the whole step in one launch instead of the unfused path's twenty or so (the
q | k | v concatenation, conv, conv state, two L2 norms, the gate and β in torch, the recurrence, the gated norm,
the copies between them): one program per (row, head) holds q and k (convolved and normalised in registers) and
walks the V columns in blocks of BV: each block's v is convolved, its ``[K, BV]`` block of the state decayed,
updated and written back, and its o kept (rounded as the unfused path rounds it) in the output buffer; the norm over
V then rescales the output in a second pass. Values are rounded where the unfused path stores them in its dtype (the
conv output, the normalised q and k, o, the norm's output and sigmoid of the gate), so the two differ only by the
order of fp32 sums. A barrier separates each read of a state from its write (threads of a program may hold the same
element), and the output's first pass from the second. Offsets: the conv state's row (row x C·W) and the recurrent
state's (row, head) (x K·V) are int64; the projections' row offsets are int32 (a decoding batch times a
projection's width).

Dispatch: the Triton kernel for CUDA tensors when triton imports, else torch; ``backend="torch" | "triton"``
forces one (the tests run the kernel on CPU tensors under ``TRITON_INTERPRET=1``). No autograd (decoding).
"""

import torch

from .fused_norm import gated_rms_norm_torch, l2norm_torch, triton, use_triton
from .kda import recurrent_kda
from .kda_common import L2NORM_EPS, resolve_gate
from .short_conv import short_conv_silu_torch, short_conv_state_torch

if triton is not None:
    import triton.language as tl

    from .kda_gate import _gate

MAX_HEAD_DIM = 256  # the kernel holds a [K, BV] block of the state and the K-vectors q, k and g in registers
LAUNCH = dict(BV=32, num_warps=4)  # a [128, 32] fp32 block of the state is 32 registers a thread


def _check(q, k, v, beta, g, out_gate, conv_state, recurrent_state, conv_weight, A_log, dt_bias, norm_weight):
    """Shapes of ``kda_decode_step``'s inputs (no values read); returns ``(B, H, K, V)``."""
    if beta.dim() != 2:
        raise ValueError(f"beta must be [B, H], got {tuple(beta.shape)}")
    B, H = beta.shape
    if q.dim() != 2 or q.shape[0] != B or q.shape[1] % H:
        raise ValueError(f"q must be [B, H*K] with B={B}, H={H}, got {tuple(q.shape)}")
    K = q.shape[1] // H
    if v.dim() != 2 or v.shape[0] != B or v.shape[1] % H:
        raise ValueError(f"v must be [B, H*V] with B={B}, H={H}, got {tuple(v.shape)}")
    V = v.shape[1] // H
    for name, x, shape in (("k", k, (B, H * K)), ("g", g, (B, H * K)), ("out_gate", out_gate, (B, H * V)),
                           ("recurrent_state", recurrent_state, (B, H, K, V)), ("A_log", A_log, (H,)),
                           ("dt_bias", dt_bias, (H * K,)), ("norm_weight", norm_weight, (V,))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
    C = 2 * H * K + H * V
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C:
        raise ValueError(f"conv_weight must be [C, W] with C = 2*H*K + H*V = {C}, got {tuple(conv_weight.shape)}")
    if tuple(conv_state.shape) != (B, C, conv_weight.shape[1]):
        raise ValueError(f"conv_state must have shape {[B, C, conv_weight.shape[1]]}, got {tuple(conv_state.shape)}")
    if recurrent_state.dtype != torch.float32 or not recurrent_state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("the states are updated in place: recurrent_state must be contiguous fp32 and conv_state "
                         "contiguous")
    return B, H, K, V


def kda_decode_step_torch(q, k, v, beta, g, out_gate, conv_state, recurrent_state, *, conv_weight, A_log, dt_bias,
                          norm_weight, norm_eps, gate, lower_bound=None, scale=None):
    """The reference: the layer's unfused torch path for one token per row (arguments as ``kda_decode_step``)."""
    B, H, K, V = _check(q, k, v, beta, g, out_gate, conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                        norm_weight)
    qkv = torch.cat([q, k, v], -1).unsqueeze(1)  # [B, 1, C]
    mixed = short_conv_silu_torch(qkv, conv_weight, context=conv_state[..., 1:].transpose(1, 2))
    conv_state.copy_(short_conv_state_torch(qkv, conv_weight.shape[1], state=conv_state))
    qh, kh, vh = (t.view(B, 1, H, -1) for t in mixed.split([H * K, H * K, H * V], dim=-1))
    o, state = recurrent_kda(
        l2norm_torch(qh), l2norm_torch(kh), vh.contiguous(), g.view(B, 1, H, K), beta.float().sigmoid().view(B, 1, H),
        scale=scale, initial_state=recurrent_state, output_final_state=True, use_gate_in_kernel=True, A_log=A_log,
        dt_bias=dt_bias, gate=gate, lower_bound=lower_bound, backend="torch")
    recurrent_state.copy_(state)
    return gated_rms_norm_torch(o[:, 0], norm_weight, out_gate.view(B, H, V), norm_eps)


if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr, ROUND: tl.constexpr):
        """fp32 ``x`` as stored in ``dtype`` and read back (ROUND), or as it is."""
        if ROUND:
            return x.to(dtype).to(tl.float32)
        return x

    @triton.jit
    def _conv_silu(x_ptrs, state_ptr, w_ptr, c, m, W: tl.constexpr, WP: tl.constexpr):
        """Channels c (mask m) of one row, new inputs at ``x_ptrs``: ``(silu(pre) fp32, new state [BC, WP])``. pre
        sums, in fp32 and in ``short_conv_silu``'s order, the new input times the last tap, then the state's last
        W − 1 inputs times the taps before; the new state is the window (the state shifted by one, the input last),
        in the state's dtype."""
        j = tl.arange(0, WP)
        m2 = m[:, None] & (j < W)[None, :]
        x = tl.load(x_ptrs, mask=m, other=0.0)
        w = tl.load(w_ptr + c[:, None] * W + j[None, :], mask=m2, other=0.0).to(tl.float32)
        last = (j == W - 1)[None, :]
        window = tl.where(last, x.to(state_ptr.dtype.element_ty)[:, None],
                          tl.load(state_ptr + c[:, None] * W + (j + 1)[None, :], mask=m2 & ~last, other=0.0))
        pre = x.to(tl.float32) * tl.sum(tl.where(last, w, 0.0), axis=1)
        for tap in tl.static_range(W - 1):
            col = (j == tap)[None, :]
            pre += tl.sum(tl.where(col, window.to(tl.float32), 0.0), axis=1) * tl.sum(tl.where(col, w, 0.0), axis=1)
        return pre * tl.sigmoid(pre), window

    @triton.jit
    def _decode_kernel(q_ptr, k_ptr, v_ptr, b_ptr, g_ptr, og_ptr, cw_ptr, conv_ptr, s_ptr, a_ptr, dtb_ptr, nw_ptr,
                       o_ptr, s_q, s_k, s_v, s_b, s_g, s_og, scale, l2_eps, norm_eps, lower_bound, H,
                       K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, GATE: tl.constexpr, ROUND: tl.constexpr):
        """Row b, head h (module docstring). ROUND: the conv output (and so q, k, o) is stored in the projections'
        dtype by the unfused path (else in fp32)."""
        b = tl.program_id(0) // H
        h = tl.program_id(0) % H
        scale = tl.cast(scale, tl.float32)  # Inductor may pass Python floats as fp64
        l2_eps = tl.cast(l2_eps, tl.float32)
        norm_eps = tl.cast(norm_eps, tl.float32)
        C = 2 * H * K + H * V
        conv_row = conv_ptr + b.to(tl.int64) * C * W
        xdt = q_ptr.dtype.element_ty
        ck = tl.arange(0, BK)
        mk = ck < K
        j = tl.arange(0, WP)

        q, q_win = _conv_silu(q_ptr + b * s_q + h * K + ck, conv_row, cw_ptr, h * K + ck, mk, W, WP)
        k, k_win = _conv_silu(k_ptr + b * s_k + h * K + ck, conv_row, cw_ptr, H * K + h * K + ck, mk, W, WP)
        q, k = _round(q, xdt, ROUND), _round(k, xdt, ROUND)
        q = _round(q * tl.rsqrt(tl.sum(q * q) + l2_eps), xdt, ROUND) * scale
        k = _round(k * tl.rsqrt(tl.sum(k * k) + l2_eps), xdt, ROUND)
        x_g = tl.load(g_ptr + b * s_g + h * K + ck, mask=mk, other=0.0).to(tl.float32)
        x_g += tl.load(dtb_ptr + h * K + ck, mask=mk, other=0.0).to(tl.float32)
        decay = tl.exp(_gate(x_g, tl.exp(tl.load(a_ptr + h).to(tl.float32)), lower_bound, GATE))
        beta = tl.sigmoid(tl.load(b_ptr + b * s_b + h).to(tl.float32))

        state = s_ptr + (b * H + h).to(tl.int64) * (K * V)
        out = o_ptr + (b * H + h).to(tl.int64) * V
        sum_sq = tl.zeros([BV], dtype=tl.float32)
        for v0 in tl.static_range(0, V, BV):
            cv = v0 + tl.arange(0, BV)
            mv = cv < V
            v, v_win = _conv_silu(v_ptr + b * s_v + h * V + cv, conv_row, cw_ptr, 2 * H * K + h * V + cv, mv, W, WP)
            v = _round(v, xdt, ROUND)
            offs = ck[:, None] * V + cv[None, :]
            ms = mk[:, None] & mv[None, :]
            S = tl.load(state + offs, mask=ms, other=0.0) * decay[:, None]
            u = (v - tl.sum(S * k[:, None], axis=0)) * beta
            S += k[:, None] * u[None, :]
            o = _round(tl.sum(S * q[:, None], axis=0), xdt, ROUND)
            sum_sq += tl.where(mv, o * o, 0.0)
            tl.debug_barrier()
            tl.store(state + offs, S, mask=ms)
            tl.store(out + cv, o.to(o_ptr.dtype.element_ty), mask=mv)
            tl.store(conv_row + (2 * H * K + h * V + cv)[:, None] * W + j[None, :], v_win,
                     mask=mv[:, None] & (j < W)[None, :])
        tl.store(conv_row + (h * K + ck)[:, None] * W + j[None, :], q_win, mask=mk[:, None] & (j < W)[None, :])
        tl.store(conv_row + (H * K + h * K + ck)[:, None] * W + j[None, :], k_win,
                 mask=mk[:, None] & (j < W)[None, :])

        rstd = tl.rsqrt(tl.sum(sum_sq) / V + norm_eps)
        tl.debug_barrier()
        for v0 in tl.static_range(0, V, BV):
            cv = v0 + tl.arange(0, BV)
            mv = cv < V
            o = tl.load(out + cv, mask=mv, other=0.0).to(tl.float32)
            y = _round(tl.load(nw_ptr + cv, mask=mv, other=0.0).to(tl.float32) * (o * rstd), xdt, ROUND)
            s = tl.sigmoid(tl.load(og_ptr + b * s_og + h * V + cv, mask=mv, other=0.0).to(tl.float32))
            tl.store(out + cv, (y * s.to(og_ptr.dtype.element_ty).to(tl.float32)).to(o_ptr.dtype.element_ty), mask=mv)


def _rows(x):
    """A 2-D ``[B, N]`` tensor with unit column stride (a view when there is one)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def kda_decode_step_triton(q, k, v, beta, g, out_gate, conv_state, recurrent_state, *, conv_weight, A_log, dt_bias,
                           norm_weight, norm_eps, gate, lower_bound=None, scale=None):
    """The fused step on Triton (arguments as ``kda_decode_step``)."""
    B, H, K, V = _check(q, k, v, beta, g, out_gate, conv_state, recurrent_state, conv_weight, A_log, dt_bias,
                        norm_weight)
    if max(K, V) > MAX_HEAD_DIM:
        raise ValueError(f"the fused decode step takes head dims up to {MAX_HEAD_DIM}, got K={K}, V={V}")
    gate, lower_bound = resolve_gate(gate, lower_bound)
    conv_dtype = torch.promote_types(q.dtype, conv_weight.dtype)
    out = torch.empty(B, H, V, dtype=torch.promote_types(conv_dtype, out_gate.dtype), device=q.device)
    q, k, v, beta, g, out_gate = (_rows(x) for x in (q, k, v, beta, g, out_gate))
    W = conv_weight.shape[1]
    if B:
        _decode_kernel[(B * H,)](
            q, k, v, beta, g, out_gate, conv_weight.contiguous(), conv_state, recurrent_state, A_log, dt_bias,
            norm_weight, out, q.stride(0), k.stride(0), v.stride(0), beta.stride(0), g.stride(0), out_gate.stride(0),
            K ** -0.5 if scale is None else float(scale), L2NORM_EPS, float(norm_eps),
            float(lower_bound) if gate == "bounded" else 0.0, H, K=K, V=V, W=W, WP=triton.next_power_of_2(W),
            BK=triton.next_power_of_2(K), BV=min(LAUNCH["BV"], triton.next_power_of_2(V)),
            GATE=1 if gate == "bounded" else 2, ROUND=conv_dtype == q.dtype and q.dtype != torch.float32,
            num_warps=LAUNCH["num_warps"])
    return out


def kda_decode_step(q, k, v, beta, g, out_gate, conv_state, recurrent_state, *, conv_weight, A_log, dt_bias,
                    norm_weight, norm_eps, gate, lower_bound=None, scale=None, backend=None):
    """One token per row through a KDA layer's conv, norms, gate and recurrence (module docstring).

    Args:
        q, k: ``[B, H*K]`` and v ``[B, H*V]``: the raw q, k, v projections of the new token.
        beta: ``[B, H]`` before the sigmoid; g: ``[B, H*K]`` the raw gate input (the low-rank projection's output);
            out_gate: ``[B, H*V]`` the output gate before the sigmoid.
        conv_state: ``[B, 2*H*K + H*V, W]`` contiguous, updated in place (shifted by one, the new inputs last).
        recurrent_state: ``[B, H, K, V]`` contiguous fp32, updated in place.
        conv_weight: ``[2*H*K + H*V, W]``; A_log: ``[H]``; dt_bias: ``[H*K]``; norm_weight: ``[V]``.
        norm_eps: the output RMSNorm's eps. gate, lower_bound: as ``chunk_kda``. scale: default ``K ** -0.5``.
        backend: None (Triton for CUDA tensors when triton is installed, else torch), ``"torch"`` or ``"triton"``.

    Returns:
        ``[B, H, V]``, ``RMSNorm(o) · w · sigmoid(out_gate)`` in ``promote_types(conv output dtype, out_gate.dtype)``
        (the conv output's dtype is ``promote_types(q.dtype, conv_weight.dtype)``).
    """
    kwargs = dict(conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, norm_weight=norm_weight, norm_eps=norm_eps,
                  gate=gate, lower_bound=lower_bound, scale=scale)
    step = kda_decode_step_triton if use_triton(backend, q) else kda_decode_step_torch
    return step(q, k, v, beta, g, out_gate, conv_state, recurrent_state, **kwargs)

"""Chunked KDA on Triton: the autograd function and ``chunk_kda_triton`` (imported only when triton is there).

Layout and recurrence as in ``kda.py``. The forward's kernels are in ``kda_chunk_fwd.py``, the backward's in
``kda_chunk_bwd.py``. A single long sequence runs in slabs (``kda_launch.slab_ranges``): the chunk loop of a slab on
a second CUDA stream beside the parallel kernels of the next slab (forward) or of the one after it (backward, from
the last slab), the state carried between slabs in fp32: bit-identical to one pass.
"""

import torch

from .kda_chunk_bwd import chunk_bwd
from .kda_chunk_fwd import GateArgs, chunk_fwd, kept_states
from .kda_common import GATES, check_inputs
from .kda_launch import SLAB_MIN_TOKEN_HEADS, chunk_tables, slab_ranges

MAX_HEAD_DIM = 256
# Tokens x heads the kernels take: the chunk tables hold token indices in int32, and chunk x head offsets are int32
# (``kda_kernel_utils``); 4M tokens x 64 heads is 2^28.
MAX_TOKEN_HEADS = 2**31 - 1


class KDAContext:
    """What the chunked forward hands its backward besides the inputs and the kept tensors: the chunk tables, the
    backward's slabs and the scalars."""

    def __init__(self, tables, slabs, scale, safe, mode, lb):
        self.tables, self.slabs, self.scale, self.safe, self.mode, self.lb = tables, slabs, scale, safe, mode, lb


def kda_forward(q, k, v, g, beta, A_log, dt_bias, scale, h0, output_final_state, cu_seqlens, safe, mode, lb, grad,
                norm):
    """The Triton forward on ``[B, T, H, *]`` inputs: ``(o [B, T, H, V], final state or None, KDAContext, kept)``,
    kept = the tensors the backward takes besides the inputs (A_qk, T, the per-chunk states or None, and with
    ``norm`` (q, k L2-normalised inside the kernels) the rows' norm factors rq, rk ``[B*T, H]`` fp32; all None
    without grad)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    tables = chunk_tables(B, T, cu_seqlens, q.device)
    slabs = slab_ranges(B, T, H, q.device, SLAB_MIN_TOKEN_HEADS["forward"]) if cu_seqlens is None else None
    h0c = None if h0 is None else h0.contiguous()
    fw = chunk_fwd(flatten_rows(q, k, v, g, beta), gate_args(mode, A_log, dt_bias, lb, H, K, q.device), scale, h0c,
                   tables, safe, output_final_state, keep_tinv=grad, slabs=slabs, norm=norm)
    # A_qk and T (bf16 with bf16 inputs), [B*T, H, 64] each, are kept for the backward: it skips the intra and
    # solve kernels; and the per-chunk states (16-bit with 16-bit inputs, [chunks, H, K, V]: 512 B per token and
    # head at K = V = 128) when they fit (`kept_states`): it skips the chunk loop too. Γ (fp32, 512 B per token and
    # head) is not: the gate kernel runs again, cheaper than the loop
    kept = (fw.aqk, fw.tinv, kept_states(fw.hs), fw.rq, fw.rk) if grad else (None,) * 5
    bwd_slabs = slab_ranges(B, T, H, q.device, SLAB_MIN_TOKEN_HEADS["backward"]) if cu_seqlens is None else None
    return fw.o.reshape(B, T, H, V), fw.ht, KDAContext(tables, bwd_slabs, scale, safe, mode, lb), kept


def kda_backward(q, k, v, g, beta, A_log, dt_bias, h0, kc: KDAContext, kept, do, dht):
    """The Triton backward: ``(dq, dk, dv, dg, dβ, dA_log, ddt_bias, dh0)`` in the inputs' shapes (None where an
    input is None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if do is None:
        do = torch.zeros_like(v)
    dht = None if dht is None else dht.float().contiguous()
    h0c = None if h0 is None else h0.float().contiguous()
    gate = gate_args(kc.mode, A_log, dt_bias, kc.lb, H, K, q.device)
    dq, dk, dv, dg, db, dh0, dgate = chunk_bwd(flatten_rows(q, k, v, g, beta), gate, kc.scale, h0c, kc.tables,
                                               kc.safe, do.reshape(B * T, H, V), dht, tuple(kept), slabs=kc.slabs)
    dA_log = ddt_bias = None
    if A_log is not None:  # the gate's chain rule ran in the last backward kernel
        dA_log = dgate[0].reshape(A_log.shape).to(A_log.dtype)
    if dt_bias is not None:
        ddt_bias = dgate[1].reshape(dt_bias.shape).to(dt_bias.dtype)
    dh0 = None if dh0 is None else dh0.to(h0.dtype)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
            db.reshape(beta.shape), dA_log, ddt_bias, dh0)


class _ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, h0, output_final_state, cu_seqlens, safe, mode, lb,
                grad, norm):
        o, ht, kc, kept = kda_forward(q, k, v, g, beta, A_log, dt_bias, scale, h0, output_final_state, cu_seqlens,
                                      safe, mode, lb, grad, norm)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, *kept)
        ctx.kc = kc
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, *kept = ctx.saved_tensors
        dq, dk, dv, dg, db, dA_log, ddt_bias, dh0 = kda_backward(q, k, v, g, beta, A_log, dt_bias, h0, ctx.kc, kept,
                                                                 do, dht)
        return dq, dk, dv, dg, db, dA_log, ddt_bias, None, dh0, None, None, None, None, None, None, None


def gate_args(mode, A_log, dt_bias, lb, H, K, device):
    """The fused gate's kernel arguments (``GateArgs``) for mode 0 (none), 1 (bounded) or 2 (softplus)."""
    if mode == 0:
        dummy = torch.empty(1, device=device, dtype=torch.float32)
        return GateArgs(0, dummy, dummy, 0.0)
    a = torch.ones(H, device=device) if A_log is None else A_log.detach().float().exp().contiguous()
    dtb = torch.zeros(H * K, device=device) if dt_bias is None else dt_bias.detach().float().reshape(H * K).contiguous()
    return GateArgs(mode, a, dtb, float(lb))


def check_triton_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gate):
    """``check_inputs`` plus what the kernels add: head dims up to MAX_HEAD_DIM, at most MAX_TOKEN_HEADS tokens x
    heads, and a known gate."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got K={q.shape[-1]}, V={v.shape[-1]}")
    B, T, H = q.shape[:3]
    if B * T * H > MAX_TOKEN_HEADS:
        raise ValueError(f"the KDA kernels take at most {MAX_TOKEN_HEADS} tokens x heads (int32 chunk tables and "
                         f"chunk x head offsets), got B*T*H = {B}*{T}*{H} = {B * T * H}")
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")


def flatten_rows(q, k, v, g, beta):
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
    check_triton_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gate)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    safe = _safe_path(gate, lower_bound)
    mode, lb = 0, 0.0
    if use_gate_in_kernel:  # computed inside the gate kernel from the raw input
        mode = 1 if gate == "bounded" else 2
        lb = -5.0 if lower_bound is None else float(lower_bound)
    else:
        A_log = dt_bias = None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    return _ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                   cu_seqlens, safe, mode, lb, grad, use_qk_l2norm_in_kernel)

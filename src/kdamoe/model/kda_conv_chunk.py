"""The KDA layer's training path on Triton as one autograd function: short convolution + SiLU of the q | k | v
projection, q / k L2 norm, chunked KDA with the gate in the kernel (imported only when triton is there).

Composed of the separate ops, the backward keeps the conv input (for the conv's backward) and also q, k and v (for
the chunk kernels' backward): two copies of the three projections. This function keeps the conv input only and
recomputes the conv in its backward (bit-identical: the same kernel on the same input), three ``[B, T, H·K]``
tensors fewer a layer for one conv forward more. The conv writes q, k and v as three tensors and its backward reads
their gradients as three, so neither pass copies a third out of or into a ``[B, T, 3·H·K]`` tensor; the L2 norm of
q and k runs inside the chunk kernels (neither normalised tensor is ever written).
"""

import torch

from .kda_chunk import _safe_path, check_triton_inputs, kda_backward, kda_forward
from .kda_common import resolve_gate
from .short_conv import _check_conv, _on_device, _rows, conv_silu_bwd, conv_silu_fwd


def _conv_q_k_v(x, weight, cu_seqlens_device, num_heads, flat):
    """The conv output as q, k and v ``[B, T, H, K]`` (``[1, B·T, H, K]`` when ``flat``), each contiguous."""
    B, T, C = x.shape
    shape = (1, B * T) if flat else (B, T)
    parts = conv_silu_fwd(x, weight, cu_seqlens_device, None, split=True)  # q | k | v apart, each [B, T, H·K]
    return [t.view(*shape, num_heads, C // (3 * num_heads)) for t in parts]


class _ConvChunkKDAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, weight, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_device, num_heads, safe, mode, lb,
                output_final_state):
        x, weight = _rows(qkv), weight.contiguous()
        flat = cu_seqlens is not None
        q, k, v = _conv_q_k_v(x, weight, cu_seqlens_device, num_heads, flat)
        scale = q.shape[-1] ** -0.5
        o, ht, kc, kept = kda_forward(q, k, v, g, beta, A_log, dt_bias, scale, None, output_final_state, cu_seqlens,
                                      safe, mode, lb, True, True)
        ctx.save_for_backward(x, weight, cu_seqlens_device, g, beta, A_log, dt_bias, *kept)
        ctx.kc, ctx.num_heads, ctx.flat = kc, num_heads, flat
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        x, weight, cu_seqlens_device, g, beta, A_log, dt_bias, *kept = ctx.saved_tensors
        q, k, v = _conv_q_k_v(x, weight, cu_seqlens_device, ctx.num_heads, ctx.flat)
        dq, dk, dv, dg, db, dA_log, ddt_bias, _ = kda_backward(q, k, v, g, beta, A_log, dt_bias, None, ctx.kc, kept,
                                                               do, dht)
        dx, dweight = conv_silu_bwd(x, weight, cu_seqlens_device, None,
                                    [t.reshape(*x.shape[:2], -1) for t in (dq, dk, dv)])
        return dx, dweight, dg, db, dA_log, ddt_bias, None, None, None, None, None, None, None


def conv_chunk_kda(qkv, conv_weight, g, beta, num_heads, cu_seqlens=None, cu_seqlens_device=None, *, A_log=None,
                   dt_bias=None, gate="bounded", lower_bound=None, output_final_state=False, use_gate_in_kernel=True):
    """``chunk_kda(l2norm(q), l2norm(k), v, g, β, use_gate_in_kernel=True, ...)`` with ``q | k | v =
    silu(conv(qkv))``, differentiable, keeping ``qkv`` for the backward and not q, k, v (module docstring).

    Args:
        qkv: ``[B, T, 3·H·K]`` (a column slice of a wider projection is read in place); conv_weight: ``[3·H·K, W]``.
        g: ``[B, T, H, K]`` raw gate input; beta: ``[B, T, H]``.
        num_heads: H.
        cu_seqlens: ``[N+1]`` document boundaries over the ``B·T`` tokens as one flattened row (packed documents):
            the conv stops at document starts and the KDA inputs run as ``[1, B·T, H, *]``; g and beta are then
            ``[1, B·T, H, *]`` too. cu_seqlens_device: its copy on qkv's device, if there is one (else made here).
        A_log, dt_bias, gate, lower_bound, output_final_state: as ``kda.chunk_kda`` (the gate is in the kernel:
            ``use_gate_in_kernel`` must be True).

    Returns:
        ``(o [B, T, H, K] ([1, B·T, H, K] with cu_seqlens) in qkv's dtype, final state [N, H, K, K] fp32 or None)``.
    """
    if not use_gate_in_kernel:
        raise ValueError("conv_chunk_kda computes the gate in the kernel: use_gate_in_kernel must be True")
    _check_conv(qkv, conv_weight, cu_seqlens, None)
    B, T, C = qkv.shape
    if C % (3 * num_heads):
        raise ValueError(f"qkv's last dim {C} is not 3 x num_heads ({num_heads}) x head_dim")
    shape = (1, B * T) if cu_seqlens is not None else (B, T)
    gate, lower_bound = resolve_gate(gate, lower_bound)
    probe = qkv.new_empty(1).expand(*shape, num_heads, C // (3 * num_heads))  # q's shape, for the input checks
    check_triton_inputs(probe, probe, probe, g, beta, None, cu_seqlens, gate)
    mode, lb = (1, lower_bound) if gate == "bounded" else (2, -5.0)
    if cu_seqlens_device is None:
        cu_seqlens_device = _on_device(cu_seqlens, qkv)
    return _ConvChunkKDAFn.apply(qkv, conv_weight, g, beta, A_log, dt_bias, cu_seqlens, cu_seqlens_device, num_heads,
                                 _safe_path(gate, lower_bound), mode, lb, output_final_state)

"""Token-by-token KDA on Triton for decoding: ``recurrent_kda_triton`` (no autograd; the state updated in place)."""

import torch
import triton
import triton.language as tl

from .fused_norm import l2norm
from .kda_chunk import check_triton_inputs, flatten_rows
from .kda_common import kda_gate
from .kda_kernel_utils import _loop_program, _state_block
from .kda_launch import LAUNCH, launch_cfg


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, h0_ptr, ht_ptr, cu_ptr, scale, H,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      HAS_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """The per-token recurrence of one sequence, head and V block: ``S ← e^g S``, ``u = β (v − Sᵀ k)``,
    ``S ← S + k uᵀ``, ``o = Sᵀ q · scale``; the state stays in registers from ``h0`` to ``ht``."""
    n, iv, h = _loop_program(V, BV)
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


def recurrent_kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                         *, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                         lower_bound=None, gate="bounded"):
    """Token-by-token KDA on Triton for decoding (no autograd). Arguments and returns as ``chunk_kda_triton``.

    When ``initial_state`` is a contiguous fp32 tensor and ``output_final_state`` is set, the final state is
    written into ``initial_state`` in place and that same tensor is returned.
    """
    check_triton_inputs(q, k, v, g, beta, initial_state, cu_seqlens, gate)
    with torch.no_grad():
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)  # one fused kernel per tensor
        if use_gate_in_kernel:
            g = kda_gate(g, A_log, dt_bias, gate=gate, lower_bound=-5.0 if lower_bound is None else float(lower_bound))
        B, T, H, K = q.shape
        V = v.shape[-1]
        scale = K ** -0.5 if scale is None else float(scale)
        if cu_seqlens is None:
            cu = torch.arange(0, B + 1, device=q.device, dtype=torch.int32) * T
        else:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        N = cu.numel() - 1
        flat = flatten_rows(q, k, v, g, beta)
        h0 = initial_state
        if h0 is not None and not (h0.dtype == torch.float32 and h0.is_contiguous()):
            h0 = h0.float().contiguous()
        ht = None
        if output_final_state:
            ht = h0 if h0 is not None else torch.empty(N, H, K, V, device=q.device, dtype=torch.float32)
        o = torch.empty(B * T, H, V, device=q.device, dtype=q.dtype)
        BK, _, BV = launch_cfg(K, V)
        _recurrent_kernel[(triton.cdiv(V, BV) * N, H)](
            *flat, o, h0 if h0 is not None else o, ht if ht is not None else o, cu, scale, H, K, V, BK, BV,
            HAS_H0=h0 is not None, STORE_HT=ht is not None, **LAUNCH["recurrent"])
    return o.reshape(B, T, H, V), ht

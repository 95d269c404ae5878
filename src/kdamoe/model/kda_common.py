"""What the torch and the Triton paths of KDA share: the tile sizes, the gate formula, the q/k L2 norm and the
input contract. Layout as in ``kda.py``: ``q, k, g: [B, T, H, K]``, ``v: [B, T, H, V]``, ``beta: [B, T, H]``,
state ``[N, H, K, V]``."""

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of the chunked form
SUB_BLOCK = 16  # tokens per sub-block of a chunk (the intra-chunk scores and the triangular solve)
L2NORM_EPS = 1e-6
GATES = ("bounded", "softplus")


def compute_dtype(x):
    """fp64 for fp64 inputs (the references), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def kda_gate(g_raw, A_log, dt_bias=None, gate="bounded", lower_bound=-5.0):
    """Log-decay gate of KDA, in fp32 (fp64 when ``g_raw`` is fp64).

    Args:
        g_raw: ``[..., H, K]`` output of the low-rank gate projection.
        A_log: ``[H]`` per-head log scale, or None (scale 1).
        dt_bias: ``[H * K]`` or ``[H, K]`` per-channel bias, or None.
        gate: ``"bounded"``: ``lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))``, range
            ``(lower_bound, 0)``; ``"softplus"``: ``-exp(A_log) * softplus(g_raw + dt_bias)``, range ``(-inf, 0)``.
        lower_bound: negative float, used by the bounded gate only.

    Returns:
        ``g`` with the shape of ``g_raw``.
    """
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    if g_raw.dim() < 2:
        raise ValueError(f"g_raw must have shape [..., H, K], got {tuple(g_raw.shape)}")
    H, K = g_raw.shape[-2:]
    dtype = compute_dtype(g_raw)
    x = g_raw.to(dtype)
    if dt_bias is not None:
        if dt_bias.numel() != H * K or dt_bias.dim() not in (1, 2):
            raise ValueError(f"dt_bias must have shape [H*K] = [{H * K}] or [H, K] = [{H}, {K}], got {tuple(dt_bias.shape)}")
        x = x + dt_bias.to(dtype).reshape(H, K)
    if A_log is None:
        a = x.new_ones(H, 1)
    else:
        if tuple(A_log.shape) != (H,):
            raise ValueError(f"A_log must have shape [H] = [{H}], got {tuple(A_log.shape)}")
        a = A_log.to(dtype).exp().unsqueeze(-1)
    if gate == "bounded":
        if lower_bound is None or not lower_bound < 0:
            raise ValueError(f"the bounded gate needs a negative lower_bound, got {lower_bound!r}")
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def l2norm(x, eps=L2NORM_EPS):
    """``x / sqrt(Σ x² + eps)`` over the last dim, in the compute dtype (fp32, or fp64 for fp64 inputs)."""
    x = x.to(compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def resolve_gate(gate, lower_bound):
    """flash-linear-attention's semantics when ``gate`` is None: bounded iff ``lower_bound`` is given. Returns
    ``(gate, lower_bound)``; the bounded gate's bound defaults to -5."""
    if gate is None:
        gate = "softplus" if lower_bound is None else "bounded"
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES} or None, got {gate!r}")
    if gate == "bounded":
        lower_bound = -5.0 if lower_bound is None else float(lower_bound)
    elif lower_bound is not None:
        raise ValueError(f"lower_bound={lower_bound} is only valid with the bounded gate, got gate='softplus'")
    return gate, lower_bound


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    """Check the shapes of the op's inputs (no device values are read); return N, the number of sequences."""
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have the shape of q {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N+1], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must have shape [N, H, K, V] = [{N}, {H}, {K}, {v.shape[-1]}], got {tuple(initial_state.shape)}")
    return N


def doc_lengths(cu_seqlens, T):
    """The document lengths of ``cu_seqlens`` (read to the host), checked to run non-decreasing from 0 to T."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:])]

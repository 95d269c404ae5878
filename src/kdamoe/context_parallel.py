"""Context parallelism: one sequence split across the ranks of a process group, in rank order.

KDA. A rank's tokens act on the recurrent state ``S [K, V]`` (per sequence and head) as an affine map, ``S_out = M
S_in + S⁰``, with ``M = Π_t (I − β_t k_t k_tᵀ) diag(e^{g_t})`` ``[K, K]`` and ``S⁰`` the state its tokens build from
zero; its outputs are affine in ``S_in`` too: ``o_t = o⁰_t + S_inᵀ Q_t`` with ``Q_t = scale · P_tᵀ q_t``, ``P_t`` the
map of its tokens up to t. One KDA call on values ``[0 | v]`` from the initial state ``[I | 0]`` (``K + V`` value
columns) gives all four: its output is ``[Q | o⁰]`` and its final state ``[M | S⁰]``. The ranks all-gather ``(M,
S⁰)`` (``[B, H, K, K + V]`` per rank), each composes the maps of the ranks before it into its ``S_in`` and adds
``S_inᵀ Q`` to ``o⁰``. The result is the single-process one up to the order of the sums, forward and backward
(autograd runs through the op, the gather and the composition) on any KDA backend; the cost is K more value columns in
the local call and an exchange of ``[K, K + V]`` per sequence and head.

Packed documents (``cu_seqlens`` of the rank's own tokens): only the rank's first document can continue the state of
the ranks before it (``continues``: False when a document starts at the rank's first token); the others start from
zero, so their part of the initial state, and so of ``M`` and ``Q``, is zero.

The collectives are plain ``torch.distributed`` calls on the given group (gloo on CPU, NCCL on GPUs); the gather's
backward sums the gradients over the ranks with an all-reduce (gloo has no reduce-scatter).
"""

import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    """``[x_0, ..., x_{R-1}]`` stacked on a new dim 0, from every rank's ``x`` of one shape; the backward all-reduces
    the stacked gradient and returns this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def _compose(maps, state, rank):
    """``(S_in of rank, final state)``: the maps ``[R, N, H, K, K + V]`` applied in rank order from ``state``."""
    K = maps.shape[-2]
    s_in = state
    for j in range(maps.shape[0]):
        if j == rank:
            s_in = state
        state = maps[j, ..., :K] @ state + maps[j, ..., K:]
    return s_in, state


class _ExchangeStates(torch.autograd.Function):
    """Every rank's ``[M | S⁰]`` gathered and composed from the initial state into this rank's ``S_in`` and the final
    state. Both outputs depend on ``last`` for autograd on every rank, so every rank runs the backward's one
    all-reduce (of the gradients of all ranks' maps), whichever of them its loss reaches."""

    @staticmethod
    def forward(ctx, last, state, group):
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(last) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, last.contiguous(), group=group)
        maps = torch.stack(parts)
        ctx.save_for_backward(maps, state)
        return _compose(maps, state, ctx.rank)

    @staticmethod
    def backward(ctx, d_in, d_final):
        maps, state = ctx.saved_tensors
        with torch.enable_grad():
            maps, state = maps.detach().requires_grad_(), state.detach().requires_grad_()
            s_in, final = _compose(maps, state, ctx.rank)
            outs = [(t, d) for t, d in ((s_in, d_in), (final, d_final)) if d is not None and t.requires_grad]
            d_maps, d_state = torch.autograd.grad([t for t, _ in outs], [maps, state], [d for _, d in outs],
                                                  allow_unused=True) if outs else (None, None)
        d_maps = torch.zeros_like(maps) if d_maps is None else d_maps.contiguous()
        dist.all_reduce(d_maps, group=ctx.group)
        return d_maps[ctx.rank], d_state, None


def all_gather(x, group=None):
    """Every rank's ``x`` (one shape on all ranks), stacked: ``[R, *x.shape]``; differentiable (every rank must use
    the result in its loss's graph: the backward is a collective)."""
    return _AllGather.apply(x, group)


def gather_sequence(x, group=None, dim=1):
    """The whole sequence from every rank's part along ``dim`` (equal parts, in rank order); differentiable. Used for
    the keys and values of attention layers and the short convolutions' left context."""
    parts = all_gather(x, group)
    return torch.cat(parts.unbind(0), dim=dim)


def previous_tail(x, width, group=None, dim=1):
    """The last ``width`` positions along ``dim`` of the previous rank's ``x`` (zeros on rank 0): the left context of
    a causal convolution of kernel ``width + 1``; differentiable."""
    rank = dist.get_rank(group)
    tail = x.narrow(dim, x.shape[dim] - width, width)
    tails = all_gather(tail, group)
    # rank 0 keeps the gather in its graph (a zero tail), so that every rank runs the gather's backward all-reduce
    return tails[rank - 1] if rank > 0 else tails[0] * 0


def context_parallel_kda(op, q, k, v, g, beta, group=None, *, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, continues=True, **op_kwargs):
    """KDA on this rank's part of a sequence split across ``group`` in rank order.

    Args:
        op: a chunked KDA op with ``kda.chunk_kda``'s signature (``chunk_kda`` itself, or a backend of it).
        q, k, g: ``[B, T_r, H, K]``; v: ``[B, T_r, H, V]``; beta: ``[B, T_r, H]``: this rank's tokens (T_r may differ
            between ranks; B, H, K, V may not).
        initial_state: ``[B, H, K, V]`` state before the whole sequence (used by rank 0; B = 1 with cu_seqlens), or
            None (zeros).
        cu_seqlens: ``[N+1]`` documents of this rank's tokens (B = 1), or None.
        continues: whether this rank's first token continues the state of the ranks before it (rank 0: whether it
            starts from ``initial_state``).
        op_kwargs: passed on (gate, L2 norm, backend).
    Returns:
        ``(o [B, T_r, H, V], final state of the whole sequence [B, H, K, V] fp32 or None)``, the latter the same on
        every rank.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    h0 = torch.zeros(N, H, K, K + V, dtype=wide, device=q.device)
    if continues:  # the first sequence (every row without cu_seqlens) carries the incoming state
        first = slice(None) if cu_seqlens is None else slice(0, 1)
        h0[first, :, :, :K] = torch.eye(K, dtype=wide, device=q.device)
    values = torch.cat([v.new_zeros(B, T, H, K), v], dim=-1)
    out, final = op(q, k, values, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                    cu_seqlens=cu_seqlens, **op_kwargs)
    Q, o0 = out[..., :K], out[..., K:]
    last = final if cu_seqlens is None else final[-1:]  # the map this rank passes on: its last sequence's
    state = (torch.zeros(last.shape[0], H, K, V, dtype=wide, device=q.device) if initial_state is None
             else initial_state.to(wide))
    s_in, state = _ExchangeStates.apply(last.to(wide), state, group)
    if cu_seqlens is None:
        fix = torch.einsum("bthk,bhkv->bthv", Q.to(wide), s_in)
    else:  # Q is zero past the first document
        fix = torch.einsum("bthk,hkv->bthv", Q.to(wide), s_in[0])
    return (o0.to(wide) + fix).to(o0.dtype), (state if output_final_state else None)


__all__ = ["all_gather", "context_parallel_kda", "gather_sequence", "previous_tail"]

"""Context parallelism: every row of a batch split across the ranks of a process group, in rank order.

The model runs context-parallel when its forward gets ``context_parallel=ContextParallel(group)``: rank r of the
group holds columns ``[r·T, (r+1)·T)`` of every row (equal parts of T tokens), and everything that crosses a rank
boundary is exchanged with ``torch.distributed`` collectives on that group (gloo on CPU, NCCL on GPUs). Per-token
work (projections, norms, MoE, Block AttnRes) needs no exchange.

KDA. A rank's tokens act on the recurrent state ``S [K, V]`` (per sequence and head) as an affine map, ``S_out = M
S_in + S⁰``, with ``M = Π_t (I − β_t k_t k_tᵀ) diag(e^{g_t})`` ``[K, K]`` and ``S⁰`` the state its tokens build from
zero; its outputs are affine in ``S_in`` too: ``o_t = o⁰_t + S_inᵀ Q_t`` with ``Q_t = scale · P_tᵀ q_t``, ``P_t`` the
map of its tokens up to t. One KDA call on values ``[0 | v]`` from the initial state ``[I | 0]`` (``K + V`` value
columns) gives all four: its output is ``[Q | o⁰]`` and its final state ``[M | S⁰]``. The ranks all-gather ``(M,
S⁰)`` (``[B, H, K, K + V]`` per rank), each composes the maps of the ranks before it into its ``S_in`` and adds
``S_inᵀ Q`` to ``o⁰``. The result is the single-process one up to the order of the sums, forward and backward
(autograd runs through the op, the gather and the composition) on any KDA backend; the cost is K more value columns in
the local call and an exchange of ``[K, K + V]`` per row and head.

Packed documents (``cu_seqlens`` of the rank's own tokens): only a row's first document can continue the state of
the ranks before it (``continues``: False when a document starts at the rank's first token of the row); the others
start from zero, so their part of the initial state, and so of ``M`` and ``Q``, is zero.

The short convolutions read the previous rank's last ``W − 1`` inputs (``previous_tail``), zeroed where they lie
before the start of the row's first document; attention layers all-gather the keys and values (``gather_sequence``)
and mask by global positions (``RowShard.attention_mask``); the loss shifts the labels across rank boundaries and
sums over the group (``ContextParallel.shift_labels`` / ``ContextParallel.mean``).

Gradients: the collectives' backwards are collectives (every rank runs each of them, whichever of its outputs its
loss reaches); the gather's backward sums the gradients over the ranks with an all-reduce (gloo has no
reduce-scatter). A rank's parameter gradients are its share: averaged over the group, as data parallelism (DDP,
FSDP2) does, they are the single process's, because the loss every rank returns is the group's (its backward hands
every rank the group's summed gradient).
"""

import dataclasses

import torch
import torch.distributed as dist

from .kda import chunk_kda


# ----------------------------------------------------------------------------------------------------------------------
# Collectives with a backward
# ----------------------------------------------------------------------------------------------------------------------


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


class _AllReduceSum(torch.autograd.Function):
    """The sum of every rank's ``x``; the backward sums the ranks' gradients (every rank's result is the same sum, so
    each rank's ``x`` reaches all of them)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_gather(x, group=None):
    """Every rank's ``x`` (one shape on all ranks), stacked: ``[R, *x.shape]``; differentiable (every rank must use
    the result in its loss's graph: the backward is a collective)."""
    return _AllGather.apply(x, group)


def gather_sequence(x, group=None, dim=1):
    """The whole sequence from every rank's part along ``dim`` (equal parts, in rank order); differentiable. Used for
    the keys and values of attention layers."""
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


# ----------------------------------------------------------------------------------------------------------------------
# KDA's state exchange
# ----------------------------------------------------------------------------------------------------------------------


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


def context_parallel_kda(op, q, k, v, g, beta, group=None, *, scale=None, initial_state=None,
                         output_final_state=False, cu_seqlens=None, rows=1, continues=True, **op_kwargs):
    """KDA on this rank's part of rows split across ``group`` in rank order.

    Args:
        op: a chunked KDA op with ``kda.chunk_kda``'s signature (``chunk_kda`` itself, or a backend of it).
        q, k, g: ``[B, T_r, H, K]``; v: ``[B, T_r, H, V]``; beta: ``[B, T_r, H]``: this rank's tokens (T_r may differ
            between ranks; B, H, K, V may not).
        cu_seqlens: ``[N+1]`` host offsets of the documents in the flattened tokens of ``rows`` rows of equal length
            (B = 1, every row starting a document there, as ``PackedDocuments`` builds them), or None (the B rows).
        rows: the rows flattened into the tokens with ``cu_seqlens`` (without it, B).
        continues: whether each row's first token continues the state of the ranks before it (rank 0: whether it
            starts from ``initial_state``): a bool for every row or a host bool tensor ``[rows]``.
        initial_state: ``[rows, H, K, V]`` state before each whole row (used by rank 0), or None (zeros).
        op_kwargs: passed on (gate, L2 norm, backend).
    Returns:
        ``(o like v, final state [rows, H, K, V] fp32 (of each row's last document) or None)``, the latter the same
        on every rank.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    wide = torch.promote_types(q.dtype, torch.float32)
    if cu_seqlens is None:
        rows = B
        first = last = torch.arange(B)
    else:  # the document starting each row, and the one each row ends in
        cu = cu_seqlens.cpu()
        first = torch.searchsorted(cu, torch.arange(rows) * (T // rows))
        last = torch.cat([first[1:], torch.tensor([len(cu) - 1])]) - 1
    carried = first[torch.as_tensor(continues, dtype=torch.bool).expand(rows)]
    h0 = torch.zeros(len(first) if cu_seqlens is None else len(cu) - 1, H, K, K + V, dtype=wide, device=q.device)
    h0[carried.to(q.device), :, :, :K] = torch.eye(K, dtype=wide, device=q.device)
    values = torch.cat([v.new_zeros(B, T, H, K), v], dim=-1)
    out, final = op(q, k, values, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                    cu_seqlens=cu_seqlens, **op_kwargs)
    Q, o0 = out[..., :K], out[..., K:]
    state = (torch.zeros(rows, H, K, V, dtype=wide, device=q.device) if initial_state is None
             else initial_state.to(wide))
    s_in, state = _ExchangeStates.apply(final[last.to(q.device)].to(wide), state, group)
    # Q is zero outside each row's first document (when it continues): one row's correction per row
    fix = torch.einsum("bthk,bhkv->bthv", Q.to(wide).reshape(rows, -1, H, K), s_in).reshape(*Q.shape[:-1], V)
    return (o0.to(wide) + fix).to(o0.dtype), (state if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------------
# The model's view: which part of each row this rank holds
# ----------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """A process group (None: the default group) with this process's rank in it and its size."""

    group: "dist.ProcessGroup | None" = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


@dataclasses.dataclass(frozen=True)
class ContextParallel(RankGroup):
    """The process group whose ranks hold consecutive equal parts of every row, in rank order (None: the default
    group). Passed to the model's forward as ``context_parallel``; the inputs, ``position_ids`` (restarting at 0 at
    document starts, as for packed rows), ``attention_mask`` and ``labels`` are then this rank's columns."""

    def shift_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` -> ``[B, T]``: the target of each position, the next column's label (the next rank's first
        label for the last column; -100 on the last rank), as ``labels[..., 1:]`` of the whole row."""
        heads = [torch.empty_like(labels[:, :1]) for _ in range(self.size)]
        dist.all_gather(heads, labels[:, :1].contiguous(), group=self.group)
        after = heads[self.rank + 1] if self.rank + 1 < self.size else torch.full_like(heads[0], -100)
        return torch.cat([labels[:, 1:], after], dim=1)

    def mean(self, loss_sum: torch.Tensor, shift_labels: torch.Tensor, num_items=None) -> torch.Tensor:
        """The group's summed loss over ``num_items`` (default: the group's labelled positions,
        ``shift_labels != -100``), the same on every rank; differentiable."""
        if num_items is None:
            num_items = (shift_labels != -100).sum().to(loss_sum.device)
            dist.all_reduce(num_items, group=self.group)
        return _AllReduceSum.apply(loss_sum, self.group) / num_items


@dataclasses.dataclass
class RowShard:
    """What the layers of one context-parallel forward need to know about this rank's part of the rows: built once
    per forward (``build``). Shapes: B rows, T this rank's tokens a row, offset = rank · T.

    `continues`: ``[B]`` host bool, whether the row's first token continues a document of the previous ranks;
    `doc_start`: ``[B, T]`` int64, the global column where each token's document starts; `key_mask`: ``[B, offset +
    T]`` bool, the real (unpadded) keys up to this rank's last token, or None; `conv_cu_seqlens`: the documents of the
    short convolutions' input (``conv_input``) on the device, or None."""

    context_parallel: ContextParallel
    offset: int
    continues: torch.Tensor
    doc_start: torch.Tensor
    key_mask: torch.Tensor | None
    conv_width: int
    conv_cu_seqlens: torch.Tensor | None

    @classmethod
    def build(cls, context_parallel: ContextParallel, batch: int, seq_len: int, device, conv_width: int,
              position_ids=None, attention_mask=None, cu_seqlens=None) -> "RowShard":
        """From the short convolutions' kernel width, this rank's ``position_ids [B, T]`` (None: one document a
        row), ``attention_mask [B, T]`` (1 = real token; None: no padding) and the host ``cu_seqlens`` of its packed
        tokens (``PackedDocuments``; None when every row holds one document here). Collectives: an all-gather of
        each row's last document start ``[B]``, and of the attention mask when one is given (every rank or none)."""
        rank, offset = context_parallel.rank, context_parallel.rank * seq_len
        group = context_parallel.group
        if position_ids is None:
            starts = torch.zeros(batch, seq_len, dtype=torch.bool)
        else:
            starts = (position_ids == 0).cpu()
        starts[:, 0] |= rank == 0
        columns = torch.arange(seq_len)
        last_start = torch.where(starts, offset + columns, -1).amax(1).to(device)  # [B], -1: none here
        gathered = [torch.empty_like(last_start) for _ in range(context_parallel.size)]
        dist.all_gather(gathered, last_start, group=group)
        incoming = torch.stack(gathered[:rank]).amax(0) if rank else torch.zeros_like(last_start)
        doc_start = torch.where(starts.to(device), offset + columns.to(device), incoming[:, None]).cummax(1).values
        key_mask = None
        if attention_mask is not None:
            key_mask = gather_sequence(attention_mask.to(torch.uint8), group).bool()[:, : offset + seq_len]
        conv_cu = None
        if cu_seqlens is not None:  # each row's part as [W - 1 context | T tokens]: offsets shift by W - 1 a row
            cu = cu_seqlens.to(torch.int64)
            inside = (cu % seq_len != 0).long()
            conv_cu = (cu + (cu // seq_len + inside) * (conv_width - 1)).to(torch.int32).to(device)
        return cls(context_parallel, offset, ~starts[:, 0], doc_start, key_mask, conv_width, conv_cu)

    @property
    def group(self):
        return self.context_parallel.group

    def kda(self, q, k, v, g, beta, cu_seqlens=None, **kwargs):
        """``chunk_kda`` through ``context_parallel_kda`` on these rows (``cu_seqlens``: the flattened rows'
        documents, as for packed rows of the single process)."""
        rows = len(self.continues)
        return context_parallel_kda(chunk_kda, q, k, v, g, beta, self.group, cu_seqlens=cu_seqlens, rows=rows,
                                    continues=self.continues, **kwargs)

    def conv_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, C]`` preceded by the previous rank's last ``W − 1`` inputs of each row ``[B, W − 1 + T, C]``,
        zero where they lie before the start of the row's first document (so they add nothing): the short
        convolution of it, with ``conv_cu_seqlens``, gives this rank's outputs after its first ``W − 1``."""
        width = self.conv_width - 1
        tail = previous_tail(x, width, self.group)
        columns = self.offset - width + torch.arange(width, device=x.device)
        keep = columns >= self.doc_start[:, :1]  # [B, W - 1]
        return torch.cat([tail * keep.unsqueeze(-1).to(tail.dtype), x], dim=1)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [B, T, ...]`` up to this rank's last token: ``[B, offset + T, ...]``; differentiable."""
        return gather_sequence(x, self.group)[:, : self.offset + x.shape[1]]

    def attention_mask(self, max_elements: int) -> torch.Tensor:
        """``[B, 1, T, offset + T]`` bool: each query attends to the keys of its document up to itself (and real
        keys only), and always to itself. A ValueError past ``max_elements`` (``B · T · (offset + T)``)."""
        batch, seq_len = self.doc_start.shape
        keys = self.offset + seq_len
        if batch * seq_len * keys > max_elements:
            raise ValueError(
                f"context-parallel attention masks this rank's {seq_len} queries a row against {keys} keys "
                f"({batch * seq_len * keys} elements, more than {max_elements}): use more ranks, shorter rows or "
                "KDA layers only")
        device = self.doc_start.device
        q_pos = self.offset + torch.arange(seq_len, device=device)
        k_pos = torch.arange(keys, device=device)
        allowed = (k_pos <= q_pos[:, None]) & (k_pos >= self.doc_start[:, :, None])  # [B, T, offset + T]
        if self.key_mask is not None:
            allowed = allowed & self.key_mask[:, None, :]
        return (allowed | (k_pos == q_pos[:, None])).unsqueeze(1)


__all__ = ["ContextParallel", "RowShard", "all_gather", "context_parallel_kda", "gather_sequence", "previous_tail"]

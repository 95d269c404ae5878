"""Kimi Delta Attention (KDA) ops: torch reference paths and backend dispatch.

Layout (identical to flash-linear-attention's): ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``,
``g: [B, T, H, K]`` (log-decay, ``g <= 0``), ``beta: [B, T, H]``, recurrent state ``[N, H, K, V]`` in fp32,
where ``N = B`` or, with ``cu_seqlens``, the number of packed documents (then ``B`` must be 1).

Recurrence, per head and token ``t`` (``α_t = exp(g_t)`` per key channel)::

    S ← Diag(α_t) S
    S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
    o_t = Sᵀ q_t · scale                      (scale defaults to K ** -0.5)

Chunked form (``chunk_kda``, torch backend). Write the update as ``S_t = D_t S_{t-1} + k_t u_tᵀ`` with the
"new value" ``u_t = β_t (v_t − S_{t-1}ᵀ D_t k_t)``. Inside a chunk of C = 64 tokens entering with state
``S0``, let ``Γ_i`` be the within-chunk cumulative sum of ``g`` and ``E_ij = exp(Γ_i − Γ_j)`` (per channel,
``j <= i``, so every factor is ``<= 1``). Unrolling gives

    (I + A_kk) U = Diag(β) (V − (K ⊙ e^Γ) S0),   A_kk[i, j] = β_i Σ_c k_ic k_jc E_ijc  (j < i)
    O            = scale · ((Q ⊙ e^Γ) S0 + A_qk U),  A_qk[i, j] = Σ_c q_ic k_jc E_ijc   (j <= i)
    S_next       = Diag(e^{Γ_C}) S0 + (K ⊙ e^{Γ_C − Γ})ᵀ U

``I + A_kk`` is unit lower-triangular: one solve per chunk (block forward substitution over 16-row blocks)
gives ``W`` and ``U0`` with ``U = U0 − W S0`` (the WY/UT transform). The chunk transition is then
``S_next = M S0 + Z`` with per-chunk ``M, Z`` computed in parallel; only that short loop is sequential.

``A_kk`` and ``A_qk`` are built from 16-token sub-blocks, each entry as a product of finite factors:
- sub-block I after J: anchor at the end of J, ``E_ij = e^{Γ_i − Γ_start(I)} · e^{Γ_start(I) − Γ_end(J)} ·
  e^{Γ_end(J) − Γ_j}``, all exponents ``<= 0``, one matmul whatever the gate's range;
- diagonal sub-block I: anchor at its start, ``E_ij = e^{Γ_i − Γ_start} · e^{Γ_start − Γ_j}``. The second factor
  is ``<= e^{80}`` while row i has decayed at most SPAN_LIMIT = 80 nats since the block start, which the bounded
  gate (``g >= −5``, 16 tokens) guarantees. Rows past that (unbounded softplus gate only) are recomputed
  exactly from the pairwise differences ``Γ_i − Γ_j``, masked to ``j <= i`` before ``exp``.
Every entry (i, j) reads tokens ``<= i`` only, so later inputs cannot change earlier outputs, not even
their rounding.

The Triton kernels (``kda_chunk.py``, ``kda_fused_recurrent.py``; optional) plug in behind ``chunk_kda`` /
``recurrent_kda``.
"""

import math

import torch
import torch.nn.functional as F

from .kda_common import CHUNK_SIZE, SUB_BLOCK, check_inputs, compute_dtype, doc_lengths, kda_gate, l2norm, resolve_gate

try:
    from .kda_chunk import chunk_kda_triton
    from .kda_fused_recurrent import recurrent_kda_triton
except ImportError:
    chunk_kda_triton = recurrent_kda_triton = None

__all__ = ["chunk_kda", "kda_gate", "naive_recurrent_kda", "recurrent_kda"]

SPAN_LIMIT = 80.0  # nats a sub-block may decay over and still use the anchored matmul form
BACKENDS = ("torch", "triton")


def _validate(q, k, v, g, beta, initial_state, cu_seqlens):
    """Check the op contract; return ``(N, doc_lengths or None)``."""
    N = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return N, None if cu_seqlens is None else doc_lengths(cu_seqlens, q.shape[1])


def _pick_backend(backend, q, kernel):
    if backend is None:
        return "triton" if (q.is_cuda and kernel is not None) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and (kernel is None or not q.is_cuda):
        raise ValueError("backend='triton' needs CUDA tensors and the Triton kernels (triton installed)")
    return backend


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """The per-token KDA recurrence; the test oracle.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H, K]`` log-decay; beta: ``[B, T, H]``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        output_final_state: return the final state.
        cu_seqlens: ``[N+1]`` document boundaries in the single row (B must be 1).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] or None)``; computed in fp32 (fp64 for fp64 inputs).
    """
    N, lengths = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        o, state = _naive_core(q, k, v, g, beta, scale, initial_state)
    else:
        outs, states, start = [], [], 0
        for n, length in enumerate(lengths):
            sl = slice(start, start + length)
            h0 = None if initial_state is None else initial_state[n : n + 1]
            o_n, s_n = _naive_core(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale, h0)
            outs.append(o_n)
            states.append(s_n)
            start += length
        o, state = torch.cat(outs, 1), torch.cat(states, 0)
    return o, (state if output_final_state else None)


def _naive_core(q, k, v, g, beta, scale, h0):
    B, T, H, K = q.shape
    out_dtype, dtype = q.dtype, compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, v.shape[-1]) if h0 is None else h0.to(dtype)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        k_t = k[:, t]
        delta = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + beta[:, t, :, None, None] * k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale))
    o = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(out_dtype), S


def _prepare(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, use_qk_l2norm_in_kernel, gate, lower_bound):
    """Apply the fused keywords in torch (shared by the torch backends)."""
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, gate=gate, lower_bound=lower_bound)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    *,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate=None,
    backend=None,
):
    """Chunked KDA (training / prefill).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (post-sigmoid).
        g: ``[B, T, H, K]``: the log-decay, or the raw gate input when ``use_gate_in_kernel``.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros); N = B, or the number of documents with cu_seqlens.
        output_final_state: also return the final state ``[N, H, K, V]`` (fp32; fp64 for fp64 inputs).
        cu_seqlens: ``[N+1]`` int boundaries of documents packed in one row (B must be 1); no state crosses them.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6) first.
        use_gate_in_kernel: compute ``g = kda_gate(g, A_log, dt_bias, gate, lower_bound)`` first.
        A_log: ``[H]``; dt_bias: ``[H*K]`` or ``[H, K]`` (gate parameters, used with ``use_gate_in_kernel``).
        lower_bound, gate: as flash-linear-attention when ``gate`` is None: the bounded gate with this
            bound if ``lower_bound`` is set, else the softplus gate. ``gate="bounded"`` with no bound uses -5.
        backend: None (triton for CUDA tensors when available, else torch), ``"torch"`` or ``"triton"``.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state or None)``.
    """
    return _dispatch(chunk_kda_triton, _chunk_core, q, k, v, g, beta, scale, initial_state, output_final_state,
                     cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, gate, backend)


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    *,
    use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    gate=None,
    backend=None,
):
    """Step-by-step KDA for decoding (a few tokens, state in and out). Same arguments and returns as ``chunk_kda``."""
    return _dispatch(recurrent_kda_triton, _recurrent_core, q, k, v, g, beta, scale, initial_state,
                     output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                     lower_bound, gate, backend)


def _chunk_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, span_bounded=False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, state = _chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, span_bounded)
    return o, (state if output_final_state else None)


def _recurrent_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, span_bounded=False):
    """``naive_recurrent_kda`` with ``_chunk_core``'s arguments (``span_bounded`` concerns the chunked form only)."""
    return naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def _dispatch(kernel, torch_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
              use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, lower_bound, gate, backend):
    """The shared front of `chunk_kda` / `recurrent_kda`: validate, then run the Triton kernel (which fuses the
    gate and L2 norm itself) or apply them in torch and run the torch core."""
    gate, lower_bound = resolve_gate(gate, lower_bound)
    if _pick_backend(backend, q, kernel) == "triton":  # it checks the inputs itself, without a host round trip
        return kernel(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate,
        )
    _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, A_log, dt_bias, use_gate_in_kernel, use_qk_l2norm_in_kernel, gate,
                                lower_bound)
    # The bounded gate's decay over a sub-block, below SUB_BLOCK * |lower_bound|, decides the exact pairwise form of
    # the intra-chunk scores statically (no read of the values).
    span_bounded = use_gate_in_kernel and gate == "bounded" and -lower_bound * SUB_BLOCK <= SPAN_LIMIT
    o, state = torch_core(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, span_bounded)
    return o.to(out_dtype), state


def _chunk_torch(q, k, v, g, beta, scale, initial_state, cu_seqlens, span_bounded=False):
    """Torch chunked KDA on validated inputs (``span_bounded``: see ``_intra_chunk_scores``). Returns
    ``(o [B, T, H, V], final_state [N, H, K, V])`` in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, S = CHUNK_SIZE, SUB_BLOCK
    n = C // S
    dtype = compute_dtype(q)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    # Padding tokens have k = v = beta = 0 and g = 0: they leave the state untouched and are cut from o.
    if cu_seqlens is None:
        pad = -T % C
        xs = [F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta)]
        doc_starts, doc_ends = {}, {}
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
        index, doc_starts, doc_ends, chunk = [], {}, {}, 0
        for d, (a, b) in enumerate(zip(cu, cu[1:])):
            if b == a:
                continue
            n_chunks = -(-(b - a) // C)
            index += list(range(a, b)) + [T] * (n_chunks * C - (b - a))
            doc_starts[chunk], doc_ends[chunk + n_chunks - 1] = d, d
            chunk += n_chunks
        index = torch.tensor(index, dtype=torch.long, device=q.device)
        xs = [torch.cat([x, x.new_zeros(x[:, :1].shape)], 1).index_select(1, index) for x in (q, k, v, g, beta)]
    Tp = xs[0].shape[1]
    NC = Tp // C
    # [B, Tp, H, D] -> [NC, B, H, n, S, D]: chunks of n sub-blocks; the chunk loop slices contiguous blocks.
    q, k, v, g = (x.reshape(B, NC, n, S, H, x.shape[-1]).permute(1, 0, 4, 2, 3, 5).contiguous() for x in xs[:4])
    beta = xs[4].reshape(B, NC, C, H, 1).permute(1, 0, 3, 2, 4)  # [NC, B, H, C, 1]
    q = q * scale

    Gam = g.flatten(-3, -2).cumsum(-2).unflatten(-2, (n, S))  # Γ, cumulative within the chunk
    end = Gam[..., -1, :]  # Γ at the last token of each sub-block, [..., n, K]
    start = torch.cat([torch.zeros_like(end[..., :1, :]), end[..., :-1, :]], -2)  # Γ before each sub-block
    from_start = (Gam - start.unsqueeze(-2)).exp()  # exp(Γ_i − Γ_start(I)) <= 1
    k_end = k * (end.unsqueeze(-2) - Gam).exp()  # k ⊙ exp(Γ_end(I) − Γ) <= |k|
    q_l, k_l = q * from_start, k * from_start
    A_qk, A_kk = _intra_chunk_scores(q, k, Gam, q_l, k_l, k_end, start, end, span_bounded)

    def flat(x):  # [..., n, S, D] -> [..., C, D]
        return x.flatten(-3, -2)

    start_decay = start.exp().unsqueeze(-2)  # exp(Γ_start(I)): q_l · start_decay = q ⊙ e^Γ
    rhs = torch.cat([beta * flat(k_l * start_decay), beta * flat(v)], -1)
    W, U0 = _solve_unit_lower(beta * A_kk, rhs).split([K, V], -1)
    k_to_end = flat(k_end * (end[..., -1:, :] - end).exp().unsqueeze(-2)).transpose(-1, -2)  # k ⊙ e^{Γ_C − Γ}, [.., K, C]
    # Chunk transition S_next = M S + Z with M = Diag(e^{Γ_C}) − (k ⊙ e^{Γ_C − Γ})ᵀ W and Z = (k ⊙ e^{Γ_C − Γ})ᵀ U0.
    M = torch.diag_embed(end[..., -1, :].exp()) - k_to_end @ W
    Z = k_to_end @ U0

    h0 = None if initial_state is None else initial_state.to(dtype)
    state = (q.new_zeros(B, H, K, V) if h0 is None else h0) if cu_seqlens is None else None
    finals = [None] * (B if cu_seqlens is None else len(cu) - 1)
    states_in = []
    for c in range(NC):
        if c in doc_starts:
            d = doc_starts[c]
            state = q.new_zeros(1, H, K, V) if h0 is None else h0[d : d + 1]
        states_in.append(state)
        state = torch.baddbmm(Z[c].flatten(0, 1), M[c].flatten(0, 1), state.flatten(0, 1)).view_as(Z[c])
        if c in doc_ends:
            finals[doc_ends[c]] = state
    # the state entering each chunk, [NC, B, H, K, V]
    states_in = torch.stack(states_in) if NC else q.new_zeros(0, B, H, K, V)
    o = flat(q_l * start_decay) @ states_in + A_qk @ (U0 - W @ states_in)  # [NC, B, H, C, V]
    o = o.permute(1, 0, 3, 2, 4).reshape(B, Tp, H, V)
    if cu_seqlens is None:
        return o[:, :T], state
    for d, final in enumerate(finals):  # empty documents keep their initial state
        if final is None:
            finals[d] = q.new_zeros(1, H, K, V) if h0 is None else h0[d : d + 1]
    return o.index_select(1, (index < T).nonzero().squeeze(-1)), torch.cat(finals, 0)


def _intra_chunk_scores(q, k, Gam, q_l, k_l, k_end, start, end, span_bounded):
    """Intra-chunk ``A_qk`` (``j <= i``) and ``A_kk`` (``j < i``, without β) as ``[..., C, C]``.

    Inputs in sub-blocks ``[..., n, S, K]``: ``q, k, Gam``; ``q_l, k_l = (q, k) ⊙ e^{Γ − Γ_start}``,
    ``k_end = k ⊙ e^{Γ_end − Γ}``; ``start, end: [..., n, K]`` (Γ before / at the end of each sub-block).
    ``span_bounded``: the gate keeps every sub-block's decay within SPAN_LIMIT (decided from the gate, not the
    values), so no row needs the exact pairwise form.
    Entry (i, j) only reads tokens ``<= i``, so later inputs cannot change it (not even its rounding).
    """
    n, S, K = q.shape[-3:]
    lead = q.shape[:-3]
    C = n * S
    # Diagonal block I, anchored at the block start: (q_l)_I (k ⊙ e^{Γ_start − Γ})_Iᵀ; exact for rows whose decay since
    # the start stays <= SPAN_LIMIT (always, with the bounded gate); the clamp only keeps the other rows finite.
    since_start = start.unsqueeze(-2) - Gam  # [..., n, S, K], >= 0
    k_r = k * since_start.clamp(max=SPAN_LIMIT).exp()
    # Block J < I: (q_l)_I Diag(e^{Γ_start(I) − Γ_end(J)}) (k_end)_Jᵀ, all exponents <= 0.
    rows = []
    for i in range(n):
        right = k_r[..., i, :, :]
        if i:
            off = (start[..., i, None, :] - end[..., :i, :]).exp().unsqueeze(-2) * k_end[..., :i, :, :]  # [..., i, S, K]
            right = torch.cat([off.flatten(-3, -2), right], -2)
        row = torch.cat([q_l[..., i, :, :], k_l[..., i, :, :]], -2) @ right.transpose(-1, -2)  # [..., 2S, (i+1)S]
        rows.append(F.pad(row, (0, C - (i + 1) * S)))
    rows = torch.stack(rows, -3)  # [..., n(I), 2S, C]
    A_qk, A_kk = rows[..., :S, :], rows[..., S:, :]
    if not span_bounded:  # only unbounded gates get here
        A_qk, A_kk = _exact_wide_rows(q, k, Gam, since_start, A_qk, A_kk)
    return A_qk.reshape(*lead, C, C).tril(), A_kk.reshape(*lead, C, C).tril(-1)


def _exact_wide_rows(q, k, Gam, since_start, A_qk, A_kk):
    """``A_qk, A_kk [..., n(I), S, C]`` with the diagonal-block entries of the rows that decayed more than
    SPAN_LIMIT since their sub-block's start replaced by the exact pairwise form: ``exp(Γ_i − Γ_j)``, masked to
    ``j <= i`` before ``exp``. Eagerly only the sub-blocks that hold such rows are computed; under
    ``torch.compile`` every sub-block is (static shapes, no host read of the values)."""
    n, S = q.shape[-3:-1]
    wide = since_start.amax(-1) > SPAN_LIMIT  # [..., n, S]
    compiling = torch.compiler.is_compiling()
    if not compiling and not wide.any():
        return A_qk, A_kk
    idx = (...,) if compiling else wide.any(-1).nonzero(as_tuple=True)
    qw, kw, Gw = q[idx], k[idx], Gam[idx]
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril().unsqueeze(-1)
    kd = (Gw.unsqueeze(-2) - Gw.unsqueeze(-3)).masked_fill(~causal, -math.inf).exp() * kw.unsqueeze(-3)
    on_diag = torch.eye(n, dtype=torch.bool, device=q.device)[:, None, :, None]  # [n(I), 1, n(J), 1]
    replace = wide[..., None, None] & on_diag  # [..., n(I), S(i), n(J), 1]

    def exact(x, pairwise):  # x [..., n, S, C]: wide rows take the pairwise values on their diagonal block
        d = pairwise if compiling else x.new_zeros(*q.shape[:-1], S).index_put(idx, pairwise)
        return torch.where(replace, d.unsqueeze(-2), x.unflatten(-1, (n, S))).flatten(-2)

    return exact(A_qk, (kd @ qw.unsqueeze(-1)).squeeze(-1)), exact(A_kk, (kd @ kw.unsqueeze(-1)).squeeze(-1))


def _solve_unit_lower(N, rhs):
    """Solve ``(I + N) X = rhs`` for strictly lower-triangular ``N [..., C, C]``, ``rhs [..., C, R]``.

    Block forward substitution over SUB_BLOCK rows, with the diagonal blocks inverted once (batched).
    """
    C, S = N.shape[-1], SUB_BLOCK
    n = C // S
    eye = torch.eye(S, dtype=N.dtype, device=N.device)
    diag = N.unflatten(-2, (n, S)).unflatten(-1, (n, S)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, S, S]
    inv = torch.linalg.solve_triangular(eye + diag, eye.expand_as(diag), upper=False, unitriangular=True)
    X = []
    for b in range(n):
        r = rhs[..., b * S : (b + 1) * S, :]
        if b:
            r = r - N[..., b * S : (b + 1) * S, : b * S] @ torch.cat(X, -2)
        X.append(inv[..., b, :, :] @ r)
    return torch.cat(X, -2)

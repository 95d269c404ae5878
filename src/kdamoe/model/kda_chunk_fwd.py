"""The forward of chunked KDA on Triton: buffers, the order of the launches, and the slabbed single sequence.

Per chunk of 64 tokens entering with state ``S0`` (``Γ`` = within-chunk cumsum of ``g``)::

    T      = (I + A_kk)^-1,   A_kk[i, j] = β_i Σ_c k_ic k_jc exp(Γ_ic − Γ_jc)   (j < i)
    W      = T (β K e^Γ),     U0 = T (β V),     U = U0 − W S0
    O      = scale (Q e^Γ) S0 + P U,            P[i, j] = scale Σ_c q_ic k_jc exp(Γ_ic − Γ_jc)   (j <= i)
    S_next = e^{Γ_C} S0 + (K e^{Γ_C − Γ})ᵀ U

Kernels, in order: ``_gate_cumsum_kernel`` (fused gate, Γ), ``_qk_rstd_kernel`` (with the L2 norm inside: the
rows' factors), ``_intra_kernel`` (A_qk and T), ``_wu_kernel`` (W,
U0 and the loop's operands), ``_fwd_state_kernel`` (the sequential chunk loop, per sequence, head and V block)
and ``_fwd_o_kernel`` (O per chunk, in parallel, from the stored states, Q and Γ).
"""

import dataclasses

import torch
import triton

from .kda_chunk_intra import _intra_kernel, _qk_rstd_kernel
from .kda_chunk_o import _fwd_o_kernel
from .kda_chunk_state import _fwd_state_kernel
from .kda_common import CHUNK_SIZE
from .kda_gate import _gate_cumsum_kernel
from .kda_launch import LAUNCH, SLICE, fwd_loop_bv, launch_cfg, lp, run_pipeline
from .kda_wy_fast import _wu_kernel

# The forward keeps per-chunk states (then O runs in a parallel kernel: faster) when they take at most this many
# bytes more than the fp32 Γ (head dim 128: the same bytes; Γ is freed before they are allocated); else (V > K at
# very long T) the chunk loop writes O itself. The autograd forward keeps the states for the backward when they take
# at most this many bytes (else the backward runs the chunk loop again).
STATES_LIMIT_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class GateArgs:
    """The fused gate's kernel arguments. mode 0: ``g`` is the log-decay; 1 bounded / 2 softplus: ``g`` is the raw
    gate input, ``a = exp(A_log)`` ``[H]`` and ``dt_bias`` ``[H*K]`` fp32."""

    mode: int
    a: torch.Tensor
    dt_bias: torch.Tensor
    lower_bound: float


@dataclasses.dataclass
class ChunkBuffers:
    """The forward's intermediates: per token ``[TT, H, *]``, per chunk ``[NC, H, *]``, per sequence ``[N, H, K, V]``.

    16-bit tensors are in the inputs' dtype when that is 16-bit (fp32 otherwise); A_qk and T are bf16 with bf16
    inputs. The recomputation for the backward keeps U and Q e^Γ; the output's forward frees what it no longer needs
    as it goes (a 1M-token forward keeps only what the chunk loop reads).
    """

    aqk: torch.Tensor  # [TT, H, 64] P = scale · A_qk (lower; upper blocks 0)
    tinv: torch.Tensor | None  # [TT, H, 64] T = (I + A_kk)^-1
    w: torch.Tensor  # [TT, H, K] W (16-bit)
    kd: torch.Tensor  # [TT, H, K] K e^{Γ_C − Γ} (16-bit)
    u: torch.Tensor  # [TT, H, V] U0, overwritten with U by the chunk loop (fp32 for the backward, else 16-bit)
    qg: torch.Tensor | None  # [TT, H, K] scale Q e^Γ (16-bit; the backward only)
    dl: torch.Tensor  # [NC, H, K] e^{Γ_C} fp32
    gam: torch.Tensor | None = None  # [TT, H, K] Γ fp32
    hs: torch.Tensor | None = None  # [NC, H, K, V] the state entering each chunk (16-bit)
    o: torch.Tensor | None = None  # [TT, H, V] the output, in the inputs' dtype
    ht: torch.Tensor | None = None  # [N, H, K, V] final states fp32
    rq: torch.Tensor | None = None  # [TT, H] fp32 the L2-norm factors of q's rows (None: q, k are taken as given)
    rk: torch.Tensor | None = None  # [TT, H] fp32 ... and of k's rows

    def view(self, rows, chunks):
        """The buffers of token rows ``rows`` and chunks ``chunks`` (views; no final states)."""
        def cut(x, index):
            return None if x is None else x[index]
        return ChunkBuffers(aqk=cut(self.aqk, rows), tinv=cut(self.tinv, rows), w=cut(self.w, rows),
                            kd=cut(self.kd, rows), u=cut(self.u, rows), qg=cut(self.qg, rows),
                            dl=cut(self.dl, chunks), gam=cut(self.gam, rows), hs=cut(self.hs, chunks),
                            o=cut(self.o, rows), rq=cut(self.rq, rows), rk=cut(self.rk, rows))

    def norm_args(self):
        """The kernels' L2-norm arguments: ``(rq, rk, NORM)`` (a dummy pointer where there is no norm)."""
        if self.rq is None:
            return self.dl, self.dl, False
        return self.rq, self.rk, True


def kept_states(hs):
    """The per-chunk states the autograd forward keeps for the backward: ``hs`` when it takes at most
    STATES_LIMIT_BYTES, else None (the backward then runs the chunk loop again)."""
    return hs if hs is not None and hs.numel() * hs.element_size() <= STATES_LIMIT_BYTES else None


def prepare_chunks(x, gate, scale, safe, tables, buf, hs_kept, intra):
    """The parallel kernels before the chunk loop over the chunks of ``tables``: Γ into ``buf.gam``; with ``intra``
    A_qk and T (else given: the backward) and, where ``buf.rq`` is not None, the L2-norm factors of q's and k's rows
    into ``buf.rq``, ``buf.rk``; then W, U0 (U from the per-chunk states ``hs_kept`` unless None), K e^{Γ_C − Γ},
    e^{Γ_C} and scale Q e^Γ (into ``buf.qg`` unless None). ``x = (q, k, v, g, β)`` as ``[TT, H, *]``."""
    q, k, v, g, beta = x
    TT, H, K = q.shape
    V = v.shape[-1]
    NC = tables.num_chunks
    if NC == 0:
        return
    BK, BVf, _ = launch_cfg(K, V)
    BKg = min(BK, SLICE["gate_k"])
    _gate_cumsum_kernel[(NC, H, triton.cdiv(K, BKg))](g, gate.a, gate.dt_bias, buf.gam, tables.cstart, tables.cend,
                                                      gate.lower_bound, H, K, BKg, GATE=gate.mode,
                                                      **LAUNCH["gate_cumsum"])
    rq, rk, norm = buf.norm_args()
    if intra:
        if norm:
            _qk_rstd_kernel[(NC, H)](q, k, rq, rk, tables.cstart, tables.cend, H, K, min(BK, SLICE["norm_k"]),
                                     **LAUNCH["qk_rstd"])
        _intra_kernel[(NC, H)](q, k, buf.gam, beta, buf.aqk, buf.tinv, rq, rk, tables.cstart, tables.cend, scale, H,
                               K, min(BK, SLICE["intra_k"]), SAFE=safe, FTZ=lp(q), NORM=norm, **LAUNCH["intra"])
    _wu_kernel[(NC, H)](q, k, v, beta, buf.gam, buf.tinv, buf.w, buf.u, buf.qg if buf.qg is not None else buf.w,
                        buf.kd, buf.dl, hs_kept if hs_kept is not None else buf.dl, rq, rk, tables.cstart, tables.cend,
                        scale, H, K, V, min(BK, SLICE["wu_k"]), min(BVf, SLICE["wu_v"]), STORE_QG=buf.qg is not None,
                        U_FROM_STATES=hs_kept is not None, LP=lp(q), FTZ=lp(q), NORM=norm, **LAUNCH["wu"])


def state_loop(tables, q, buf, h0, ht, scale):
    """The chunk loop over the sequences of ``tables``: U0 → U in place in ``buf.u``, the per-chunk states into
    ``buf.hs`` (else O into ``buf.o``, from Q and Γ), the final states into ``ht`` (unless None), from ``h0``
    (unless None)."""
    TT, H, K = q.shape
    V = buf.u.shape[-1]
    NC = tables.num_chunks
    if NC == 0:  # no token (T = 0, or only empty documents): each final state is its initial state
        if ht is not None and h0 is not None:
            ht.copy_(h0)
        elif ht is not None:
            ht.zero_()
        return
    N = tables.num_seqs
    BK, _, BV = launch_cfg(K, V)
    hs, w = buf.hs, buf.w
    # Pipeline stages (chunks prefetched): 3 where the per-chunk states are kept and W, K e^{Γ_C − Γ} are 16-bit
    # [64, BK] tiles of at most 256 B a row; 2 otherwise up to BK = 128 (the loop writing O holds more tiles: 3
    # overflow its shared memory), else 1
    stages3 = hs is not None and BK * w.element_size() <= 256
    BVl = fwd_loop_bv(BV, N, H, V, stages3, q.device)
    dummy = buf.dl
    rq, _, norm = buf.norm_args()
    _fwd_state_kernel[(triton.cdiv(V, BVl) * N, H)](
        q, buf.gam if hs is None else dummy, buf.aqk, buf.o if buf.o is not None else dummy, buf.kd, buf.dl, w, buf.u,
        h0 if h0 is not None else dummy, ht if ht is not None else dummy, hs if hs is not None else dummy, rq,
        tables.cu, tables.coff, scale, H, K, V, BK, BVl, HAS_H0=h0 is not None, STORE_HT=ht is not None,
        STORE_H=hs is not None, WRITE_O=hs is None, LP=lp(q), NORM=norm,
        num_stages=3 if stages3 else 2 if BK <= 128 else 1,
        **LAUNCH["fwd_state" if hs is not None else "fwd_state_o"])


def output_chunks(tables, q, buf, scale):
    """``O = (scale Q e^Γ) S0 + P U`` of every chunk of ``tables`` into ``buf.o``, in parallel, from ``buf.hs``."""
    NC = tables.num_chunks
    H, K = q.shape[1:]
    V = buf.o.shape[-1]
    BK, BVf, _ = launch_cfg(K, V)
    BVo = min(BVf, 128)
    rq, _, norm = buf.norm_args()
    if NC > 0:
        _fwd_o_kernel[(NC * triton.cdiv(V, BVo), H)](q, buf.gam, buf.aqk, buf.hs, buf.u, buf.o, rq, tables.cstart,
                                                   tables.cend, scale, H, K, V, min(BK, SLICE["o_k"]), BVo, FTZ=lp(q),
                                                   LP=lp(q), NORM=norm, **LAUNCH["fwd_o"])


def chunk_fwd(x, gate, scale, h0, tables, safe, output_final_state, *, keep_tinv=False, saved=None, slabs=None,
              norm=False):
    """The forward kernels on flat inputs ``x = (q, k, v, g, β)``, each ``[TT, H, *]``; returns the ChunkBuffers.

    Args:
        gate: GateArgs. scale: the query scale. h0: ``[N, H, K, V]`` fp32 or None. tables: ChunkTables.
        safe: the pairwise path of the diagonal sub-blocks (any gate) instead of the dense one (``g >= -5``).
        keep_tinv: also return T (the autograd forward keeps it for the backward).
        saved: None for the output's forward. The backward's recomputation passes ``(A_qk, T, per-chunk states or
            None, rq, rk)`` kept by the autograd forward: it skips the intra and solve kernels, and with the states
            the chunk loop too (``_wu_kernel`` then computes U from them); it returns Γ, U in fp32, scale Q e^Γ and
            the states, and no output.
        slabs: token ranges of a single sequence (``kda_launch.slab_ranges``) or None.
        norm: q and k are L2-normalised inside the kernels (``buf.rq``, ``buf.rk``: their rows' factors, from
            ``_qk_rstd_kernel``); the recomputation takes them from ``saved`` (None there: no norm).
    """
    q = x[0]
    TT, H, K = q.shape
    V = x[2].shape[-1]
    N, NC = tables.num_seqs, tables.num_chunks
    recompute = saved is not None
    keep_tinv = keep_tinv or recompute
    f32 = dict(device=q.device, dtype=torch.float32)
    aqk, tinv, hs_kept, rq, rk = saved if recompute else (None, None, None, None, None)
    if norm and not recompute:
        rq, rk = (torch.empty(TT, H, **f32) for _ in range(2))
    # T and A_qk in bf16 with bf16 inputs: half their bytes in the kernels that read them and kept for the backward;
    # every dot reading them widens them to fp32
    t16 = dict(device=q.device, dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32)
    if aqk is None:
        aqk = torch.empty(TT, H, CHUNK_SIZE, **t16)
    # W, K e^{Γ_C − Γ}, Q e^Γ and the per-chunk states (and their gradients) are stored in the inputs' 16-bit dtype:
    # half the bytes the loops read. P stays fp32, and so does U for the backward: their rounding is what reaches
    # the gradients (docs/kda_kernels.md). The output's own forward stores U in 16 bits.
    lp16 = dict(device=q.device, dtype=q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32)
    buf = ChunkBuffers(aqk=aqk, tinv=tinv, w=torch.empty(TT, H, K, **lp16), kd=torch.empty(TT, H, K, **lp16),
                       u=torch.empty(TT, H, V, **(f32 if recompute else lp16)),
                       qg=torch.empty(TT, H, K, **lp16) if recompute else None,
                       dl=torch.empty(max(NC, 1), H, K, **f32), rq=rq, rk=rk)
    keep_states = recompute or NC * H * K * V * buf.w.element_size() <= STATES_LIMIT_BYTES + TT * H * K * 4
    if slabs is not None and keep_states and hs_kept is None:
        # Γ (and T unless kept) per slab; the loop of slab j beside the parallel kernels of slab j+1
        buf.gam = torch.empty(TT, H, K, **f32) if recompute else None
        if buf.tinv is None and keep_tinv:
            buf.tinv = torch.empty(TT, H, CHUNK_SIZE, **t16)
        buf.ht = torch.empty(N, H, K, V, **f32) if (output_final_state and not recompute) else None
        buf.hs = torch.empty(max(NC, 1), H, K, V, **lp16)
        buf.o = None if recompute else torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
        _slabbed_forward(slabs, x, gate, scale, safe, not recompute, buf, h0, t16)
        return buf
    if buf.tinv is None:
        buf.tinv = torch.empty(TT, H, CHUNK_SIZE, **t16)
    buf.gam = torch.empty(TT, H, K, **f32)
    prepare_chunks(x, gate, scale, safe, tables, buf, hs_kept, intra=not recompute)
    if not keep_tinv:
        buf.tinv = None  # freed before the states are allocated
    if hs_kept is not None:  # the backward, with the forward's states: _wu_kernel computed U, no loop
        buf.hs = hs_kept
        return buf
    buf.ht = torch.empty(N, H, K, V, **f32) if (output_final_state and not recompute) else None
    buf.hs = torch.empty(max(NC, 1), H, K, V, **lp16) if keep_states else None
    buf.o = None if recompute else torch.empty(TT, H, V, device=q.device, dtype=q.dtype)
    state_loop(tables, q, buf, h0, buf.ht, scale)
    if buf.o is not None and keep_states:
        output_chunks(tables, q, buf, scale)
    if not recompute:
        buf.gam = None
    return buf


def _slabbed_forward(slabs, x, gate, scale, safe, intra, buf, h0, t16):
    """The forward of one sequence in ``slabs``, each a sequence of its own whose initial state is the previous
    slab's final state (fp32, as the loop carries it): a slab's parallel kernels, then its loop on the loop stream,
    then its O kernel (none for the backward's recomputation). ``buf.tinv``, ``buf.gam``: None to allocate them
    per slab."""
    q = x[0]
    H, K = q.shape[1:]
    V = buf.u.shape[-1]
    carry = [torch.empty(1, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2)]
    gams = {}  # the output's forward: each slab's Γ, until its O kernel

    def prep(j, tab, rows, chunks):
        part = buf.view(rows, chunks)
        n = rows.stop - rows.start
        if part.tinv is None:
            part.tinv = torch.empty(n, H, CHUNK_SIZE, **t16)
        if part.gam is None:
            part.gam = torch.empty(n, H, K, device=q.device, dtype=torch.float32)
        prepare_chunks([t[rows] for t in x], gate, scale, safe, tab, part, None, intra)
        gams[j] = part.gam

    def loop(j, tab, rows, chunks):
        h_in = h0 if j == 0 else carry[(j - 1) % 2]
        h_out = buf.ht if j == len(slabs) - 1 else carry[j % 2]
        state_loop(tab, q[rows], buf.view(rows, chunks), h_in, h_out, scale)

    def out(j, tab, rows, chunks):
        if buf.o is not None:
            part = buf.view(rows, chunks)
            part.gam = gams.pop(j)
            output_chunks(tab, q[rows], part, scale)

    run_pipeline(q.device, slabs, range(len(slabs)), prep, loop, out, wait_each=True)

"""The backward of chunked KDA on Triton.

The autograd forward keeps the inputs, A_qk, T and the per-chunk states (memory linear in T: 1.0 KB per token and
head at K = V = 128 with bf16 inputs, output included); the backward recomputes Γ and W, U (``_wu_kernel`` turns U0
into U from the kept states: no second chunk loop; above ``STATES_LIMIT_BYTES`` of states the loop runs again
instead), then ``_bwd_du0_kernel`` (Pᵀ dO), ``_bwd_state_kernel`` (the reverse loop carrying dS), ``_bwd_v_kernel``
(sums over V), ``_bwd_da_kernel`` (dA = −Tᵀ dT Tᵀ, Tᵀ dW), ``_bwd_intra_kernel`` (dq, dk, dβ and dΓ per 16-row block:
dense and pairwise terms) and ``_bwd_dg_kernel`` (suffix sums of dΓ and the gate's chain rule).
"""

import dataclasses

import torch
import triton

from .kda_chunk_fwd import chunk_fwd
from .kda_chunk_intra import _bwd_intra_kernel
from .kda_chunk_o import _bwd_du0_kernel, _bwd_v_kernel
from .kda_chunk_state import _bwd_state_kernel
from .kda_common import CHUNK_SIZE
from .kda_gate import _bwd_dg_kernel
from .kda_launch import LAUNCH, SLICE, few_loop_programs, launch_cfg, lp, lps, run_pipeline
from .kda_wy_fast import _bwd_da_kernel


@dataclasses.dataclass
class GradBuffers:
    """The backward's outputs and its two carried buffers: per token ``[TT, H, *]``, per chunk ``[NC, H, *]``."""

    dhs: torch.Tensor  # [NC, H, K, V] dS entering each chunk from its end (16-bit with 16-bit inputs)
    dus: torch.Tensor  # [TT, H, V] dU0 = Pᵀ dO, completed to dU by the reverse loop (fp32)
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    db: torch.Tensor
    da_part: torch.Tensor | None  # [NC, H] the fused gate's per-chunk partial gradient of A_log (None: no gate)
    ddtb_part: torch.Tensor | None  # [NC, H, K] ... and of dt_bias

    def view(self, rows, chunks):
        def cut(x, index):
            return None if x is None else x[index]
        return GradBuffers(dhs=self.dhs[chunks], dus=self.dus[rows], dq=self.dq[rows], dk=self.dk[rows],
                           dv=self.dv[rows], dg=self.dg[rows], db=self.db[rows], da_part=cut(self.da_part, chunks),
                           ddtb_part=cut(self.ddtb_part, chunks))


def chunk_bwd(x, gate, scale, h0, tables, safe, do, dht, saved, slabs=None):
    """Gradients of the chunked forward on flat inputs ``x = (q, k, v, g, β)`` from ``do [TT, H, V]`` and ``dht``
    (``[N, H, K, V]`` fp32 or None); ``saved``: what the autograd forward kept (``chunk_fwd``). Returns ``(dq, dk, dv,
    dg, dβ, dh0 or None, (dA_log [H], ddt_bias [H*K]) or None)``."""
    q, k, v, g, beta = x
    TT, H, K = q.shape
    V = v.shape[-1]
    N, NC = tables.num_seqs, tables.num_chunks
    fw = chunk_fwd(x, gate, scale, h0, tables, safe, False, saved=saved, slabs=slabs)
    f32 = dict(device=q.device, dtype=torch.float32)
    # the fused gate's per-chunk partial gradients of A_log and dt_bias (zeros when there is no chunk)
    parts = (torch.zeros(max(NC, 1), H, **f32), torch.zeros(max(NC, 1), H, K, **f32)) if gate.mode else (None, None)
    grads = GradBuffers(torch.empty_like(fw.hs), torch.empty(TT, H, V, **f32), *(torch.empty_like(t) for t in x),
                        *parts)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    do = do.contiguous()
    if NC > 0:
        BVo = min(launch_cfg(K, V)[1], 64)
        _bwd_du0_kernel[(NC * triton.cdiv(V, BVo), H)](fw.aqk, do, grads.dus, tables.cstart, tables.cend, H, V, BVo,
                                                      **LAUNCH["bwd_du0"])
    if slabs is not None:
        _slabbed_backward(slabs, x, gate, scale, safe, fw, do, dht, dh0, grads)
    else:
        reverse_loop(tables, fw, do, dht, dh0, grads)
        backward_chunks(tables, x, gate, scale, safe, fw, do, grads)
    dgate = (parts[0].sum(0), parts[1].sum(0)) if gate.mode else None
    return grads.dq, grads.dk, grads.dv, grads.dg, grads.db, dh0, dgate


def reverse_loop(tables, fw, do, dht, dh0, grads):
    """The reverse chunk loop over the sequences of ``tables`` (buffers: views of the same rows and chunks),
    carrying dS from ``dht`` (unless None) into ``dh0`` (unless None): dS entering every chunk into ``grads.dhs``,
    dU completed in ``grads.dus``."""
    N = tables.num_seqs
    w = fw.w
    H, K = w.shape[1:]
    V = do.shape[-1]
    BK, BVf, BV = launch_cfg(K, V)
    # with bf16 dots (LPS): 64-wide V blocks, 4 warps, 3 stages (its loads then feed the dots and are pipelined).
    # Otherwise 32-wide blocks: at 16 it is slower, and wrong at 8 warps in triton 3.6
    low = lps(w)
    BVr = min(BVf, 64) if low else BV
    few = few_loop_programs(BVr, N, H, V, w.device)
    # 2 stages only when the [64, BK] tiles it prefetches are at most 256 B a row (16-bit at BK <= 128): fp32 inputs
    # at head dim 128 overflow the H200's shared memory
    launch = dict(LAUNCH["bwd_state_lp" if low else "bwd_state_few" if few else "bwd_state"],
                  **({"num_stages": 1} if BK * w.element_size() > 256 else {}))
    dhs, dus = grads.dhs, grads.dus
    _bwd_state_kernel[(triton.cdiv(V, BVr) * N, H)](
        fw.qg, fw.kd, fw.dl, w, do, dht if dht is not None else dhs, dh0 if dh0 is not None else dhs, dhs, dus,
        tables.cu, tables.coff, H, K, V, BK, BVr, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, LP=lp(w),
        LPS=low, **launch)


def backward_chunks(tables, x, gate, scale, safe, fw, do, grads):
    """The backward's parallel kernels after the reverse loop, over the chunks of ``tables`` (all buffers: views of
    the same rows and chunks): the gradients into ``grads``."""
    NC = tables.num_chunks
    if NC == 0:
        return
    q, k, v, g, beta = x
    cstart, cend = tables.cstart, tables.cend
    TT, H, K = q.shape
    V = v.shape[-1]
    BK, _, BV = launch_cfg(K, V)
    f32 = dict(device=q.device, dtype=torch.float32)
    low = lps(q)
    dqg, dkd, dw, dgam, dge = (torch.empty(TT, H, K, **f32) for _ in range(5))
    da = torch.empty(TT, H, CHUNK_SIZE, **f32)  # dT from _bwd_v, then dA in place (_bwd_da); dw becomes Tᵀ dW there
    dp = torch.empty(TT, H, CHUNK_SIZE, **f32)
    db32 = torch.empty(TT, H, **f32)
    dgc = torch.empty(NC, H, K, **f32)
    _bwd_v_kernel[(NC, H)](v, beta, fw.tinv, fw.hs, grads.dhs, fw.u, grads.dus, do, grads.dv, dqg, dkd, dw, da, dp,
                           db32, dgc, cstart, cend, scale, H, K, V, BK, BV, LPS=low,
                           **LAUNCH["bwd_v_lp" if low else "bwd_v"])
    xpre = torch.empty(NC, H, 3, K, **f32)
    rq, rk, norm = fw.norm_args()
    _bwd_da_kernel[(NC, H)](k, beta, fw.gam, fw.tinv, dw, dkd, da, xpre, rk, cstart, cend, H, K, BK,
                            min(BK, SLICE["bwd_da_k"]), FTZ=lp(q), LPS=low, NORM=norm, **LAUNCH["bwd_da"])
    _bwd_intra_kernel[(NC * 4, H)](q, k, beta, fw.gam, dqg, dkd, dw, dp, da, dgc, xpre, dgam, dge, db32, grads.dq,
                                  grads.dk, grads.db, rq, rk, cstart, cend, scale, H, K, BK,
                                  BK if norm else min(BK, SLICE["bwd_intra_k"]), SAFE=safe, FTZ=lp(q), NORM=norm,
                                  **LAUNCH["bwd_intra"])
    da_part, ddtb_part = (grads.da_part, grads.ddtb_part) if gate.mode else (grads.dg, grads.dg)
    _bwd_dg_kernel[(NC, H)](dgam, dge, g, gate.a, gate.dt_bias, grads.dg, da_part, ddtb_part, cstart, cend,
                            gate.lower_bound, H, K, BK, GATE=gate.mode, **LAUNCH["bwd_dg"])


def _slabbed_backward(slabs, x, gate, scale, safe, fw, do, dht, dh0, grads):
    """The backward of one sequence after the recomputed forward, in ``slabs`` from the last: the reverse loop of a
    slab on the loop stream (dS carried between slabs in fp32), the slab's parallel kernels after it, beside the
    reverse loop of the slab before."""
    q = x[0]
    H, K = q.shape[1:]
    V = do.shape[-1]
    carry = [torch.empty(1, H, K, V, device=q.device, dtype=torch.float32) for _ in range(2)]

    def loop(j, tab, rows, chunks):
        d_in = dht if j == len(slabs) - 1 else carry[(j + 1) % 2]
        d_out = dh0 if j == 0 else carry[j % 2]
        reverse_loop(tab, fw.view(rows, chunks), do[rows], d_in, d_out, grads.view(rows, chunks))

    def chunks(j, tab, rows, chunk_range):
        backward_chunks(tab, [t[rows] for t in x], gate, scale, safe, fw.view(rows, chunk_range), do[rows],
                        grads.view(rows, chunk_range))

    # the reverse loops need only the recomputed forward and dU0: one wait, before the first
    run_pipeline(q.device, slabs, reversed(range(len(slabs))), None, loop, chunks, wait_each=False)

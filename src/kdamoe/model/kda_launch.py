"""How the chunked KDA kernels are launched: the launch settings per kernel, the chunk tables, the tile widths,
the GPU-only code paths, and the slabs that run a single long sequence's chunk loop beside the parallel kernels."""

import contextlib
import dataclasses
import functools
import weakref

import torch
import triton

from .kda_common import CHUNK_SIZE

# Launch settings (CUDA; the interpreter ignores them) and head-dim / V column slices per kernel, chosen on an H200
# (bf16, H 16, head dim 128, 4x8K and 1x32K tokens) by tools/tune_kda_kernels.py, each pick kept only where a
# same-run A/B of the whole forward+backward (tools/ab_kda.sh) confirmed it.
LAUNCH = {
    "gate_cumsum": dict(num_warps=4),
    "qk_rstd": dict(num_warps=4),
    "intra": dict(num_warps=1, num_stages=2),  # [16, 16] dots need no cross-warp exchange
    "wu": dict(num_warps=4, num_stages=3),
    "fwd_state": dict(num_warps=4),
    "fwd_state_o": dict(num_warps=8),  # the loop writing O (no per-chunk states kept: a 1M-token forward)
    "fwd_o": dict(num_warps=4, num_stages=2),  # two programs per SM
    "bwd_du0": dict(num_warps=2),
    "bwd_state": dict(num_warps=4, num_stages=1),
    "bwd_state_few": dict(num_warps=8, num_stages=2),  # fewer programs than SMs (one long sequence): prefetch
    "bwd_state_lp": dict(num_warps=4, num_stages=3),  # bf16 dots, 64-wide V blocks
    "bwd_v": dict(num_warps=8, num_stages=2),
    "bwd_v_lp": dict(num_warps=8, num_stages=3),  # bf16 operands take half the shared memory: a third stage fits
    "bwd_da": dict(num_warps=4, num_stages=1),
    "bwd_intra": dict(num_warps=8, num_stages=1, maxnreg=128),
    "bwd_dg": dict(num_warps=4),
    "recurrent": dict(num_warps=4),
}
# Column slice widths: whole [64, 128] fp32 tiles spill registers in `_wu_kernel`; `_intra_kernel`'s 16-wide slices
# keep its 20 accumulators in registers; `_bwd_intra_kernel` takes the head dim in one slice (with the q/k L2 norm
# inside the kernels it must: its backward needs whole rows; at head dim 256 that slice spills 640 B of stack, against
# 168 B in two); `_qk_rstd_kernel` sums the squares of q, k 64 columns at a time.
SLICE = {"gate_k": 64, "intra_k": 16, "wu_k": 64, "wu_v": 64, "bwd_intra_k": 128, "bwd_da_k": 64, "o_k": 64,
         "norm_k": 64}
# Slabs of a single sequence (`slab_ranges`): about SLABS of them, each of at least SLAB_MIN_TOKEN_HEADS token-heads
# (a slab's launches cost host time; a forward slab is less GPU work than a backward one); SLAB_TOKENS forces a slab
# length (tests: the slabbed paths under the interpreter).
SLABS, SLAB_MIN_TOKEN_HEADS, SLAB_TOKENS = 8, dict(forward=1 << 18, backward=1 << 17), None


@dataclasses.dataclass(frozen=True)
class ChunkTables:
    """Where the sequences and chunks of a flat ``[TT, H, *]`` batch lie (int32 tensors on the inputs' device; TT is
    below 2^31, ``kda_chunk.check_triton_inputs``)."""

    cu: torch.Tensor  # [N+1] first token of each sequence, and TT
    coff: torch.Tensor  # [N+1] first chunk of each sequence, and NC
    cstart: torch.Tensor  # [NC] first token of each chunk
    cend: torch.Tensor  # [NC] one past the last token of each chunk
    num_chunks: int  # NC

    @property
    def num_seqs(self):
        return self.cu.numel() - 1


def chunk_tables(B, T, cu_seqlens, device):
    """The tables of B sequences of T tokens, or of the documents of ``cu_seqlens`` (checked to run non-decreasing
    from 0 to T). Fixed-length batches reuse cached tables (a dozen small launches less per call); the tables of the
    last ``cu_seqlens`` tensors are kept by tensor, so the layers of one forward read its boundaries from the device
    once, not once per layer."""
    if cu_seqlens is None:
        return fixed_chunk_tables(B, T, device)
    key = (id(cu_seqlens), cu_seqlens._version, T, device)
    hit = _VARLEN_TABLES.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1]
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if cu[0] != 0 or cu[-1] != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {cu.tolist()}")
    tables = _tables_from_cu(cu, None, device)
    if len(_VARLEN_TABLES) >= 8:
        _VARLEN_TABLES.pop(next(iter(_VARLEN_TABLES)))
    _VARLEN_TABLES[key] = (weakref.ref(cu_seqlens), tables)
    return tables


_VARLEN_TABLES = {}  # (id, version, T, device) of a cu_seqlens tensor -> (weak reference to it, its ChunkTables)


@functools.lru_cache(maxsize=16)
def fixed_chunk_tables(B, T, device):
    return _tables_from_cu(torch.arange(0, B + 1, device=device, dtype=torch.int64) * T, B * triton.cdiv(T, CHUNK_SIZE),
                           device)


def _tables_from_cu(cu, num_chunks, device):
    """The tables of int64 ``cu`` (on the host, or on ``device`` with ``num_chunks`` given), built where ``cu`` is
    and sent to ``device`` without waiting for the copy."""
    lens = cu[1:] - cu[:-1]
    nt = (lens + CHUNK_SIZE - 1) // CHUNK_SIZE
    coff = torch.cat([nt.new_zeros(1), nt.cumsum(0)])
    NC = int(coff[-1]) if num_chunks is None else num_chunks
    seq = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), nt, output_size=NC)
    idx = torch.arange(NC, device=cu.device) - coff[seq]
    cstart = cu[seq] + idx * CHUNK_SIZE
    cend = torch.minimum(cstart + CHUNK_SIZE, cu[seq + 1])
    def put(x):
        x = x.to(torch.int32)
        if x.device.type == "cpu" and device.type == "cuda":  # a pinned copy: the host does not wait for it
            x = x.pin_memory()
        return x.to(device, non_blocking=True)

    return ChunkTables(put(cu), put(coff), put(cstart), put(cend), NC)


def _pow2(n):
    return max(32, triton.next_power_of_2(n))  # 16-wide fp32 tiles hit a shared-memory fault in triton 3.6


def launch_cfg(K, V):
    """``(BK, BV_full, BV)``: the head dim and V as whole power-of-2 tiles, and the V block of the chunk loops (32
    wide: more programs for the sequential loop)."""
    BK, BVf = _pow2(K), _pow2(V)
    return BK, BVf, min(BVf, 32)


def lp(x):
    """Whether the kernels take their GPU-only paths: dots with 16-bit operands on 16-bit tensor cores (`LP`), exps
    as inline asm (`FTZ`). The CPU interpreter widens those dots to fp32 (its bf16 dot multiplies raw bits in triton
    3.9) and runs no inline asm."""
    return x.is_cuda


def lps(x):
    """Whether the backward's dots round operands that are not stored in 16 bits (dS, dU, U, dW) to bf16 too (the
    kernels' `LPS`): on a GPU with bf16 inputs only, as fp16 would flush small gradients."""
    return lp(x) and x.dtype == torch.bfloat16


def few_loop_programs(BV, N, H, V, device):
    """Whether a chunk loop over (V/BV blocks, N sequences, H heads) leaves SMs of a GPU idle (few long sequences)."""
    if device.type != "cuda":
        return False
    return triton.cdiv(V, BV) * N * H < torch.cuda.get_device_properties(device).multi_processor_count


def fwd_loop_bv(BV, N, H, V, wide, device):
    """V block of the forward chunk loop: 16 when BV-wide blocks leave SMs idle (twice the programs, each with half
    the work per chunk; 16 is only the N dimension of its dots), else 64 when ``wide`` (the 3-stage loop), else BV."""
    if few_loop_programs(BV, N, H, V, device):
        return 16
    return min(_pow2(V), 64) if wide else BV


def slab_ranges(B, T, H, device, min_token_heads):
    """Token ranges ``(s0, s1)`` of a single sequence's forward and backward in slabs, or None (one pass). The chunk
    loop of one sequence is latency-bound (a few programs per head); in slabs, the loop of one slab runs on a second
    stream beside the parallel kernels of the next slab (forward) or of the one after it (backward). Same kernels,
    same arithmetic: the results are bit-identical to one pass. About SLABS slabs of at least ``min_token_heads``
    token-heads; SLAB_TOKENS forces the length. Batches of several sequences run in one pass: in slabs of whole
    sequences their loops would run one sequence at a time."""
    if B != 1 or T == 0:
        return None
    if SLAB_TOKENS is not None:
        L = SLAB_TOKENS
    elif device.type == "cuda":
        L = triton.cdiv(max(triton.cdiv(min_token_heads, H), triton.cdiv(T, SLABS)), CHUNK_SIZE) * CHUNK_SIZE
    else:
        return None
    return [(s0, min(s0 + L, T)) for s0 in range(0, T, L)] if T > L else None


@functools.lru_cache(maxsize=None)
def loop_stream(device):
    """The stream of the slabbed chunk loops (forward and reverse), at high priority: the loops are the critical
    path, the parallel kernels fill the SMs around them."""
    return torch.cuda.Stream(device, priority=-1)


def run_pipeline(device, slabs, order, before, loop, after, wait_each):
    """Slab j of ``slabs`` (in ``order``): ``before`` on the current stream, ``loop`` on ``loop_stream`` once the
    current stream's work so far is done (with ``wait_each`` False only for the first slab: the loops then need
    nothing the current stream does later), and ``after`` on the current stream once that loop is done and the
    next slab's loop is enqueued. Each is called with (j, tables, token rows, chunks); None skips ``before``. On
    the CPU (the interpreter) all in order on the one stream."""
    cuda = device.type == "cuda"
    main, side = (torch.cuda.current_stream(device), loop_stream(device)) if cuda else (None, None)

    def finish(done, args):
        if done is not None:
            main.wait_event(done)
        after(*args)

    pending = None
    for j in order:
        s0, s1 = slabs[j]
        args = (j, fixed_chunk_tables(1, s1 - s0, device), slice(s0, s1),
                slice(s0 // CHUNK_SIZE, triton.cdiv(s1, CHUNK_SIZE)))
        if before is not None:
            before(*args)
        if cuda and (wait_each or pending is None):
            side.wait_stream(main)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            loop(*args)
            done = side.record_event() if cuda else None
        if pending is not None:
            finish(*pending)
        pending = (done, args)
    finish(*pending)
    if cuda:
        main.wait_stream(side)

"""Triton kernel of the chunked linear cross-entropy (``loss.py``): a chunk's logits turned into per-row losses and,
in place, into the gradient of the loss w.r.t. those logits.

Per row of V logits ``x`` (in the dtype the projection's GEMM wrote them): ``lse = log Σ_v e^{x_v}`` (a running
max and sum per lane over ``BLOCK_V``-wide tiles, fp32), ``loss = lse − x_target``; then, with ``GRAD``, in place
``x_v ← (e^{x_v − lse} − [v = target]) · scale`` with the row's scale (1/count for the mean, 0 for rows that do not
count, NaN for a batch with a bad label). The row is read twice and written once in its own dtype; the torch code
makes about six fp32 passes over the chunk. One program per row (a chunk holds about 2^26 logits: 2,000 rows of a
32K vocab, several waves of the SMs); the row offset is int64.

Launch: ``BLOCK_V`` 4096 values at 16 per thread (8 warps), or the next power of 2 of a smaller vocab: the running
max and sum take 32 fp32 registers per thread.
"""

import torch

from .fused_norm import triton

if triton is not None:
    import triton.language as tl

BLOCK_V = 4096  # logits per tile of a row
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if triton is not None:

    @triton.jit
    def _cross_entropy_kernel(X, TARGET, SCALE, LOSS, V, stride, GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
        """Row ``pid``: its loss into LOSS; with GRAD the gradient over the row's logits, in place."""
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride
        cols = tl.arange(0, BLOCK_V)
        m = tl.full([BLOCK_V], -1e30, tl.float32)  # finite: a masked lane (-inf) then adds exp(-inf) = 0
        s = tl.zeros([BLOCK_V], tl.float32)
        for start in range(0, V, BLOCK_V):
            x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
        target = tl.load(TARGET + row)
        tl.store(LOSS + row, lse - tl.load(x_row + target).to(tl.float32))
        if GRAD:
            scale = tl.load(SCALE + row)
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                g = (tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)) * scale
                tl.store(x_row + start + cols, g.to(X.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits, target, scale=None):
    """Per-row ``logsumexp(logits) − logits[target]`` (``[C]`` fp32) of ``logits [C, V]`` (row stride free, unit
    column stride) and in-range ``target [C]``; with ``scale [C]`` fp32 the logits are overwritten by
    ``(softmax − onehot(target)) · scale``, in their dtype."""
    C, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the cross-entropy kernel needs logits with unit column stride")
    loss = torch.empty(C, dtype=torch.float32, device=logits.device)
    if C:
        block_v = min(BLOCK_V, triton.next_power_of_2(V))
        _cross_entropy_kernel[(C,)](logits, target.contiguous(), loss if scale is None else scale.contiguous(), loss,
                                    V, logits.stride(0), GRAD=scale is not None, BLOCK_V=block_v,
                                    num_warps=max(1, min(8, block_v // 512)))
    return loss

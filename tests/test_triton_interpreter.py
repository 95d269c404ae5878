"""The test harness's vectorised ``tl.reduce`` under the interpreter (``triton_interpreter._tree_reduce``) against
numpy: a tuple of two reductions with a combine function of the kernel's own, along each axis, with and without
``keep_dims``, over the whole block."""

import pytest
import torch

from triton_interpreter import DEV, kernel_test, tl

if tl is not None:
    import triton

    @triton.jit
    def _sum_max(a0, a1, b0, b1):
        return a0 + b0, tl.maximum(a1, b1)

    @triton.jit
    def _reduce_kernel(X, SUM, MAX, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr, KEEP: tl.constexpr):
        x = tl.load(X + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :])
        if AXIS == 0:
            s, m = tl.reduce((x, -x), 0, _sum_max, keep_dims=KEEP)
            offs = tl.arange(0, C)[None, :] if KEEP else tl.arange(0, C)
        elif AXIS == 1:
            s, m = tl.reduce((x, -x), 1, _sum_max, keep_dims=KEEP)
            offs = tl.arange(0, R)[:, None] if KEEP else tl.arange(0, R)
        else:
            s, m = tl.reduce((x, -x), None, _sum_max)
            offs = 0
        tl.store(SUM + offs, s)
        tl.store(MAX + offs, m)


@kernel_test
@pytest.mark.parametrize("axis,keep", [(0, False), (0, True), (1, False), (1, True), (None, False)])
def test_tuple_reduce_matches_numpy(axis, keep):
    x = torch.randn(8, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(DEV)
    n = {0: 32, 1: 8, None: 1}[axis]
    out_sum, out_max = torch.empty(n, dtype=x.dtype, device=DEV), torch.empty(n, dtype=x.dtype, device=DEV)
    _reduce_kernel[(1,)](x, out_sum, out_max, R=8, C=32, AXIS=-1 if axis is None else axis, KEEP=keep)
    ref_sum = x.sum() if axis is None else x.sum(axis)
    ref_max = (-x).max() if axis is None else (-x).amax(axis)
    torch.testing.assert_close(out_sum, ref_sum.reshape(n), rtol=1e-12, atol=1e-12)
    assert torch.equal(out_max, ref_max.reshape(n))

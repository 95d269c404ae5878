"""The Quantile Balancing kernels (``moe_balancing_triton.py``) against the torch path they replace, bit for bit:
the histogram counts of the selection thresholds, the quantile and refined range read from counts, and
``balanced_bias`` as a whole. Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (rerun in a fresh process
when triton was imported first); a compile test checks the sm_90 build the interpreter does not."""

import pytest
import torch

from triton_interpreter import DEV, check_compiles_for_sm90, kernel_test, rerun_in_interpreter, rerun_test

from kdamoe.model import moe  # noqa: E402
from kdamoe.model.moe import QuantileHistogram, balanced_bias, selection_thresholds  # noqa: E402

try:
    from kdamoe.model.moe_balancing_triton import histogram_quantile, threshold_histogram
except ImportError:
    histogram_quantile = threshold_histogram = None

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


def routed_scores(L, N, E, seed, ties=False):
    """fp32 sigmoid scores of `L` layers with skewed experts; `ties` rounds them so that many values coincide
    (equal scores + bias at the cutoff)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.linspace(-2.0, 1.0, E)
    scores = torch.sigmoid(mu + 0.7 * torch.randn(L, N, E, generator=g))
    return (scores * 16).round() / 16 if ties else scores


def torch_counts(scores, bias, k, low, high, bins, mask):
    hist = QuantileHistogram(low.numel(), bins, low, high)
    hist.add(selection_thresholds(scores, bias, k), mask)
    return hist


CASES = [  # L, N, E, k, bins, mask, ties
    (1, 37, 16, 2, 50, None, False),  # a partial token block, E a power of two
    (3, 70, 12, 3, 40, "layer", False),  # E below its block (masked expert lanes), a mask per layer
    (2, 64, 8, 1, 30, "token", True),  # ties at the cutoff, one mask for every layer
    (2, 33, 6, 5, 20, None, True),  # k = E - 1
]


@kernel_test
@pytest.mark.parametrize("L,N,E,k,bins,mask,ties", CASES)
def test_threshold_histogram_and_quantile_match_torch(L, N, E, k, bins, mask, ties):
    scores = routed_scores(L, N, E, seed=L * N + E, ties=ties)
    g = torch.Generator().manual_seed(1)
    bias = 0.3 * torch.randn(L, E, generator=g, dtype=torch.float64)
    token_mask = {None: None, "layer": torch.rand(L, N, generator=g) > 0.3,
                  "token": torch.rand(N, generator=g) > 0.3}[mask]
    q = k / E
    low = (bias.amin(-1, keepdim=True) - 1.0).expand_as(bias).reshape(-1)
    high = (bias.amax(-1, keepdim=True) + 1.0).expand_as(bias).reshape(-1)
    coarse = torch_counts(scores, bias, k, low, high, bins, token_mask)
    fine = coarse.refine(q)
    fine.add(selection_thresholds(scores, bias, k), token_mask)
    assert (fine.counts[:, 0] > 0).any() and (fine.counts[:, -1] > 0).any()  # values clamped into the end bins

    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    scores, bias, token_mask, qt = dev(scores), dev(bias), dev(token_mask), torch.tensor(q, dtype=torch.float64,
                                                                                           device=DEV)
    counts = torch.zeros(L * E, bins, dtype=torch.int64, device=DEV)
    range_low, range_width = torch.empty(2, L * E, dtype=torch.float64, device=DEV)
    # the coarse histogram over each layer's [min(bias) - 1, max(bias) + 1], then its quantile and refined range
    assert torch.equal(threshold_histogram(scores, bias, k, counts, token_mask=token_mask).cpu(), coarse.counts)
    quantile = histogram_quantile(counts, bias, qt, range_low, range_width, coarse=True)
    assert torch.equal(quantile.cpu(), coarse.quantile(q)) and not counts.any()  # read, then zeroed
    assert torch.equal(range_low.cpu(), fine.low) and torch.equal(range_width.cpu(), fine.width)
    # the fine histogram inside the bin found
    threshold_histogram(scores, bias, k, counts, range_low, range_width, token_mask)
    assert torch.equal(counts.cpu(), fine.counts)
    quantile = histogram_quantile(counts, bias, qt, range_low, range_width, coarse=False)
    assert torch.equal(quantile.cpu(), fine.quantile(q))
    refined = fine.refine(q)
    assert torch.equal(range_low.cpu(), refined.low) and torch.equal(range_width.cpu(), refined.width)


@kernel_test
def test_histogram_quantile_of_empty_and_piled_up_columns():
    counts = torch.zeros(4, 10, dtype=torch.int64)
    counts[1, 3] = 7  # everything in one bin
    counts[2, 0], counts[2, 9] = 5, 5  # split between the end bins
    counts[3] = torch.arange(10)
    low = torch.tensor([-1.0, 0.0, 0.5, -3.0], dtype=torch.float64)
    high = low + torch.tensor([2.0, 1.0, 0.25, 6.0], dtype=torch.float64)
    hist = QuantileHistogram(4, 10, low, high)
    hist.counts = counts
    unused_bias = torch.zeros(1, 4, dtype=torch.float64, device=DEV)
    for q in (0.0, 2 / 6, 0.5, 1.0):
        range_low, range_width = hist.low.to(DEV, copy=True), hist.width.to(DEV, copy=True)  # overwritten
        quantile = histogram_quantile(counts.to(DEV), unused_bias, torch.tensor(q, dtype=torch.float64, device=DEV),
                                      range_low, range_width, coarse=False)
        assert torch.equal(quantile.cpu(), hist.quantile(q)), q
        refined = hist.refine(q)
        assert torch.equal(range_low.cpu(), refined.low) and torch.equal(range_width.cpu(), refined.width), q


@kernel_test
@pytest.mark.parametrize("mask", [None, "layer", "token", "one row"])
def test_balanced_bias_with_the_kernels_equals_the_torch_path(monkeypatch, mask):
    L, N, E, k = 3, 96, 16, 2
    scores = routed_scores(L, N, E, seed=5)
    g = torch.Generator().manual_seed(2)
    bias = 0.1 * torch.randn(L, E, generator=g, dtype=torch.float64)
    token_mask = {None: None, "layer": torch.rand(L, N, generator=g) > 0.2, "token": torch.rand(N, generator=g) > 0.2,
                  "one row": torch.rand(1, N, generator=g) > 0.2}[mask]  # [1, N]: every layer's
    scores, bias = scores.to(DEV), bias.to(DEV)
    token_mask = None if token_mask is None else token_mask.to(DEV)

    def run(fused):  # the torch path on the same device as the kernels (CPU and CUDA reductions round apart)
        monkeypatch.setattr(moe, "_use_balancing_kernels", lambda scores, num_bins: fused)
        reduced = []
        new = balanced_bias(scores, bias, k, 3, 40, token_mask, reduce=lambda c: reduced.append(c.clone()))
        single = balanced_bias(scores[1], bias[1], k, 3, 40)  # one problem ([N, E], no layer dim)
        return new, reduced, single

    expected, reduced, single = run(False)
    got, fused_reduced, fused_single = run(True)
    assert torch.equal(got, expected) and torch.equal(fused_single, single)
    assert len(fused_reduced) == len(reduced) == 6  # two histograms an iteration, each reduced once
    assert all(torch.equal(a, b) for a, b in zip(fused_reduced, reduced))


def test_balancing_kernels_only_for_fp32_scores_on_a_gpu():
    scores = torch.rand(2, 8, 16)
    assert not moe._use_balancing_kernels(scores, 1000)  # on the CPU: the torch path
    if torch.cuda.is_available() and threshold_histogram is not None:
        assert moe._use_balancing_kernels(scores.cuda(), 1000)
        assert not moe._use_balancing_kernels(scores.cuda().double(), 1000)  # the float64 oracle stays in torch
        assert not moe._use_balancing_kernels(scores.cuda(), 1)


BALANCE_SM90_LAUNCHES = r"""
from kdamoe.model import moe_balancing_triton as mbt

kernel = mbt.{kernel}
mbt.{kernel} = Record()
L, N, E = 6, 4096, 64
scores = torch.rand(L, N, E)
bias = torch.zeros(L, E, dtype=torch.float64)
low = torch.full((L * E,), -1.0, dtype=torch.float64)
width = torch.full((L * E,), 2e-3, dtype=torch.float64)
counts = torch.zeros(L * E, 1000, dtype=torch.int64)
q = torch.tensor(4 / 64, dtype=torch.float64)
if kernel.fn.__name__ == "_threshold_histogram_kernel":
    mbt.threshold_histogram(scores, bias, 4, counts, token_mask=torch.ones(L, N, dtype=torch.bool))
    mbt.threshold_histogram(scores[:, :, :48].contiguous(), bias[:, :48], 8, counts[: L * 48], low[: L * 48],
                            width[: L * 48])
else:
    mbt.histogram_quantile(counts, bias, q, low, width, coarse=True)
    mbt.histogram_quantile(counts[:, :300].contiguous(), bias, q, low, width, coarse=False)
"""


def test_balancing_kernels_compile_for_sm90():
    """Both kernels compile to cubins for an H100/H200 (sm_90) at the launches of the model's shapes (fp64 binning,
    int64 atomics, a cumulative sum over the bins), which the interpreter does not check."""
    check_compiles_for_sm90(BALANCE_SM90_LAUNCHES, expected=2,
                            kernels=("_threshold_histogram_kernel", "_histogram_quantile_kernel"))

"""Triton kernels of the Quantile Balancing update (`moe.balanced_bias`); imported only when triton is there.

One iteration of the update reads two histograms of every expert's selection thresholds `r [L, N, E]` (coarse, then
inside the bin that holds the quantile). In torch that is ~90 launches over `[L, N, E]` float64 values an iteration
and a `scatter_add_` whose values pile into a column's end bins; here it is two kernels a histogram, and no torch op
between them:

- `threshold_histogram`: each program takes a block of tokens of one layer, computes their thresholds in registers
  from the fp32 scores (`moe.selection_thresholds`: the k-th and (k+1)-th largest `scores + bias` of a token, found by
  k+1 rounds of max-and-remove-one, so ties count as `torch.topk` counts them) and adds their bins to the int64 counts
  (`QuantileHistogram.add`: the same float64 operations); the first and last bins, where everything outside a refined
  range lands, are summed in the program before one atomic add a column. Without a range it bins over the coarse
  range `[min(bias) - 1, max(bias) + 1]` of the token's layer.
- `histogram_quantile`: one program a column reads the quantile and the bin that holds it from the counts
  (`QuantileHistogram.quantile` / `refine`: the same float64 operations, compiled without FMA contraction), writes
  the quantile and the refined range (its low edge and bin width), and zeroes the column's counts for the next
  histogram.

Counts are integers and their float64 sums exact, so both equal the torch path bit for bit
(tests/test_balancing_triton.py).
"""

import torch

try:  # inside try so that transformers' remote-code import check does not demand triton; moe.py catches this
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError("the fused Quantile Balancing kernels need triton") from error


@triton.jit
def _reciprocal(NUM_BINS: tl.constexpr):
    """`1.0 / NUM_BINS` in float64 (a Python float constant would be fp32): bin widths are a difference times it, as
    `QuantileHistogram` computes them."""
    return tl.full([], 1.0, tl.float64) / NUM_BINS


@triton.jit
def _coarse_range(bias_ptr, layer, E, NUM_BINS: tl.constexpr, BE: tl.constexpr):
    """`QuantileHistogram`'s coarse range of a layer: low = min(bias) - 1, and the bin width up to max(bias) + 1."""
    cols = tl.arange(0, BE)
    bias = tl.load(bias_ptr + layer * E + cols, mask=cols < E, other=0.0)
    low = tl.min(tl.where(cols < E, bias, float("inf")), axis=0) - 1.0
    high = tl.max(tl.where(cols < E, bias, float("-inf")), axis=0) + 1.0
    return low, (high - low) * _reciprocal(NUM_BINS)


@triton.jit
def _threshold_histogram_kernel(s_ptr, bias_ptr, low_ptr, width_ptr, mask_ptr, counts_ptr, N, E, mask_stride,
                                TOP_K: tl.constexpr, NUM_BINS: tl.constexpr, HAS_MASK: tl.constexpr,
                                COARSE: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BE)
    row_ok = rows < N
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    s = tl.load(s_ptr + (layer * N + rows[:, None].to(tl.int64)) * E + cols[None, :], mask=ok, other=0.0)
    bias = tl.load(bias_ptr + layer * E + cols, mask=col_ok, other=0.0).to(tl.float32)
    x = s + bias[None, :]
    work = tl.where(col_ok[None, :], x, float("-inf"))
    kth = tl.zeros([BT], dtype=tl.float32)
    for i in tl.static_range(TOP_K + 1):  # the i-th largest, each removed once (duplicates count as in topk)
        top = tl.max(work, axis=1)
        if i == TOP_K - 1:
            kth = top
        first = tl.min(tl.where(work == top[:, None], cols[None, :], BE), axis=1)
        work = tl.where(cols[None, :] == first[:, None], float("-inf"), work)
    # `top` is now the (k+1)-th largest: an expert above it is picked, and the k-th largest of the others is `top`
    r = tl.where(x > top[:, None], top[:, None], kth[:, None]) - s

    column = layer * E + cols
    if COARSE:
        low, width = _coarse_range(bias_ptr, layer, E, NUM_BINS, BE)
        position = tl.floor((r.to(tl.float64) - low) / width)
    else:
        low = tl.load(low_ptr + column, mask=col_ok, other=0.0)
        width = tl.load(width_ptr + column, mask=col_ok, other=1.0)
        position = tl.floor((r.to(tl.float64) - low[None, :]) / width[None, :])
    bins = tl.minimum(tl.maximum(position, 0.0), NUM_BINS - 1).to(tl.int64)
    if HAS_MASK:
        weight = tl.load(mask_ptr + layer * mask_stride + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        weight = row_ok.to(tl.int64)
    weight = tl.where(ok, weight[:, None], 0)
    first_bin = tl.sum(tl.where(bins == 0, weight, 0), axis=0)
    last_bin = tl.sum(tl.where(bins == NUM_BINS - 1, weight, 0), axis=0)
    inner = (weight > 0) & (bins > 0) & (bins < NUM_BINS - 1)
    base = counts_ptr + column * NUM_BINS
    tl.atomic_add(base[None, :] + bins, weight, mask=inner, sem="relaxed")
    tl.atomic_add(base, first_bin, mask=col_ok & (first_bin > 0), sem="relaxed")
    tl.atomic_add(base + NUM_BINS - 1, last_bin, mask=col_ok & (last_bin > 0), sem="relaxed")


@triton.jit
def _histogram_quantile_kernel(counts_ptr, bias_ptr, low_ptr, width_ptr, q_ptr, quantile_ptr, E,
                               NUM_BINS: tl.constexpr, COARSE: tl.constexpr, BLOCK: tl.constexpr, BE: tl.constexpr):
    column = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    in_range = index < NUM_BINS
    counts = tl.load(counts_ptr + column * NUM_BINS + index, mask=in_range, other=0).to(tl.float64)
    tl.store(counts_ptr + column * NUM_BINS + index, tl.zeros([BLOCK], dtype=tl.int64), mask=in_range)
    cum = tl.cumsum(counts, axis=0)
    total = tl.sum(tl.where(index == NUM_BINS - 1, cum, 0.0), axis=0)
    target = tl.load(q_ptr) * total
    b = tl.min(tl.where((cum >= target) & in_range, index, NUM_BINS - 1), axis=0)
    below = tl.sum(tl.where(index == b - 1, cum, 0.0), axis=0)
    inside = tl.sum(tl.where(index == b, counts, 0.0), axis=0)
    frac = tl.where(inside > 0, (target - below) / tl.maximum(inside, 1.0), 0.0)
    if COARSE:
        low, width = _coarse_range(bias_ptr, column // E, E, NUM_BINS, BE)
    else:
        low = tl.load(low_ptr + column)
        width = tl.load(width_ptr + column)
    tl.store(quantile_ptr + column, low + (b.to(tl.float64) + frac) * width)
    edge = low + b.to(tl.float64) * width
    tl.store(low_ptr + column, edge)  # the refined range, for the next histogram
    tl.store(width_ptr + column, (low + (b + 1).to(tl.float64) * width - edge) * _reciprocal(NUM_BINS))


def threshold_histogram(scores: torch.Tensor, bias: torch.Tensor, top_k: int, counts: torch.Tensor,
                        low: torch.Tensor | None = None, width: torch.Tensor | None = None,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Add `selection_thresholds(scores, bias, top_k)` to the int64 `counts [L * E, B]`, binned as
    `QuantileHistogram(L * E, B, low, low + B * width).add(r, token_mask)` bins them; without `low` and `width`
    (`[L * E]` float64) over each layer's coarse range `[min(bias) - 1, max(bias) + 1]`. `scores [L, N, E]` fp32
    contiguous, `bias [L, E]` float64, `token_mask` bool `[L, N]` or `[N]`. Returns `counts`."""
    L, N, E = scores.shape
    BE = triton.next_power_of_2(E)
    BT = max(1, 1024 // BE)
    coarse = low is None
    bias = bias.contiguous()
    mask_stride = 0 if token_mask is None or token_mask.dim() == 1 else token_mask.stride(0)
    mask = scores if token_mask is None else token_mask.contiguous().view(torch.uint8)  # unused without a mask
    _threshold_histogram_kernel[(triton.cdiv(N, BT), L)](
        scores, bias, bias if coarse else low, bias if coarse else width, mask, counts, N, E, mask_stride,
        TOP_K=top_k, NUM_BINS=counts.shape[1], HAS_MASK=token_mask is not None, COARSE=coarse, BT=BT, BE=BE,
        num_warps=4)
    return counts


def histogram_quantile(counts: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, low: torch.Tensor,
                       width: torch.Tensor, coarse: bool) -> torch.Tensor:
    """Per column of `counts [C, B]`: the q-quantile `[C]` float64 as `QuantileHistogram.quantile(q)` reads it, with
    the column's range in `low`, `width [C]` (float64), or with `coarse` each layer's coarse range of `bias [L, E]`.
    `low` and `width` are then overwritten with the range `QuantileHistogram.refine(q)` gives, and `counts` zeroed.
    `q`: a 0-d float64 tensor (a Python float would arrive as fp32)."""
    C, num_bins = counts.shape
    quantile = torch.empty(C, dtype=torch.float64, device=counts.device)
    bias = bias.contiguous()
    _histogram_quantile_kernel[(C,)](counts, bias, low, width, q, quantile, bias.shape[-1], NUM_BINS=num_bins,
                                     COARSE=coarse, BLOCK=triton.next_power_of_2(num_bins),
                                     BE=triton.next_power_of_2(bias.shape[-1]), num_warps=4, enable_fp_fusion=False)
    return quantile

"""A decode step's softmax attention over a long KV cache, split over the key length (imported only when triton is
there).

One new token per row attends to the L cached keys of its KV head group. PyTorch's SDPA kernels parallelise a call
over (row, head, query block): with one query that is a handful of programs, each streaming its head's whole cache,
so a step over a 1M-token cache reads it at a small fraction of the memory bandwidth. Here the key length is split
too: program (row · KV head, split) holds the G = Hq / Hkv queries of the group (GQA: the cache is read once for
all of them, no copy of the KV heads), walks its keys in blocks of ``BLOCK_N`` with an online softmax (scores and
statistics in fp32, the probabilities rounded to the values' dtype for their product, as flash attention does), and
writes its unnormalised output with its running max and sum; ``decode_attention`` then combines the splits. A key
the boolean mask hides (padding, positions a static cache has not written) gets no weight; a split with no visible
key contributes nothing.
"""

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK_N = 64  # keys a program takes per step
MIN_KEYS_PER_SPLIT = 512
PROGRAMS_PER_SM = 4  # the splits are sized so that the grid fills the GPU about this many times over
INTERPRETER_SMS = 2  # the CPU interpreter's stand-in for the number of SMs (several splits on small test shapes)


def supported(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes: `query [B, Hq, 1, D]`, `key [B, Hkv, L, D]` with Hkv dividing Hq, and a
    head dim the tensor cores take (a power of two from 16 to 256)."""
    D = query.shape[-1]
    return (triton is not None and query.dim() == 4 and query.shape[2] == 1 and query.shape[1] % key.shape[1] == 0
            and 16 <= D <= 256 and D & (D - 1) == 0)


if triton is not None:

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, stat_ptr, L, HKV, split_len, n_splits,
                      s_qb, s_qh, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_mb, scale,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, HAS_MASK: tl.constexpr,
                      IEEE: tl.constexpr):
        bh, split = tl.program_id(0), tl.program_id(1)
        b, h = bh // HKV, bh % HKV
        rg, rd = tl.arange(0, GP), tl.arange(0, D)
        q = tl.load(q_ptr + b.to(tl.int64) * s_qb + (h * G + rg)[:, None] * s_qh + rd[None, :],
                    mask=(rg < G)[:, None], other=0.0)  # [GP, D]
        k_base = k_ptr + b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh
        v_base = v_ptr + b.to(tl.int64) * s_vb + h.to(tl.int64) * s_vh
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, D), dtype=tl.float32)
        start = split * split_len
        end = tl.minimum(start + split_len, L)
        for n0 in range(start, end, BN):
            rn = n0 + tl.arange(0, BN)
            visible = rn < end
            if HAS_MASK:
                visible &= tl.load(mask_ptr + b.to(tl.int64) * s_mb + rn, mask=rn < end, other=0) != 0
            k = tl.load(k_base + rn.to(tl.int64)[:, None] * s_kl + rd[None, :], mask=visible[:, None], other=0.0)
            v = tl.load(v_base + rn.to(tl.int64)[:, None] * s_vl + rd[None, :], mask=visible[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(visible[None, :], s * scale, float("-inf"))  # [GP, BN] fp32
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key visible yet: every weight stays 0
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = (bh * n_splits + split).to(tl.int64) * GP + rg
        tl.store(acc_ptr + out[:, None] * D + rd[None, :], acc)
        tl.store(stat_ptr + out * 2, m)
        tl.store(stat_ptr + out * 2 + 1, l)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else INTERPRETER_SMS


def _split_len(L: int, groups: int, device: torch.device) -> int:
    """Keys per split: enough splits that ``groups`` (row · KV head) x splits programs fill the GPU
    ``PROGRAMS_PER_SM`` times, at least ``MIN_KEYS_PER_SPLIT`` keys each (whole blocks)."""
    splits = max(1, -(-PROGRAMS_PER_SM * _sm_count(device) // groups))
    per_split = max(-(-L // splits), MIN_KEYS_PER_SPLIT)
    return -(-per_split // BLOCK_N) * BLOCK_N


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """Softmax attention of one query per row over cached keys.

    Args:
        query: ``[B, Hq, 1, D]``; key, value: ``[B, Hkv, L, D]`` (any strides with a contiguous last dim).
        mask: None (every key visible) or boolean, broadcastable to ``[B, 1, 1, L]``, True = attend.
        scale: the scores' factor.

    Returns:
        ``[B, 1, Hq, D]`` in query's dtype (the layout of transformers' attention functions).
    """
    if not supported(query, key):
        raise ValueError(f"decode_attention takes query [B, Hq, 1, D] and key [B, Hkv, L, D] with Hkv dividing Hq "
                         f"and D a power of two in [16, 256], got {tuple(query.shape)} and {tuple(key.shape)}")
    B, Hq, _, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    G = Hq // Hkv
    GP = max(16, triton.next_power_of_2(G))
    q = query[:, :, 0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (key, value))
    if mask is not None:
        mask = mask.expand(B, 1, 1, L)[:, 0, 0]
        mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
    split_len = _split_len(L, B * Hkv, query.device)
    n_splits = max(1, -(-L // split_len))
    acc = torch.empty(B * Hkv, n_splits, GP, D, device=query.device, dtype=torch.float32)
    stats = torch.empty(B * Hkv, n_splits, GP, 2, device=query.device, dtype=torch.float32)
    _split_kernel[(B * Hkv, n_splits)](
        q, key, value, mask if mask is not None else q, acc, stats, L, Hkv, split_len, n_splits,
        q.stride(0), q.stride(1), *key.stride()[:3], *value.stride()[:3], mask.stride(0) if mask is not None else 0,
        float(scale), G=G, GP=GP, D=D, BN=BLOCK_N, HAS_MASK=mask is not None, IEEE=query.dtype == torch.float32,
        num_warps=4)
    m, l = stats[:, :, :G].unbind(-1)  # [B·Hkv, splits, G] each
    weight = torch.exp(m - m.amax(1, keepdim=True))  # a split with no visible key: m = -inf, weight 0
    out = (acc[:, :, :G] * weight[..., None]).sum(1) / (l * weight).sum(1)[..., None]  # [B·Hkv, G, D]
    return out.view(B, 1, Hq, D).to(query.dtype)

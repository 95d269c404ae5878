"""Sizes past 32-bit offsets: every kernel family on inputs whose flattened offsets pass 2^31 elements.

CPU: the size checks raise a ValueError that names the limit, before any launch (expanded views: no memory).
GPU (``gpu_only``, written for an H200): one test per kernel family at a size whose flattened offsets pass 2^31
elements, each compared with a torch reference on the rows at the end of the tensors (past 2^31), where an int32
offset would wrap: a wrong value or a device fault. Each test keeps its peak below ``MEMORY_LIMIT`` (checked). The
interpreter cannot reach these sizes, so they have no CPU twin.
"""

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import DEV, ON_GPU, gpu_only
from conftest import rel

from kdamoe.model import attnres, fused_norm, kda, moe, moe_triton, short_conv
from kdamoe.model.kda_chunk import MAX_TOKEN_HEADS, chunk_kda_triton
from kdamoe.model.kda_fused_recurrent import recurrent_kda_triton
from kdamoe.model.loss import linear_cross_entropy

PAST = 2**31  # elements: the first offset an int32 cannot hold
MEMORY_LIMIT = 60 << 30  # bytes of GPU memory a test may take at its peak
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _peak_memory():
    """On a GPU: each test's peak allocation stays below MEMORY_LIMIT; its memory is released after it."""
    if not ON_GPU:
        yield
        return
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    assert peak <= MEMORY_LIMIT, f"peak {peak / 2**30:.1f} GiB"


def randn(*shape, dtype=BF16, scale=1.0):
    return torch.randn(*shape, device=DEV, dtype=dtype).mul_(scale)  # in place: no second copy at the peak


# ------------------------------------------------------------------------------------------ size checks (CPU)
@pytest.mark.parametrize("op", [chunk_kda_triton, recurrent_kda_triton])
@pytest.mark.parametrize("B,T,H", [(1, MAX_TOKEN_HEADS // 4 + 1, 4), (3, MAX_TOKEN_HEADS // 48 + 1, 16)])
def test_kda_rejects_more_token_heads_than_its_int32_tables_hold(op, B, T, H):
    K = 16
    q = torch.zeros(1, 1, 1, K).expand(B, T, H, K)
    beta = torch.zeros(1, 1, 1).expand(B, T, H)
    with pytest.raises(ValueError, match=rf"at most {MAX_TOKEN_HEADS} tokens x heads .* B\*T\*H = {B}\*{T}\*{H}"):
        op(q, q, q, q, beta)


# ------------------------------------------------------------------------------------------ norms
@gpu_only
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_rms_norm_rows_past_2_31(gated):
    """RMSNorm and the gated RMSNorm over [2^31 / 4096 + 4096, 4096] bf16: the last rows' output and dx, and dw
    (a sum over every row), against the unfused torch expression."""
    D, L = 4096, 2048
    R = PAST // D + 4096
    x = randn(R, D).requires_grad_()
    w = (1.0 + randn(D, dtype=torch.float32, scale=0.1)).requires_grad_()
    gate = randn(R, D).requires_grad_() if gated else None
    dy = randn(R, D)
    if gated:
        y = fused_norm.gated_rms_norm(x, w, gate, backend="triton")
    else:
        y = fused_norm.rms_norm(x, w, backend="triton")
    y.backward(dy)

    def ref(x_, w_, g_):
        return fused_norm.gated_rms_norm_torch(x_, w_, g_, 1e-6) if gated else fused_norm.rms_norm_torch(x_, w_, 1e-6)

    w_ref = w.detach().clone().requires_grad_()
    for start in range(0, R, 1 << 16):  # dw over every row; the last chunk also gives the tail's dx and dgate
        rows = slice(start, min(start + (1 << 16), R))
        xs = x.detach()[rows].requires_grad_()
        gs = gate.detach()[rows].requires_grad_() if gated else None
        ys = ref(xs, w_ref, gs)
        ys.backward(dy[rows])
    assert rows.start >= PAST // D
    tail = slice(R - L, R)
    assert rel(y[tail], ys[-L:]) < 1e-2
    assert rel(x.grad[tail], xs.grad[-L:]) < 1e-2
    if gated:
        assert rel(gate.grad[tail], gs.grad[-L:]) < 1e-2
    assert rel(w.grad, w_ref.grad) < 5e-3  # the unfused gated path rounds dy · sigmoid(gate) to bf16


@gpu_only
def test_gpu_l2_norm_strided_rows_past_2_31():
    """The q/k L2 norm reading a [T, H, D] slice of a [T, 2 H D] conv output in place (source offsets past 2^31),
    writing a contiguous [T, H, D] output of more than 2^31 values; the last rows and their dx against torch."""
    H, D, L = 16, 128, 2048
    T = PAST // (H * D) + 8192
    base = randn(T, 2 * H * D)
    x = base[:, H * D:].view(T, H, D).requires_grad_()
    y = fused_norm.l2norm(x, backend="triton")
    dy = randn(T, H, D)
    y.backward(dy)
    xs = x.detach()[-L:].requires_grad_()
    ys = fused_norm.l2norm_torch(xs)
    ys.backward(dy[-L:])
    assert rel(y[-L:], ys) < 1e-2 and rel(x.grad[-L:], xs.grad) < 1e-2


# ------------------------------------------------------------------------------------------ short convolution
@gpu_only
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_short_conv_one_million_tokens_by_4096_channels(varlen):
    """The conv + SiLU over 2^20 tokens x 4096 channels (2^32 values), plain or with a last document starting
    past 2^31: the last tokens' output and dx, dweight (a sum over every token) and the decode state gathered
    from the last tokens, against torch."""
    T, C, W, L = 1 << 20, 4096, 4, 3000
    x = randn(1, T, C).requires_grad_()
    weight = randn(C, W, scale=0.5).requires_grad_()
    cu = torch.tensor([0, T - L, T], device=DEV, dtype=torch.int32) if varlen else None
    y = short_conv.short_conv_silu(x, weight, cu_seqlens=cu, backend="triton")
    dy = randn(1, T, C)
    y.backward(dy)

    w_ref = weight.detach().float().requires_grad_()
    starts = [*range(0, T - L, 1 << 16), T - L]
    for a, b in zip(starts, [*starts[1:], T]):  # each chunk with the W - 1 tokens before it as its context
        xs = x.detach()[:, a:b].requires_grad_()
        fresh = a == 0 or (varlen and a == T - L)
        context = None if fresh else x.detach()[:, a - W + 1 : a]
        ys = short_conv.short_conv_silu_torch(xs, w_ref, context=context)
        ys.backward(dy[:, a:b].float())
    assert (T - L) * C >= PAST
    assert rel(y[:, T - L :], ys) < 1e-2
    assert rel(x.grad[:, T - L :], xs.grad) < 1e-2
    assert rel(weight.grad, w_ref.grad) < 1e-2
    state = short_conv.short_conv_state(x.detach(), W, cu_seqlens=cu, backend="triton")
    assert torch.equal(state, short_conv.short_conv_state_torch(x.detach()[:, -W:], W))


# ------------------------------------------------------------------------------------------ depth attention
@gpu_only
def test_gpu_depth_attention_rows_past_2_31():
    """Block AttnRes' depth attention over 3 sources of [1, 2^31 / 2048 + 16384, 2048] bf16: the last rows' output
    and source gradients, and the query's and key-norm's gradients (sums over every row), against the torch path."""
    D, S, L = 2048, 3, 2048
    T = PAST // D + 16384
    depth = attnres.DepthAttention(D).to(DEV)
    ref = attnres.DepthAttention(D).to(DEV)
    with torch.no_grad():
        for module in (depth, ref):
            module.query.copy_(torch.linspace(-0.05, 0.05, D))
            module.key_norm_weight.copy_(torch.linspace(0.5, 1.5, D))
    sources = [randn(1, T, D, scale=s + 1.0).requires_grad_() for s in range(S)]
    out = depth(sources, backend="triton")
    dout = randn(1, T, D)
    out.backward(dout)
    for start in range(0, T, 1 << 16):
        rows = slice(start, min(start + (1 << 16), T))
        chunk = [v.detach()[:, rows].requires_grad_() for v in sources]
        out_ref = ref(chunk, backend="torch")
        out_ref.backward(dout[:, rows])
    assert rows.start * D >= PAST
    assert rel(out[:, -L:], out_ref[:, -L:]) < 1e-2
    for v, v_ref in zip(sources, chunk):
        assert rel(v.grad[:, -L:], v_ref.grad[:, -L:]) < 1e-2
    assert rel(depth.query.grad, ref.query.grad) < 1e-3
    assert rel(depth.key_norm_weight.grad, ref.key_norm_weight.grad) < 1e-3


# ------------------------------------------------------------------------------------------ MoE
@gpu_only
def test_gpu_moe_permute_and_combine_one_million_tokens_top_8():
    """The token permutation, combine and combine backward at 2^20 tokens x top-8 of 64 experts x 1024 (8M routed
    rows, 2^33 values), routed as the grouped path routes them; the rows and tokens whose data lie past 2^31
    against torch."""
    N, D, E, k, L = 1 << 20, 1024, 64, 8, 4096
    hidden = randn(N, D)
    top = torch.rand(N, E, device=DEV).topk(k, dim=-1).indices
    weights = torch.rand(N, k, device=DEV)
    order = torch.argsort(top.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=DEV)
    y = moe_triton.gather_rows_triton(hidden, order // k, torch.empty(N * k, D, device=DEV, dtype=BF16))
    assert torch.equal(y[-L:], hidden[order[-L:] // k])
    tokens = torch.cat([torch.arange(N - L, N, device=DEV), order[-L:] // k])  # the last tokens, the last rows'
    picked = y[inverse.view(N, k)[tokens]].float()  # [tokens, k, D]
    assert inverse.view(N, k)[tokens].max() * D >= PAST

    out = moe_triton.gather_sum_triton(y, inverse, weights, torch.empty(N, D, device=DEV, dtype=BF16))
    ref = torch.bmm(weights[tokens].unsqueeze(1), picked).squeeze(1)
    assert rel(out[tokens], ref) < 1e-2
    out = moe_triton.gather_sum_triton(y, inverse, None, out)
    assert rel(out[tokens], picked.sum(1)) < 1e-2

    grad_out = randn(N, D)
    grad_y = torch.empty_like(y)
    grad_w = torch.empty_like(weights)
    moe_triton.combine_bwd_triton(grad_out, y, weights, inverse, grad_y, grad_w)
    ref_dy = weights.reshape(-1)[order[-L:], None] * grad_out[order[-L:] // k].float()
    assert rel(grad_y[-L:], ref_dy) < 1e-2
    assert rel(grad_w[tokens], (picked * grad_out[tokens].float().unsqueeze(1)).sum(-1)) < 1e-4


@gpu_only
def test_gpu_situ_glu_eight_million_routed_rows():
    """SiTU-GLU forward and backward on a packed [8M, 2 x 384] bf16 projection (1M tokens x top-8; 6.4G values):
    the last rows against the torch formulas."""
    M, width, L = 8 << 20, 384, 4096
    gate_up = randn(M, 2 * width, scale=3.0)
    g, u = gate_up[:, :width], gate_up[:, width:]
    h = moe_triton.situ_glu_fwd_triton(g, u, torch.empty(M, width, device=DEV, dtype=BF16))
    assert rel(h[-L:], moe._situ_glu_forward(g[-L:], u[-L:])) < 1e-2
    dh = randn(M, width)
    grad = torch.empty_like(gate_up)
    moe_triton.situ_glu_bwd_triton(g, u, dh, grad[:, :width], grad[:, width:])
    ref_dg, ref_du = moe._situ_glu_backward(g[-L:].float(), u[-L:].float(), dh[-L:].float())
    assert (M - L) * width >= PAST
    assert rel(grad[-L:, :width], ref_dg) < 1e-2 and rel(grad[-L:, width:], ref_du) < 1e-2


# ------------------------------------------------------------------------------------------ chunked cross-entropy
@gpu_only
@pytest.mark.parametrize("chunk_rows", [None, PAST // 32768 + 1024])
def test_gpu_linear_cross_entropy_one_million_rows(chunk_rows):
    """The chunked linear cross-entropy over 2^20 rows x 4096 (hidden and its gradient: 2^32 values) and a 32K
    vocab, in the default chunks or in chunks of more than 2^31 logits: the loss against a reference chunked
    differently, the last rows' gradient against fp32 torch from the same bf16 logits."""
    N, D, V, L = 1 << 20, 4096, 32768, 256
    hidden = randn(N, D).requires_grad_()
    weight = randn(V, D, scale=D**-0.5).requires_grad_()
    labels = torch.randint(V, (N,), device=DEV)
    labels[-L // 2 :: 3] = -100
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_rows)
    loss.backward()
    count = (labels != -100).sum()
    with torch.no_grad():
        ref = sum(F.cross_entropy((hidden[a : a + 16384] @ weight.T).float(), labels[a : a + 16384],
                                  reduction="sum") for a in range(0, N, 16384)) / count
        logits = (hidden[-L:] @ weight.T).float()
        grad = (logits.softmax(-1) - F.one_hot(labels[-L:].clamp(min=0), V)) * (labels[-L:] != -100)[:, None]
        ref_grad = grad @ weight.float() / count
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item()
    assert rel(hidden.grad[-L:], ref_grad) < 2e-2
    assert torch.isfinite(weight.grad).all()


# ------------------------------------------------------------------------------------------ KDA
@gpu_only
def test_gpu_kda_forward_past_2_31():
    """The chunked forward (fused bounded gate) over 1.08M tokens x 16 heads x 128 (2.2G values a tensor) as two
    documents, the second starting past 2^31, and the decode kernel over the same tokens as documents of 8K: the
    second document's output and final state against the float64 torch reference."""
    H, K, L = 16, 128, 3000
    T = (1 << 20) + (1 << 15)
    q, k = randn(1, T, H, K, scale=K**-0.5), randn(1, T, H, K, scale=K**-0.5)
    v, g = randn(1, T, H, K), randn(1, T, H, K)
    beta = torch.rand(1, T, H, device=DEV, dtype=BF16)
    A_log, dt_bias = torch.linspace(-1.0, 1.0, H, device=DEV), torch.zeros(H * K, device=DEV)
    gate = {"use_gate_in_kernel": True, "A_log": A_log, "dt_bias": dt_bias, "gate": "bounded"}
    assert (T - L) * H * K >= PAST
    xs = [x[:, T - L :].double() for x in (q, k, v, g, beta)]
    ro, rht = kda.chunk_kda(*xs, output_final_state=True, use_gate_in_kernel=True, A_log=A_log.double(),
                            dt_bias=dt_bias.double(), gate="bounded", backend="torch")
    with torch.no_grad():
        cu = torch.tensor([0, T - L, T], device=DEV, dtype=torch.int32)
        o, ht = chunk_kda_triton(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, **gate)
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
        assert rel(o[:, T - L :], ro) < 5e-3 and rel(ht[1], rht[0]) < 5e-3
        del o, ht
        decay = torch.empty(g.shape, device=DEV)  # the decode kernel reads the log-decay: the gate in fp32, by parts
        for a in range(0, T, 1 << 16):
            decay[:, a : a + (1 << 16)] = kda.kda_gate(g[:, a : a + (1 << 16)], A_log, dt_bias)
        cu = torch.tensor([*range(0, T - L, 8192), T - L, T], device=DEV, dtype=torch.int32)
        o, ht = recurrent_kda_triton(q, k, v, decay, beta, output_final_state=True, cu_seqlens=cu)
        assert rel(o[:, T - L :], ro) < 5e-3 and rel(ht[-1], rht[0]) < 5e-3


@gpu_only
def test_gpu_kda_more_sequences_than_a_grid_axis_takes():
    """70,000 sequences of 3 tokens (CUDA takes 65,535 programs on grid axes 1 and 2): the chunk loops' forward
    and backward and the decode kernel, as a batch and as packed documents, against the float64 recurrence."""
    N, L, H, K = 70000, 3, 2, 32
    q = F.normalize(randn(N, L, H, K, dtype=torch.float32), dim=-1)
    k = F.normalize(randn(N, L, H, K, dtype=torch.float32), dim=-1)
    v = randn(N, L, H, K, dtype=torch.float32)
    g = -5.0 * torch.rand(N, L, H, K, device=DEV)
    beta = torch.rand(N, L, H, device=DEV)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    refs = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    ro, rht = kda.naive_recurrent_kda(*refs, output_final_state=True)
    o, ht = chunk_kda_triton(*leaves, output_final_state=True)
    assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3
    do = torch.randn_like(o)
    o.backward(do)
    ro.backward(do.double())
    for name, x, x_ref in zip(("q", "k", "v", "g", "beta"), leaves, refs):
        assert rel(x.grad, x_ref.grad) < 1e-2, name
    cu = torch.arange(N + 1, device=DEV, dtype=torch.int32) * L
    flat = [x.reshape(1, N * L, *x.shape[2:]) for x in (q, k, v, g, beta)]
    with torch.no_grad():
        for op, cu_seqlens in ((chunk_kda_triton, cu), (recurrent_kda_triton, None), (recurrent_kda_triton, cu)):
            xs = flat if cu_seqlens is not None else (q, k, v, g, beta)
            o, ht = op(*xs, output_final_state=True, cu_seqlens=cu_seqlens)
            assert rel(o.reshape(ro.shape), ro) < 5e-3 and rel(ht, rht) < 5e-3, op.__name__

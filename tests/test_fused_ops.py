"""Fused norms (``fused_norm.py``) and the short convolution (``short_conv.py``): every Triton kernel, forward and
backward, against float64 references; the torch paths against the model's current code.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on small shapes (fp32 inputs, tight tolerances). The
flag must be set before triton is first imported; when another test module imported triton earlier in this process,
``test_kernels_in_interpreter_subprocess`` reruns this file in a fresh process. The ``small_tiles`` fixture shrinks
the launch tiles so that each shape spans several row / token tiles, channel blocks and persistent programs.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEV, ON_GPU, check_compiles_for_sm90, kernel_test, rerun_in_interpreter, rerun_test
from conftest import assert_out_dtype_is_a_rounding, rel

from kdamoe.model import fused_norm, kda, modeling_kdamoe, short_conv  # noqa: E402

# masked-off lanes must not compute inf or NaN either (numpy's RuntimeWarning under the interpreter)
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

TOL = 1e-5  # fp32 kernels against float64 (no tensor-core products anywhere)
EPS = 1e-6
W_CONV = 4
KDA_TOL, KDA_GRAD_TOL = (5e-3, 1e-2) if ON_GPU else (1e-4, 1e-4)  # the chunk kernels' tf32 dots on the GPU


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(fused_norm, "TILE_ELEMENTS", 256)
    monkeypatch.setitem(short_conv.LAUNCH, "fwd", dict(BT=8, BD=16, num_warps=1, channels_first=False))
    monkeypatch.setitem(short_conv.LAUNCH, "dpre", dict(BT=8, BD=16, num_warps=1, programs_per_sm=1,
                                                        channels_first=False))
    monkeypatch.setitem(short_conv.LAUNCH, "dx", dict(BT=8, BD=16, num_warps=1, channels_first=False))
    monkeypatch.setitem(short_conv.LAUNCH, "state", dict(BD=16, num_warps=1))


def leaves(*tensors):
    """fp32 leaves on DEV and their float64 twins."""
    ours = [t.to(DEV).requires_grad_() for t in tensors]
    return ours, [t.detach().double().requires_grad_() for t in ours]


def check(out, ref, ours, refs):
    """Outputs and the gradients of one random cotangent agree with the float64 reference to TOL; returns ours."""
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert rel(out, ref) < TOL
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, ours, cot)
    ref_grads = torch.autograd.grad(ref, refs, cot.double())
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.shape == r.shape and rel(g, r) < TOL, i
    return grads


# ---------------------------------------------------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------------------------------------------------


def rms64(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def conv_silu64(x, weight, cu_seqlens=None, context=None):
    """Per document: ``F.conv1d`` over the zero- (or context-) padded document, in float64."""
    B, T, C = x.shape
    W = weight.shape[1]
    w = weight.unsqueeze(1)  # [C, 1, W]
    if cu_seqlens is None:
        left = context.double() if context is not None else x.new_zeros(B, W - 1, C)
        return F.silu(F.conv1d(torch.cat([left, x], 1).transpose(1, 2), w, groups=C)).transpose(1, 2)
    flat, outs = x.reshape(B * T, C), []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            outs.append(F.conv1d(F.pad(flat[a:b].t()[None], (W - 1, 0)), w, groups=C)[0].t())
    return F.silu(torch.cat(outs)).view(B, T, C)


def state_loop(x, W, state=None, cu_seqlens=None):
    """The cache state row by row: position T − W + j of each row, from the old state before the row, zero before
    the start of the document holding the row's last token."""
    B, T, C = x.shape
    out = torch.zeros(B, C, W, dtype=x.dtype)
    for b in range(B):
        last = b * T + T - 1
        start = max(c for c in cu_seqlens.tolist() if c <= last) if cu_seqlens is not None else b * T
        for j in range(W):
            p = T - W + j
            if p >= 0 and b * T + p >= start:
                out[b, :, j] = x[b, p]
            elif p < 0 and state is not None:
                out[b, :, j] = state[b, :, W + p]
    return out


def l2norm64(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + EPS)


# ---------------------------------------------------------------------------------------------------------------------
# The KDA layer's conv + L2 norm + chunked KDA as one function (kda_conv_chunk.py)
# ---------------------------------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("B,T,lengths", [(2, 70, None), (1, 150, [40, 0, 90, 20])])
def test_conv_chunk_kda_matches_float64_composition(small_tiles, gate, B, T, lengths):
    """`conv_chunk_kda` (which keeps qkv and recomputes the conv and the L2 norm in its backward) against the
    float64 conv -> split -> L2 norm -> `chunk_kda(backend="torch")`: o, the final state, and every gradient for
    random cotangents of both (plain rows and packed documents, the conv input a column slice)."""
    from kdamoe.model.kda_conv_chunk import conv_chunk_kda

    H, K = 2, 16
    C = 3 * H * K
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0))) if lengths else None
    wide = torch.randn(B, T, C + 5)
    g = torch.randn(B, T, H, K)
    beta = torch.rand(B, T, H)
    A_log, dt_bias = torch.randn(H) * 0.5, torch.randn(H * K)
    (wide, weight, g, beta, A_log, dt_bias), refs = leaves(wide, torch.randn(C, W_CONV) * 0.5, g, beta, A_log, dt_bias)
    lb = -5.0 if gate == "bounded" else None
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate=gate, lower_bound=lb, output_final_state=True)
    o, ht = conv_chunk_kda(wide[..., 1:C + 1], weight, g, beta, H, cu, **kw)

    wide64, weight64, g64, beta64, A64, dt64 = refs
    mixed = conv_silu64(wide64[..., 1:C + 1], weight64, cu)
    q, k, v = (t.reshape(B, T, H, K) for t in mixed.split(H * K, -1))
    flat = (lambda t: t.reshape(1, B * T, *t.shape[2:])) if cu is not None else (lambda t: t)
    ro, rht = kda.chunk_kda(flat(l2norm64(q)), flat(l2norm64(k)), flat(v), flat(g64), flat(beta64), cu_seqlens=cu,
                            use_gate_in_kernel=True, A_log=A64, dt_bias=dt64, gate=gate, lower_bound=lb,
                            output_final_state=True, backend="torch")
    assert o.shape == ro.shape and ht.shape == rht.shape
    assert rel(o, ro) < KDA_TOL and rel(ht, rht) < KDA_TOL
    cots = torch.randn_like(o), torch.randn_like(ht)
    grads = torch.autograd.grad((o, ht), [wide, weight, g, beta, A_log, dt_bias], cots)
    ref_grads = torch.autograd.grad((ro, rht), refs, [c.double() for c in cots])
    # A_log's and dt_bias's gradients are sums over every token of a head (channel), with cancellation: on the GPU
    # (tf32 dots) their error is measured against the sum of the terms' magnitudes. Both enter the gate through
    # exp(A_log) * x, x = g + dt_bias, so the terms are dL/dx (the float64 gradient of g) and dL/dx * x.
    dx = ref_grads[2]
    x = (g64 + dt64.reshape(H, K)).detach()
    scales = {"A_log": (dx * x).abs().sum((0, 1, 3)), "dt_bias": dx.abs().sum((0, 1)).reshape(-1)}
    for name, a, b in zip(["qkv", "weight", "g", "beta", "A_log", "dt_bias"], grads, ref_grads):
        scale = scales[name] if ON_GPU and name in scales else b
        err = ((a.double().cpu() - b.cpu()).norm() / scale.cpu().norm()).item()
        assert a.shape == b.shape and err < KDA_GRAD_TOL, (name, err)
    assert grads[0][..., 0].abs().max() == 0 and grads[0][..., C + 1:].abs().max() == 0  # outside the slice


@kernel_test
@pytest.mark.parametrize("use_cache,checkpointing", [(True, False), (False, True)])
def test_kda_layer_in_one_function_equals_the_separate_ops(monkeypatch, use_cache, checkpointing):
    """The whole model with its KDA layers through `conv_chunk_kda` (Triton, the rest on the torch path) against
    the same model through the separate ops: loss, every gradient and the cached states, plain and packed rows;
    under activation checkpointing (which runs the function's forward again in the backward) packed rows."""
    import kdamoe
    from conftest import cache_of, tiny_config

    torch.manual_seed(0)
    config = tiny_config(kda_head_dim=16, router_balancing="none", num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense"] * 2)
    model = kdamoe.KDAMoEForCausalLM(config).to(DEV).train()
    if checkpointing:  # transformers >= 5.2x calls it `activation_checkpointing_enable`; 5.17 the older name
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    ids = torch.randint(3, 97, (2, 70)).to(DEV)
    positions = torch.cat([torch.arange(30), torch.arange(40)]).repeat(2, 1).to(DEV)
    rows = ({"position_ids": positions},) if checkpointing else ({}, {"position_ids": positions})
    for kwargs in rows:
        runs = []
        for one_function in (False, True):
            monkeypatch.setattr(modeling_kdamoe, "conv_kda_in_one_function",
                                lambda qkv: one_function and torch.is_grad_enabled())
            model.zero_grad()
            out = model(ids, labels=ids, use_cache=use_cache, **kwargs)
            out.loss.backward()
            states = [layer.recurrent_states[0] for layer in cache_of(out).layers
                      if getattr(layer, "recurrent_states", None)] if use_cache else []
            runs.append((out.loss, {n: p.grad.clone() for n, p in model.named_parameters()}, states))
        (ref_loss, ref_grads, ref_states), (loss, grads, states) = runs
        assert rel(loss, ref_loss) < 1e-5
        for name, ref in ref_grads.items():
            assert rel(grads[name], ref) < 1e-4, name
        assert len(states) == len(ref_states) == (1 if use_cache else 0)
        for a, b in zip(states, ref_states):
            assert rel(a, b) < 1e-4


# ---------------------------------------------------------------------------------------------------------------------
# Norm kernels
# ---------------------------------------------------------------------------------------------------------------------


@kernel_test
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 64), (3, 1, 3), (4, 7, 1000), (0, 24)])
def test_rms_norm_kernels_match_float64(small_tiles, shape):
    (x, w), (x64, w64) = leaves(torch.randn(shape) * 3, 1 + 0.3 * torch.randn(shape[-1]))
    check(fused_norm.rms_norm(x, w, EPS, backend="triton"), rms64(x64, w64), [x, w], [x64, w64])


@kernel_test
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 64), (4, 7, 1000), (0, 24)])
def test_add_rms_norm_kernels_match_float64(small_tiles, shape):
    """``h = residual + x`` and RMSNorm(h) against float64: both outputs, and the gradients when h's gradient comes
    from later sublayers as well as through the norm, through the norm alone, or through h alone."""
    (r, x, w), (r64, x64, w64) = leaves(torch.randn(shape) * 3, torch.randn(shape), 1 + 0.3 * torch.randn(shape[-1]))
    h, y = fused_norm.add_rms_norm(r, x, w, EPS, backend="triton")
    h64 = r64 + x64
    y64 = rms64(h64, w64)
    check(torch.cat([h.reshape(-1), y.reshape(-1)]), torch.cat([h64.reshape(-1), y64.reshape(-1)]), [r, x, w],
          [r64, x64, w64])
    for pick in (1, 0):  # the norm's output only, h only
        out = fused_norm.add_rms_norm(r, x, w, EPS, backend="triton")[pick]
        ref = r64 + x64 if pick == 0 else rms64(r64 + x64, w64)
        cot = torch.randn_like(out)
        grads = torch.autograd.grad(out, [r, x, w], cot, allow_unused=True)
        want = torch.autograd.grad(ref, [r64, x64, w64], cot.double(), allow_unused=True)
        for g, want_g, leaf in zip(grads, want, (r, x, w)):
            if want_g is None:
                assert g is None or not g.any()
            else:
                assert rel(g, want_g) < TOL


@kernel_test
def test_add_rms_norm_rounds_h_as_the_add_and_returns_each_input_its_dtype():
    """An fp32 residual plus an fp16 sublayer output (the stream under autocast): h is fp32 and equal to torch's add,
    the norm's output equals the norm of that h, and the gradients come back fp32 and fp16, as the unfused ops give
    them."""
    r = torch.randn(6, 40).to(DEV).requires_grad_()
    x = torch.randn(6, 40).to(DEV, torch.float16).requires_grad_()
    w = (1 + 0.3 * torch.randn(40)).to(DEV).requires_grad_()
    h, y = fused_norm.add_rms_norm(r, x, w, EPS, backend="triton")
    h_ref = r + x
    y_ref = fused_norm.rms_norm_torch(h_ref, w, EPS)
    assert h.dtype == y.dtype == torch.float32 and torch.equal(h, h_ref)
    assert rel(y, y_ref.double()) < 1e-6
    cots = torch.randn_like(h), torch.randn_like(y)
    got = torch.autograd.grad((h, y), (r, x, w), cots)
    want = torch.autograd.grad((h_ref, y_ref), (r, x, w), cots)
    assert [g.dtype for g in got] == [g.dtype for g in want] == [torch.float32, torch.float16, torch.float32]
    for g, want_g in zip(got, want):
        assert rel(g, want_g.double()) < 1e-3


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_output_in_out_dtype_is_the_rounding_of_the_fp32_output(small_tiles, backend, residual):
    """``out_dtype`` (a norm before a projection under autocast): the fp32 output rounded to it, and the same
    gradients (h, with the residual, stays fp32)."""
    r, x = torch.randn(12, 40).to(DEV), torch.randn(12, 40).to(DEV)
    w = (1 + 0.3 * torch.randn(40)).to(DEV)
    cot = torch.randn(12, 40).to(DEV, torch.float16)

    def run(out_dtype):
        leaves = [t.clone().requires_grad_() for t in (r, x, w)]
        if residual:
            h, y = fused_norm.add_rms_norm(*leaves, EPS, backend=backend, out_dtype=out_dtype)
            assert h.dtype == torch.float32
        else:
            y = fused_norm.rms_norm(*leaves[1:], EPS, backend=backend, out_dtype=out_dtype)
        y.backward(cot.to(y.dtype))
        return y, [t.grad for t in leaves[0 if residual else 1:]]

    assert_out_dtype_is_a_rounding(run)


@kernel_test
@pytest.mark.parametrize("shape", [(2, 9, 3, 24), (1, 5, 4, 128), (3, 2, 2, 100)])
def test_gated_rms_norm_kernels_match_float64(small_tiles, shape):
    (o, w, g), (o64, w64, g64) = leaves(torch.randn(shape), 1 + 0.3 * torch.randn(shape[-1]), 2 * torch.randn(shape))
    out = fused_norm.gated_rms_norm(o, w, g, EPS, backend="triton")
    check(out, rms64(o64, w64) * torch.sigmoid(g64), [o, w, g], [o64, w64, g64])


@kernel_test
@pytest.mark.parametrize("o_dtype,gate_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.float16, torch.float32)])
def test_gated_rms_norm_rounds_as_the_unfused_expression(o_dtype, gate_dtype):
    """The norm's output is rounded to o's dtype and the sigmoid to the gate's before the product, as in
    ``o_norm(o) * out_gate.sigmoid()``: the fused output stays within one fp16 step of the unfused one (last-bit
    flips from the order of the fp32 sums) and is 20x closer to it on average than an fp32-to-the-end fusion. fp16,
    as the interpreter truncates bf16 casts (the GPU rounds them to nearest even, as for fp16)."""
    shape = (4, 16, 3, 40)
    o, g = torch.randn(shape).to(DEV, o_dtype), torch.randn(shape).to(DEV, gate_dtype)
    w = (1 + 0.3 * torch.randn(40)).to(DEV)
    out = fused_norm.gated_rms_norm(o, w, g, EPS, backend="triton")
    unfused = modeling_kdamoe.KDAMoERMSNorm(40, eps=EPS).to(DEV)
    unfused.weight.data.copy_(w)
    ref = (unfused(o) * g.sigmoid()).double()
    assert out.dtype == torch.promote_types(o_dtype, gate_dtype)
    fp32_to_end = (rms64(o.double(), w.double()) * torch.sigmoid(g.double())).to(out.dtype)

    def mean_rel(a):
        return ((a.double() - ref).abs().mean() / ref.abs().mean()).item()

    assert ((out.double() - ref).abs() <= torch.finfo(torch.float16).eps * ref.abs() + 1e-7).all()
    assert 20 * mean_rel(out) < mean_rel(fp32_to_end)


@kernel_test
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 3, 16), (4, 3), (0, 8)])
def test_l2norm_kernels_match_float64(small_tiles, shape):
    (x,), (x64,) = leaves(torch.randn(shape) * 2)
    out = fused_norm.l2norm(x, backend="triton")
    check(out, l2norm64(x64), [x], [x64])


@kernel_test
def test_l2norm_reads_the_q_and_k_slices_of_the_conv_output_in_place(small_tiles):
    """q and k are ``[B, T, H, K]`` views of the ``[B, T, 3·H·K]`` conv output (row stride 3·H·K): the kernel reads
    them without a copy and the gradient lands in the right slice of the base tensor."""
    B, T, H, K = 2, 5, 3, 12
    (mixed,), (mixed64,) = leaves(torch.randn(B, T, 3 * H * K))
    q, key = (mixed[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in range(2))
    q64, k64 = (mixed64[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in range(2))
    assert not q.is_contiguous()
    out = torch.stack([fused_norm.l2norm(t, backend="triton") for t in (q, key)])
    ref = torch.stack([t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + EPS) for t in (q64, k64)])
    (grad,) = check(out, ref, [mixed], [mixed64])
    assert grad[..., 2 * H * K:].abs().max() == 0  # v's slice gets nothing


# ---------------------------------------------------------------------------------------------------------------------
# Short convolution kernels
# ---------------------------------------------------------------------------------------------------------------------

# (B, T, document lengths of the flattened B·T tokens or None): length-1 documents, documents shorter than the
# width, empty documents (at the start, in the middle, at the end), one document per row
CONV_CASES = [
    (2, 13, None),
    (1, 17, [1, 2, 3, 1, 10]),
    (3, 7, [0, 7, 1, 0, 0, 2, 4, 3, 4, 0]),
    (2, 6, [6, 6]),
    (4, 1, [1, 1, 1, 1]),
]


def cu_of(lengths, dtype=torch.int32):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(DEV, dtype)


@kernel_test
@pytest.mark.parametrize("B,T,lengths", CONV_CASES)
@pytest.mark.parametrize("W,C", [(4, 24), (3, 7), (1, 5)])
def test_short_conv_kernels_match_float64(small_tiles, B, T, lengths, W, C):
    cu = cu_of(lengths, torch.int64 if W == 3 else torch.int32) if lengths is not None else None
    (x, w), (x64, w64) = leaves(torch.randn(B, T, C), torch.randn(C, W) * 0.7)
    out = short_conv.short_conv_silu(x, w, cu_seqlens=cu, backend="triton")
    check(out, conv_silu64(x64, w64, None if cu is None else cu.cpu()), [x, w], [x64, w64])


@kernel_test
@pytest.mark.parametrize("B,T,lengths", CONV_CASES[:3])
def test_short_conv_program_order_changes_no_bit(small_tiles, monkeypatch, B, T, lengths):
    """Channel blocks fastest or token blocks fastest: every tile and every program's share of the weight gradient
    is the same work, so output, dx and dweight are bit-identical (and match float64)."""
    cu = cu_of(lengths) if lengths is not None else None
    (x, w), (x64, w64) = leaves(torch.randn(B, T, 40), torch.randn(40, W_CONV) * 0.7)
    cot = torch.randn(B, T, 40).to(DEV)
    runs = []
    for channels_first in (False, True):
        for role in ("fwd", "dpre", "dx"):
            monkeypatch.setitem(short_conv.LAUNCH, role, dict(short_conv.LAUNCH[role], channels_first=channels_first))
        out = short_conv.short_conv_silu(x, w, cu_seqlens=cu, backend="triton")
        runs.append((out, *torch.autograd.grad(out, [x, w], cot)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    check(short_conv.short_conv_silu(x, w, cu_seqlens=cu, backend="triton"),
          conv_silu64(x64, w64, None if cu is None else cu.cpu()), [x, w], [x64, w64])


@kernel_test
@pytest.mark.parametrize("B,T,lengths", [(2, 13, None), (1, 17, [1, 2, 3, 1, 10])])
def test_short_conv_reads_a_column_slice_in_place(small_tiles, B, T, lengths):
    """x as the KDA layer passes it: the q | k | v columns of a wider projection (rows 31 elements apart, not C),
    read without a copy; the gradient lands in those columns only; the state kernel reads the same slice."""
    cu = cu_of(lengths) if lengths is not None else None
    (wide, w), (wide64, w64) = leaves(torch.randn(B, T, 31), torch.randn(24, W_CONV) * 0.7)
    x, x64 = wide[..., 3:27], wide64[..., 3:27]
    assert not x.is_contiguous() and short_conv._rows(x) is x
    out = short_conv.short_conv_silu(x, w, cu_seqlens=cu, backend="triton")
    (grad, _) = check(out, conv_silu64(x64, w64, None if cu is None else cu.cpu()), [wide, w], [wide64, w64])
    assert grad[..., :3].abs().max() == 0 and grad[..., 27:].abs().max() == 0
    state = short_conv.short_conv_state(x.detach(), W_CONV, cu_seqlens=cu, backend="triton")
    torch.testing.assert_close(state, short_conv.short_conv_state_torch(x.detach().contiguous(), W_CONV,
                                                                        cu_seqlens=cu))


@kernel_test
@pytest.mark.parametrize("B,T,lengths", [(2, 13, None), (1, 17, [1, 2, 3, 1, 10])])
@pytest.mark.parametrize("C", [96, 72])
def test_short_conv_split_thirds_are_bit_identical(small_tiles, B, T, lengths, C):
    """``conv_silu_fwd(..., split=True)`` writes the thirds of C (the KDA layer's q | k | v) as three contiguous
    tensors and ``conv_silu_bwd`` takes the gradient as three: the same bits as one ``[B, T, C]`` tensor each way,
    with each channel tile inside one third (C = 96, tiles of 16: the kernels write and read the three tensors) and
    thirds that tiles straddle (C = 72: the launchers split or join one tensor)."""
    cu = cu_of(lengths) if lengths is not None else None
    wide = torch.randn(B, T, C + 5).to(DEV)
    x, w = wide[..., 2:C + 2], (torch.randn(C, W_CONV) * 0.7).to(DEV)
    dy = torch.randn(B, T, C).to(DEV)
    whole = short_conv.conv_silu_fwd(x, w, cu, None)
    parts = short_conv.conv_silu_fwd(x, w, cu, None, split=True)
    assert all(p.is_contiguous() and p.shape == (B, T, C // 3) for p in parts)
    assert torch.equal(torch.cat(parts, -1), whole)
    split_grads = short_conv.conv_silu_bwd(x, w, cu, None, list(dy.split(C // 3, -1)))
    for a, b in zip(split_grads, short_conv.conv_silu_bwd(x, w, cu, None, dy)):
        assert torch.equal(a, b)


@kernel_test
@pytest.mark.parametrize("T", [1, 2, 9])
def test_short_conv_kernels_with_decoding_context_match_float64(small_tiles, T):
    """Plain rows continued from the cache: context ``[B, W-1, C]`` read in place from the ``[B, C, W]`` state; the
    weight gradient includes the taps that read the context."""
    B, C = 2, 24
    state = torch.randn(B, C, W_CONV).to(DEV)
    context = state[..., 1:].transpose(1, 2)
    (x, w), (x64, w64) = leaves(torch.randn(B, T, C), torch.randn(C, W_CONV) * 0.7)
    out = short_conv.short_conv_silu(x, w, context=context, backend="triton")
    check(out, conv_silu64(x64, w64, context=context.double()), [x, w], [x64, w64])


@kernel_test
def test_short_conv_default_tiles_match_float64():
    """The default launch (64-token tiles) on a long packed row: tiles that hold many documents."""
    lengths = [1, 3, 0, 80, 2, 1, 40]
    cu = cu_of(lengths)
    (x, w), (x64, w64) = leaves(torch.randn(1, sum(lengths), 40), torch.randn(40, W_CONV) * 0.7)
    check(short_conv.short_conv_silu(x, w, cu_seqlens=cu, backend="triton"), conv_silu64(x64, w64, cu.cpu()),
          [x, w], [x64, w64])


CONV_SM90_LAUNCHES = r"""
from kdamoe.model import short_conv

short_conv.persistent_programs = lambda device, *args, **kwargs: 132 * 16 // args[1]
class Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


kernel = short_conv.{kernel}
for name in ("_conv_fwd_kernel", "_conv_dpre_kernel", "_conv_dx_kernel"):
    setattr(short_conv, name, Skip())
short_conv.{kernel} = Record()
x = torch.zeros(2, 64, 3 * 1024 + 64, dtype=torch.bfloat16)[..., :3 * 1024]  # the q | k | v columns
w = torch.zeros(3 * 1024, 4, dtype=torch.bfloat16)
for cu in (None, torch.tensor([0, 5, 128], dtype=torch.int32)):
    for channels_first, split in ((False, False), (True, False), (False, True)):
        for role in ("fwd", "dpre", "dx"):
            short_conv.LAUNCH[role] = dict(short_conv.LAUNCH[role], channels_first=channels_first)
        if kernel.fn.__name__ == "_conv_fwd_kernel":
            short_conv.conv_silu_fwd(x, w, cu, None, split=split)
        else:
            dy = torch.zeros(x.shape, dtype=x.dtype)
            short_conv.conv_silu_bwd(x, w, cu, None, list(dy.split(1024, -1)) if split else dy)
"""


def test_short_conv_kernels_compile_for_sm90():
    """The convolution's kernels compile to cubins for an H100/H200 (sm_90) as the GPU launches them at the default
    tiles (bf16, a column slice of a wider projection, plain rows and packed documents, both program orders, q | k |
    v apart), which the interpreter does not check. No GPU needed, in a process without the interpreter."""
    check_compiles_for_sm90(CONV_SM90_LAUNCHES, expected=6,
                            kernels=("_conv_fwd_kernel", "_conv_dpre_kernel", "_conv_dx_kernel"))


@kernel_test
@pytest.mark.parametrize("B,T,lengths", CONV_CASES)
def test_short_conv_state_kernel_matches_loop(small_tiles, B, T, lengths):
    x = torch.randn(B, T, 40)
    cu = cu_of(lengths) if lengths is not None else None
    for state in (None, torch.randn(B, 40, W_CONV)) if cu is None else (None,):
        for backend in ("triton", "torch"):
            got = short_conv.short_conv_state(x.to(DEV), W_CONV, None if state is None else state.to(DEV),
                                              cu_seqlens=cu, backend=backend)
            assert torch.equal(got.cpu(), state_loop(x, W_CONV, state, None if cu is None else cu.cpu())), backend


# ---------------------------------------------------------------------------------------------------------------------
# torch paths against the model's current code
# ---------------------------------------------------------------------------------------------------------------------


def packed_rows(device="cpu"):
    """Two rows of 9 tokens, position_ids restarting: the first row ends in a 2-token document (shorter than the
    width), the second in a 1-token one; documents of 1 and 3 tokens inside."""
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 0]], device=device)
    return modeling_kdamoe.PackedDocuments.from_position_ids(position_ids, position_ids.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_torch_paths_equal_the_model(dtype):
    norm = modeling_kdamoe.KDAMoERMSNorm(24, eps=1e-5)
    norm.weight.data.normal_(1.0, 0.3)
    o, g = torch.randn(3, 5, 4, 24).to(dtype), torch.randn(3, 5, 4, 24).to(dtype)
    assert torch.equal(fused_norm.rms_norm(o, norm.weight, 1e-5), norm(o))
    assert torch.equal(fused_norm.gated_rms_norm(o, norm.weight, g, 1e-5), norm(o) * g.sigmoid())


def test_l2norm_torch_path_equals_the_kda_ops_own():
    """``chunk_kda(..., use_qk_l2norm_in_kernel=True)`` (the model's call) equals ``chunk_kda`` of our l2norm's q, k."""
    B, T, H, K = 1, 10, 2, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    g, beta = -torch.rand(B, T, H, K), torch.rand(B, T, H)
    inside, _ = kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    outside, _ = kda.chunk_kda(fused_norm.l2norm(q), fused_norm.l2norm(k), v, g, beta)
    assert torch.equal(inside, outside)


def test_short_conv_torch_path_equals_conv1d_per_document():
    """The torch path on the model's packed documents (``PackedDocuments``) and with a decoding context, against
    ``F.conv1d`` per document in float64; bf16 activations with an fp32 weight compute in fp32."""
    packed = packed_rows()
    B, T = packed.doc_ids.shape
    for x_dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(B, T, 40).to(x_dtype), torch.randn(40, W_CONV)
        ours = short_conv.short_conv_silu(x, w, cu_seqlens=packed.cu_seqlens)
        assert ours.dtype == torch.float32
        assert rel(ours, conv_silu64(x.double(), w.double(), packed.cu_seqlens)) < 1e-6
        context = torch.randn(B, W_CONV - 1, 40).to(x_dtype)
        ours = short_conv.short_conv_silu(x[:, :2], w, context=context)
        assert rel(ours, conv_silu64(x[:, :2].double(), w.double(), context=context.double())) < 1e-6


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
def test_conv_state_equals_the_model_cache(make_config, backend):
    """The KDA layer's cache after a packed prefill and after a decode step equals ``short_conv_state`` of the
    layer's q/k/v projections."""
    config = make_config()
    layer = modeling_kdamoe.KDAMoEKimiDeltaAttention(config, 0).to(DEV)
    for p in (layer.conv_weight, layer.A_log, layer.dt_bias):
        torch.nn.init.normal_(p, std=0.5)
    packed = packed_rows(DEV)
    cache = modeling_kdamoe.KDAMoECache(config)

    def qkv(h):
        return torch.cat([layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)], -1)

    with torch.no_grad():
        h = torch.randn(*packed.doc_ids.shape, config.hidden_size, device=DEV)
        layer(h, cache=cache, packed=packed)
        state = cache.layers[0].conv_states[0].clone()
        expected = short_conv.short_conv_state(qkv(h), layer.conv_size, cu_seqlens=packed.cu_seqlens,
                                               backend=backend)
        assert torch.equal(state, expected)
        h1 = torch.randn(h.shape[0], 1, config.hidden_size, device=DEV)
        layer(h1, cache=cache)
        expected = short_conv.short_conv_state(qkv(h1), layer.conv_size, state=state, backend=backend)
        assert torch.equal(cache.layers[0].conv_states[0], expected)


# ---------------------------------------------------------------------------------------------------------------------
# Dispatch and contracts
# ---------------------------------------------------------------------------------------------------------------------


def test_argument_errors():
    x, w = torch.randn(2, 5, 8), torch.randn(8, W_CONV)
    with pytest.raises(ValueError, match="backend"):
        fused_norm.rms_norm(x, torch.ones(8), backend="cuda")
    with pytest.raises(ValueError, match="weight must have shape"):
        fused_norm.rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="gate must have the shape"):
        fused_norm.gated_rms_norm(x, torch.ones(8), x[:, :1])
    with pytest.raises(ValueError, match="exclusive"):
        short_conv.short_conv_silu(x, w, cu_seqlens=torch.tensor([0, 10]), context=torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match="context must have shape"):
        short_conv.short_conv_silu(x, w, context=torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="state must have shape"):
        short_conv.short_conv_state(x, W_CONV, state=torch.zeros(2, 8, 3))


def test_modules_import_and_fall_back_without_triton(tmp_path):
    """The two files (and the KDA constants they read) alone, as in a saved remote-code folder, on a machine without triton: the auto backend is
    torch, results equal the torch references, and ``backend="triton"`` raises a clear error."""
    src = Path(fused_norm.__file__).parent
    pkg = tmp_path / "remote"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("fused_norm.py", "short_conv.py", "kda_common.py"):
        shutil.copy(src / name, pkg / name)
    code = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch
from remote import fused_norm, short_conv
assert fused_norm.triton is None
x, w, cu = torch.randn(2, 6, 8), torch.randn(8, 4), torch.tensor([0, 5, 12])
assert torch.equal(fused_norm.rms_norm(x, torch.ones(8)), fused_norm.rms_norm_torch(x, torch.ones(8), 1e-6))
assert torch.equal(fused_norm.l2norm(x), fused_norm.l2norm_torch(x))
assert torch.equal(short_conv.short_conv_silu(x, w, cu), short_conv.short_conv_silu_torch(x, w, cu))
assert short_conv.short_conv_state(x, 4, cu_seqlens=cu).shape == (2, 8, 4)
try:
    fused_norm.gated_rms_norm(x, torch.ones(8), x, backend="triton")
except RuntimeError as error:
    assert "needs triton" in str(error)
else:
    raise AssertionError("backend='triton' without triton must raise")
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]

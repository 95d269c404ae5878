"""MoE building blocks: SiTU-GLU, experts (loop vs grouped), router, sparse block outputs and aux loss."""

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kdamoe.model.configuration_kdamoe import KDAMoEConfig
from kdamoe.model import moe
from kdamoe.model.moe import (
    KDAMoEExperts,
    KDAMoEMLP,
    KDAMoERouter,
    KDAMoESparseMoeBlock,
    situ_glu,
    swiglu,
)


def make_config(**kw):
    base = dict(num_hidden_layers=1, mlp_layer_types=["dense"], hidden_size=16, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=8, num_shared_experts=1)
    base.update(kw)
    return KDAMoEConfig(**base)


def init_(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def situ_formula(g, u):
    return 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)


# ----------------------------------------------------------------------------------------------- SiTU-GLU


def test_situ_glu_matches_formula_and_is_bounded():
    g = torch.randn(64, 32, dtype=torch.float64) * 10
    u = torch.randn(64, 32, dtype=torch.float64) * 50
    torch.testing.assert_close(situ_glu(g, u), situ_formula(g, u), rtol=1e-12, atol=1e-12)
    big = torch.tensor([1e4, -1e4, 300.0, -300.0, 1e30], dtype=torch.float64)
    h = situ_glu(big[:, None].expand(5, 5), big[None, :].expand(5, 5))
    assert torch.isfinite(h).all() and h.abs().max() <= 100.0
    assert h.abs().max() > 99.0  # the bound is reached, not just respected
    small = torch.randn(100, dtype=torch.float64) * 1e-2  # near zero it is SwiGLU
    torch.testing.assert_close(situ_glu(small, small), swiglu(small, small), rtol=1e-3, atol=1e-9)


def test_situ_glu_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        situ_glu(torch.zeros(3, 4), torch.zeros(3, 5))


def test_situ_glu_gradcheck_float64():
    g = (torch.randn(7, 5, dtype=torch.float64) * 6).requires_grad_()
    u = (torch.randn(7, 5, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(situ_glu, (g, u))
    # the hand backward equals autograd through the formula
    dh = torch.randn(7, 5, dtype=torch.float64)
    got = torch.autograd.grad(situ_glu(g, u), (g, u), dh)
    want = torch.autograd.grad(situ_formula(g, u), (g, u), dh)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # packed [gate | up] variant used by the experts
    gu = torch.cat([g, u], -1).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: moe._packed_activation("situ_glu", x), (gu,))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernels_in_interpreter():
    """The fused kernels (run by the Triton interpreter on CPU) match the torch forward and backward."""
    code = """
import torch
from kdamoe.model.moe_triton import situ_glu_fwd_triton, situ_glu_bwd_triton
from kdamoe.model.moe import _situ_glu_forward, _situ_glu_backward
torch.manual_seed(0)
gu = torch.randn(37, 2 * 40) * 8
g, u = gu[:, :40], gu[:, 40:]
h = torch.empty(37, 40); situ_glu_fwd_triton(g, u, h)
torch.testing.assert_close(h, _situ_glu_forward(g, u), rtol=1e-5, atol=1e-5)
dh = torch.randn(37, 40); d = torch.empty(37, 80)
situ_glu_bwd_triton(g, u, dh, d[:, :40], d[:, 40:])
dg, du = _situ_glu_backward(g, u, dh)
torch.testing.assert_close(d[:, :40], dg, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(d[:, 40:], du, rtol=1e-5, atol=1e-5)
print("OK")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("path", ["fused", "modules"])
@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_mlp_matches_formula(activation, path):
    """The one-GEMM path (plain projections) and the module-by-module path (here: a hook on gate_proj; PEFT's
    adapters take it) against the formula, output and gradients."""
    config = make_config(expert_activation=activation)
    mlp = init_(KDAMoEMLP(config, 12)).double()
    if path == "modules":
        mlp.gate_proj.register_forward_hook(lambda module, args, out: None)
    assert mlp.fused_inputs() == (path == "fused")
    x = torch.randn(3, 4, 16, dtype=torch.float64, requires_grad=True)
    g, u = x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T
    h = situ_formula(g, u) if activation == "situ_glu" else F.silu(g) * u
    want = h @ mlp.down_proj.weight.T
    got = mlp(x)
    torch.testing.assert_close(got, want)
    # gradients through the packed gate/up GEMM equal those of the two separate projections
    dout = torch.randn_like(want)
    inputs = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    for a, b in zip(torch.autograd.grad(got, inputs, dout), torch.autograd.grad(want, inputs, dout)):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------------------------- experts


def naive_experts(experts, x, index, weights):
    """Token-by-token reference."""
    out = torch.zeros_like(x)
    inter = experts.intermediate_size
    for t in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e = index[t, slot].item()
            gu = experts.gate_up_proj[e] @ x[t]
            g, u = gu[:inter], gu[inter:]
            h = situ_formula(g, u) if experts.activation == "situ_glu" else F.silu(g) * u
            out[t] += weights[t, slot] * (experts.down_proj[e] @ h)
    return out


def routing(n, num_experts, k, seed=0, skip=()):
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in skip])
    index = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(n)])
    return index, torch.rand(n, k, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_loop_experts_match_naive_reference(activation):
    experts = init_(KDAMoEExperts(make_config(expert_activation=activation))).double()
    x = torch.randn(9, 16, dtype=torch.float64)
    index, weights = routing(9, 6, 2, skip=(4,))  # expert 4 receives no token
    torch.testing.assert_close(experts.forward_loop(x, index, weights), naive_experts(experts, x, index, weights))


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_grouped_and_dense_paths_equal_loop_path_with_gradients(activation):
    """float64: the grouped path runs its torch fallback for grouped_mm, the dense one (torch.compile's) every expert
    on every token; outputs and all gradients agree with the loop's."""
    experts = init_(KDAMoEExperts(make_config(expert_activation=activation))).double()
    x = torch.randn(11, 16, dtype=torch.float64)
    index, weights = routing(11, 6, 2, seed=1, skip=(0, 3))
    results = []
    for fn in (experts.forward_loop, experts.forward_grouped, experts.forward_dense):
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(xx, index, ww)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(),
                                    (xx, ww, experts.gate_up_proj, experts.down_proj))
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(moe._GROUPED_MM is None, reason="torch has no grouped_mm")
def test_grouped_path_with_torch_grouped_mm_on_cpu():
    """float32 without autograd: torch 2.13 has a CPU grouped_mm kernel; the grouped path uses it directly."""
    experts = init_(KDAMoEExperts(make_config(num_experts=5))).float()
    x = torch.randn(13, 16)
    index, weights = routing(13, 5, 2, seed=2, skip=(2,))
    calls = []
    real = moe._GROUPED_MM

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    moe._GROUPED_MM = spy
    try:
        with torch.no_grad():
            got = experts.forward_grouped(x, index, weights.float())
    finally:
        moe._GROUPED_MM = real
    assert len(calls) == 2
    want = naive_experts(experts.double(), x.double(), index, weights).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- permute / combine


def sorted_routing(n, num_experts, k, seed=0):
    """Routing as forward_grouped sorts it: `(index [n, k], order, inverse)` (sorted position <-> flat position)."""
    index, _ = routing(n, num_experts, k, seed=seed)
    order = torch.argsort(index.reshape(-1), stable=True)
    return index, order, torch.argsort(order)


def naive_combine(y, weights, order):
    """out[t] = sum over sorted rows p of weights.flat[order[p]] * y[p], for t = order[p] // k (float64 loop)."""
    n, k = weights.shape
    out = torch.zeros(n, y.shape[1], dtype=torch.float64)
    for p, flat in enumerate(order.tolist()):
        out[flat // k] += weights.reshape(-1)[flat].double() * y[p].double()
    return out


def test_combine_and_permute_gradcheck_float64():
    n, k, d = 7, 3, 5
    _, order, inverse = sorted_routing(n, 6, k, seed=3)
    y = torch.randn(n * k, d, dtype=torch.float64, requires_grad=True)
    w = torch.rand(n, k, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(moe._CombineTokens.apply(y, w, order, inverse), naive_combine(y.detach(), w.detach(),
                                                                                             order))
    assert torch.autograd.gradcheck(lambda a, b: moe._CombineTokens.apply(a, b, order, inverse), (y, w))
    # weights without gradient: only dy, y is not kept for the backward
    out = moe._CombineTokens.apply(y, w.detach(), order, inverse)
    (dy,) = torch.autograd.grad(out, y, torch.ones_like(out))
    want = w.detach().reshape(-1)[order, None].expand(-1, d)
    torch.testing.assert_close(dy, want)
    # permutation: forward is hidden[token_of], backward sums the k copies of each token
    h = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(moe._PermuteTokens.apply(h, order // k, inverse, k), h.detach()[order // k])
    assert torch.autograd.gradcheck(lambda a: moe._PermuteTokens.apply(a, order // k, inverse, k), (h,))


@pytest.mark.parametrize("y_dtype,w_dtype", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_combine_dtypes(y_dtype, w_dtype):
    """Output and dy in y's dtype, dw in the weights' dtype, accumulation in fp32 (bf16 only rounds the results)."""
    n, k, d = 9, 2, 24
    _, order, inverse = sorted_routing(n, 5, k, seed=4)
    y64, w64 = torch.randn(n * k, d, dtype=torch.float64), torch.rand(n, k, dtype=torch.float64)
    dout64 = torch.randn(n, d, dtype=torch.float64)
    y, w = y64.to(y_dtype).requires_grad_(), w64.to(w_dtype).requires_grad_()
    out = moe._CombineTokens.apply(y, w, order, inverse)
    dy, dw = torch.autograd.grad(out, (y, w), dout64.to(y_dtype))
    assert (out.dtype, dy.dtype, dw.dtype) == (y_dtype, y_dtype, w_dtype)
    # reference on the same (rounded) inputs in float64
    yr, wr = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = naive_combine(yr, wr, order)
    ref_dy, ref_dw = torch.autograd.grad(ref, (yr, wr), dout64.to(y_dtype).double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[y_dtype]
    for got, want in ((out, ref), (dy, ref_dy), (dw, ref_dw)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(moe.gather_sum_triton is None, reason="triton not installed")
@pytest.mark.parametrize("n,k,d", [(5, 2, 40), (6, 9, 300)])  # (6, 9, 300): masked slots, two blocks of D
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
def test_combine_and_permute_triton_match_torch(monkeypatch, n, k, d, y_dtype):
    """The Triton combine / permute kernels, forward and backward (the interpreter on CPU), against the torch path."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, order, inverse = sorted_routing(n, 12, k, seed=5)
    order, inverse = order.to(device), inverse.to(device)
    y0 = torch.randn(n * k, d, device=device).to(y_dtype)
    w0 = torch.rand(n, k, device=device)
    h0 = torch.randn(n, d, device=device).to(y_dtype)
    dout = torch.randn(n, d, device=device).to(y_dtype)
    dx = torch.randn(n * k, d, device=device).to(y_dtype)
    results = []
    for use in (False, True):
        monkeypatch.setattr(moe, "_use_triton", lambda x, use=use: use)
        y, w, h = (t.clone().requires_grad_() for t in (y0, w0, h0))
        out = moe._CombineTokens.apply(y, w, order, inverse)
        dy, dw = torch.autograd.grad(out, (y, w), dout)
        (dy_only,) = torch.autograd.grad(moe._CombineTokens.apply(y, w0, order, inverse), y, dout)
        x = moe._PermuteTokens.apply(h, order // k, inverse, k)
        (dh,) = torch.autograd.grad(x, h, dx)
        results.append((out, dy, dw, dy_only, x, dh))
    tol = 1e-5 if y_dtype == torch.float32 else 1e-2
    for want, got in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(results[1][4], results[0][4])  # the permutation is a copy: bit-identical rows


@pytest.mark.skipif(moe.gather_sum_triton is None, reason="triton not installed")
def test_grouped_path_with_triton_kernels_equals_loop_path(monkeypatch):
    """float32, every Triton kernel of the grouped path (interpreter on CPU) on: outputs and gradients match."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = init_(KDAMoEExperts(make_config())).to(device)
    x = torch.randn(11, 16, device=device)
    index, weights = routing(11, 6, 2, seed=1, skip=(3,))
    index, weights = index.to(device), weights.float().to(device)
    dout = torch.randn(11, 16, device=device)
    results = []
    for fn, use in ((experts.forward_loop, False), (experts.forward_grouped, True)):
        monkeypatch.setattr(moe, "_use_triton", lambda t, use=use: use)
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(xx, index, ww)
        results.append((out, *torch.autograd.grad(out, (xx, ww, experts.gate_up_proj, experts.down_proj), dout)))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_experts_reject_bad_shapes():
    experts = KDAMoEExperts(make_config())
    with pytest.raises(ValueError, match="top_k_index"):
        experts.forward_loop(torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3))


# ----------------------------------------------------------------------------------------------- router


def test_router_weights_and_biased_selection():
    config = make_config(num_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5)
    router = init_(KDAMoERouter(config))
    x = torch.randn(50, 16)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]))  # expert 7 always selected
    logits, scores, index, weights, cutoff = router(x)
    ref_scores = torch.sigmoid(x.double() @ router.weight.double().T)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=1e-6, atol=1e-6)
    assert (index == 7).any(-1).all()
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 2.5))
    # weights are the unbiased scores at the selected experts, normalised, times the scale
    picked = ref_scores.gather(1, index)
    torch.testing.assert_close(weights.double(), picked / picked.sum(-1, keepdim=True) * 2.5, rtol=1e-5, atol=1e-6)
    # selection = top-k of the biased scores; cutoff = (k+1)-th largest biased score
    biased = ref_scores + router.bias.double()
    order = biased.argsort(-1, descending=True)
    assert torch.equal(index.sort(-1).values, order[:, :3].sort(-1).values)
    torch.testing.assert_close(cutoff.double(), biased.gather(1, order[:, 3:4]).squeeze(1), rtol=1e-6, atol=1e-6)


def test_router_logits_stay_fp32_under_autocast():
    """docs/design.md §3: the router runs in fp32 even when autocast would make the linear layer bf16."""
    router = init_(KDAMoERouter(make_config(num_experts=8)))
    x = torch.randn(64, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, scores, *_ = router(x)
    assert logits.dtype == scores.dtype == torch.float32
    torch.testing.assert_close(logits.double(), x.double() @ router.weight.double().T, rtol=1e-6, atol=1e-6)


def test_router_logits_gradients_match_float64():
    x = torch.randn(5, 3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 3, 4, dtype=torch.float64)
    got = torch.autograd.grad(moe._RouterLogits.apply(x, w), (x, w), g)
    want = torch.autograd.grad(x @ w.T, (x, w), g)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_router_bf16_logits_are_exact_products_in_fp32():
    """bf16 operands: fp32-output GEMM == widening first (exact products); gradients vs float64."""
    x = torch.randn(300, 256, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(16, 256, device="cuda") * 0.05).bfloat16().requires_grad_()
    logits = moe._RouterLogits.apply(x, w)
    want = x.double() @ w.double().T
    assert logits.dtype == torch.float32
    assert ((logits.double() - want).norm() / want.norm()).item() < 1e-6
    g = torch.randn(300, 16, device="cuda")
    logits.backward(g)
    for got, ref in ((x.grad, g.double() @ w.double()), (w.grad, g.double().T @ x.double())):
        assert got.dtype == torch.bfloat16 and ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_router_bias_is_a_persistent_fp32_buffer():
    router = KDAMoERouter(make_config())
    assert "bias" in router.state_dict() and router.bias.dtype == torch.float32
    assert "bias" not in dict(router.named_parameters())


# ----------------------------------------------------------------------------------------------- block


@pytest.mark.parametrize("num_shared", [0, 2])
@pytest.mark.parametrize("parts", [1, 4])
def test_block_output_equals_router_plus_experts_plus_shared(num_shared, parts, monkeypatch):
    """Also an inference forward longer than MOE_INFERENCE_TOKENS (3 here: 10 tokens in 4 parts)."""
    config = make_config(num_shared_experts=num_shared)
    block = init_(KDAMoESparseMoeBlock(config)).double().eval()
    assert (block.shared_experts is None) == (num_shared == 0)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    if parts > 1:
        monkeypatch.setattr(moe, "MOE_INFERENCE_TOKENS", 3)
    with torch.set_grad_enabled(parts == 1):
        out, logits, aux = block(x)
    flat = x.reshape(-1, 16)
    ref_logits = flat @ block.router.weight.T
    s = torch.sigmoid(ref_logits)
    index = s.topk(2, -1).indices
    w = s.gather(1, index)
    ref = naive_experts(block.experts, flat, index, w / w.sum(-1, keepdim=True))
    if num_shared:
        ref = ref + block.shared_experts(flat)
    assert aux is None and logits.dtype == torch.float64 and logits.shape == (10, 6)  # a float64 block routes in it
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref.view(2, 5, 16), rtol=1e-12, atol=1e-12)


def test_statistics_nothing_applies_are_warned_about_once_the_window_is_long(monkeypatch):
    """Quantile Balancing keeps every training forward's router logits until `apply_balancing`; a trainer that never
    calls it (HF Trainer without `LoadBalancingCallback`) would grow them without end: after
    PENDING_FORWARDS_WARNING forwards of one window a warning says what to call. Applying the update starts a new
    window; loss-free balancing keeps only counts and never warns."""
    warnings = []
    monkeypatch.setattr(moe, "PENDING_FORWARDS_WARNING", 3)
    monkeypatch.setattr(moe.logger, "warning_once", warnings.append)
    x = torch.randn(2, 5, 16)
    block = init_(KDAMoESparseMoeBlock(make_config(router_balancing="quantile"))).train()
    for _ in range(2):
        block(x)
    assert warnings == []
    block.apply_balancing()
    for _ in range(3):
        block(x)
    assert len(warnings) == 1 and "apply_load_balancing" in warnings[0] and "LoadBalancingCallback" in warnings[0]
    block.apply_balancing()
    block(x)
    assert len(warnings) == 1
    free = init_(KDAMoESparseMoeBlock(make_config(router_balancing="loss_free"))).train()
    for _ in range(4):
        free(x)
    assert len(warnings) == 1


def test_aux_loss_switch_style():
    config = make_config(router_balancing="aux_loss", router_aux_loss_coef=0.1, num_experts=4)
    block = init_(KDAMoESparseMoeBlock(config)).train()
    x = torch.randn(2, 6, 16)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out, logits, aux = block(x, mask)
    s = torch.sigmoid(logits.double())[mask.reshape(-1)]
    index = s.topk(2, -1).indices
    f = torch.stack([(index == j).sum() for j in range(4)]).double() / index.numel()
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(aux.double(), 0.1 * 4 * (f * p).sum(), rtol=1e-5, atol=1e-7)
    aux.backward()
    assert block.router.weight.grad.abs().sum() > 0
    block.eval()
    assert block(x)[2] is None
    assert init_(KDAMoESparseMoeBlock(make_config())).train()(x)[2] is None  # only with router_balancing="aux_loss"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_cuda_grouped_bf16_matches_float64(activation):
    """GPU path (grouped_mm, Triton SiTU-GLU) vs the float64 loop: outputs and input gradients."""
    config = make_config(hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                         expert_activation=activation)
    experts = init_(KDAMoEExperts(config), std=0.05)
    index, weights = routing(1000, 16, 4, skip=(5,))
    x = torch.randn(1000, 256, dtype=torch.float64)
    dy = torch.randn(1000, 256, dtype=torch.float64)
    results = []
    for dtype, device in ((torch.bfloat16, "cuda"), (torch.float64, "cpu")):
        e = copy.deepcopy(experts).to(device, dtype)
        xx = x.to(device, dtype).requires_grad_()
        out = e(xx, index.to(device), weights.to(device, torch.float32 if dtype == torch.bfloat16 else dtype))
        out.backward(dy.to(device, dtype))
        results.append((out.double().cpu(), xx.grad.double().cpu(), e.gate_up_proj.grad.double().cpu()))
    for got, want in zip(*results):
        assert ((got - want).norm() / want.norm()).item() < 2e-2

"""Depth attention (`attnres.py`) against the stacked formula of docs/design.md §4, in float64."""

import pytest
import torch

from kdamoe.model.attnres import DepthAttention


def naive_depth_attention(sources, query, gamma, eps):
    """``Σ_s softmax_s(w · RMSNorm_γ(V_s)) V_s`` on the stacked ``[S, B, T, D]`` sources."""
    values = torch.stack(sources)
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return torch.einsum("sbt,sbtd->btd", (keys @ query).softmax(0), values)


def make(S, B=2, T=5, D=24, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(B, T, D, generator=gen) * (1 + s)).to(dtype).requires_grad_() for s in range(S)]
    module = DepthAttention(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        module.query.copy_(torch.randn(D, generator=gen))
        module.key_norm_weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    return module, sources


@pytest.mark.parametrize("S", [1, 2, 5])
def test_forward_and_gradients_equal_the_stacked_formula(S):
    module, sources = make(S)
    out = module(sources)
    ref = naive_depth_attention(sources, module.query, module.key_norm_weight, module.eps)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    cot = torch.randn_like(out)
    params = [*sources, module.query, module.key_norm_weight]
    got = torch.autograd.grad(out, params, cot)
    want = torch.autograd.grad(ref, params, cot)
    for name, a, b in zip([f"source{s}" for s in range(S)] + ["query", "key_norm_weight"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    small, small_sources = make(S, B=1, T=3, D=8, seed=1)
    assert torch.autograd.gradcheck(lambda *x: small(list(x)), tuple(small_sources))


def test_bf16_sources_match_the_fp64_formula_and_weights_are_convex():
    module, sources = make(4, dtype=torch.float64)
    low = [s.detach().bfloat16() for s in sources]
    lowmod = DepthAttention(module.query.numel()).bfloat16()
    lowmod.load_state_dict(module.state_dict())
    out = lowmod(low)
    assert out.dtype == torch.bfloat16
    ref = naive_depth_attention([s.double() for s in low], lowmod.query.double(), lowmod.key_norm_weight.double(),
                                lowmod.eps)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2
    w = lowmod.depth_weights(low)
    assert w.shape == (4, 2, 5) and torch.allclose(w.sum(0), torch.ones(2, 5)) and (w >= 0).all()


def test_backward_keeps_the_sources_by_reference():
    """What autograd keeps for the backward: the sources themselves (no stacked or fp32 copy) and [S, B, T] stats."""
    module, sources = make(3, B=2, T=7, D=32, dtype=torch.float32)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = module(sources)
    big = [x for x in saved if x.numel() >= 2 * 7 * 32]
    assert len(big) == 3 and all(any(x.data_ptr() == s.data_ptr() for s in sources) for x in big)
    assert sum(x.numel() for x in saved if x.numel() < 2 * 7 * 32) <= 3 * 3 * 2 * 7 + 2 * 32
    out.sum().backward()
    assert all(s.grad is not None for s in sources)

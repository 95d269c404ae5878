"""KDA ops (torch paths) against the naive per-token recurrence of docs/design.md §2."""

import pytest
import torch
import torch.nn.functional as F

import kdamoe

LOWER_BOUND = -5.0


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_inputs(B, T, H, K, V, gate, dtype=torch.float64, seed=0, with_state=True):
    """Random op inputs as the KDA layer produces them: unit-norm k, beta in (0, 1), g from the gate."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(B, T, H, K)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    beta = torch.sigmoid(randn(B, T, H))
    if gate == "bounded":
        g = kdamoe.kda_gate(2 * randn(B, T, H, K), torch.zeros(H, dtype=torch.float64), gate="bounded", lower_bound=LOWER_BOUND)
    else:
        g = kdamoe.kda_gate(3 * randn(B, T, H, K), torch.zeros(H, dtype=torch.float64), gate="softplus")
        # A few tokens decay by 50..100 nats on some channels: far past what a factorised exp(Γ_i − Γ_j) survives.
        hit = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) < 0.03
        g = torch.where(hit, -50 - 50 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64), g)
    h0 = randn(B, H, K, V) if with_state else None
    out = [q, k, v, g, beta]
    return [x.to(dtype) for x in out] + [None if h0 is None else h0.to(dtype)]


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("T", [1, 63, 65, 130, 200])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-4)])
def test_chunk_matches_naive(T, gate, dtype, tol):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 16, 24, gate, dtype, seed=T, with_state=T != 63)
    # The oracle runs in float64 on the same (rounded) values.
    ref_o, ref_s = kdamoe.naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=None if h0 is None else h0.double(), output_final_state=True)
    o, s = kdamoe.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == dtype and o.shape == (2, T, 2, 24)
    assert s.shape == (2, 2, 16, 24) and s.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert rel_err(o, ref_o) < tol
    assert rel_err(s, ref_s) < tol


def test_naive_float32_matches_float64():
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 16, 16, "softplus")
    ref_o, ref_s = kdamoe.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kdamoe.naive_recurrent_kda(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(), output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-5 and rel_err(s, ref_s) < 1e-5
    o_no_state, s_none = kdamoe.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert s_none is None and torch.equal(o_no_state, ref_o)


def test_chunk_bfloat16_inputs():
    q, k, v, g, beta, h0 = make_inputs(1, 100, 2, 32, 32, "bounded", torch.bfloat16)
    ref_o, ref_s = kdamoe.naive_recurrent_kda(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double(), output_final_state=True)
    o, s = kdamoe.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-2 and rel_err(s, ref_s) < 1e-4


def test_scale_argument():
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 8, 8, "bounded")
    o, _ = kdamoe.chunk_kda(q, k, v, g, beta, scale=0.3, initial_state=h0)
    ref, _ = kdamoe.naive_recurrent_kda(q * (0.3 / 8**-0.5), k, v, g, beta, initial_state=h0)
    assert rel_err(o, ref) < 1e-12


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("op", ["chunk", "recurrent", "naive"])
def test_cu_seqlens_equals_separate_documents(op, gate):
    fn = {"chunk": kdamoe.chunk_kda, "recurrent": kdamoe.recurrent_kda, "naive": kdamoe.naive_recurrent_kda}[op]
    lengths = [5, 65, 0, 130, 1]
    T = sum(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 16, 8, gate, seed=1)
    h0 = torch.randn(len(lengths), 2, 16, 8, dtype=torch.float64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, T, 2, 8) and s.shape == (len(lengths), 2, 16, 8)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        ref_o, ref_s = kdamoe.naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=h0[n : n + 1], output_final_state=True)
        if b > a:
            assert rel_err(o[:, sl], ref_o) < 1e-10
        assert rel_err(s[n : n + 1], ref_s) < 1e-10
    # Without an initial state every document starts from zeros, never from its predecessor's state.
    o0, _ = fn(q, k, v, g, beta, cu_seqlens=cu)
    a, b = cu[3].item(), cu[4].item()
    ref_o, _ = kdamoe.naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
    assert rel_err(o0[:, a:b], ref_o) < 1e-10


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gradients_match_naive(gate):
    inputs = make_inputs(2, 130, 2, 8, 8, gate, seed=3)
    w_o = torch.randn(2, 130, 2, 8, dtype=torch.float64)
    w_s = torch.randn(2, 2, 8, 8, dtype=torch.float64)

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        return [x.grad for x in leaves]

    for name, got, ref in zip("q k v g beta h0".split(), grads(kdamoe.chunk_kda), grads(kdamoe.naive_recurrent_kda)):
        assert torch.isfinite(got).all(), name
        assert rel_err(got, ref) < 1e-6, name


@pytest.mark.parametrize("op", [kdamoe.chunk_kda, kdamoe.recurrent_kda])
@pytest.mark.parametrize("cu_seqlens", [None, torch.tensor([0, 0, 0])])
def test_no_tokens_pass_the_state_through(op, cu_seqlens):
    """T = 0 (or only empty documents): an empty output, each final state equal to its initial state, and the
    state's gradient flowing back unchanged, as the naive recurrence gives."""
    B = 2 if cu_seqlens is None else 1
    q, k, v, g, beta, _ = make_inputs(B, 0, 2, 8, 4, "bounded")
    h0 = torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    o, s = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    ro, rs = kdamoe.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        cu_seqlens=cu_seqlens)
    assert o.shape == ro.shape == (B, 0, 2, 4)
    assert torch.equal(s, rs) and torch.equal(s, h0)
    w = torch.randn_like(s)
    (s * w).sum().backward()
    assert torch.equal(h0.grad, w)
    o, s = op(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens)
    assert torch.equal(s, torch.zeros_like(s))


def test_recurrent_in_pieces_equals_one_chunk_call():
    q, k, v, g, beta, h0 = make_inputs(2, 150, 2, 16, 8, "bounded", torch.float32, seed=4)
    full_o, full_s = kdamoe.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for op in (kdamoe.recurrent_kda, kdamoe.chunk_kda):
        state, outs, start = h0, [], 0
        for length in (1, 63, 7, 1, 78):
            sl = slice(start, start + length)
            o, state = op(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, output_final_state=True)
            outs.append(o)
            start += length
        assert rel_err(torch.cat(outs, 1), full_o) < 1e-5
        assert rel_err(state, full_s) < 1e-5


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("t", [1, 40, 64, 100])
def test_causality(gate, t):
    """Changing q/k/v/g/beta at positions >= t leaves o[:, :t] and the gradients of a loss on it unchanged."""
    T = 150
    inputs = make_inputs(1, T, 2, 16, 16, gate, torch.float32, seed=5)
    changed = [x.clone() for x in inputs[:5]]
    gen = torch.Generator().manual_seed(6)
    for x in changed[:3]:
        x[:, t:] = torch.randn(x[:, t:].shape, generator=gen)
    changed[3][:, t:] = -100 * torch.rand(changed[3][:, t:].shape, generator=gen)  # much faster future decay
    changed[4][:, t:] = torch.rand(changed[4][:, t:].shape, generator=gen)
    w = torch.randn(1, t, 2, 16, generator=gen)

    def run(xs):
        leaves = [x.clone().requires_grad_() for x in [*xs, inputs[5]]]
        o, _ = kdamoe.chunk_kda(*leaves[:5], initial_state=leaves[5])
        (o[:, :t] * w).sum().backward()
        return o[:, :t].detach(), [x.grad[:, :t] if i < 5 else x.grad for i, x in enumerate(leaves)]

    o_a, grads_a = run(inputs[:5])
    o_b, grads_b = run(changed)
    assert torch.equal(o_a, o_b)
    for name, a, b in zip("q k v g beta h0".split(), grads_a, grads_b):
        assert torch.equal(a, b), name


def test_kda_gate_ranges_and_formulas():
    g_raw = 3 * torch.randn(3, 7, 4, 16, dtype=torch.float64)
    A_log = 0.5 * torch.randn(4, dtype=torch.float64)
    dt_bias = torch.randn(4 * 16, dtype=torch.float64)
    x = g_raw + dt_bias.view(4, 16)
    bounded = kdamoe.kda_gate(g_raw, A_log, dt_bias, gate="bounded", lower_bound=-3.0)
    assert bounded.dtype == torch.float64 and bounded.shape == g_raw.shape
    assert (bounded > -3.0).all() and (bounded < 0).all()
    assert torch.allclose(bounded, -3.0 * torch.sigmoid(A_log.exp()[:, None] * x))
    soft = kdamoe.kda_gate(g_raw, A_log, dt_bias.view(4, 16), gate="softplus")
    assert (soft < 0).all()
    assert torch.allclose(soft, -A_log.exp()[:, None] * torch.log1p(torch.exp(x)), rtol=1e-5, atol=1e-6)
    # Saturated inputs stay inside the closed range (sigmoid rounds to 0 or 1 in fp32); softplus is unbounded below.
    huge = 1e4 * torch.randn(3, 7, 4, 16)
    bounded = kdamoe.kda_gate(huge, A_log.float(), dt_bias.float(), gate="bounded", lower_bound=-5.0)
    assert bounded.dtype == torch.float32 and (bounded >= -5.0).all() and (bounded <= 0).all()
    assert kdamoe.kda_gate(huge, A_log.float(), dt_bias.float(), gate="softplus").min() < -1e3
    assert kdamoe.kda_gate(g_raw.bfloat16(), A_log.float(), None, gate="softplus").dtype == torch.float32


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate,lower_bound", [(None, -4.0), ("bounded", None), (None, None), ("softplus", None)])
def test_fused_gate_and_l2norm(op, gate, lower_bound):
    fn = {"chunk": kdamoe.chunk_kda, "recurrent": kdamoe.recurrent_kda}[op]
    gen = torch.Generator().manual_seed(7)
    B, T, H, K, V = 1, 70, 2, 8, 8
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for D in (K, K, V))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g_raw = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    A_log, dt_bias = torch.randn(H, generator=gen, dtype=torch.float64), torch.randn(H * K, generator=gen, dtype=torch.float64)
    o, s = fn(q, k, v, g_raw, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, gate=gate)
    # Expected gate: flash-linear-attention semantics when gate is None; -5 is the bounded default.
    kind = gate or ("bounded" if lower_bound is not None else "softplus")
    g = kdamoe.kda_gate(g_raw, A_log, dt_bias, gate=kind, lower_bound=lower_bound if lower_bound is not None else -5.0)
    qn, kn = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (q, k))
    ref_o, ref_s = kdamoe.naive_recurrent_kda(qn, kn, v, g, beta, output_final_state=True)
    assert rel_err(o, ref_o) < 1e-10 and rel_err(s, ref_s) < 1e-10


def test_backend_selection():
    q, k, v, g, beta, _ = make_inputs(1, 10, 1, 8, 8, "bounded")
    o_auto, _ = kdamoe.chunk_kda(q, k, v, g, beta)  # CPU tensors: the torch backend
    o_torch, _ = kdamoe.chunk_kda(q, k, v, g, beta, backend="torch")
    assert torch.equal(o_auto, o_torch)
    with pytest.raises(ValueError, match="backend"):
        kdamoe.chunk_kda(q, k, v, g, beta, backend="triton")  # CPU tensors never go to triton
    with pytest.raises(ValueError, match="backend"):
        kdamoe.recurrent_kda(q, k, v, g, beta, backend="cuda")


def test_bad_inputs_raise():
    q, k, v, g, beta, h0 = make_inputs(2, 10, 2, 8, 4, "bounded")
    cases = [
        (dict(q=q[0]), "q must have shape"),
        (dict(k=k[..., :4]), "k must have the shape"),
        (dict(g=g[:, :5]), "g must have the shape"),
        (dict(v=v[:, :5]), "v must have shape"),
        (dict(beta=beta[..., None]), "beta must have shape"),
        (dict(initial_state=h0[:1]), "initial_state must have shape"),
        (dict(initial_state=h0.transpose(-1, -2)), "initial_state must have shape"),
        (dict(cu_seqlens=torch.tensor([0, 4, 10])), "batch size must be 1"),
    ]
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    for fn in (kdamoe.chunk_kda, kdamoe.recurrent_kda, kdamoe.naive_recurrent_kda):
        for change, message in cases:
            with pytest.raises(ValueError, match=message):
                fn(**{**args, **change})
    one = dict(q=q[:1], k=k[:1], v=v[:1], g=g[:1], beta=beta[:1])
    for cu, message in [(torch.tensor([0, 4, 9]), "cu_seqlens"), (torch.tensor([0, 6, 4, 10]), "cu_seqlens"),
                        (torch.tensor([0.0, 10.0]), "cu_seqlens"), (torch.tensor([[0, 10]]), "cu_seqlens")]:
        with pytest.raises(ValueError, match=message):
            kdamoe.chunk_kda(**one, cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state"):
        kdamoe.chunk_kda(**one, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=h0[:1])
    with pytest.raises(ValueError, match="lower_bound"):
        kdamoe.chunk_kda(**args, use_gate_in_kernel=True, gate="softplus", lower_bound=-5.0)
    with pytest.raises(ValueError, match="gate"):
        kdamoe.chunk_kda(**args, use_gate_in_kernel=True, gate="sigmoid")
    with pytest.raises(ValueError, match="A_log"):
        kdamoe.chunk_kda(**args, use_gate_in_kernel=True, A_log=torch.zeros(3))
    with pytest.raises(ValueError, match="dt_bias"):
        kdamoe.kda_gate(g, None, torch.zeros(5))
    with pytest.raises(ValueError, match="lower_bound"):
        kdamoe.kda_gate(g, None, gate="bounded", lower_bound=1.0)

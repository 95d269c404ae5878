"""Depth attention (`attnres.py`) against the stacked formula of docs/design.md §4, in float64; its Triton kernels
(`attnres_triton.py`) against that formula and the torch path.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set before triton is first imported; when another module
imported triton earlier in this process, ``test_kernels_in_interpreter_subprocess`` reruns this file in a fresh
process). The ``small_tiles`` fixture shrinks the tiles so that each shape spans several tiles and persistent
programs with rows left over; the model-level tests run the default launch (their 48 rows of 32 values are two tiles).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_interpreter import DEV, ON_GPU, check_compiles_for_sm90, kernel_test, rerun_in_interpreter, rerun_test
from conftest import assert_out_dtype_is_a_rounding, rel

from kdamoe.model import attnres, attnres_triton  # noqa: E402
from kdamoe.model.attnres import DepthAttention  # noqa: E402

# masked-off lanes must not compute inf or NaN either (numpy's RuntimeWarning under the interpreter)
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


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


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
def test_backward_keeps_the_sources_by_reference(backend):
    """What autograd keeps for the backward: the sources themselves (no stacked or fp32 copy) and [S, B, T] stats."""
    module, sources = on_dev(*make(3, B=2, T=7, D=32, dtype=torch.float32))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = module(sources, backend=backend)
    big = [x for x in saved if x.numel() >= 2 * 7 * 32]
    assert len(big) == 3 and all(any(x.data_ptr() == s.data_ptr() for s in sources) for x in big)
    assert sum(x.numel() for x in saved if x.numel() < 2 * 7 * 32) <= 3 * 3 * 2 * 7 + 2 * 32
    out.sum().backward()
    assert all(s.grad is not None for s in sources)


def read_by_three_sublayers(sources, modules, marks, backend, cot, extra):
    """Sublayers 0, 1, 2 read sources[:1], [:2], [:3] (marked by `with_gradient_sink` where `marks[s]`), and the loss
    adds `extra` times the sum of source 0 (a gradient reaching a marked source the usual way); the leaves' grads."""
    leaves = [v.detach().requires_grad_() for v in sources]
    read = [attnres.with_gradient_sink(v) if mark else v for v, mark in zip(leaves, marks)]
    loss = extra * read[0].sum()
    for n, module in enumerate(modules):
        loss = loss + (module(read[: n + 1], backend=backend) * cot[n]).sum()
    loss.backward()
    return [v.grad for v in leaves], read


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
def test_readers_sum_a_sources_gradient_in_its_sink(small_tiles, monkeypatch, backend):
    """Sources marked by `with_gradient_sink`: every reader's backward adds its part to the sink (the kernels into the
    buffer, in place) and autograd gets the sum once: the gradients equal the float64 formula's and those of the same
    sources unmarked, with and without a gradient reaching a marked source the usual way."""
    gen = torch.Generator().manual_seed(5)
    sources = make(3, B=2, T=5, D=24, seed=5)[1]
    modules = [make(n + 1, B=2, T=5, D=24, seed=10 + n)[0] for n in range(3)]
    cot = [torch.randn(2, 5, 24, generator=gen, dtype=torch.float64) for _ in range(3)]
    dev_modules = [on_dev(m, sources)[0] for m in modules]
    dev_sources = [v.detach().to(DEV, torch.float32) for v in sources]
    dev_cot = [c.to(DEV, torch.float32) for c in cot]
    calls = []
    real_bwd = attnres.depth_attention_bwd

    def recording_bwd(*args):
        calls.append([acc is not None for acc in args[10]])
        return real_bwd(*args)

    monkeypatch.setattr(attnres, "depth_attention_bwd", recording_bwd)
    for extra in (0.0, 0.5):
        loss = extra * sources[0].sum()
        for n, m in enumerate(modules):
            loss = loss + (naive_depth_attention(sources[: n + 1], m.query, m.key_norm_weight, m.eps) * cot[n]).sum()
        want = torch.autograd.grad(loss, sources)
        calls.clear()
        got, read = read_by_three_sublayers(dev_sources, dev_modules, [True, True, False], backend, dev_cot, extra)
        plain, _ = read_by_three_sublayers(dev_sources, dev_modules, [False] * 3, backend, dev_cot, extra)
        for s in range(3):
            assert rel(got[s], want[s]) < 1e-5 and rel(got[s], plain[s]) < 1e-6, s
        assert all(v._gradient_sink.grad is None for v in read[:2])  # handed to autograd, nothing kept
        if backend == "triton":  # backward order: sublayer 2 stores into the sinks, 1 adds into both, 0 into one
            assert calls[:3] == [[False, False, False], [True, True], [True]], calls


def block_of_three_sublayers(embedding, modules, weights, backend, cot, seen=None):
    """One block through `ResidualState`: sublayer n reads the embedding and the partial sum, its output
    ``tanh(x @ weights[n])`` is added to the sum, and ``modules[3]`` reads the last sum; ``seen`` collects each
    output's gradient (the tensor, and a copy made when it arrives)."""
    state = attnres.ResidualState.start(embedding, "block_attnres")
    for module, weight in zip(modules, weights):
        out = torch.tanh(module(state.sources(), backend=backend) @ weight)
        if seen is not None:
            out.register_hook(lambda grad: seen.append((grad, grad.clone())))
        state = state.add(out, close_block=False)
    return (modules[3](state.sources(), backend=backend) * cot).sum()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
def test_partial_sums_take_the_gradient_the_add_lends(small_tiles, monkeypatch, backend):
    """The partial sums of a block carry sinks too: the add forming the next sum lends its gradient to the partial's
    sink and the depth attention reading the partial adds its part to it out of place. Every gradient equals float64
    autograd's and that of the same block unmarked, and the lent tensors (the outputs' gradients) keep their values."""
    D = 24
    gen = torch.Generator().manual_seed(7)
    embedding = torch.randn(2, 5, D, generator=gen, dtype=torch.float64)
    weights = [torch.randn(D, D, generator=gen, dtype=torch.float64) / D**0.5 for _ in range(3)]
    modules = [make(1, D=D, seed=30 + n)[0] for n in range(4)]
    cot = torch.randn(2, 5, D, generator=gen, dtype=torch.float64)

    def grads(dev, dtype, marked, seen=None):
        leaves = [t.detach().to(dev, dtype).requires_grad_() for t in (embedding, *weights)]
        mods = [on_dev(m, [])[0].to(dev, dtype) for m in modules]
        with monkeypatch.context() as m:
            if not marked:
                m.setattr(attnres, "with_gradient_sink", lambda source: source)
            loss = block_of_three_sublayers(leaves[0], mods, leaves[1:], backend if dtype == torch.float32 else "torch",
                                            cot.to(dev, dtype), seen)
        params = [p for mod in mods for p in mod.parameters()]
        return torch.autograd.grad(loss, leaves + params)

    addends = []
    real = attnres._lent_gradient
    monkeypatch.setattr(attnres, "_lent_gradient", lambda *args: addends.append(real(*args)) or addends[-1])
    want = grads("cpu", torch.float64, marked=False)
    seen = []
    addends.clear()
    got = grads(DEV, torch.float32, marked=True, seen=seen)
    lent = addends[:]
    addends.clear()
    plain = grads(DEV, torch.float32, marked=False)
    for n, (a, b, c) in enumerate(zip(got, want, plain)):
        if not b.any():  # the first sublayer's query: a softmax over one source has no gradient
            assert a.abs().max() < 1e-6 and c.abs().max() < 1e-6, n
            continue
        assert rel(a, b) < 1e-5 and rel(a, c) < 1e-6, n
    assert len(seen) == 3 and all(torch.equal(grad, copy) for grad, copy in seen)
    # backward order: the last read (no add after it), sublayers 2 and 1 (their partial sum holds the add's lent
    # gradient), sublayer 0 (the embedding alone); unmarked, no reader gets one
    assert [None if a is None else a[0] for a in lent] == [None, 1, 1, None] and addends == [None] * 4


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------------------


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


@pytest.fixture
def small_tiles(monkeypatch):
    """2 rows of D <= 32 per tile, 1 of wider rows (the interpreter runs 3 persistent programs)."""
    for cfg in attnres_triton.LAUNCH.values():
        monkeypatch.setitem(cfg, "tile", 64)


def on_dev(module, sources, dtype=torch.float32, requires_grad=True):
    """The module and sources of ``make`` on DEV in ``dtype`` (the module's parameters in fp32)."""
    mod = DepthAttention(module.query.numel(), eps=module.eps).to(DEV)
    mod.load_state_dict(module.state_dict())
    return mod, [s.detach().to(DEV, dtype).requires_grad_(requires_grad) for s in sources]


# (S, B, T, D): D not a power of 2, rows (B·T) not a multiple of the tile, one program with several tiles
KERNEL_CASES = [(1, 2, 5, 24), (2, 3, 7, 100), (7, 1, 9, 20), (4, 2, 3, 1), (3, 0, 4, 24)]


@kernel_test
@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("S,B,T,D", KERNEL_CASES)
def test_kernels_match_the_torch_path_and_float64(small_tiles, monkeypatch, hold, S, B, T, D):
    if not hold:
        monkeypatch.setattr(attnres_triton, "HOLD_REGISTERS", 0)
    module, sources = make(S, B, T, D, seed=S)
    mod, ours = on_dev(module, sources)
    u = mod.query.detach() * mod.key_norm_weight.detach()
    stats = attnres_triton.depth_attention_fwd([v.detach() for v in ours], mod.query.detach(),
                                                mod.key_norm_weight.detach(), mod.eps)
    for got, want, name in zip(stats, attnres._forward_torch([v.detach() for v in ours], u, mod.eps),
                               ("out", "logits", "rstd", "weights")):
        assert got.shape == want.shape and rel(got, want) < 1e-6, name
    out = mod(ours, backend="triton")
    ref = naive_depth_attention(sources, module.query, module.key_norm_weight, module.eps)
    assert out.dtype == torch.float32 and rel(out, ref) < 1e-6
    cot = torch.randn(out.shape, dtype=torch.float64)
    params = [*ours, mod.query, mod.key_norm_weight]
    got = torch.autograd.grad(out, params, cot.to(DEV, torch.float32))
    torch_path = torch.autograd.grad(mod(ours, backend="torch"), params, cot.to(DEV, torch.float32))
    want = torch.autograd.grad(ref, [*sources, module.query, module.key_norm_weight], cot)
    for name, g, t, w in zip([f"source{s}" for s in range(S)] + ["query", "key_norm_weight"], got, torch_path, want):
        assert g.shape == w.shape and g.dtype == torch.float32, name
        if w.norm() > 0:  # S = 1: no gradient reaches query and key_norm_weight
            assert rel(g, w) < 1e-5 and rel(g, t) < 1e-5, name
        else:  # only fp32 rounding of Σ_s w_s g_s − w_s Σ_s w_s g_s, which is 0 for S = 1
            assert (g.abs() < 1e-5).all() and (t.abs() < 1e-5).all(), name


@kernel_test
@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("S,B,T,D", [case for case in KERNEL_CASES if case[3] > 1])  # a norm over 1 value: sign(h)
def test_kernels_with_the_norm_match_float64(small_tiles, monkeypatch, hold, S, B, T, D):
    """``norm=(weight, eps)``: RMSNorm of the mix in the same kernels (the mix recomputed in the backward, never kept)
    against the float64 formula followed by RMSNorm, output and every gradient, the norm weight's included; and the
    torch path (the two ops apart) alike."""
    if not hold:
        monkeypatch.setattr(attnres_triton, "HOLD_REGISTERS", 0)
    module, sources = make(S, B, T, D, seed=S)
    mod, ours = on_dev(module, sources)
    weight64 = (1 + 0.3 * torch.randn(D, dtype=torch.float64)).requires_grad_()
    weight = weight64.detach().to(DEV, torch.float32).requires_grad_()
    mix = naive_depth_attention(sources, module.query, module.key_norm_weight, module.eps)
    ref = mix * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + 1e-5) * weight64
    cot = torch.randn(ref.shape, dtype=torch.float64)
    params = [*ours, mod.query, mod.key_norm_weight, weight]
    want = torch.autograd.grad(ref, [*sources, module.query, module.key_norm_weight, weight64], cot)
    for backend in ("triton", "torch"):
        out = mod(ours, backend=backend, norm=(weight, 1e-5))
        assert out.dtype == torch.float32 and rel(out, ref) < 1e-5, backend
        got = torch.autograd.grad(out, params, cot.to(DEV, torch.float32))
        for name, g, w in zip([f"source{s}" for s in range(S)] + ["query", "key_norm_weight", "norm"], got, want):
            assert g.shape == w.shape and g.dtype == torch.float32, (backend, name)
            if w.norm() > 1e-9:
                assert rel(g, w) < 1e-4, (backend, name, rel(g, w))
            else:
                assert (g.abs() < 1e-5).all(), (backend, name)
    with torch.no_grad():
        assert rel(mod(ours, backend="triton", norm=(weight, 1e-5)), ref) < 1e-5


@kernel_test
def test_kernels_write_only_the_gradients_autograd_needs(small_tiles):
    module, sources = make(5, 2, 3, 40)
    mod, ours = on_dev(module, sources)
    for s in (0, 3):
        ours[s].requires_grad_(False)
    out = mod(ours, backend="triton")
    ref = naive_depth_attention(sources, module.query, module.key_norm_weight, module.eps)
    cot = torch.randn(out.shape, dtype=torch.float64)
    out.backward(cot.to(DEV, torch.float32))
    ref.backward(cot)
    assert ours[0].grad is None and ours[3].grad is None
    for ours_s, ref_s in zip([*ours[1:3], ours[4], mod.query], [*sources[1:3], sources[4], module.query]):
        assert rel(ours_s.grad, ref_s.grad) < 1e-5


@kernel_test
def test_kernels_with_bf16_sources_match_the_fp64_formula():
    """bf16 sources (the model's under autocast), fp32 parameters: output and source gradients in bf16, within bf16
    rounding of the float64 formula of the same bf16 values, and of the torch path."""
    module, sources = make(6, 2, 7, 48)
    mod, ours = on_dev(module, sources, torch.bfloat16)
    out = mod(ours, backend="triton")
    assert out.dtype == torch.bfloat16
    low = [v.detach().double().cpu().requires_grad_() for v in ours]
    ref = naive_depth_attention(low, module.query, module.key_norm_weight, module.eps)
    cot = torch.randn(out.shape, dtype=torch.float64).to(torch.bfloat16).double()
    params = [*ours, mod.query, mod.key_norm_weight]
    got = torch.autograd.grad(out, params, cot.to(DEV, torch.bfloat16))
    torch_path = torch.autograd.grad(mod(ours, backend="torch"), params, cot.to(DEV, torch.bfloat16))
    want = torch.autograd.grad(ref, [*low, module.query, module.key_norm_weight], cot)
    assert rel(out, ref) < 1e-2
    for s, (g, t, w) in enumerate(zip(got, torch_path, want)):
        assert g.dtype == (torch.bfloat16 if s < 6 else torch.float32)
        assert rel(g, w) < 2e-2 and rel(g, t) < 2e-2, s


@kernel_test
@pytest.mark.parametrize("norm", [False, True])
def test_kernels_take_sources_of_mixed_dtypes(small_tiles, norm):
    """Under autocast the embedding is fp32 and a block's first sublayer output bf16: the kernels take such sources
    (not the torch fallback), give the output in the first source's dtype and each source's gradient in its own,
    within bf16 rounding of the float64 formula of the same values and of the torch path."""
    module, sources = make(4, 2, 7, 48)
    mod, ours = on_dev(module, sources)
    ours = [v.detach().to(torch.bfloat16 if s % 2 else torch.float32).requires_grad_() for s, v in enumerate(ours)]
    assert attnres_triton.unsupported(ours) is None
    weight = (1 + 0.3 * torch.randn(48, dtype=torch.float64)).to(DEV, torch.float32)
    low = [v.detach().double().cpu().requires_grad_() for v in ours]
    ref = naive_depth_attention(low, module.query, module.key_norm_weight, module.eps)
    if norm:
        ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double().cpu()
    cot = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, low, cot)
    outs = {b: mod(ours, backend=b, norm=(weight, 1e-5) if norm else None) for b in ("triton", "torch")}
    grads = {b: torch.autograd.grad(out, ours, cot.to(DEV, out.dtype)) for b, out in outs.items()}
    assert outs["triton"].dtype == torch.float32 and rel(outs["triton"], ref) < 1e-5
    for s, (g, t, w) in enumerate(zip(grads["triton"], grads["torch"], want)):
        assert g.dtype == ours[s].dtype, s
        assert rel(g, w) < 1e-2 and rel(g, t) < 1e-2, s


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=kernel_test)])
def test_norm_output_in_out_dtype_is_the_rounding_of_the_wide_output(small_tiles, backend):
    """``out_dtype`` with the norm (a KDA layer's or dense MLP's input under autocast): the fp32 output rounded to it,
    and the same gradients."""
    module, sources = make(3, 2, 7, 48)
    mod, ours = on_dev(module, sources)
    ours = [v.detach().float() for v in ours]
    weight = (1 + 0.3 * torch.randn(48)).to(DEV)
    cot = torch.randn(2, 7, 48).to(DEV, torch.float16)

    def run(out_dtype):
        leaves = [v.clone().requires_grad_() for v in ours]
        mod.zero_grad(set_to_none=True)
        out = mod(leaves, backend=backend, norm=(weight, 1e-5), out_dtype=out_dtype)
        out.backward(cot.to(out.dtype))
        return out, [v.grad for v in leaves] + [mod.query.grad, mod.key_norm_weight.grad]

    assert_out_dtype_is_a_rounding(run)


@kernel_test
def test_kernel_dispatch():
    """Non-contiguous sources are copied; what the kernels cannot take falls back to torch, or raises when forced."""
    module, sources = make(3, 2, 5, 24)
    mod, ours = on_dev(module, sources)
    strided = [v.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for v in ours]
    assert not strided[0].is_contiguous()
    assert rel(mod(strided, backend="triton"), mod(ours, backend="torch")) < 1e-6
    many = [ours[0]] * (attnres_triton.MAX_SOURCES + 1)
    assert "MAX_SOURCES" in attnres_triton.unsupported(many)
    with pytest.raises(ValueError, match="MAX_SOURCES"):
        mod(many, backend="triton")
    with pytest.raises(ValueError, match="dtype torch.float64"):
        mod([ours[0], ours[1].double()], backend="triton")
    with pytest.raises(ValueError, match="backend"):
        mod(ours, backend="cuda")
    assert attnres._use_kernels(None, ours) == ON_GPU  # CPU tensors: the torch path unless forced


SM90_LAUNCHES = r"""
from kdamoe.model import attnres_triton

class Skip:  # the other kernels of a pass are not launched
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None

attnres_triton.persistent_programs = lambda device, *args, **kwargs: 132 * 12
kernel = attnres_triton.{kernel}
for name in ("_fwd_kernel", "_bwd_kernel", "_param_grad_kernel"):
    setattr(attnres_triton, name, Record() if name == "{kernel}" else Skip())
D, R = 1024, 64
for dtypes, norm, sink in (((torch.bfloat16,) * 5, True, True), ((torch.float32, torch.bfloat16), False, False)):
    sources = [torch.zeros(R, D, dtype=dtype) for dtype in dtypes]
    stats = torch.zeros(len(sources), R)
    rms = (torch.zeros(D), 1e-6) if norm else None
    if kernel.fn.__name__ == "_fwd_kernel":
        attnres_triton.depth_attention_fwd(sources, torch.zeros(D), torch.zeros(D), 1e-6, norm=rms)
    else:
        sinks = [torch.zeros_like(v) if sink and s < len(sources) - 1 else None for s, v in enumerate(sources)]
        attnres_triton.depth_attention_bwd(torch.zeros(R, D, dtype=torch.bfloat16), sources, torch.zeros(D),
                                           torch.zeros(D), stats, stats, stats, [True] * len(sources), norm=rms,
                                           rstd_h=torch.zeros(R) if norm else None, accumulate=sinks,
                                           addend=(len(sources) - 1, torch.zeros_like(sources[-1])) if sink else None)
"""


def test_kernels_compile_for_sm90():
    """The kernels compile to cubins for an H100/H200 (sm_90) as the GPU launches them, which the interpreter does
    not check: the twin's deepest Block AttnRes read (5 bf16 sources, the fused norm, gradient sinks on the 4
    completed sources, a gradient lent to the partial sum's) and mixed-dtype sources (fp32 embedding, bf16 sublayer
    output, as under autocast). No GPU needed, in a process without the interpreter."""
    check_compiles_for_sm90(SM90_LAUNCHES, expected=2, kernels=("_fwd_kernel", "_bwd_kernel", "_param_grad_kernel"))


def test_module_imports_and_falls_back_without_triton(tmp_path):
    """The model folder's files, as in a saved remote-code folder, on a machine without triton: attnres.py imports,
    the torch path runs and ``backend="triton"`` raises a clear error."""
    pkg = tmp_path / "remote"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for path in Path(attnres.__file__).parent.glob("*.py"):
        shutil.copy(path, pkg / path.name)
    code = """
import sys
sys.modules["triton"] = None  # import triton raises ImportError
import torch
from remote.attnres import DepthAttention
module = DepthAttention(8)
torch.nn.init.normal_(module.query)
torch.nn.init.ones_(module.key_norm_weight)
sources = [torch.randn(2, 3, 8, requires_grad=True) for _ in range(3)]
module(sources).sum().backward()
assert all(s.grad is not None for s in sources)
try:
    module(sources, backend="triton")
except RuntimeError as error:
    assert "needs triton" in str(error)
else:
    raise AssertionError("backend='triton' without triton must raise")
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


@kernel_test
@pytest.mark.parametrize("mode", ["block_attnres", "full_attnres"])
def test_model_with_depth_attention_and_norm_in_one_op_equals_the_two_ops(monkeypatch, mode):
    """A Block / Full AttnRes model whose depth attention runs on the kernels: with each sublayer's norm fused into
    them (the default) its loss, every parameter gradient and the hidden states equal those of the two ops apart (a
    hook on every norm turns the fusion off, as any hook does)."""
    from conftest import tiny_model

    model = tiny_model(residual_mode=mode, attnres_block_layers=2).to(DEV)
    monkeypatch.setattr(attnres, "_use_kernels", lambda backend, sources: True)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device=DEV)

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused, fused_grads = run()
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
    norms = [m for m in model.modules() if type(m).__name__ == "KDAMoERMSNorm"]
    handles = [m.register_forward_hook(lambda *args: None) for m in norms]
    apart, apart_grads = run()
    hidden_apart = model(input_ids=ids, output_hidden_states=True).hidden_states
    for handle in handles:
        handle.remove()
    assert rel(fused, apart) < 1e-6 and fused_grads.keys() == apart_grads.keys()
    # the two backward paths round apart in fp32; on the GPU the KDA kernels' tf32 dots (10-bit mantissa) turn that
    # into differences of ~4e-4 in the gradients that pass through them
    tol = 2e-3 if ON_GPU else 1e-4
    for name, grad in fused_grads.items():
        assert rel(grad, apart_grads[name]) < tol, name
    assert len(hidden) == len(hidden_apart) and all(rel(a, b) < 1e-6 for a, b in zip(hidden, hidden_apart))


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=kernel_test)])
@pytest.mark.parametrize("mode", ["block_attnres", "full_attnres"])
def test_model_gradients_with_gradient_sinks_equal_autograds_sums(monkeypatch, mode, kernels):
    """A Block / Full AttnRes model whose completed sources sum their readers' gradients in sinks: every parameter
    gradient equals that of the same model with the sources unmarked (autograd sums), also under gradient
    checkpointing, whose recompute builds sinks of its own."""
    from conftest import tiny_model

    model = tiny_model(residual_mode=mode, attnres_block_layers=2).to(DEV)
    monkeypatch.setattr(attnres, "_use_kernels", lambda backend, sources: kernels)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), device=DEV)

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    with_sinks = grads()
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()  # 5.17: older name
    checkpointed = grads()
    getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)()
    with monkeypatch.context() as m:
        m.setattr(attnres, "with_gradient_sink", lambda source: source)
        summed = grads()
    assert with_sinks.keys() == summed.keys() == checkpointed.keys()
    for name, grad in summed.items():
        assert rel(with_sinks[name], grad) < 1e-5 and rel(checkpointed[name], grad) < 1e-5, name

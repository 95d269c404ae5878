"""Triton KDA kernels against the float64 references of ``kda.py``.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on tiny shapes (fp32 inputs, tight tolerances).
The flag must be set before triton is first imported; when another test module imported triton earlier in
this process, ``test_kernels_in_interpreter_subprocess`` reruns this file in a fresh interpreter process.
On a GPU the same tests run on the device, plus the long-sequence sweeps marked ``gpu_only``.
"""


import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEV, ON_GPU, gpu_only, kernel_test, rerun_in_interpreter, rerun_test
from conftest import rel

pytest.importorskip("triton")
from kdamoe.model import kda, kda_chunk_bwd, kda_chunk_fwd, kda_launch  # noqa: E402
from kdamoe.model.kda_chunk import chunk_kda_triton  # noqa: E402
from kdamoe.model.kda_fused_recurrent import recurrent_kda_triton  # noqa: E402

# Under the interpreter an overflow or invalid value in any lane (numpy's RuntimeWarning) fails the test: lanes that
# are masked off must not compute inf or NaN either (a row block past the end of a part-filled chunk once did in
# `_intra_kernel`, harmlessly, as nothing of it was stored)
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

TOL = 5e-3 if ON_GPU else 1e-4  # tf32 matmuls on the GPU, exact fp32 in the interpreter
GRAD_TOL = 1e-2 if ON_GPU else 1e-4


def assert_gradients_match(outs, ref_outs, leaves, ref_leaves, tol):
    """Backpropagate the same random cotangents through ``(o, final_state)`` and its float64 reference; the
    gradients of ``q, k, v, g, beta, h0`` must agree to ``tol``."""
    cotangents = [torch.randn_like(x) for x in outs]
    torch.autograd.backward(list(outs), cotangents)
    torch.autograd.backward(list(ref_outs), [c.double() for c in cotangents])
    for name, x, y in zip("q k v g beta h0".split(), leaves, ref_leaves):
        assert rel(x.grad, y.grad) < tol, name


def count_launches(monkeypatch, module, name):
    """Count the launches of kernel ``name`` from ``module`` (the returned list gets one entry per launch)."""
    kernel, launches = getattr(module, name), []

    class Counted:
        def __getitem__(self, grid):
            launches.append(1)
            return kernel[grid]

    monkeypatch.setattr(module, name, Counted())
    return launches


@pytest.mark.parametrize("B,T", [(1, 1), (2, 64), (3, 130)])
def test_chunk_tables_fixed_length_cached_and_equal_to_a_loop(B, T):
    """The cached tables of a fixed-length batch equal those built by a Python loop over chunks, and the ones of
    the same boundaries given as cu_seqlens; a second call returns the cached tensors."""
    cstart = [n * T + t for n in range(B) for t in range(0, T, 64)]
    cend = [min(c + 64, (c // T + 1) * T) for c in cstart]
    coff = [n * -(-T // 64) for n in range(B + 1)]
    fixed = kda_launch.chunk_tables(B, T, None, torch.device("cpu"))
    varlen = kda_launch.chunk_tables(1, B * T, torch.arange(B + 1) * T, torch.device("cpu"))
    for tables in (fixed, varlen):
        assert tables.cu.tolist() == [n * T for n in range(B + 1)] and tables.coff.tolist() == coff
        assert tables.cstart.tolist() == cstart and tables.cend.tolist() == cend and tables.num_chunks == len(cstart)
        assert tables.num_seqs == B and tables.cstart.dtype == torch.int32
    assert kda_launch.chunk_tables(B, T, None, torch.device("cpu")).cstart is fixed.cstart


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=1200)


def make_inputs(B, T, H, K, V, gate="bounded", dtype=torch.float32, g_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    if gate == "bounded":
        g = -5.0 * torch.rand(B, T, H, K, generator=gen)  # the full bounded range [-5, 0]
    else:
        g = -F.softplus(3.0 * torch.randn(B, T, H, K, generator=gen)) * 4.0 * g_scale  # reaches ~ -40 per token
    return [x.to(DEV, dtype) for x in (q, k, v, g, beta)]


def oracle(q, k, v, g, beta, h0=None, cu_seqlens=None):
    """The float64 naive recurrence (short T) or float64 torch chunked path (long T)."""
    xs = [x.double() for x in (q, k, v, g, beta)]
    h0 = None if h0 is None else h0.double()
    if q.shape[1] <= 2048:
        return kda.naive_recurrent_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    return kda.chunk_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, backend="torch")


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("T,K,V", [(1, 16, 32), (70, 16, 32), (130, 32, 16)])
def test_forward_matches_oracle(gate, T, K, V):
    q, k, v, g, beta = make_inputs(2, T, 2, K, V, gate)
    h0 = torch.randn(2, 2, K, V, device=DEV)
    o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, gate=gate)
    ro, rht = oracle(q, k, v, g, beta, h0)
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL


@kernel_test
def test_forward_without_kept_states_matches_oracle(monkeypatch):
    """Per-chunk states above the bytes of Γ plus ``STATES_LIMIT_BYTES`` (V > K at very long T): the chunk loop
    writes O itself and keeps no states."""
    q, k, v, g, beta = make_inputs(1, 200, 2, 16, 32, "bounded")
    cu = torch.tensor([0, 70, 70, 200], device=DEV)
    h0 = torch.randn(3, 2, 16, 32, device=DEV)
    ro, rht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                            backend="torch")
    monkeypatch.setattr(kda_chunk_fwd, "STATES_LIMIT_BYTES", -(1 << 62))
    o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL


@kernel_test
@pytest.mark.parametrize("keep_states", [True, False])
@pytest.mark.parametrize("bv", [16, 64])
def test_forward_loop_v_blocks(monkeypatch, keep_states, bv):
    """The forward chunk loop in 16-wide V blocks (what a GPU takes when wider ones leave SMs idle) and 64-wide
    ones (16-bit inputs with many programs; here V = 96: the second block part-masked), on both of its paths
    (per-chunk states kept, or O written by the loop)."""
    q, k, v, g, beta = make_inputs(1, 200, 2, 16, 96, "bounded")
    cu = torch.tensor([0, 70, 70, 200], device=DEV)
    h0 = torch.randn(3, 2, 16, 96, device=DEV)
    ro, rht = oracle(q, k, v, g, beta, h0, cu_seqlens=cu)
    monkeypatch.setattr(kda_chunk_fwd, "fwd_loop_bv", lambda *args: bv)
    if not keep_states:
        monkeypatch.setattr(kda_chunk_fwd, "STATES_LIMIT_BYTES", -(1 << 62))
    o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_head_dims_over_several_slices(gate):
    """Head dims covered in several column slices (``SLICE``): K = 96 and V = 80 are two slices of 64 in
    ``_wu_kernel`` and ``_gate_cumsum_kernel``, the second part-masked, and six of 16 in ``_intra_kernel``; forward
    and gradients. On a GPU also fp32 tiles at BK = 128 in a reverse loop with fewer programs than SMs (its 2-stage
    prefetch once overflowed shared memory there)."""
    xs = [x.clone().requires_grad_() for x in make_inputs(1, 70, 1, 96, 80, gate)]
    h0 = torch.randn(1, 1, 96, 80, device=DEV, requires_grad=True)
    o, ht = chunk_kda_triton(*xs, initial_state=h0, output_final_state=True, gate=gate)
    rxs = [x.detach().double().requires_grad_() for x in xs + [h0]]
    ro, rht = kda.naive_recurrent_kda(*rxs[:5], initial_state=rxs[5], output_final_state=True)
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL
    assert_gradients_match((o, ht), (ro, rht), xs + [h0], rxs, GRAD_TOL)


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_backward_matches_oracle(gate, monkeypatch):
    inputs = make_inputs(1, 100, 2, 16, 32, gate) + [torch.randn(1, 2, 16, 32, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    loops = count_launches(monkeypatch, kda_chunk_fwd, "_fwd_state_kernel")
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, gate=gate)
    ro, rht = kda.naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True)
    assert_gradients_match((o, ht), (ro, rht), xs, ys, GRAD_TOL)
    assert loops == [1]  # the backward computes U from the states that the forward kept: no second chunk loop


@kernel_test
def test_backward_without_kept_states_matches_oracle(monkeypatch):
    """Per-chunk states over ``STATES_LIMIT_BYTES`` are not kept for the backward: it runs the chunk loop again
    instead of computing U from the forward's states. Both ways must give the reference gradients."""
    monkeypatch.setattr(kda_chunk_fwd, "STATES_LIMIT_BYTES", -(1 << 62))
    loops = count_launches(monkeypatch, kda_chunk_fwd, "_fwd_state_kernel")
    inputs = make_inputs(1, 100, 2, 16, 32, "bounded") + [torch.randn(1, 2, 16, 32, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True)
    ro, rht = kda.naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True)
    assert_gradients_match((o, ht), (ro, rht), xs, ys, GRAD_TOL)
    assert loops == [1, 1]  # the forward's loop, and the backward's again


@kernel_test
@pytest.mark.parametrize("T,slabs", [(300, 3), (256, 2)])
@pytest.mark.parametrize("keep_states", [True, False])
def test_slabbed_forward_backward_bit_identical_to_one_pass(monkeypatch, T, slabs, keep_states):
    """One sequence in slabs of 128 tokens (on a GPU the chunk loop of one slab beside the parallel kernels of the
    next, on another stream; the last slab of T = 300 ends in a part chunk): output, final state and gradients
    bit-identical to one pass, and the output the oracle's. Without kept states the forward runs in one pass and the
    backward's forward in slabs. Batches of several sequences are not slabbed."""
    inputs = make_inputs(1, T, 2, 16, 32, "bounded") + [torch.randn(1, 2, 16, 32, device=DEV)]
    cotangents = [torch.randn(1, T, 2, 32, device=DEV), torch.randn(1, 2, 16, 32, device=DEV)]
    runs = []
    for slab in (None, 128):
        monkeypatch.setattr(kda_launch, "SLAB_TOKENS", slab)
        if not keep_states:
            monkeypatch.setattr(kda_chunk_fwd, "STATES_LIMIT_BYTES", -(1 << 62))
        loops = count_launches(monkeypatch, kda_chunk_fwd, "_fwd_state_kernel")
        rev = count_launches(monkeypatch, kda_chunk_bwd, "_bwd_state_kernel")
        xs = [x.clone().requires_grad_() for x in inputs]
        o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True)
        torch.autograd.backward([o, ht], cotangents)
        runs.append([o, ht] + [x.grad for x in xs])
        monkeypatch.undo()
    assert len(loops) == (slabs if keep_states else 1 + slabs) and len(rev) == slabs
    for name, a, b in zip("o ht q k v g beta h0".split(), *runs):
        assert torch.equal(a, b), name
    ys = [x.double().clone().requires_grad_() for x in inputs]
    ro, rht = kda.naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True)
    assert rel(runs[1][0], ro) < TOL and rel(runs[1][1], rht) < TOL
    monkeypatch.setattr(kda_launch, "SLAB_TOKENS", 128)
    assert kda_launch.slab_ranges(1, T, 2, torch.device(DEV), 0) == [(s, min(s + 128, T)) for s in range(0, T, 128)]
    assert kda_launch.slab_ranges(2, T, 2, torch.device(DEV), 0) is None


@kernel_test
def test_second_backward_through_the_kept_intermediates_is_identical():
    """The forward keeps A_qk and T for the backward: a second backward (retain_graph) must not see them changed,
    and a forward under no_grad keeps nothing that a backward would need (it has none)."""
    xs = [x.clone().requires_grad_() for x in make_inputs(1, 100, 2, 16, 32, "bounded")]
    o, _ = chunk_kda_triton(*xs)
    do = torch.randn_like(o)
    first = torch.autograd.grad(o, xs, do, retain_graph=True)
    second = torch.autograd.grad(o, xs, do)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert chunk_kda_triton(*xs)[0].grad_fn is None


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_varlen_forward_backward(gate):
    lengths = [3, 0, 64, 67]  # an empty document, a full chunk, a partial chunk
    cu = torch.tensor([0, 3, 3, 67, 134], device=DEV)
    inputs = make_inputs(1, sum(lengths), 2, 16, 16, gate) + [torch.randn(4, 2, 16, 16, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, gate=gate)
    ro, rht = kda.naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True, cu_seqlens=cu)
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL
    torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
    torch.autograd.backward([ro, rht], [torch.ones_like(ro), torch.ones_like(rht)])
    for name, x, y in zip("q k v g beta h0".split(), xs, ys):
        assert rel(x.grad, y.grad) < GRAD_TOL, name


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_causality_bit_exact(gate):
    """Changing tokens >= t0 leaves outputs < t0 and the gradients of their loss w.r.t. inputs < t0 bit-identical."""
    T, t0 = 100, 37  # t0 inside the first chunk, mid sub-block
    a = make_inputs(1, T, 2, 16, 16, gate, seed=1)
    b = [x.clone() for x in a]
    c = make_inputs(1, T, 2, 16, 16, gate, seed=2)
    for x, y in zip(b, c):
        x[:, t0:] = y[:, t0:]
    if gate == "softplus":
        b[3][:, t0:] = -60.0  # far beyond any bounded range
    res = []
    for inputs in (a, b):
        xs = [x.clone().requires_grad_() for x in inputs]
        o, _ = chunk_kda_triton(*xs, gate=gate)
        o[:, :t0].pow(2).sum().backward()
        res.append([o[:, :t0]] + [x.grad[:, :t0] for x in xs])
    for ra, rb in zip(*res):
        assert torch.isfinite(rb).all()
        assert torch.equal(ra, rb)


@kernel_test
@pytest.mark.parametrize("gate,value", [("bounded", -5.0), ("softplus", -30.0), ("bounded", 0.0)])
def test_extreme_gates_gradients(gate, value):
    """Gates pinned at the bound, far past it (softplus), or at zero: every gradient, dg included, stays accurate."""
    q, k, v, g, beta = make_inputs(1, 100, 2, 32, 32, gate)
    inputs = [q, k, v, torch.full_like(g, value), beta, torch.randn(1, 2, 32, 32, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, gate=gate)
    ro, rht = kda.naive_recurrent_kda(*ys[:5], initial_state=ys[5], output_final_state=True)
    assert rel(o, ro) < TOL
    assert_gradients_match((o, ht), (ro, rht), xs, ys, GRAD_TOL)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    q, k, v, g, beta = make_inputs(1, 80, 2, 32, 32, dtype=dtype)
    o, ht = chunk_kda_triton(q, k, v, g, beta, output_final_state=True)
    ro, rht = oracle(q, k, v, g, beta)
    assert o.dtype == dtype
    assert rel(o, ro) < 1e-2 and rel(ht, rht) < 5e-3


@kernel_test
@pytest.mark.parametrize("gate,path", [("bounded", "one_pass"), ("bounded", "no_kept_states"), ("bounded", "slabs"),
                                       ("softplus", "one_pass")])
def test_fused_gate_and_l2norm_match_torch_backend(gate, path, monkeypatch):
    """The gate and the q/k L2 norm inside the kernels (raw q, k whose rows' norms span e^±2; a kernel of its own
    computes the rows' factors, the others scale the rows they load, the backward applies the norm's chain rule) give
    the float64 torch path's output and gradients of every input, on each way through the kernels: documents of a
    packed row (one ends inside a chunk, one is empty), without kept per-chunk states (the forward loop writes O, the
    backward runs the loop again), one sequence in slabs (the softplus gate's pairwise diagonal blocks load rows of k
    of their own: the first); the rows' squares summed over two column slices."""
    T, H, K, V = 140, 2, 16, 16
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, T, H, K, generator=gen) * torch.randn(1, T, H, 1, generator=gen).exp() for _ in range(2))
    g_raw = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.randn(H * K, generator=gen)
    q, k, g_raw, v, beta, A_log, dt_bias = (x.to(DEV) for x in (q, k, g_raw, v, beta, A_log, dt_bias))
    cu = torch.tensor([0, 70, 70, T], device=DEV) if path == "one_pass" else None
    if path == "no_kept_states":
        monkeypatch.setattr(kda_chunk_fwd, "STATES_LIMIT_BYTES", -(1 << 62))
    elif path == "slabs":
        monkeypatch.setattr(kda_launch, "SLAB_TOKENS", 64)
    monkeypatch.setitem(kda_launch.SLICE, "norm_k", 8)
    lb = -5.0 if gate == "bounded" else None
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lb, gate=gate, cu_seqlens=cu,
              output_final_state=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g_raw, beta, A_log, dt_bias)]
    o, ht = chunk_kda_triton(*leaves[:5], A_log=leaves[5], dt_bias=leaves[6], **kw)
    ref_leaves = [x.double().clone().requires_grad_() for x in (q, k, v, g_raw, beta, A_log, dt_bias)]
    ro, rht = kda.chunk_kda(*ref_leaves[:5], A_log=ref_leaves[5], dt_bias=ref_leaves[6], backend="torch", **kw)
    assert rel(o, ro) < TOL and rel(ht, rht) < TOL
    cotangents = [torch.randn_like(o), torch.randn_like(ht)]
    torch.autograd.backward([o, ht], cotangents)
    torch.autograd.backward([ro, rht], [c.double() for c in cotangents])
    # A_log's and dt_bias' gradients sum the gate's over every token, and the terms cancel: on the GPU tf32's
    # per-term error grows by the cancellation (to 1.4e-2 on these inputs, the norm inside the kernels or outside)
    for name, x, y in zip("q k v g_raw beta A_log dt_bias".split(), leaves, ref_leaves):
        assert rel(x.grad, y.grad) < (3 if ON_GPU and name in ("A_log", "dt_bias") else 1) * GRAD_TOL, name


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("with_A_log", [True, False])
def test_fused_gate_backward_with_optional_parameters(gate, with_A_log):
    """The gate's chain rule runs in the last backward kernel: A_log or dt_bias may be absent."""
    B, T, H, K = 1, 70, 2, 16
    gen = torch.Generator().manual_seed(5)
    q, k, v, g_raw = (torch.randn(B, T, H, K, generator=gen).to(DEV) for _ in range(4))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=gen).to(DEV)
    param = (torch.rand(H, generator=gen) if with_A_log else torch.randn(H, K, generator=gen)).to(DEV)
    name = "A_log" if with_A_log else "dt_bias"
    kw = dict(use_gate_in_kernel=True, lower_bound=-5.0 if gate == "bounded" else None, gate=gate)
    grads = []
    for fn, dtype in ((chunk_kda_triton, torch.float32), (kda.chunk_kda, torch.float64)):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (g_raw, param)]
        extra = {} if fn is chunk_kda_triton else dict(backend="torch")
        o, _ = fn(q.to(dtype), k.to(dtype), v.to(dtype), leaves[0], beta.to(dtype), **kw, **{name: leaves[1]}, **extra)
        o.sum().backward()
        grads.append([x.grad for x in leaves])
    (dg_raw, dparam), (dg_raw_ref, dparam_ref) = grads
    assert rel(dg_raw, dg_raw_ref) < GRAD_TOL
    if with_A_log:
        assert rel(dparam, dparam_ref) < GRAD_TOL
    else:
        # dt_bias enters as x = g_raw + dt_bias, so its gradient is the sum of g_raw's over the tokens: a sum with
        # cancellation, whose error scale is the sum of the terms' magnitudes (tf32 dots on the GPU)
        torch.testing.assert_close(dparam, dg_raw.sum((0, 1)), rtol=0, atol=1e-5 * dg_raw.abs().sum().item())
        scale = dg_raw_ref.abs().sum((0, 1))
        assert ((dparam - dparam_ref).norm() / scale.norm()).item() < GRAD_TOL


@kernel_test
def test_recurrent_matches_oracle_and_updates_state_in_place():
    B, H, K, V = 2, 2, 16, 32
    q, k, v, g, beta = make_inputs(B, 3, H, K, V, "softplus")
    h0 = torch.randn(B, H, K, V, device=DEV)
    state = h0.clone()
    o, ht = recurrent_kda_triton(q, k, v, g, beta, initial_state=state, output_final_state=True)
    ro, rht = oracle(q, k, v, g, beta, h0)
    assert ht is state
    assert rel(o, ro) < 1e-5 and rel(ht, rht) < 1e-5
    cu = torch.tensor([0, 2, 6], device=DEV)
    flat = [x.reshape(1, B * 3, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o2, ht2 = recurrent_kda_triton(*flat, initial_state=h0[:, :, :, :].clone(), output_final_state=True,
                                              cu_seqlens=cu)
    ro2, rht2 = kda.naive_recurrent_kda(*[x.double() for x in flat], initial_state=h0.double(),
                                        output_final_state=True, cu_seqlens=cu)
    assert rel(o2, ro2) < 1e-5 and rel(ht2, rht2) < 1e-5


@kernel_test
@pytest.mark.parametrize("cu_seqlens", [None, [0, 0, 0]])
def test_no_tokens_pass_the_state_through(cu_seqlens):
    """T = 0 (or only empty documents): no chunk to run; an empty output, each final state its initial state (zeros
    without one), and the state's gradient back unchanged — for the chunked and the decode kernel."""
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEV)
    B = 2 if cu is None else 1
    q, k, v, g, beta = make_inputs(B, 0, 2, 16, 32)
    h0 = torch.randn(2, 2, 16, 32, device=DEV, requires_grad=True)
    for op in (chunk_kda_triton, recurrent_kda_triton):
        o, ht = op(q, k, v, g, beta, initial_state=h0.detach().clone(), output_final_state=True, cu_seqlens=cu)
        assert o.shape == (B, 0, 2, 32) and torch.equal(ht, h0.detach())
        o, ht = op(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
        assert torch.equal(ht, torch.zeros_like(ht))
    o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    w = torch.randn_like(ht)
    (ht * w).sum().backward()
    assert torch.equal(h0.grad, w)


@kernel_test
def test_bad_inputs_raise():
    q, k, v, g, beta = make_inputs(2, 8, 2, 16, 16)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_triton(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="batch size"):
        chunk_kda_triton(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8], device=DEV))
    with pytest.raises(ValueError, match="gate"):
        chunk_kda_triton(q, k, v, g, beta, gate="relu")
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda_triton(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 16, 16, device=DEV))


# ------------------------------------------------------------------------------------------ GPU-only sweeps
@gpu_only
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000, 4097, 70000])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_forward_sweep(gate, T, D):
    q, k, v, g, beta = make_inputs(1, T, 2, D, D, gate, dtype=torch.bfloat16, seed=T)
    h0 = torch.randn(1, 2, D, D, device=DEV)
    o, ht = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True, gate=gate)
    ro, rht = oracle(q, k, v, g, beta, h0)
    assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3


@gpu_only
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("extreme", ["zero", "floor"])
def test_gpu_extreme_gates_and_varlen(gate, extreme):
    lengths = [1, 700, 0, 64, 3000, 129]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV)
    q, k, v, g, beta = make_inputs(1, sum(lengths), 4, 128, 128, gate, dtype=torch.bfloat16)
    floor = -5.0 if gate == "bounded" else -30.0  # -30: a 16-token sub-block spans 480 nats
    g = torch.zeros_like(g) if extreme == "zero" else torch.full_like(g, floor)
    h0 = torch.randn(len(lengths), 4, 128, 128, device=DEV)
    xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, gate=gate)
    ys = [x.double().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ro, rht = kda.chunk_kda(*ys[:5], initial_state=ys[5], output_final_state=True, cu_seqlens=cu, backend="torch")
    assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3
    assert_gradients_match((o, ht), (ro, rht), xs, ys, 1e-2)


@gpu_only
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("T", [200, 5000])
def test_gpu_backward(gate, T):
    inputs = make_inputs(1, T, 2, 128, 128, gate, dtype=torch.bfloat16, seed=7) + [torch.randn(1, 2, 128, 128, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, gate=gate)
    ro, rht = oracle(*ys[:5], h0=ys[5])
    assert_gradients_match((o, ht), (ro, rht), xs, ys, 1e-2)


@gpu_only
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_backward_with_more_loop_programs_than_sms(D):
    """16 sequences x 16 heads: the chunk loops have more programs than an H200 has SMs and take their many-program
    launch settings (with bf16 inputs `LAUNCH["bwd_state_lp"]`), which the one-sequence tests above never reach. (A 4-warp reverse
    loop with bf16 dots gave dk 10 % off there in triton 3.6, and right answers with one long sequence.)"""
    B, H = 16, 16
    assert B * H * D // 64 >= torch.cuda.get_device_properties(DEV).multi_processor_count
    inputs = make_inputs(B, 200, H, D, D, dtype=torch.bfloat16, seed=3) + [torch.randn(B, H, D, D, device=DEV)]
    xs = [x.clone().requires_grad_() for x in inputs]
    ys = [x.double().clone().requires_grad_() for x in inputs]
    o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True)
    ro, rht = oracle(*ys[:5], h0=ys[5])
    assert rel(o, ro) < 5e-3 and rel(ht, rht) < 5e-3
    assert_gradients_match((o, ht), (ro, rht), xs, ys, 1e-2)


@gpu_only
def test_gpu_long_sequence_in_slabs_bit_identical_to_one_pass(monkeypatch):
    """At H = 16 a 20K-token sequence takes the automatic slabs (forward 2, backward 3: loops on a second stream
    beside the parallel kernels): output, final state and gradients bit-identical to one pass, output within the
    bf16 bound of the float64 chunked reference."""
    T, H, D = 20000, 16, 128
    dev = torch.device(DEV)
    assert len(kda_launch.slab_ranges(1, T, H, dev, kda_launch.SLAB_MIN_TOKEN_HEADS["forward"])) == 2
    assert len(kda_launch.slab_ranges(1, T, H, dev, kda_launch.SLAB_MIN_TOKEN_HEADS["backward"])) == 3
    inputs = make_inputs(1, T, H, D, D, dtype=torch.bfloat16, seed=11) + [torch.randn(1, H, D, D, device=DEV)]
    cotangents = [torch.randn(1, T, H, D, device=DEV, dtype=torch.bfloat16), torch.randn(1, H, D, D, device=DEV)]
    runs = []
    for slab in (1 << 40, None):  # one pass, then the automatic slabs
        monkeypatch.setattr(kda_launch, "SLAB_TOKENS", slab)
        xs = [x.clone().requires_grad_() for x in inputs]
        o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True)
        torch.autograd.backward([o, ht], cotangents)
        runs.append([o, ht] + [x.grad for x in xs])
    for name, a, b in zip("o ht q k v g beta h0".split(), *runs):
        assert torch.equal(a, b), name
    ro, rht = oracle(*inputs[:5], h0=inputs[5])
    assert rel(runs[1][0], ro) < 5e-3 and rel(runs[1][1], rht) < 5e-3


@gpu_only
def test_gpu_one_million_tokens_at_the_floor_is_finite():
    T = 1 << 20
    q, k, v, g, beta = make_inputs(1, T, 2, 128, 128, dtype=torch.bfloat16)
    g = torch.full_like(g, -5.0)
    with torch.no_grad():
        o, ht = chunk_kda_triton(q, k, v, g, beta, output_final_state=True, gate="bounded")
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    ro, _ = kda.naive_recurrent_kda(*[x[:, -300:].double() for x in (q, k, v, g, beta)])
    # with decay e^-5 per token the state forgets within a few hundred tokens: the tail matches a fresh start
    assert rel(o[:, -100:], ro[:, -100:]) < 5e-3


@gpu_only
def test_gpu_solve_of_correlated_keys_is_exact_to_its_bf16_storage():
    """T = (I + A_kk)^-1 of chunks whose keys share two directions (as a trained model's do), bf16 inputs, against
    the float64 inverse of the same A_kk: within T's bf16 rounding. The nilpotent product cancels large terms; with
    tf32 dots T's error is ~2 % of its largest entry (up to 14 %), which the bf16 chunk-state recurrence can
    amplify into non-finite states."""
    from kdamoe.model import kda_chunk

    gen = torch.Generator().manual_seed(0)
    NC, H, K = 64, 2, 128
    base = torch.randn(H, 2, K, generator=gen)
    k = torch.randn(NC * 64, H, K, generator=gen) * 0.1 + torch.einsum("thd,hdk->thk",
                                                                      torch.randn(NC * 64, H, 2, generator=gen), base)
    k = F.normalize(k, dim=-1)
    beta = torch.rand(NC * 64, H, generator=gen) * 0.2 + 0.8
    g = -5 * torch.sigmoid(torch.randn(NC * 64, H, K, generator=gen) - 6)  # little decay: A_kk far from 0
    q, k, v, g, beta = (x.to(DEV, torch.bfloat16) for x in (k, k, k, g, beta))
    tables = kda_launch.chunk_tables(1, NC * 64, None, torch.device(DEV))
    gate = kda_chunk.gate_args(0, None, None, 0.0, H, K, torch.device(DEV))
    z = dict(device=DEV, dtype=torch.bfloat16)
    buf = kda_chunk_fwd.ChunkBuffers(
        aqk=torch.zeros(NC * 64, H, 64, **z), tinv=torch.zeros(NC * 64, H, 64, **z), w=torch.zeros(NC * 64, H, K, **z),
        kd=torch.zeros(NC * 64, H, K, **z), u=torch.zeros(NC * 64, H, K, **z), qg=None,
        dl=torch.zeros(NC, H, K, device=DEV), gam=torch.zeros(NC * 64, H, K, device=DEV))
    kda_chunk_fwd.prepare_chunks((q, k, v, g, beta), gate, K ** -0.5, False, tables, buf, None, intra=True)
    kc = k.double().view(NC, 64, H, K).transpose(1, 2)  # [NC, H, 64, K]
    gam = g.double().view(NC, 64, H, K).transpose(1, 2).cumsum(2)
    akk = (kc * gam.exp()) @ (kc * (-gam).exp()).transpose(-1, -2)
    akk = torch.tril(beta.double().view(NC, 64, H).transpose(1, 2)[..., None] * akk, -1)
    ref = torch.linalg.inv(torch.eye(64, dtype=torch.float64, device=DEV) + akk)
    got = buf.tinv.double().view(NC, 64, H, 64).transpose(1, 2)
    err = (got - ref).abs().amax((-1, -2)) / ref.abs().amax((-1, -2))
    assert err.max() < 5e-3, float(err.max())  # bf16 rounding of T: 2^-9 of its largest entry

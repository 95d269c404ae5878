"""Chunked linear cross-entropy (`kdamoe.model.loss`) against `F.cross_entropy(hidden @ weight.T, labels)` in
float64, on the torch path and on the Triton kernel of `loss_triton.py` (under `TRITON_INTERPRET=1` without a GPU;
`test_kernels_in_interpreter_subprocess` reruns this file in a fresh process when triton was imported earlier).
Peak memory (the point of chunking) is not observable on the CPU and is not tested here."""

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEV, kernel_test, rerun_in_interpreter, rerun_test

from kdamoe.model import loss_triton  # noqa: E402
from kdamoe.model.loss import _accumulate_product, linear_cross_entropy  # noqa: E402

N, D, V = 50, 24, 37


def make_inputs(dtype, seed=0, ignored=(3, 4, 17, 49)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(V, D, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def reference(hidden, weight, labels, reduction="mean"):
    """Loss and gradients of the plain formulation in float64."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, ignore_index=-100, reduction=reduction)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def ours(hidden, weight, labels, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def rel(got, want):
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("chunk_size", [1, 7, 16, N, 1000, None])
def test_fp32_matches_float64_reference(chunk_size):
    hidden, weight, labels = make_inputs(torch.float32)
    ref_loss, ref_h, ref_w = reference(hidden, weight, labels)
    loss, gh, gw = ours(hidden, weight, labels, chunk_size=chunk_size)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    assert gh.dtype == torch.float32 and gw.dtype == torch.float32
    assert rel(gh, ref_h) < 1e-5 and rel(gw, ref_w) < 1e-5
    assert not gh[[3, 4, 17, 49]].any()  # ignored rows get no gradient


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_bf16_matches_float64_reference(chunk_size):
    hidden, weight, labels = make_inputs(torch.bfloat16)
    ref_loss, ref_h, ref_w = reference(hidden, weight, labels)  # on the same bf16 values, in float64
    loss, gh, gw = ours(hidden, weight, labels, chunk_size=chunk_size)
    assert loss.dtype == torch.float32
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    # bf16 logits (8-bit mantissa) and bf16 gradients: errors of a few 2^-8
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-2, atol=1e-2)
    assert rel(gh, ref_h) < 1e-2 and rel(gw, ref_w) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GEMM that adds into an fp32 gradient is CUDA's")
def test_weight_gradient_sums_chunk_products_in_fp32_on_cuda():
    """Each chunk's bf16 product adds into the fp32 weight gradient unrounded: the sum equals the float64 sum of the
    same bf16 products to fp32 precision (rounding each product to bf16 first would leave it ~1e-3 off)."""
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(300, 64, generator=g).bfloat16(), torch.randn(300, 48, generator=g).bfloat16())
             for _ in range(4)]
    acc = torch.zeros(64, 48, device="cuda")
    for a, b in parts:
        _accumulate_product(acc, a.cuda().T, b.cuda())
    want = sum(a.double().T @ b.double() for a, b in parts)
    assert rel(acc.cpu(), want) < 1e-5


def test_sum_reduction_and_grad_output_scaling():
    hidden, weight, labels = make_inputs(torch.float32, seed=1)
    ref_loss, ref_h, ref_w = reference(hidden, weight, labels, reduction="sum")
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, chunk_size=9, reduction="sum")
    (loss / 3.0).backward()  # as `loss / num_items_in_batch` or gradient accumulation does
    torch.testing.assert_close(loss.detach().double(), ref_loss, rtol=1e-6, atol=1e-5)
    assert rel(h.grad, ref_h / 3.0) < 1e-5 and rel(w.grad, ref_w / 3.0) < 1e-5


def test_all_labels_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, _ = make_inputs(torch.float32)
    labels = torch.full((N,), -100)
    loss, gh, gw = ours(hidden, weight, labels, chunk_size=8)
    assert loss.item() == 0.0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_custom_ignore_index():
    hidden, weight, labels = make_inputs(torch.float32, ignored=())
    labels[:10] = V + 5  # out of range, but it is the ignore_index
    want = F.cross_entropy(hidden.double() @ weight.double().T, labels, ignore_index=V + 5)
    got = linear_cross_entropy(hidden, weight, labels, ignore_index=V + 5, chunk_size=11)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_tied_weight_gradients_accumulate_with_the_embedding():
    g = torch.Generator().manual_seed(2)
    embed = torch.nn.Embedding(V, D)
    proj = torch.nn.Linear(D, D)
    ids = torch.randint(0, V, (N,), generator=g)
    labels = torch.randint(0, V, (N,), generator=g)

    def run(loss_fn):
        embed.zero_grad()
        proj.zero_grad()
        hidden = torch.tanh(proj(embed(ids)))
        loss_fn(hidden, embed.weight).backward()  # the output projection is the input embedding
        return embed.weight.grad.clone(), proj.weight.grad.clone()

    want = run(lambda h, w: F.cross_entropy(h @ w.T, labels))
    got = run(lambda h, w: linear_cross_entropy(h, w, labels, chunk_size=13))
    assert rel(got[0], want[0].double()) < 1e-5 and rel(got[1], want[1].double()) < 1e-5


def test_only_the_gradients_that_are_needed():
    hidden, weight, labels = make_inputs(torch.float32)
    ref_loss, ref_h, _ = reference(hidden, weight, labels)
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, labels, chunk_size=8).backward()  # frozen output projection
    assert rel(h.grad, ref_h) < 1e-5
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad", [V, -1, 10**6])
def test_out_of_range_labels(bad):
    hidden, weight, labels = make_inputs(torch.float32)
    labels[5] = bad
    with pytest.raises(ValueError, match="outside"):
        linear_cross_entropy(hidden, weight, labels)  # CPU labels: checked by default
    # unchecked (the default for accelerator labels, which would need a host synchronisation): never an
    # out-of-bounds read, and the loss and every gradient are NaN
    loss, gh, gw = ours(hidden, weight, labels, validate=False, chunk_size=8)
    assert loss.isnan() and gh.isnan().all() and gw.isnan().all()


def test_argument_errors():
    hidden, weight, labels = make_inputs(torch.float32)
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(hidden, weight[:, :-1], labels)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,block_v,chunk_size", [(37, 4096, 7), (37, 16, None), (300, 64, 16)])
def test_kernel_matches_the_torch_path_and_float64(monkeypatch, dtype, vocab, block_v, chunk_size):
    """Rows of one tile and of several tiles with a masked tail; the loss and both gradients against float64 (on the
    same rounded inputs) and against the torch path."""
    monkeypatch.setattr(loss_triton, "BLOCK_V", block_v)
    g = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(N, D, generator=g).to(dtype)
    weight = (torch.randn(vocab, D, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, vocab, (N,), generator=g)
    labels[[3, 4, 17, 49]] = -100
    ref_loss, ref_h, ref_w = reference(hidden, weight, labels)
    dev = [t.to(DEV) for t in (hidden, weight, labels)]
    loss, gh, gw = ours(*dev, chunk_size=chunk_size, backend="triton")
    t_loss, t_gh, t_gw = ours(*dev, chunk_size=chunk_size, backend="torch")
    assert gh.dtype == dtype and gw.dtype == dtype and not gh[[3, 4, 17, 49]].any()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert abs(float(loss) - float(ref_loss)) < tol * max(1.0, abs(float(ref_loss)))
    assert rel(gh.cpu(), ref_h) < tol and rel(gw.cpu(), ref_w) < tol
    # the same roundings as the torch path: equal but for the fp32 sums' order
    assert abs(float(loss) - float(t_loss)) < 1e-6 * abs(float(t_loss))
    same = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel(gh.cpu(), t_gh.cpu().double()) < same and rel(gw.cpu(), t_gw.cpu().double()) < same


@kernel_test
def test_kernel_sum_reduction_ignored_rows_and_bad_labels():
    hidden, weight, labels = (t.to(DEV) for t in make_inputs(torch.float32))
    for reduction in ("mean", "sum"):
        got = ours(hidden, weight, labels, reduction=reduction, chunk_size=16, backend="triton")
        want = ours(hidden, weight, labels, reduction=reduction, chunk_size=16, backend="torch")
        for a, b in zip(got, want):
            assert rel(a.cpu(), b.cpu().double()) < 1e-6
    none = torch.full_like(labels, -100)
    loss, gh, gw = ours(hidden, weight, none, backend="triton")
    assert float(loss) == 0 and not gh.any() and not gw.any()
    bad = labels.clone()
    bad[5] = V
    loss, gh, gw = ours(hidden, weight, bad, validate=False, chunk_size=8, backend="triton")
    assert loss.isnan() and gh.isnan().all() and gw.isnan().all()
    want = reference(hidden.cpu(), weight.cpu(), labels.cpu())[0]
    with torch.no_grad():  # no gradient wanted: the loss alone
        assert rel(linear_cross_entropy(hidden, weight, labels, backend="triton").cpu(), want) < 1e-6

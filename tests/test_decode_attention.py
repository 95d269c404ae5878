"""The split-KV decode attention (`decode_attention.py`) against the model's reference attention in float64 (under
``TRITON_INTERPRET=1`` without a GPU, small shapes with several splits), the model's decode steps through it, and
its compilation for sm_90."""

import pytest
import torch

from triton_interpreter import (DEV, ON_GPU, check_compiles_for_sm90, kernel_test, rerun_in_interpreter,
                                rerun_test)
from conftest import rel

from kdamoe.model import decode_attention, modeling_kdamoe  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

TOL = 1e-4 if ON_GPU else 1e-5


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


def reference(q, k, v, mask, scale):
    """`eager_attention_forward` in float64: `[B, 1, Hq, D]`."""
    module = torch.nn.Module().eval()
    m = None if mask is None else mask.expand(q.shape[0], 1, 1, k.shape[2])
    return modeling_kdamoe.eager_attention_forward(module, q.double(), k.double(), v.double(), m, scale)[0]


@kernel_test
@pytest.mark.parametrize("B,Hq,Hkv,L,D", [(2, 4, 2, 300, 16), (1, 2, 2, 1000, 32), (3, 8, 1, 130, 16)])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_matches_float64(monkeypatch, B, Hq, Hkv, L, D, masked):
    """Several splits (small `MIN_KEYS_PER_SPLIT`), a last block and a last split part-filled, GQA groups of 1 to 8,
    keys hidden by the mask — a whole split of them in a row — and a key cache read through a strided view."""
    monkeypatch.setattr(decode_attention, "MIN_KEYS_PER_SPLIT", 64)
    gen = torch.Generator().manual_seed(L)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(DEV)
    kv = torch.randn(B, Hkv, L + 7, 2 * D, generator=gen).to(DEV)
    k, v = kv[:, :, :L, :D], kv[:, :, :L, D:]  # strided views, as of a longer static buffer
    mask = None
    if masked:
        mask = torch.rand(B, 1, 1, L, generator=gen) < 0.7
        mask[0, ..., 64:256] = False  # whole blocks and a whole split hidden
        mask[..., L - 1] = True  # the query's own position, always visible
        mask = mask.to(DEV)
    out = decode_attention.decode_attention(q, k, v, mask, D ** -0.5)
    assert out.shape == (B, 1, Hq, D) and out.dtype == q.dtype
    assert rel(out.cpu(), reference(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), D ** -0.5)) < TOL


def test_supported_shapes_and_errors():
    q, k = torch.zeros(1, 4, 1, 64), torch.zeros(1, 2, 10, 64)
    assert decode_attention.supported(q, k) == (decode_attention.triton is not None)
    assert not decode_attention.supported(torch.zeros(1, 4, 2, 64), k)  # two queries a row
    assert not decode_attention.supported(torch.zeros(1, 3, 1, 64), k)  # 3 heads over 2 KV heads
    assert not decode_attention.supported(torch.zeros(1, 4, 1, 24), torch.zeros(1, 2, 10, 24))  # head dim 24
    with pytest.raises(ValueError, match="query"):
        decode_attention.decode_attention(torch.zeros(1, 4, 2, 64), k, k, None, 1.0)


@kernel_test
def test_model_decode_step_through_the_kernel_equals_sdpa(monkeypatch):
    """A hybrid model's cached decode steps with the attention layers through `decode_attention` (forced at every
    cache length) equal the same steps through the reference attention."""
    import kdamoe
    from conftest import cache_of, tiny_config

    torch.manual_seed(0)
    model = kdamoe.KDAMoEForCausalLM(tiny_config(head_dim=16, router_balancing="none")).to(DEV).eval()
    ids = torch.randint(3, 97, (2, 40)).to(DEV)
    runs = []
    for kernel in (False, True):
        monkeypatch.setattr(modeling_kdamoe.KDAMoEAttention, "_split_kv_decode",
                            lambda self, query, keys, cache: kernel and cache is not None and query.shape[2] == 1)
        with torch.no_grad():
            out = model(ids[:, :30])
            logits = [out.logits[:, -1]]
            cache = cache_of(out)
            for t in range(30, 40):
                out = model(ids[:, t:t + 1], cache=cache)
                cache = cache_of(out)
                logits.append(out.logits[:, -1])
        runs.append(torch.stack(logits))
    assert rel(runs[1], runs[0]) < TOL


SM90_LAUNCHES = r"""
from kdamoe.model import decode_attention

kernel = decode_attention._split_kernel
decode_attention._split_kernel = Record()
for dtype in (torch.bfloat16, torch.float32):
    for Hq, Hkv, D in ((8, 2, 128), (16, 16, 64)):
        x = lambda *s: torch.zeros(*s, dtype=dtype)
        for mask in (None, torch.ones(1, 1, 1, 4096, dtype=torch.bool)):
            decode_attention.decode_attention(x(1, Hq, 1, D), x(1, Hkv, 4096, D), x(1, Hkv, 4096, D), mask, 0.1)
"""


def test_kernel_compiles_for_sm90():
    """The kernel compiles to a cubin for an H100/H200 (sm_90) as the GPU launches it (bf16 and fp32, GQA and not,
    with and without a mask), which the interpreter does not check; no GPU needed, in a process without the
    interpreter."""
    check_compiles_for_sm90(SM90_LAUNCHES, expected=8)

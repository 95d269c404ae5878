"""The fused KDA decode step (`kda_decode.py`): its torch path against the step's math in float64, the Triton kernel
against the torch path (under ``TRITON_INTERPRET=1`` without a GPU, small shapes), its in-place state updates, and
its compilation for sm_90."""

import copy

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import (DEV, ON_GPU, check_compiles_for_sm90, gpu_only, kernel_test,
                                rerun_in_interpreter, rerun_test)
from conftest import rel

from kdamoe.model import kda_decode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

TOL = 1e-4 if ON_GPU else 1e-5  # fp32: the GPU's exp / rsqrt approximations, the interpreter's numpy


@rerun_test
def test_kernels_in_interpreter_subprocess():
    rerun_in_interpreter(__file__, timeout=600)


def make_step(B=2, H=2, K=16, V=24, W=4, gate="bounded", dtype=torch.float32, device=DEV, seed=0):
    """Random inputs of one decode step: `(args, kwargs)` of `kda_decode_step` (states filled, not zeros)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    C = 2 * H * K + H * V
    args = [rand(B, H * K).to(dtype), rand(B, H * K).to(dtype), rand(B, H * V).to(dtype), rand(B, H).to(dtype),
            rand(B, H * K).to(dtype), rand(B, H * V).to(dtype), rand(B, C, W).to(dtype), rand(B, H, K, V, scale=0.3)]
    kwargs = dict(conv_weight=rand(C, W, scale=0.5).to(dtype), A_log=rand(H, scale=0.5), dt_bias=rand(H * K).to(dtype),
                  norm_weight=(1 + rand(V, scale=0.1)).to(dtype), norm_eps=1e-6, gate=gate,
                  lower_bound=-5.0 if gate == "bounded" else None)
    return args, kwargs


def step_float64(q, k, v, beta, g, out_gate, conv_state, state, *, conv_weight, A_log, dt_bias, norm_weight,
                 norm_eps, gate, lower_bound):
    """The decode step written out in float64: `(out [B, H, V], new conv state, new recurrent state)`."""
    B, H = beta.shape
    K, V = q.shape[1] // H, v.shape[1] // H
    window = torch.cat([conv_state.double()[..., 1:], torch.cat([q, k, v], -1).double()[..., None]], -1)
    y = F.silu((window * conv_weight.double()).sum(-1))
    qh, kh, vh = y[:, : H * K].view(B, H, K), y[:, H * K : 2 * H * K].view(B, H, K), y[:, 2 * H * K :].view(B, H, V)
    qh, kh = (x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() for x in (qh, kh))
    x = g.double().view(B, H, K) + dt_bias.double().view(H, K)
    a = A_log.double().exp()[:, None]
    log_decay = lower_bound * torch.sigmoid(a * x) if gate == "bounded" else -a * F.softplus(x)
    S = state.double() * log_decay.exp()[..., None]
    u = torch.sigmoid(beta.double())[..., None] * (vh - torch.einsum("bhkv,bhk->bhv", S, kh))
    S = S + kh[..., None] * u[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", S, qh) * K**-0.5
    o = o * (o.pow(2).mean(-1, keepdim=True) + norm_eps).rsqrt() * norm_weight.double()
    return o * torch.sigmoid(out_gate.double().view(B, H, V)), window, S


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_torch_step_matches_float64_math(gate):
    """The torch path (the layer's unfused references composed) against the step's math written out in float64:
    output and both states, updated in place."""
    args, kwargs = make_step(gate=gate, device="cpu")
    want, want_conv, want_state = step_float64(*args, **kwargs)
    conv, state = args[6], args[7]
    out = kda_decode.kda_decode_step_torch(*args, **kwargs)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert rel(out, want) < 1e-5 and rel(conv, want_conv) < 1e-6 and rel(state, want_state) < 1e-5


def test_layer_decode_step_equals_its_general_path():
    """The KDA layer's one-token step (`_decode_step`, the torch path on the CPU) gives its general path's output and
    states bit for bit (that path runs while the dynamic cache records past states, for assisted decoding)."""
    from conftest import tiny_config

    from kdamoe.model import modeling_kdamoe

    config = tiny_config()
    layer = modeling_kdamoe.KDAMoEKimiDeltaAttention(config, 0)
    for p in (layer.conv_weight, layer.A_log, layer.dt_bias):
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        fused = modeling_kdamoe.KDAMoECache(config)
        layer(torch.randn(2, 7, config.hidden_size), cache=fused)
        general = copy.deepcopy(fused)
        general.layers[0].activate_past_recording()
        for _ in range(3):
            x = torch.randn(2, 1, config.hidden_size)
            assert torch.equal(layer(x, cache=fused), layer(x, cache=general))
            general.layers[0].crop(0)  # back to the last W inputs
            assert torch.equal(fused.layers[0].conv_states[0], general.layers[0].conv_states[0])
    assert torch.equal(fused.layers[0].recurrent_states[0], general.layers[0].recurrent_states[0])


@kernel_test
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("B,H,K,V,W", [(2, 2, 16, 24, 4), (3, 1, 12, 40, 3), (1, 3, 32, 64, 4)])
def test_kernel_matches_torch_path(gate, B, H, K, V, W):
    """fp32: the kernel's output and states equal the torch path's to rounding, head dims that are not powers of
    two and V in several blocks included; the conv state (a shift) exactly."""
    args, kwargs = make_step(B, H, K, V, W, gate)
    ref_args = [x.clone() for x in args]
    out = kda_decode.kda_decode_step(*args, backend="triton", **kwargs)
    want = kda_decode.kda_decode_step(*ref_args, backend="torch", **kwargs)
    assert out.dtype == want.dtype and rel(out, want) < TOL
    assert torch.equal(args[6], ref_args[6]) and rel(args[7], ref_args[7]) < TOL


@kernel_test
@pytest.mark.parametrize("dtype,gate_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                              pytest.param(torch.bfloat16, torch.bfloat16, marks=gpu_only)])
def test_kernel_rounds_as_the_unfused_path(dtype, gate_dtype):
    """16-bit projections and weights: the kernel rounds where the unfused path stores a tensor (the conv output, q,
    k, o, the norm's output, the gate's sigmoid), so its output is within two steps of the dtype of the torch path's
    (a last-bit flip from the order of an fp32 sum) and on average 10x closer to it than the step computed in
    float64 to the end. fp16 in the interpreter, which truncates bf16 casts (the GPU rounds them to nearest even)."""
    args, kwargs = make_step(B=2, H=2, K=32, V=40, dtype=dtype)
    args[5] = args[5].to(gate_dtype)
    ref_args = [x.clone() for x in args]
    exact = step_float64(*[x.clone() for x in args], **kwargs)[0]
    out = kda_decode.kda_decode_step(*args, backend="triton", **kwargs)
    want = kda_decode.kda_decode_step(*ref_args, backend="torch", **kwargs)
    assert out.dtype == want.dtype == torch.promote_types(dtype, gate_dtype)
    exact = exact.to(out.dtype)
    out, want = out.double(), want.double()
    assert ((out - want).abs() <= 2 * torch.finfo(dtype).eps * want.abs()).all()

    def mean_rel(x):
        return ((x.double() - want).abs().mean() / want.abs().mean()).item()

    assert 10 * mean_rel(out) < mean_rel(exact)
    assert torch.equal(args[6], ref_args[6]) and rel(args[7], ref_args[7]) < 1e-3


@kernel_test
def test_kernel_updates_the_states_in_place_step_after_step():
    """Five steps on the same states: the state tensors keep their storage (a static cache's, a CUDA graph's
    addresses) and follow the torch path's."""
    args, kwargs = make_step(B=2, H=2, K=16, V=40)
    ref = [x.clone() for x in args[6:]]
    ptrs = [x.data_ptr() for x in args[6:]]
    for step in range(5):
        new, _ = make_step(B=2, H=2, K=16, V=40, seed=step + 1)
        out = kda_decode.kda_decode_step(*new[:6], *args[6:], backend="triton", **kwargs)
        want = kda_decode.kda_decode_step(*new[:6], *ref, backend="torch", **kwargs)
        assert rel(out, want) < TOL
    assert [x.data_ptr() for x in args[6:]] == ptrs
    assert torch.equal(args[6], ref[0]) and rel(args[7], ref[1]) < TOL


def test_argument_errors():
    args, kwargs = make_step(device="cpu")
    with pytest.raises(ValueError, match="conv_state must have shape"):
        kda_decode.kda_decode_step(*args[:6], args[6][..., :3], args[7], **kwargs)
    with pytest.raises(ValueError, match="recurrent_state must have shape"):
        kda_decode.kda_decode_step(*args[:7], args[7][:1], **kwargs)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kda_decode.kda_decode_step(*args[:7], args[7].double(), **kwargs)
    with pytest.raises(ValueError, match="dt_bias must have shape"):
        kda_decode.kda_decode_step(*args, **{**kwargs, "dt_bias": kwargs["dt_bias"][:3]})


SM90_LAUNCHES = r"""
from kdamoe.model import kda_decode

kernel = kda_decode._decode_kernel
kda_decode._decode_kernel = Record()
H, K, V, W = 8, 128, 128, 4
for dtype in (torch.bfloat16, torch.float32):
    C = 2 * H * K + H * V
    x = lambda *s: torch.zeros(*s, dtype=dtype)
    kda_decode.kda_decode_step_triton(x(1, H * K), x(1, H * K), x(1, H * V), x(1, H), x(1, H * K), x(1, H * V),
                                      x(1, C, W), torch.zeros(1, H, K, V), conv_weight=x(C, W), A_log=torch.zeros(H),
                                      dt_bias=x(H * K), norm_weight=x(V), norm_eps=1e-6, gate="bounded")
"""


def test_kernel_compiles_for_sm90():
    """The kernel compiles to a cubin for an H100/H200 (sm_90) as the GPU launches it (bf16 and fp32, the model's
    head dims), which the interpreter does not check; no GPU needed, in a process without the interpreter."""
    check_compiles_for_sm90(SM90_LAUNCHES, expected=2)

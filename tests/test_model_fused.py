"""The model's fused paths against its plain ones: the chunked linear cross-entropy on the CPU; on a GPU the fused
kernels (short convolution, norms, KDA) against the torch path, the token-id check and the host synchronisations
of a training step."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import kdamoe
from conftest import tiny_config

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_model(**overrides):
    torch.manual_seed(0)
    return kdamoe.KDAMoEForCausalLM(tiny_config(router_balancing="none", **overrides))


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_fused_linear_cross_entropy_equals_the_logits_loss(tied):
    ids = torch.randint(3, 97, (2, 17))
    plain = make_model(tie_word_embeddings=tied).train()
    fused = make_model(tie_word_embeddings=tied, fuse_linear_cross_entropy=True).train()
    fused.load_state_dict(plain.state_dict())
    for kwargs in ({}, {"num_items_in_batch": torch.tensor(21)}):
        ref, ref_grads = loss_and_grads(plain, ids, **kwargs)
        out, grads = loss_and_grads(fused, ids, **kwargs)
        assert out.logits is None and ref.logits is not None
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    fused.eval()  # evaluation keeps its logits
    with torch.no_grad():
        assert fused(ids, labels=ids).logits is not None


def test_fused_loss_leaves_a_hooked_lm_head_to_its_module():
    """An `lm_head` with a hook (or an adapter) is not bypassed by the fused loss: the loss is that of the hooked
    logits."""
    ids = torch.randint(3, 97, (2, 17))
    model = make_model(fuse_linear_cross_entropy=True).train()
    model.lm_head.register_forward_hook(lambda module, args, out: 2 * out)
    out = model(ids, labels=ids)
    want = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, want)


def count_syncs(fn):
    """Host synchronisations torch reports while ``fn`` runs (``set_sync_debug_mode("warn")``)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


@gpu_only
@pytest.mark.parametrize("residual_mode", ["standard", "block_attnres"])
def test_cuda_fused_path_equals_the_cpu_torch_path(residual_mode):
    """The whole model on the GPU (Triton conv, norms, KDA; fp32, so tf32 dots) against the CPU's torch path:
    logits and every gradient, plain and packed."""
    cpu = make_model(residual_mode=residual_mode, mlp_layer_types=["dense"] * 4).train()
    gpu = make_model(residual_mode=residual_mode, mlp_layer_types=["dense"] * 4).cuda().train()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(3, 97, (2, 150))
    positions = torch.cat([torch.arange(70), torch.arange(80)]).repeat(2, 1)
    for kwargs in ({}, {"position_ids": positions}):
        ref, ref_grads = loss_and_grads(cpu, ids, **kwargs)
        out, grads = loss_and_grads(gpu, ids.cuda(), **{k: v.cuda() for k, v in kwargs.items()})
        rel = (out.logits.cpu() - ref.logits).norm() / ref.logits.norm()
        assert rel < 5e-3, rel
        for name in ref_grads:
            g, r = grads[name].cpu(), ref_grads[name]
            assert (g - r).norm() <= 2e-2 * r.norm() + 1e-6, name


@gpu_only
def test_cuda_training_step_does_not_synchronise_and_bad_ids_raise_a_call_later():
    model = make_model(mlp_layer_types=["dense"] * 4, fuse_linear_cross_entropy=True).cuda().train()
    ids = torch.randint(3, 97, (2, 128), device="cuda")
    loss_and_grads(model, ids)  # compile and cache first
    assert count_syncs(lambda: loss_and_grads(model, ids)) == 0
    bad = ids.clone()
    bad[0, 5] = model.config.vocab_size + 3
    with torch.no_grad():
        model(bad, use_cache=False)  # no device fault: the ids are clamped
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="vocab_size"):
            model(ids, use_cache=False)
        model(ids, use_cache=False)  # reported once


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_mlp_recomputing_its_activation_equals_plain_autograd(activation):
    """`KDAMoEMLP` keeps only `gate_up` for its backward; its gradients equal the plain composition's (float64)."""
    from kdamoe.model.moe import KDAMoEMLP, _packed_activation

    mlp = KDAMoEMLP(tiny_config(expert_activation=activation), 24).double()
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    out = mlp(x)
    gate_up = torch.nn.functional.linear(x, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    ref = mlp.down_proj(_packed_activation(activation, gate_up))
    torch.testing.assert_close(out, ref)
    cot = torch.randn_like(out)
    params = [x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    for a, b in zip(torch.autograd.grad(out, params, cot), torch.autograd.grad(ref, params, cot)):
        torch.testing.assert_close(a, b)


@gpu_only
def test_cuda_moe_step_synchronises_once_for_the_balancing_statistics():
    """The hybrid MoE config: a forward and backward without host synchronisation; `apply_load_balancing` reads the
    statistics of every layer in one copy, and with `to_host=False` not at all."""
    model = kdamoe.KDAMoEForCausalLM(tiny_config(fuse_linear_cross_entropy=True)).cuda().bfloat16().train()
    ids = torch.randint(3, 97, (2, 128), device="cuda")
    loss_and_grads(model, ids)
    model.apply_load_balancing()
    assert count_syncs(lambda: loss_and_grads(model, ids)) == 0
    assert count_syncs(model.apply_load_balancing) == 1
    loss_and_grads(model, ids)
    assert count_syncs(lambda: model.apply_load_balancing(to_host=False)) == 0  # the update alone: no round trip


@gpu_only
@pytest.mark.parametrize("precision", ["bf16", "amp"])
def test_cuda_packed_documents_through_varlen_equal_the_masked_path(monkeypatch, precision):
    """Packed rows with bf16 weights, and with fp32 weights under bf16 autocast (as `kdamoe-train` runs): the
    attention layers' one `varlen_attn` call per forward against the block-diagonal mask (varlen off): logits and
    every gradient to bf16 tolerance, and the step does not synchronise."""
    from kdamoe.model import modeling_kdamoe

    if modeling_kdamoe.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model = make_model(mlp_layer_types=["dense"] * 4).cuda().train()
    if precision == "bf16":
        model.bfloat16()
    ids = torch.randint(3, 97, (2, 150), device="cuda")
    positions = torch.cat([torch.arange(70), torch.arange(50), torch.arange(30)]).repeat(2, 1)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "amp"):
            return loss_and_grads(model, ids, position_ids=positions)

    calls = []
    varlen = modeling_kdamoe.varlen_attn
    monkeypatch.setattr(modeling_kdamoe, "varlen_attn", lambda *a, **k: calls.append(1) or varlen(*a, **k))
    out, grads = step()
    assert len(calls) == 1  # the one attention layer
    assert count_syncs(step) == 0
    monkeypatch.setattr(modeling_kdamoe, "varlen_attn", None)
    ref, ref_grads = step()
    rel = (out.logits.float() - ref.logits.float()).norm() / ref.logits.float().norm()
    assert rel < 1e-2, rel
    for name in ref_grads:
        g, r = grads[name].float(), ref_grads[name].float()
        assert (g - r).norm() <= 3e-2 * r.norm() + 1e-4, name

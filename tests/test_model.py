"""The causal LM through the public API: config validation, causality, caching, packing, AttnRes identities."""

import copy
import math

import pytest
import torch

import kdamoe
from conftest import tiny_config, tiny_model

KDA_ONLY = ["linear_attention"] * 4


def make_model(**overrides):
    return tiny_model(**overrides).eval()


# ---------------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(kda_gate_lower_bound=-6.0), "kda_gate_lower_bound"),
        (dict(kda_gate_lower_bound=0.0), "kda_gate_lower_bound"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(mlp_layer_types=["dense"] * 5), "mlp_layer_types"),
        (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), "layer_types"),
        (dict(mlp_layer_types=["dense"] * 3 + ["expert"]), "mlp_layer_types"),
        (dict(kda_gate="exp"), "kda_gate"),
        (dict(expert_activation="gelu"), "expert_activation"),
        (dict(router_balancing="sinkhorn"), "router_balancing"),
        (dict(residual_mode="highway"), "residual_mode"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(num_attention_heads=3), "num_attention_heads"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(attnres_block_layers=0), "attnres_block_layers"),
        (dict(pad_token_id=97), "pad_token_id"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_softplus_gate_accepts_any_bound():
    assert tiny_config(kda_gate="softplus", kda_gate_lower_bound=-20.0).kda_gate == "softplus"


def test_token_ids_out_of_range_raise():
    model = make_model()
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[1, 2, 97]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 2, 3]]))


# ---------------------------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("residual_mode", ["block_attnres", "full_attnres", "standard"])
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_causality(residual_mode, gate):
    model = make_model(residual_mode=residual_mode, kda_gate=gate)
    ids = torch.randint(3, 97, (2, 40))
    changed = ids.clone()
    changed[:, 25:] = torch.randint(3, 97, (2, 15))
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    # Not bit-exact: expert GEMMs over a different number of tokens may round differently; a leak is O(1e-2).
    torch.testing.assert_close(a[:, :25], b[:, :25], rtol=1e-5, atol=1e-5)
    assert (a[:, 25:] - b[:, 25:]).abs().max() > 1e-2


def test_loss_matches_manual_cross_entropy():
    model = make_model()
    ids = torch.randint(3, 97, (2, 16))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 97).double()
    expected = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_outputs_hidden_states_router_logits_and_tuples():
    model = make_model()
    ids = torch.randint(3, 97, (2, 12))
    out = model(ids, output_hidden_states=True, output_router_logits=True, use_cache=False)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert len(out.router_logits) == 3 and out.router_logits[0].shape == (24, 8)
    as_tuple = model(ids, return_dict=False, use_cache=False)
    torch.testing.assert_close(as_tuple[0], out.logits)


def test_block_attnres_matches_naive_depth_attention():
    """An independent loop over sublayers with explicit source lists and softmax weights."""
    model = make_model(attnres_block_layers=2)
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        expected_logits = model(ids, use_cache=False).logits

        def depth(attn_res, sources):
            v = torch.stack(sources).double()
            keys = v / v.pow(2).mean(-1, keepdim=True).add(attn_res.eps).sqrt() * attn_res.key_norm_weight.double()
            w = torch.softmax(keys @ attn_res.query.double(), dim=0)
            return (w.unsqueeze(-1) * v).sum(0).float()

        blocks, partial = [model.model.embed_tokens(ids)], None
        for i, layer in enumerate(model.model.layers):
            for attn_res, norm, sub in ((layer.mixer_attn_res, layer.mixer_norm, layer.mixer),
                                        (layer.ffn_attn_res, layer.ffn_norm, layer.ffn)):
                h = depth(attn_res, blocks + ([partial] if partial is not None else []))
                y = sub(norm(h))
                y = y[0] if isinstance(y, tuple) else y
                partial = y if partial is None else partial + y
            if (i + 1) % 2 == 0:
                blocks, partial = blocks + [partial], None
        final = depth(model.model.final_attn_res, blocks + ([partial] if partial is not None else []))
        logits = model.lm_head(model.model.norm(final))
    torch.testing.assert_close(expected_logits, logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode, block_layers", [("block_attnres", 1), ("block_attnres", 2), ("block_attnres", 3),
                                                ("full_attnres", 2)])
def test_zero_pseudo_queries_equal_standard_residual(mode, block_layers):
    # PreNorm is scale-invariant up to its eps: a negligible eps makes the identity exact up to rounding.
    attnres = make_model(residual_mode=mode, attnres_block_layers=block_layers, rms_norm_eps=1e-12)
    with torch.no_grad():
        for name, p in attnres.named_parameters():
            if name.endswith("attn_res.query"):
                p.zero_()
    standard = kdamoe.KDAMoEForCausalLM(tiny_config(residual_mode="standard", rms_norm_eps=1e-12)).eval()
    missing, unexpected = standard.load_state_dict(attnres.state_dict(), strict=False)
    assert not missing and all("attn_res" in k for k in unexpected)
    ids = torch.randint(3, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(attnres(ids).logits, standard(ids).logits, rtol=2e-4, atol=2e-4)


def test_packed_documents_do_not_see_each_other():
    model = make_model()
    doc_a, doc_b = torch.randint(3, 97, (1, 13)), torch.randint(3, 97, (1, 19))
    packed = torch.cat([doc_a, doc_b], 1)
    position_ids = torch.cat([torch.arange(13), torch.arange(19)]).unsqueeze(0)
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, use_cache=False).logits
        alone_a = model(doc_a, use_cache=False).logits
        alone_b = model(doc_b, use_cache=False).logits
    torch.testing.assert_close(out[:, :13], alone_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:, 13:], alone_b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("signature", ["this torch", "is_causal, no enable_gqa"])
def test_packed_attention_through_varlen_equals_the_masked_path(monkeypatch, signature):
    """The varlen path's plumbing (flattened rows, offsets, GQA, scale) on the CPU in float64: a per-document SDPA
    reference stands in for `varlen_attn` (flash, CUDA only); logits and gradients equal the masked path's. The
    second case takes the older signature (`is_causal`, no `enable_gqa`: the key-value heads repeated)."""
    from torch.nn import functional as F

    from kdamoe.model import modeling_kdamoe

    calls = []

    def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), is_causal=False,
                         enable_gqa=False):
        assert (is_causal or window_size == (-1, 0)) and torch.equal(cu_q, cu_k)
        assert max_q == max_k == int(cu_q.diff().max())
        calls.append(enable_gqa)
        bounds = cu_q.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                                         scale=scale, enable_gqa=enable_gqa).transpose(0, 1)
                          for a, b in zip(bounds[:-1], bounds[1:])])

    model = make_model(router_balancing="none").double().train()
    ids = torch.randint(3, 97, (2, 30))
    position_ids = torch.cat([torch.arange(11), torch.arange(19), torch.arange(7), torch.arange(23)]).view(2, 30)

    def run():
        model.zero_grad()
        out = model(ids, position_ids=position_ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_grads = run()
    monkeypatch.setattr(modeling_kdamoe, "varlen_attn", reference_varlen)
    monkeypatch.setattr(modeling_kdamoe, "varlen_packed", lambda *args: True)
    if signature != "this torch":
        monkeypatch.setattr(modeling_kdamoe, "_VARLEN_PARAMETERS", {"is_causal": None})
    logits, grads = run()
    assert calls == [signature == "this torch" and "enable_gqa" in modeling_kdamoe._VARLEN_PARAMETERS]  # one layer
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)


def test_gradient_checkpointing_gives_same_gradients():
    model = make_model(router_balancing="none").train()
    ids = torch.randint(3, 97, (2, 16))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    # transformers >= 5.2x calls it `activation_checkpointing_enable`; 5.17 only has the older name.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_weights_forward():
    model = make_model().to(torch.bfloat16)
    out = model(torch.randint(3, 97, (1, 20)), labels=torch.randint(3, 97, (1, 20)))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


# ---------------------------------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_types", [None, KDA_ONLY], ids=["hybrid", "kda_only"])
def test_greedy_with_cache_equals_without(layer_types):
    overrides = {} if layer_types is None else dict(layer_types=layer_types)
    model = make_model(**overrides)
    prompt = torch.randint(3, 97, (2, 7))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 19)
    torch.testing.assert_close(with_cache, without)


def test_decode_steps_match_full_forward_logits():
    model = make_model()
    ids = torch.randint(3, 97, (2, 70))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :50], use_cache=True)
        cache, pieces = out.cache if hasattr(out, "cache") else out.past_key_values, [out.logits]
        for t in range(50, 70, 5):  # a few tokens at a time
            step = model(ids[:, t : t + 5], cache=cache, use_cache=True)
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer_types", [None, KDA_ONLY], ids=["hybrid", "kda_only"])
def test_sampling_and_beam_search_run(layer_types):
    overrides = {} if layer_types is None else dict(layer_types=layer_types)
    model = make_model(**overrides)
    prompt = torch.randint(3, 97, (2, 5))
    sampled = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0, eos_token_id=None)
    assert sampled.shape == (2, 11)
    beams = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.testing.assert_close(model.generate(prompt, use_cache=True, **beams),
                               model.generate(prompt, use_cache=False, **beams))


def test_left_padded_batch_generates_like_single_prompts():
    model = make_model()
    short, long = torch.randint(3, 97, (1, 4)), torch.randint(3, 97, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long], 0)
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    together = model.generate(batch, attention_mask=mask, **kwargs)
    torch.testing.assert_close(together[0, 9:], model.generate(short, **kwargs)[0, 4:])
    torch.testing.assert_close(together[1, 9:], model.generate(long, **kwargs)[0, 9:])


def test_eager_attention_equals_sdpa(tmp_path):
    make_model().save_pretrained(tmp_path)
    eager = kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 97, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    with torch.no_grad():
        for kwargs in ({}, dict(attention_mask=mask), dict(position_ids=position_ids)):
            torch.testing.assert_close(eager(ids, **kwargs).logits, sdpa(ids, **kwargs).logits, rtol=1e-4, atol=1e-5)


def test_sdpa_backends_take_cudnn_only_where_its_plan_pays():
    """cuDNN builds a plan per shape: decode steps and short documents keep the plan-free kernels, a long prefill or
    document enables cuDNN (torch's first choice on Hopper), and fixed shapes (a training step) leave the choice to torch."""
    from torch.nn.attention import SDPBackend

    from kdamoe.model.modeling_kdamoe import CUDNN_MIN_SCORES, sdpa_backends

    long = math.isqrt(CUDNN_MIN_SCORES) + 1  # long * long >= CUDNN_MIN_SCORES
    assert sdpa_backends(4096, 4096, shapes_vary=False) is None
    for q_len, k_len in ((1, 2**20), (2048, 2048), (long, long // 2)):  # a decode step, a short document, a short call
        assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(q_len, k_len, shapes_vary=True)
        assert sdpa_backends(q_len, k_len, True)[0] == SDPBackend.FLASH_ATTENTION
    for q_len, k_len in ((long, long), (2**20, 2**20), (long // 4, 4 * long)):  # prefills, a chunk over a long cache
        backends = sdpa_backends(q_len, k_len, shapes_vary=True)
        assert backends[0] == SDPBackend.CUDNN_ATTENTION and SDPBackend.FLASH_ATTENTION in backends


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_then_forward_and_generate(tied):
    """A new special token (the step before SFT): the resized model takes its id at once, in the same process."""
    model = make_model(tie_word_embeddings=tied).eval()
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 5, mean_resizing=False)
    assert model.model.vocab_size == model.vocab_size == model.config.vocab_size == vocab + 5
    ids = torch.tensor([[3, vocab + 4, 5]])
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert out.logits.shape == (1, 3, vocab + 5) and torch.isfinite(out.loss)
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 6) and int(generated.max()) < vocab + 5
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[vocab + 5]]))


def test_a_forward_without_tokens_is_a_clear_error():
    model = make_model().eval()
    for ids in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="no tokens"):
            model(ids)


def test_assisted_decoding_is_refused_with_a_clear_error():
    """Prompt lookup and an assistant model (speculative decoding) need a cache rolled back to the accepted draft
    tokens, which the KDA layers' recurrent states cannot be: `generate` names that, not a missing cache, also when
    the model is another model's assistant."""
    model = make_model().eval()
    ids = torch.tensor([[3, 4, 5, 6, 3, 4, 5]])
    for kwargs in (dict(prompt_lookup_num_tokens=2), dict(assistant_model=make_model().eval())):
        with pytest.raises(ValueError, match="assisted .speculative. decoding"):
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, **kwargs)
    # as the assistant of another model (transformers' generate marks the assistant's generation config)
    assistant_config = copy.deepcopy(model.generation_config)
    assistant_config.is_assistant = True
    with pytest.raises(ValueError, match="as the assistant"):
        model.generate(ids, generation_config=assistant_config, max_new_tokens=3, pad_token_id=0)


def test_fused_input_projections_equal_the_modules_and_never_bypass_an_adapter():
    """The KDA layer's six input projections as one GEMM give the outputs and gradients of the six modules run one by
    one; a projection that is not a plain linear (here a forward hook, as adapters and quantised layers are) is
    called, not read through its weight."""
    from kdamoe.model.modeling_kdamoe import fused_projections

    torch.manual_seed(0)
    linears = [torch.nn.Linear(16, n, bias=False).double() for n in (6, 6, 6, 2, 4)]
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    groups = ((linears[0], linears[1], linears[2]), (linears[3],), (linears[4],))
    fused = fused_projections(x, *groups)
    separate = (torch.cat([m(x) for m in groups[0]], -1), linears[3](x), linears[4](x))
    cotangents = [torch.randn_like(t) for t in separate]
    leaves = [x] + [m.weight for m in linears]
    want = torch.autograd.grad(separate, leaves, cotangents)
    got = torch.autograd.grad(fused, leaves, cotangents)
    for a, b in zip(fused + got, separate + want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # gradients into one output only: the others' are None (zero for the weights that only they use)
    want = torch.autograd.grad(linears[3](x), leaves, cotangents[1], allow_unused=True)
    got = torch.autograd.grad(fused_projections(x, *groups)[1], leaves, cotangents[1], allow_unused=True)
    for a, b, leaf in zip(got, want, leaves):
        torch.testing.assert_close(a, torch.zeros_like(leaf) if b is None else b, rtol=1e-12, atol=1e-12)
    # under autocast: the outputs in the autocast dtype, the gradients in the leaves' dtypes, as the modules give them
    single = [m.float() for m in linears]
    xf = x.detach().float().requires_grad_()
    leaves = [xf] + [m.weight for m in single]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_projections(xf, *groups)
        separate = (torch.cat([m(xf) for m in groups[0]], -1), single[3](xf), single[4](xf))
    assert [t.dtype for t in fused] == [t.dtype for t in separate] == [torch.bfloat16] * 3
    cotangents = [torch.randn_like(t) for t in separate]
    want = torch.autograd.grad(separate, leaves, cotangents)
    got = torch.autograd.grad(fused, leaves, cotangents)
    for a, b in zip(fused + got, separate + want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)

    model = make_model(layer_types=KDA_ONLY)
    ids = torch.randint(3, 97, (2, 12))
    before = model(ids).logits
    handle = model.model.layers[0].mixer.v_proj.register_forward_hook(lambda module, args, out: out * 0.0)
    hooked = model(ids).logits
    handle.remove()
    assert (hooked - before).abs().max() > 1e-3
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_under_autocast_the_kda_op_gets_the_autocast_dtype(monkeypatch):
    """q, k, v reach the KDA op in the autocast dtype (the conv's fp32 taps cast as `F.conv1d` casts them), not
    promoted to fp32; the loss stays within bf16 error of fp32, and the taps' gradient is fp32."""
    from kdamoe.model import modeling_kdamoe

    seen, chunk = [], modeling_kdamoe.chunk_kda

    def recording(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return chunk(q, k, v, *args, **kwargs)

    monkeypatch.setattr(modeling_kdamoe, "chunk_kda", recording)
    model = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    reference = float(model(input_ids=ids, labels=ids).loss)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen)
    assert abs(float(loss) - reference) < 0.02 * reference
    assert model.model.layers[0].mixer.conv_weight.grad.dtype == torch.float32


@pytest.mark.parametrize("residual_mode", ["standard", "block_attnres"])
def test_under_autocast_norms_before_projections_store_the_autocast_dtype(monkeypatch, residual_mode):
    """Under autocast the norms before the KDA layers and the dense MLP store their output in the autocast dtype (the
    attention's and the MoE block's stay fp32): the rounding the projections' own casts make of an fp32 output. The
    loss and every gradient equal, bit for bit, those of the same model with fp32 norm outputs cast by the
    projections."""
    from kdamoe.model import modeling_kdamoe

    model = tiny_model(residual_mode=residual_mode)
    ids = torch.randint(3, model.config.vocab_size, (2, 48))
    seen = []
    hooks = [layer.mixer.register_forward_pre_hook(lambda m, args, kind=layer.layer_type: seen.append(
        (kind, args[0].dtype))) for layer in model.model.layers]
    hooks += [layer.ffn.register_forward_pre_hook(lambda m, args, moe=layer.is_moe: seen.append(
        ("moe" if moe else "mlp", args[0].dtype))) for layer in model.model.layers]

    def step():
        seen.clear()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, set(seen)

    loss, grads, dtypes = step()
    assert dtypes == {("linear_attention", torch.bfloat16), ("full_attention", torch.float32), ("mlp", torch.bfloat16),
                      ("moe", torch.float32)}
    monkeypatch.setattr(modeling_kdamoe, "projection_dtype", lambda x: None)
    loss_fp32, grads_fp32, dtypes_fp32 = step()
    assert dtypes_fp32 == {("linear_attention", torch.float32), ("full_attention", torch.float32),
                           ("mlp", torch.float32), ("moe", torch.float32)}
    for hook in hooks:
        hook.remove()
    assert torch.equal(loss, loss_fp32)
    assert grads.keys() == grads_fp32.keys() and len(grads) > 20
    for name, grad in grads.items():
        assert torch.equal(grad, grads_fp32[name]), name


def test_output_attentions_is_refused_not_answered_with_none():
    """No layer forms an attention matrix to return: asking for one is a clear error (base model, LM head, generate),
    not `attentions=None`; `output_attentions=False` is accepted."""
    model = tiny_model().eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 8))
    for call in (lambda: model(ids, output_attentions=True), lambda: model.model(ids, output_attentions=True),
                 lambda: model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True,
                                        pad_token_id=0)):
        with pytest.raises(ValueError, match="output_attentions is not supported"):
            call()
    assert model(ids, output_attentions=False).logits.shape == (1, 8, model.config.vocab_size)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_from_inputs_embeds_equals_generate_from_ids(cache_implementation):
    """`generate(inputs_embeds=...)` (soft prompts) runs, on the dynamic and the static cache, and greedy decoding
    from the ids' embeddings gives the ids' tokens."""
    model = tiny_model().eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation=cache_implementation)
    from_ids = model.generate(ids, **kwargs)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **kwargs)
    assert from_embeds.shape == (2, 5) and torch.equal(from_embeds, from_ids[:, -5:])


def test_peft_prompt_tuning_generates():
    """PEFT's prompt tuning prepends its virtual tokens as embeddings, through `generate(inputs_embeds=...)`."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model().eval(), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                            num_virtual_tokens=4))
    ids = torch.randint(3, model.config.vocab_size, (2, 10))
    out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 15) and torch.equal(out[:, :10], ids)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits[:, -1], model.get_base_model()(ids).logits[:, -1])

"""Long contexts end to end: a prefill with a cache, cached decoding, and the first decoded token's logits against
an uncached forward over the same tokens, for every kind of config.

GPU (``gpu_only``, written for an H200): 2^20-token prefills in bf16 (no grad, ``logits_to_keep=1``) of 4-layer
models with the ``small`` preset's widths: all-KDA with the bounded gate, all-KDA with the softplus gate and Full
AttnRes, the hybrid (3 KDA : 1 NoPE attention) with MoE (32 experts top-8: 8M routed rows) and Block AttnRes, and
that hybrid on packed documents spanning the million tokens. CPU: the same check at short lengths for what
tests/test_model.py does not cover (packed prefills followed by cached decoding, attention per document, the
softplus gate with Full AttnRes), and per-document attention against the block-diagonal mask.

The uncached forward routes the compared token to the experts the cached step chose: top-k is discontinuous, so a
rounding difference between the two paths can flip a near-tie (the check asserts that any choice it pins was one).
"""

import contextlib
from dataclasses import dataclass

import pytest
import torch
from triton_interpreter import DEV, gpu_only

import kdamoe
from conftest import tiny_config
from kdamoe.model import model_inputs

KDA, ATTENTION = "linear_attention", "full_attention"
MILLION = 1 << 20
DECODE_TOKENS = 32
GPU_DOCUMENTS = [566019, 1, 777, 4096, 262143, 3, 150000]  # then one of 65,537 tokens, up to 2^20
MEMORY_LIMIT = 80 << 30  # bytes of GPU memory a test may take at its peak


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def packed_positions(lengths: list[int]) -> torch.Tensor:
    """`position_ids [1, sum(lengths)]` restarting at every document (on the host, as kdamoe-train passes them)."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


class RouterProbe:
    """Forward hooks on every MoE router. Recording keeps the last token's experts per layer; pinning makes the last
    token take the recorded experts (weights from its own scores) and keeps the top-k gap of any choice it changes."""

    def __init__(self, model):
        self.routers = {i: layer.ffn.router for i, layer in enumerate(model.model.layers) if layer.is_moe}
        self.experts, self.flipped_gaps, self.pinned = {}, [], None

    def hook(self, i):
        def record_or_pin(router, args, out):
            logits, scores, index, weights, cutoff = out
            if self.pinned is None:
                self.experts[i] = index[-1].clone()
                return None
            pinned = self.pinned[i]
            if set(index[-1].tolist()) != set(pinned.tolist()):
                biased = (scores[-1] + router.bias).sort(descending=True).values
                self.flipped_gaps.append((biased[router.top_k - 1] - biased[router.top_k]).item())
            index, weights = index.clone(), weights.clone()
            index[-1] = pinned
            chosen = scores[-1].gather(0, pinned)
            weights[-1] = chosen / chosen.sum() * router.routed_scaling_factor
            return logits, scores, index, weights, cutoff
        return record_or_pin

    def __enter__(self):
        self.handles = [router.register_forward_hook(self.hook(i)) for i, router in self.routers.items()]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


@dataclass
class DecodeCheck:
    prefill_logits: torch.Tensor  # [V] of the last prompt token
    decode_logits: list[torch.Tensor]  # [V] per cached decode step
    uncached_logits: torch.Tensor  # [V]: the first decoded token's, from an uncached forward over its context
    alone_logits: torch.Tensor  # [V]: the same token with no context
    flipped_gaps: list[float]  # top-k gaps of the routing choices the uncached forward had pinned

    @property
    def error(self) -> float:
        return rel(self.decode_logits[0], self.uncached_logits)

    @property
    def context_effect(self) -> float:
        return rel(self.decode_logits[0], self.alone_logits)


@torch.no_grad()
def prefill_then_decode(model, ids: torch.Tensor, position_ids: torch.Tensor | None, steps: int) -> DecodeCheck:
    """Prefill `ids [1, T]` with a cache (`logits_to_keep=1`), decode `steps` greedy tokens from the cache, then
    run the first decoded token uncached: after the prompt (`T + 1` tokens, its document continued) and alone."""
    probe = RouterProbe(model)
    out = model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    prefill_logits, token = out.logits[0, -1], out.logits[:, -1:].argmax(-1)
    first, decode_logits = token, []
    for step in range(steps):
        with probe if step == 0 else contextlib.nullcontext():  # the first step's routing is recorded
            out = model(input_ids=token, cache=cache, use_cache=True)
        decode_logits.append(out.logits[0, -1])
        token = out.logits[:, -1:].argmax(-1)
    del cache, out
    context = torch.cat([ids, first], 1)
    if position_ids is not None:
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], 1)
    probe.pinned = probe.experts
    with probe:
        uncached = model(input_ids=context, position_ids=position_ids, use_cache=False, logits_to_keep=1).logits
    alone = model(input_ids=first, use_cache=False).logits
    return DecodeCheck(prefill_logits, decode_logits, uncached[0, -1], alone[0, -1], probe.flipped_gaps)


def assert_decode_matches(check: DecodeCheck, tolerance: float, tie: float) -> None:
    """Finite logits everywhere; the first cached step equals the uncached forward within `tolerance` (relative
    norm), which the context changes by at least 10x as much; any routing the uncached run had pinned was a
    near-tie (top-k gap below `tie`)."""
    for logits in (check.prefill_logits, *check.decode_logits, check.uncached_logits):
        assert torch.isfinite(logits).all()
    assert check.error < tolerance, f"cached vs uncached: {check.error:.3g}"
    assert check.context_effect > 10 * check.error, f"context {check.context_effect:.3g} vs {check.error:.3g}"
    assert all(gap < tie for gap in check.flipped_gaps), check.flipped_gaps


def prepared(model) -> "kdamoe.KDAMoEForCausalLM":
    """Non-zero AttnRes pseudo-queries (depth logits of standard deviation about 2: every source counts) and router
    biases, so that nothing passes by accident of initialisation, and sharp attention: q/k norm gains of 2 give the
    attention logits a standard deviation of 4, so that a query picks out a few keys even among a million and what
    an attention layer may see shows in its output (at the initial gains it averages its keys almost uniformly, to
    about nothing)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn_res.query"):
                p.normal_(0, 2 * p.numel() ** -0.5)
        for layer in model.model.layers:
            if layer.is_moe:
                layer.ffn.router.bias.normal_(0, 0.05)
            if layer.layer_type == ATTENTION:
                layer.mixer.q_norm.weight.fill_(2.0)
                layer.mixer.k_norm.weight.fill_(2.0)
    return model


# ---------------------------------------------------------------------------------------------------------------------
# GPU: a million tokens
# ---------------------------------------------------------------------------------------------------------------------

SMALL_WIDTHS = dict(vocab_size=4096, hidden_size=768, num_hidden_layers=4, intermediate_size=1536, kda_num_heads=6,
                    kda_head_dim=128, num_attention_heads=6, num_key_value_heads=2, head_dim=128, num_experts=32,
                    num_experts_per_tok=8, moe_intermediate_size=256, num_shared_experts=1, attnres_block_layers=2,
                    pad_token_id=0)
HYBRID = dict(layer_types=[KDA, KDA, KDA, ATTENTION], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
              residual_mode="block_attnres")
GPU_CONFIGS = {
    "kda": (dict(layer_types=[KDA] * 4, mlp_layer_types=["dense"] * 4, residual_mode="standard"), None),
    "kda_softplus_full_attnres": (dict(layer_types=[KDA] * 4, mlp_layer_types=["dense"] * 4,
                                       residual_mode="full_attnres", kda_gate="softplus"), None),
    "hybrid_moe_block_attnres": (HYBRID, None),
    "hybrid_moe_block_attnres_packed": (HYBRID, GPU_DOCUMENTS + [MILLION - sum(GPU_DOCUMENTS)]),
}


@gpu_only
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_million_token_prefill_then_cached_decode(name):
    overrides, documents = GPU_CONFIGS[name]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = kdamoe.KDAMoEConfig(**{**SMALL_WIDTHS, **overrides})
    model = prepared(kdamoe.KDAMoEForCausalLM(config).to(DEV, torch.bfloat16).eval())
    ids = torch.randint(1, config.vocab_size, (1, MILLION), device=DEV)
    check = prefill_then_decode(model, ids, packed_positions(documents) if documents else None, DECODE_TOKENS)
    assert_decode_matches(check, tolerance=2e-2, tie=2e-2)
    peak = torch.cuda.max_memory_allocated()
    assert peak <= MEMORY_LIMIT, f"peak {peak / 2**30:.1f} GiB"


# ---------------------------------------------------------------------------------------------------------------------
# CPU: the same check at short lengths, and attention per document
# ---------------------------------------------------------------------------------------------------------------------

CPU_DOCUMENTS = [1, 37, 64, 5, 50]
CPU_CONFIGS = {  # tiny_config's default is the hybrid with MoE and Block AttnRes
    "kda_softplus_full_attnres": (dict(layer_types=[KDA] * 4, residual_mode="full_attnres", kda_gate="softplus"),
                                  None, False),
    "kda_packed": (dict(layer_types=[KDA] * 4), CPU_DOCUMENTS, False),
    "hybrid_packed_mask": ({}, CPU_DOCUMENTS, False),
    "hybrid_packed_per_document": ({}, CPU_DOCUMENTS, True),
}


@pytest.mark.parametrize("name", list(CPU_CONFIGS))
def test_prefill_then_cached_decode_equals_uncached(name, monkeypatch):
    overrides, documents, per_document = CPU_CONFIGS[name]
    if per_document:
        monkeypatch.setattr(model_inputs, "DENSE_MASK_ELEMENTS", 0)
    model = prepared(kdamoe.KDAMoEForCausalLM(tiny_config(**overrides)).eval())
    ids = torch.randint(3, 97, (1, sum(documents) if documents else 157))
    check = prefill_then_decode(model, ids, packed_positions(documents) if documents else None, steps=4)
    assert_decode_matches(check, tolerance=1e-4, tie=1e-4)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_attention_per_document_equals_block_diagonal_mask(implementation, monkeypatch):
    """Packed rows past `DENSE_MASK_ELEMENTS` attend document by document: the same logits and gradients as the
    block-diagonal mask, for a row of three documents (one of a single token) beside a row of one."""
    model = prepared(kdamoe.KDAMoEForCausalLM(tiny_config(router_balancing="none"))).train()
    model.config._attn_implementation = implementation
    ids = torch.randint(3, 97, (2, 40))
    position_ids = torch.cat([packed_positions([1, 24, 15]), packed_positions([40])])

    def run():
        model.zero_grad()
        out = model(input_ids=ids, position_ids=position_ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    masked_logits, masked_grads = run()
    monkeypatch.setattr(model_inputs, "DENSE_MASK_ELEMENTS", 0)
    logits, grads = run()
    torch.testing.assert_close(logits, masked_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == masked_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], masked_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_million_packed_tokens_build_no_mask():
    """What a block-diagonal mask over a 2^20-token packed row would be: 2^40 elements. None is built; rows within
    the limit keep their mask."""
    long = model_inputs.PackedDocuments.from_position_ids(packed_positions([3, MILLION - 3]), "cpu")
    assert model_inputs.build_attention_mask(None, long, MILLION, 0, "cpu") is None
    short = model_inputs.PackedDocuments.from_position_ids(packed_positions([3, 13]), "cpu")
    mask = model_inputs.build_attention_mask(None, short, 16, 0, "cpu")
    assert torch.equal(mask[0, 0, 3:], torch.ones(13, 16, dtype=torch.bool).tril(3) & (torch.arange(16) >= 3))
    assert long.last_doc_start.tolist() == [3] and short.last_doc_start.tolist() == [3]

"""Generation with the static cache (`KDAMoEStaticCache`, `generate(..., cache_implementation="static")`) against
the default dynamic cache: greedy, padded, beam search and sampling, cached steps against the full forward, reuse and
the errors; on a GPU, the decode steps replayed as CUDA graphs (tokens, no host synchronisation) and transformers'
`torch.compile` of them."""

import pytest
import torch
from conftest import cache_of, tiny_model
from triton_interpreter import gpu_only

import kdamoe
from kdamoe.model.caches import CACHE_FIELD
from kdamoe.model.decode_graphs import RecordedStep

KDA_ONLY = ["linear_attention"] * 4
LAYER_TYPES = pytest.mark.parametrize("layer_types", [None, KDA_ONLY], ids=["hybrid", "kda_only"])
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def make_model(layer_types=None, **overrides):
    """The tiny model (hybrid by default) with non-zero pseudo-queries and router biases."""
    if layer_types is not None:
        overrides["layer_types"] = layer_types
    return tiny_model(**overrides).eval()


def prefill(model, ids, cache, **kwargs):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{CACHE_FIELD: cache}, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------------


@LAYER_TYPES
def test_static_generate_equals_dynamic(layer_types):
    """Greedy tokens equal the dynamic cache's, logits to fp32 rounding (bit for bit without attention layers, whose
    static keys are masked rather than cut); generate sizes the cache for the batch and max_length - 1 tokens."""
    model = make_model(layer_types)
    prompt = torch.randint(3, 97, (2, 7))
    kwargs = dict(max_new_tokens=12, return_dict_in_generate=True, output_logits=True, **GREEDY)
    dynamic = model.generate(prompt, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences) and static.sequences.shape == (2, 19)
    for got, want in zip(static.logits, dynamic.logits, strict=True):
        if layer_types is None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)
    cache = cache_of(static)
    assert isinstance(cache, kdamoe.KDAMoEStaticCache) and cache.is_compileable
    assert (cache.max_batch_size, cache.max_cache_len, int(cache.get_seq_length())) == (2, 18, 18)


def test_static_left_padded_batch_equals_dynamic():
    """Left padding: the cache keeps the padding flags of the prompt, so the decode steps (which get the new token's
    column only) do not attend to the padded keys."""
    model = make_model()
    batch = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(batch)
    batch[0, :5], mask[0, :5] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=8, **GREEDY)
    torch.testing.assert_close(model.generate(batch, cache_implementation="static", **kwargs),
                               model.generate(batch, **kwargs))


@LAYER_TYPES
def test_static_beam_search_and_sampling_equal_dynamic(layer_types):
    """Beam search reorders the static cache in place; sampling draws the same tokens from the same seed."""
    model = make_model(layer_types)
    prompt = torch.randint(3, 97, (2, 5))
    beams = dict(max_new_tokens=6, num_beams=3, **GREEDY)
    torch.testing.assert_close(model.generate(prompt, cache_implementation="static", **beams),
                               model.generate(prompt, **beams))
    sampled = []
    for implementation in ("static", None):
        torch.manual_seed(1)
        sampled.append(model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=20, pad_token_id=0,
                                      eos_token_id=None, cache_implementation=implementation))
    torch.testing.assert_close(*sampled)


def test_static_steps_of_several_tokens_match_full_forward():
    """A prefill, then steps of 5 tokens and of 1: the logits equal the uncached forward's, and the cache counts
    the tokens on the device."""
    model = make_model()
    ids = torch.randint(3, 97, (2, 70))
    cache = kdamoe.KDAMoEStaticCache(model.config, max_batch_size=2, max_cache_len=70)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        pieces = [prefill(model, ids[:, :50], cache).logits]
        for t in [*range(50, 65, 5), *range(65, 70)]:
            n = 5 if t < 65 else 1
            pieces.append(model(ids[:, t : t + n], use_cache=True, **{CACHE_FIELD: cache}).logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-5)
    assert isinstance(cache.get_seq_length(), torch.Tensor) and int(cache.get_seq_length()) == 70


def test_static_cache_reused_after_reset_and_for_fewer_rows():
    """A cache for 4 rows generates a batch of 2 (its first rows), and again after `reset()` in the same storage:
    both times the dynamic cache's tokens."""
    model = make_model()
    prompt = torch.randint(3, 97, (2, 6))
    cache = kdamoe.KDAMoEStaticCache(model.config, max_batch_size=4, max_cache_len=32)
    storage = [layer.recurrent.data_ptr() for layer in cache.layers if hasattr(layer, "recurrent")]
    want = model.generate(prompt, max_new_tokens=8, **GREEDY)
    for _ in range(2):
        cache.reset()
        assert cache.get_seq_length() == 0
        torch.testing.assert_close(model.generate(prompt, max_new_tokens=8, **{CACHE_FIELD: cache}, **GREEDY), want)
    assert [layer.recurrent.data_ptr() for layer in cache.layers if hasattr(layer, "recurrent")] == storage


def test_static_cache_errors_name_the_problem():
    model = make_model()
    config = model.config
    prompt = torch.randint(3, 97, (2, 7))
    with pytest.raises(ValueError, match="max_batch_size"):
        kdamoe.KDAMoEStaticCache(config, max_batch_size=0, max_cache_len=8)
    with pytest.raises(ValueError, match="holds 1 rows, generate needs 2"):
        model.generate(prompt, max_new_tokens=4, **{CACHE_FIELD: kdamoe.KDAMoEStaticCache(config, 1, 32)}, **GREEDY)
    with pytest.raises(ValueError, match="holds 10 tokens per row, generate needs 18"):
        model.generate(prompt, max_new_tokens=12, **{CACHE_FIELD: kdamoe.KDAMoEStaticCache(config, 2, 10)}, **GREEDY)
    with pytest.raises(ValueError, match="holds 2 rows, got a batch of 3"):
        prefill(model, torch.randint(3, 97, (3, 4)), kdamoe.KDAMoEStaticCache(config, 2, 16))
    with pytest.raises(ValueError, match="holds 8 tokens per row, got 9 at once"):
        prefill(model, torch.randint(3, 97, (2, 9)), kdamoe.KDAMoEStaticCache(config, 2, 8))
    cache = kdamoe.KDAMoEStaticCache(config, 2, 8)
    prefill(model, prompt, cache)
    with pytest.raises(ValueError, match="generation of 2 rows, got a batch of 1: reset"):
        prefill(model, prompt[:1, -1:], cache)
    prefill(model, prompt[:, -1:], cache)  # the 8th token
    with pytest.raises(RuntimeError, match="the static cache is full"):  # on the device (an assertion)
        prefill(model, prompt[:, -1:], cache)
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="cannot record past states"):
        cache.activate_past_recording()


def test_static_cache_without_attention_layers_has_no_length_limit():
    """KDA layers keep a fixed-size state: a KDA-only cache takes any number of tokens and allocates nothing per
    token."""
    model = make_model(KDA_ONLY)
    cache = kdamoe.KDAMoEStaticCache(model.config, max_batch_size=1, max_cache_len=4)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits[:, -1]
        prefill(model, ids[:, :10], cache)
        for t in (10, 11):
            last = model(ids[:, t : t + 1], use_cache=True, **{CACHE_FIELD: cache}).logits[:, -1]
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)
    assert cache.key_mask is None and int(cache.get_seq_length()) == 12


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: decode steps replayed as CUDA graphs
# ---------------------------------------------------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("layer_types,dtype", [(None, torch.float32), (KDA_ONLY, torch.float32),
                                               (KDA_ONLY, torch.bfloat16)], ids=["hybrid-fp32", "kda-fp32", "kda-bf16"])
def test_graphed_generate_equals_eager_dynamic(layer_types, dtype):
    """`generate(..., cache_implementation="static")` on the GPU replays the decode steps as CUDA graphs: greedy
    tokens equal the uncompiled dynamic cache's (bf16 too without attention layers: the same kernels), and the
    steps were recorded once and replayed."""
    model = make_model(layer_types).to("cuda", dtype)
    prompt = torch.randint(3, 97, (2, 20), device="cuda")
    cache = kdamoe.KDAMoEStaticCache(model.config, max_batch_size=2, max_cache_len=64, device="cuda", dtype=dtype)
    static = model.generate(prompt, max_new_tokens=24, **{CACHE_FIELD: cache}, **GREEDY)
    dynamic = model.generate(prompt, max_new_tokens=24, **GREEDY)
    assert torch.equal(static, dynamic)
    steps = cache.decode_graphs.steps
    assert len(steps) == 1 and all(isinstance(step, RecordedStep) for step in steps.values())


@gpu_only
def test_graphed_decode_steps_equal_eager_and_do_not_synchronise():
    """After the eager step and the recording, replayed steps (greedy, the next token chosen on the device) give the
    eager static steps' logits bit for bit and never synchronise with the host."""
    model = make_model().to("cuda", torch.bfloat16)
    ids = torch.randint(3, 97, (3, 16), device="cuda")
    runs = []
    for step in (model.get_compiled_call(None), model):
        cache = kdamoe.KDAMoEStaticCache(model.config, 3, 40, device="cuda", dtype=torch.bfloat16)
        token = prefill(model, ids, cache).logits[:, -1:].argmax(-1)
        logits = []
        with torch.no_grad():
            for i in range(10):
                if i == 3 and step is not model:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    out = step(input_ids=token, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                logits.append(out.logits.clone())
                token = out.logits[:, -1:].argmax(-1)
        runs.append(torch.cat(logits, 1))
    assert torch.equal(runs[0], runs[1])


@gpu_only
def test_compiled_generate_with_a_compile_config():
    """With a `compile_config`, generate hands the static decode step to transformers' `torch.compile` (Inductor,
    CUDA graphs through mode "reduce-overhead"): it compiles without a graph break and gives the eager tokens (fp32)."""
    from transformers import CompileConfig

    model = make_model().to("cuda")
    prompt = torch.randint(3, 97, (2, 12), device="cuda")
    compiled = model.generate(prompt, max_new_tokens=8, cache_implementation="static",
                              compile_config=CompileConfig(fullgraph=True), **GREEDY)
    assert torch.equal(compiled, model.generate(prompt, max_new_tokens=8, **GREEDY))

"""Decode steps replayed as CUDA graphs: what `generate(..., cache_implementation="static")` runs after the prefill
on a GPU (`KDAMoEForCausalLM.get_compiled_call`).

A decode step of a small model is a few hundred kernels of a few microseconds each; launched one by one from Python,
the host takes longer than the GPU. `graphed_decode_step` records the model's step on a `KDAMoEStaticCache` (whose
tensors never move and whose position lives on the device) once per batch size and replays it: one launch a step,
no host synchronisation. The recording runs the model's eager kernels, so a replayed step computes what an eager step
computes, bit for bit, and nothing is compiled (Inductor, through `torch.compile`, compiles the step for every
shape).

Per cache and batch size: the first decode step runs eagerly on a side stream (it compiles the Triton kernels for
its shapes and sets cuBLAS up on that stream, which a recording cannot do), the second is recorded on it and
replayed, and every later one is replayed after its input ids (and the new tokens' padding flags) are copied into
the graph's input buffers. A recording that fails (an operation a graph cannot hold, such as a host
synchronisation) is logged once, and that batch size's steps on the cache run eagerly. The graphs live on the cache
(`cache.decode_graphs`) and share one memory pool: a new cache (every `generate` call makes one) records anew, a
cache reused after `reset()` keeps them. A replay returns the graph's logits buffer, which the next replay overwrites
(`generate` copies the last position's logits at once).

Calls that do not fit (the prefill, several tokens, another cache, CPU tensors, gradients, training mode, hidden
states or router logits asked for) run `model(**kwargs)` as they are.
"""

import dataclasses

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.utils import logging

from .caches import CACHE_FIELD, KDAMoEStaticCache

logger = logging.get_logger(__name__)


@dataclasses.dataclass
class RecordedStep:
    """A recorded step: the graph, its input buffers and its logits."""

    graph: "torch.cuda.CUDAGraph"
    input_ids: torch.Tensor
    token_mask: torch.Tensor | None
    logits: torch.Tensor


_WARM, _EAGER = "warm", "eager"  # the first step ran eagerly / the recording failed: eager steps


@dataclasses.dataclass
class DecodeGraphs:
    """A cache's recorded steps by (batch, with a mask, logits_to_keep) (`_WARM` after the eager first step, `_EAGER`
    if the recording failed), the stream they are recorded on and their memory pool."""

    stream: "torch.cuda.Stream"
    pool: tuple
    steps: dict = dataclasses.field(default_factory=dict)


def _graphable(model, cache, input_ids, mask, kwargs) -> bool:
    config = model.config
    wants = ("output_hidden_states", "output_router_logits", "output_attentions")
    return (
        isinstance(cache, KDAMoEStaticCache) and cache.rows > 0
        and input_ids is not None and input_ids.is_cuda and input_ids.dim() == 2 and input_ids.shape[1] == 1
        and input_ids.shape[0] == cache.rows
        and (mask is None or (mask.dim() == 2 and mask.shape[0] == cache.rows))
        and kwargs.get("inputs_embeds") is None and kwargs.get("labels") is None
        and kwargs.get("use_cache") is not False
        and not any(kwargs.get(name, getattr(config, name, False)) for name in wants)
        and not model.training and not torch.is_grad_enabled()
    )


def graphed_decode_step(model, **kwargs):
    """`model(**kwargs)`, with a decode step on a static cache (one token per row) replayed as a CUDA graph."""
    cache = kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")
    input_ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    if not _graphable(model, cache, input_ids, mask, kwargs):
        return model(**kwargs)
    if cache.decode_graphs is None:
        cache.decode_graphs = DecodeGraphs(torch.cuda.Stream(input_ids.device), torch.cuda.graph_pool_handle())
    graphs = cache.decode_graphs
    logits_to_keep = kwargs.get("logits_to_keep", 0)
    key = (input_ids.shape[0], mask is not None, logits_to_keep)
    step = graphs.steps.get(key)
    if step is None:
        graphs.steps[key] = _WARM
        current = torch.cuda.current_stream(input_ids.device)
        graphs.stream.wait_stream(current)
        with torch.cuda.stream(graphs.stream):
            out = model(**kwargs)
        current.wait_stream(graphs.stream)
        return out
    if step is _WARM:
        try:
            step = _record(model, cache, graphs, input_ids, mask, logits_to_keep)
        except RuntimeError as error:  # an operation a recording cannot hold (a host synchronisation)
            logger.warning_once(f"kdamoe: the decode step could not be recorded as a CUDA graph ({error}); it runs "
                                "eagerly")
            step = _EAGER
        graphs.steps[key] = step
    if step is _EAGER:
        return model(**kwargs)
    step.input_ids.copy_(input_ids)
    if step.token_mask is not None:
        step.token_mask.copy_(mask[:, -1:])
    step.graph.replay()
    out = MoeCausalLMOutputWithPast(logits=step.logits, **{CACHE_FIELD: cache})
    return_dict = kwargs.get("return_dict")
    return out if (return_dict if return_dict is not None else model.config.return_dict) else out.to_tuple()


def _record(model, cache, graphs: DecodeGraphs, input_ids, mask, logits_to_keep) -> RecordedStep:
    """Record one decode step on the cache's stream (input buffers made outside the graph's pool)."""
    static_ids = input_ids.clone()
    static_mask = mask[:, -1:].clone() if mask is not None else None
    graph = torch.cuda.CUDAGraph()
    graphs.stream.wait_stream(torch.cuda.current_stream(input_ids.device))
    with torch.cuda.graph(graph, pool=graphs.pool, stream=graphs.stream, capture_error_mode="thread_local"):
        out = model(input_ids=static_ids, attention_mask=static_mask, cache=cache, use_cache=True,
                    logits_to_keep=logits_to_keep, return_dict=True)
    return RecordedStep(graph, static_ids, static_mask, out.logits)

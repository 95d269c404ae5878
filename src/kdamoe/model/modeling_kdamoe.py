"""kdamoe: a decoder-only causal LM of KDA (bounded-decay Kimi Delta Attention) and NoPE full-attention mixers,
dense or Quantile-Balanced MoE FFNs, and Attention Residuals over depth (docs/design.md is the contract).

Reads top to bottom: config helpers and small modules → mixers (KDA, attention) → decoder layer → model →
causal-LM head. Shapes: B batch, T new tokens, Tk attended tokens, D hidden, H heads, K/V head dims.

Packed sequences follow transformers' flattening convention: `position_ids` that restart at 0 mark document
starts. KDA then runs with `cu_seqlens` (no state crosses a document), the short convolutions stop at
document starts, and attention layers get a block-diagonal causal mask (or, for long rows, attend document by
document). A cache filled by a packed prefill continues each row's last document.

Context parallelism (`context_parallel=ContextParallel(group)`, `context_parallel.py`): each rank of the group holds
equal consecutive columns of every row; KDA passes its state across rank boundaries, the short convolutions read the
previous rank's last inputs, attention layers gather the keys and values, the loss is the group's mean.
"""

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

try:  # torch's flash kernel over packed documents (torch >= 2.10); without it they attend one call a document
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters  # its causal and GQA switches vary by version
except ImportError:
    varlen_attn, _VARLEN_PARAMETERS = None, {}

from .attnres import DepthAttention, ResidualState
from .caches import CACHE_FIELD, KDAMoECache, KDAMoEStaticCache
from .configuration_kdamoe import KDAMoEConfig
from .context_parallel import ContextParallel, RowShard
from .decode_graphs import graphed_decode_step
from .fused_norm import add_rms_norm, gated_rms_norm, rms_norm
from .kda import chunk_kda, recurrent_kda
from .kda_decode import kda_decode_step
from .loss import linear_cross_entropy
from .model_inputs import (
    DENSE_MASK_ELEMENTS,
    PackedDocuments,
    TokenIdCheck,
    build_attention_mask,
    is_safetensors_error,
    unreadable_weights,
)
from .moe import (KDAMoEExperts, KDAMoEMLP, KDAMoERouter, KDAMoESparseMoeBlock, apply_balancing, plain_linear,
                  summary_to_host)
from .short_conv import short_conv_silu, short_conv_state

try:
    from .kda_conv_chunk import conv_chunk_kda
except ImportError:
    conv_chunk_kda = None
from .decode_attention import decode_attention, supported as split_kv_supported

# Decode steps over at least this many cached keys use `decode_attention` (split over the keys) instead of SDPA.
SPLIT_KV_MIN_KEYS = 4096


# ----------------------------------------------------------------------------------------------------------------------
# Small modules and helpers
# ----------------------------------------------------------------------------------------------------------------------


class KDAMoERMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32 (one fused kernel each way on a GPU). Also used head-wise
    (`[..., H, V]` with a `[V]` gain)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _FusedLinear(torch.autograd.Function):
    """``x @ cat(weights).T`` as column slices, one per group of ``widths`` (a last group of padding columns is not
    returned). Its backward forms x's gradient from the first group's output gradient in one GEMM and adds the
    other groups' (a few narrow columns, joined) in a second GEMM's epilogue: split's backward would first write
    every output gradient into one ``[tokens, Σ widths]`` tensor. Under autocast x and the weights run in the
    autocast dtype, and the gradients return in the inputs' dtypes, as the ops autocast runs would give them."""

    @staticmethod
    def forward(ctx, x, widths, rows, *weights):
        pad = -sum(widths) % 16
        w_run = torch.cat([*weights, weights[0].new_zeros(pad, weights[0].shape[1])] if pad else weights)
        x_run = x
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x_run, w_run = x.to(dtype), w_run.to(dtype)
        ctx.save_for_backward(x_run, w_run)
        ctx.widths, ctx.rows, ctx.x_dtype = widths, rows, x.dtype
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.set_materialize_grads(False)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x_run, w_run).split(list(widths) + [pad], dim=-1)[: len(widths)]

    @staticmethod
    def backward(ctx, *grads):
        x_run, w_run = ctx.saved_tensors
        first, rest = ctx.widths[0], sum(ctx.widths[1:])
        lead = x_run.shape[:-1]
        flat = [torch.zeros(*lead, n, dtype=x_run.dtype, device=x_run.device) if g is None else g.to(x_run.dtype)
                for g, n in zip(grads, ctx.widths)]
        g_first = flat[0].reshape(-1, first)  # [N, first]
        g_rest = torch.cat(flat[1:], -1).reshape(-1, rest) if rest else None  # [N, Σ other widths]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = g_first @ w_run[:first]
            if g_rest is not None:
                dx.addmm_(g_rest, w_run[first:first + rest])
            dx = dx.view(*lead, -1).to(ctx.x_dtype)
        if any(ctx.needs_input_grad[3:]):
            x2 = x_run.reshape(-1, x_run.shape[-1])
            dw = [g_first.T @ x2] + ([g_rest.T @ x2] if g_rest is not None else [])
            dw = [g.to(d) for g, d in zip(torch.cat(dw).split(ctx.rows), ctx.w_dtypes)]
        return dx, None, None, *(dw if dw is not None else [None] * len(ctx.rows))


def fused_projections(x: torch.Tensor, *groups: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, ...]:
    """`torch.cat([m(x) for m in group], -1)` for each group of bias-free projections of the same input x. When every
    module is a plain `nn.Linear` without hooks, all groups come from one GEMM over their concatenated weights, as
    column slices of its output (`_FusedLinear`): x is read once, and the backward runs two GEMMs for x's gradient
    instead of one per projection plus an add for each. The output's rows are padded to a multiple of 16 elements, so
    that a kernel reading a group's columns in place sees 32-byte aligned rows (and vectorises its loads). Anything
    else (PEFT's LoRA layers, quantised linears, hooks) runs module by module, so adapters are never bypassed."""
    modules = [m for group in groups for m in group]
    if all(map(plain_linear, modules)):
        widths = tuple(sum(m.out_features for m in group) for group in groups)
        rows = tuple(m.out_features for m in modules)
        return _FusedLinear.apply(x, widths, rows, *(m.weight for m in modules))
    return tuple(torch.cat([m(x) for m in group], -1) if len(group) > 1 else group[0](x) for group in groups)


@dataclasses.dataclass
class KDAMoEModelOutputWithPast(MoeModelOutputWithPast):
    """`MoeModelOutputWithPast` plus the summed auxiliary load-balancing loss of the MoE layers (or None)."""

    aux_loss: torch.FloatTensor | None = None


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. `query: [B, Hq, T, Dh]`, `key/value: [B, Hkv, Tk, Dh]` -> `([B, T, Hq, Dh], probs)`."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if attention_mask is None:
        t, tk = query.shape[2], key.shape[2]
        attention_mask = torch.ones(t, tk, dtype=torch.bool, device=query.device).tril(tk - t)
    scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(-1).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return (probs @ value).transpose(1, 2).contiguous(), probs


# ----------------------------------------------------------------------------------------------------------------------
# Mixers
# ----------------------------------------------------------------------------------------------------------------------


def conv_kda_in_one_function(qkv: torch.Tensor) -> bool:
    """Whether the KDA layer runs its conv, L2 norm and chunked KDA as `conv_chunk_kda` (one autograd function that
    recomputes the conv and the norm in its backward rather than keep q, k, v): Triton on CUDA, with grad, not
    traced."""
    return conv_chunk_kda is not None and qkv.is_cuda and torch.is_grad_enabled() and not torch.compiler.is_compiling()


class KDAMoEKimiDeltaAttention(nn.Module):
    """Kimi Delta Attention with a bounded (or softplus) log-decay gate (docs/design.md §2).

    x `[B, T, D]` → q, k, v (linear → causal depthwise conv + SiLU; q, k L2-normalised), β = sigmoid
    (one per head and token), log-decay g from a low-rank projection → `chunk_kda` / `recurrent_kda` →
    head-wise RMSNorm × sigmoid(low-rank output gate) → `o_proj`.
    """

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = config.kda_num_heads
        self.head_dim = k = config.kda_head_dim
        self.conv_size = config.kda_conv_size
        self.gate = config.kda_gate
        self.lower_bound = config.kda_gate_lower_bound
        d = config.hidden_size
        self.q_proj = nn.Linear(d, h * k, bias=False)
        self.k_proj = nn.Linear(d, h * k, bias=False)
        self.v_proj = nn.Linear(d, h * k, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * h * k, self.conv_size))  # depthwise taps for q | k | v
        self.beta_proj = nn.Linear(d, h, bias=False)
        self.decay_down_proj = nn.Linear(d, k, bias=False)  # low-rank gate, rank = head_dim
        self.decay_up_proj = nn.Linear(k, h * k, bias=False)
        self.A_log = nn.Parameter(torch.empty(h))
        self.dt_bias = nn.Parameter(torch.empty(h * k))
        self.out_gate_down_proj = nn.Linear(d, k, bias=False)
        self.out_gate_up_proj = nn.Linear(k, h * k, bias=False)
        self.o_norm = KDAMoERMSNorm(k, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(h * k, d, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        packed: PackedDocuments | None = None,
        token_mask: torch.Tensor | None = None,
        shard: RowShard | None = None,
    ) -> torch.Tensor:
        """`shard`: this rank's part of context-parallel rows (`packed` then describes its own tokens)."""
        batch, seq_len, _ = hidden_states.shape
        h, k = self.num_heads, self.head_dim
        if token_mask is not None:  # padded tokens leave the state untouched: zero input gives k = v = 0
            hidden_states = hidden_states * token_mask.unsqueeze(-1).to(hidden_states.dtype)
        decoding = cache is not None and cache.has_previous_state(self.layer_idx)
        layer_cache = cache.layers[self.layer_idx] if decoding else None
        if decoding and seq_len == 1 and not getattr(layer_cache, "record_past", False):
            return self._decode_step(hidden_states, layer_cache)

        # [B, T, 3·H·K], [B, T, H], [B, T, K], [B, T, K]
        qkv, beta, decay, out_gate = fused_projections(hidden_states, *self._input_groups())
        beta = beta.to(torch.promote_types(beta.dtype, torch.float32)).sigmoid()  # [B, T, H], fp32 or fp64
        g_raw = self.decay_up_proj(decay).view(batch, seq_len, h, k)
        cu_seqlens = packed.cu_seqlens_device if packed is not None else None
        kda_kwargs = dict(
            use_gate_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            gate=self.gate,
            lower_bound=self.lower_bound if self.gate == "bounded" else None,
            output_final_state=cache is not None,
        )
        # packed documents of all rows run as one flattened varlen sequence
        flat = (lambda t: t.reshape(1, batch * seq_len, *t.shape[2:])) if packed is not None else (lambda t: t)
        if not decoding and shard is None and conv_kda_in_one_function(qkv):  # keeps qkv for the backward, not q, k, v
            o, state = conv_chunk_kda(qkv, self._conv_weight(qkv), flat(g_raw), flat(beta), h,
                                      packed.cu_seqlens if packed is not None else None, cu_seqlens, **kda_kwargs)
        else:
            o, state = self._conv_and_kda(qkv, g_raw, beta, layer_cache, packed, shard, flat, kda_kwargs)
        o = o.view(batch, seq_len, h, k)
        if packed is not None and state is not None:
            state = state[packed.last_doc_of_row]

        if cache is not None:  # the decode context never reaches into an earlier document
            conv_state = short_conv_state(qkv, self.conv_size, state=layer_cache.conv_states[0] if decoding else None,
                                          cu_seqlens=cu_seqlens)
            cache.update_conv_state(conv_state, self.layer_idx, conv_kernel_size=self.conv_size)
            cache.update_recurrent_state(state.float(), self.layer_idx)
        return self._output(o, out_gate)

    def _input_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The projections of x, as `fused_projections`' groups: q | k | v, β, the decay's and the output gate's
        down-projections."""
        return ((self.q_proj, self.k_proj, self.v_proj), (self.beta_proj,), (self.decay_down_proj,),
                (self.out_gate_down_proj,))

    def fused_inputs(self) -> bool:
        """x enters one GEMM (`fused_projections`' fast path), not one per projection."""
        return all(plain_linear(m) for group in self._input_groups() for m in group)

    def _conv_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The conv taps in the autocast dtype under autocast (as `F.conv1d` runs there), so that q, k, v reach the
        KDA kernels in it rather than promoted to the fp32 of the weight; else as stored."""
        if torch.is_autocast_enabled(x.device.type):
            return self.conv_weight.to(torch.get_autocast_dtype(x.device.type))
        return self.conv_weight

    def _conv_and_kda(self, qkv, g_raw, beta, layer_cache, packed, shard, flat, kda_kwargs):
        """The conv + SiLU and the KDA op (the q/k L2 norm inside it) as separate ops (decoding, context
        parallelism, the CPU, inference, tracing): `(o, final state or None)`, both as the op returns them (`flat`
        rows when packed)."""
        batch, seq_len, _ = qkv.shape
        h, k = self.num_heads, self.head_dim
        cu_seqlens = packed.cu_seqlens_device if packed is not None else None
        if shard is not None:  # the previous rank's last inputs lead each row
            mixed = short_conv_silu(shard.conv_input(qkv), self._conv_weight(qkv), cu_seqlens=shard.conv_cu_seqlens)
            mixed = mixed[:, self.conv_size - 1:]
        else:
            context = layer_cache.conv_states[0][..., 1:].transpose(1, 2) if layer_cache is not None else None
            mixed = short_conv_silu(qkv, self._conv_weight(qkv), cu_seqlens=cu_seqlens, context=context)
        # q, k, v copied out, so that what the op keeps holds no view of the whole conv output; q, k L2-normalised
        # per head inside the op (on a GPU in its kernels)
        q, key, v = (t.view(batch, seq_len, h, k).contiguous() for t in mixed.split(h * k, dim=-1))
        kda_kwargs = dict(kda_kwargs, use_qk_l2norm_in_kernel=True)
        if layer_cache is not None:  # decoding
            kda = recurrent_kda if seq_len < 64 else chunk_kda
            return kda(q, key, v, g_raw, beta, initial_state=layer_cache.recurrent_states[0], **kda_kwargs)
        if packed is not None:
            kda = shard.kda if shard is not None else chunk_kda
            return kda(*map(flat, (q, key, v, g_raw, beta)), cu_seqlens=packed.cu_seqlens, **kda_kwargs)
        if shard is not None:
            return shard.kda(q, key, v, g_raw, beta, **kda_kwargs)
        return chunk_kda(q, key, v, g_raw, beta, **kda_kwargs)

    def _output(self, o: torch.Tensor, out_gate: torch.Tensor) -> torch.Tensor:
        """`o [B, T, H, K]` → o_norm(o) · sigmoid(out_gate_up_proj(out_gate)) → `o_proj` → `[B, T, D]`."""
        batch, seq_len, h, k = o.shape
        out_gate = self.out_gate_up_proj(out_gate).view(batch, seq_len, h, k)
        o = gated_rms_norm(o, self.o_norm.weight, out_gate, self.o_norm.eps)
        return self.o_proj(o.reshape(batch, seq_len, h * k))

    def _decode_step(self, hidden_states: torch.Tensor, layer_cache) -> torch.Tensor:
        """One new token per row (`[B, 1, D]`) from the cached states, which it updates in place: what the path above
        computes for it, in one kernel on a GPU (`kda_decode_step`)."""
        batch = hidden_states.shape[0]

        def rows(x):  # a projection's [B, 1, N] output as [B, N]
            return x.view(batch, -1)

        qkv, beta, decay, out_gate = fused_projections(hidden_states, *self._input_groups())
        q, k, v = rows(qkv).split([self.num_heads * self.head_dim] * 3, dim=-1)
        o = kda_decode_step(
            q, k, v, rows(beta), rows(self.decay_up_proj(decay)), rows(self.out_gate_up_proj(out_gate)),
            layer_cache.conv_states[0],
            layer_cache.recurrent_states[0], conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias,
            norm_weight=self.o_norm.weight, norm_eps=self.o_norm.eps, gate=self.gate,
            lower_bound=self.lower_bound if self.gate == "bounded" else None,
        )
        return self.o_proj(o.view(batch, 1, -1))


# SDPA's backends where the shapes vary from call to call (a cache: every decode step has a new key length; packed
# documents: each its own length). cuDNN's kernel (torch's first choice on Hopper, 1.6-1.9x the flash kernel's speed
# on causal attention) builds an execution plan per shape, tens of ms; the flash / memory-efficient kernels need none.
# A call of at least CUDNN_MIN_SCORES query x key positions (a prefill or document of ~180K tokens and more, where
# cuDNN saves ~0.1 s a call on an H100 at 8 heads of 128, twice its plan's cost and more) enables cuDNN too: torch
# ranks it first on Hopper, so there it runs.
_VARYING_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
CUDNN_MIN_SCORES = 2**35


def sdpa_backends(query_len: int, key_len: int, shapes_vary: bool) -> list[SDPBackend] | None:
    """The SDPA backends enabled for one CUDA attention call of `query_len` queries over `key_len` keys (torch picks
    among them in its own priority); None: all of them (fixed shapes, as in a training step)."""
    if not shapes_vary:
        return None
    if query_len * key_len >= CUDNN_MIN_SCORES:
        return [SDPBackend.CUDNN_ATTENTION, *_VARYING_SDPA_BACKENDS]
    return _VARYING_SDPA_BACKENDS


def varlen_packed(device: torch.device, dtype: torch.dtype, config, training: bool) -> bool:
    """Whether the attention layers attend within packed documents through one `varlen_attn` call (flash, GQA) rather
    than a block-diagonal mask or one SDPA call a document: on CUDA with 16-bit attention inputs (`dtype`), the SDPA
    implementation, a head dim the flash kernel takes (a multiple of 8 up to 256), without dropout."""
    return (varlen_attn is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and config._attn_implementation == "sdpa" and config.head_dim % 8 == 0 and config.head_dim <= 256
            and not (training and config.attention_dropout > 0))


def _varlen_kwargs(group: int) -> dict:
    """`varlen_attn`'s causal and (for `group` > 1 query heads a key-value head) GQA arguments in this torch."""
    kwargs = {"is_causal": True} if "is_causal" in _VARLEN_PARAMETERS else {"window_size": (-1, 0)}
    if "enable_gqa" in _VARLEN_PARAMETERS and group > 1:
        kwargs["enable_gqa"] = True
    return kwargs


def _backends_for(query_len: int, key_len: int, shapes_vary: bool, cuda: bool):
    """`sdpa_backends` as a context manager (a fresh one each call: `sdpa_kernel`'s can be entered once)."""
    chosen = sdpa_backends(query_len, key_len, shapes_vary) if cuda else None
    return sdpa_kernel(chosen) if chosen is not None else contextlib.nullcontext()


class KDAMoEAttention(nn.Module):
    """Grouped-query softmax attention without positional encoding (NoPE), with q/k RMSNorm per head."""

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = KDAMoERMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = KDAMoERMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        packed: PackedDocuments | None = None,
        positions: torch.Tensor | None = None,
        shard: RowShard | None = None,
    ) -> torch.Tensor:
        """`packed` without an `attention_mask`: packed rows too long for a block-diagonal mask
        (`build_attention_mask`), attended one document at a time. `positions [T]`: where the new keys go in a
        static cache (`KDAMoEStaticCache.advance`). `shard`: this rank's part of context-parallel rows, whose
        queries attend to the keys and values of every rank up to its own (`attention_mask` from
        `RowShard.attention_mask`)."""
        batch, seq_len, _ = hidden_states.shape
        shape = (batch, seq_len, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape))  # [B, T, Hq, Dh]
        k = self.k_norm(self.k_proj(hidden_states).view(shape))  # [B, T, Hkv, Dh]
        v = self.v_proj(hidden_states).view(shape)
        per_document = packed is not None and attention_mask is None
        if shard is not None:  # [B, offset + T, Hkv, Dh] each, from one gather
            k, v = shard.keys(torch.cat([k, v], dim=-1)).split(self.head_dim, dim=-1)
        keys, values = k.transpose(1, 2), v.transpose(1, 2)
        if positions is not None:
            keys, values = cache.update(keys, values, self.layer_idx, positions)
        elif cache is not None:
            keys, values = cache.update(keys, values, self.layer_idx)

        attention: Callable = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        kwargs = dict(dropout=self.config.attention_dropout if self.training else 0.0, scaling=self.scaling)
        query = q.transpose(1, 2)  # [B, Hq, T, Dh]
        if self._split_kv_decode(query, keys, cache):
            return self.o_proj(decode_attention(query, keys, values, attention_mask, self.scaling)
                               .reshape(batch, seq_len, -1))
        if per_document:
            out = self._attend_per_document(attention, q, k, v, packed, kwargs)
        else:
            with _backends_for(seq_len, keys.shape[2], cache is not None, q.is_cuda):
                out, _ = attention(self, query, keys, values, attention_mask, **kwargs)
        return self.o_proj(out.reshape(batch, seq_len, -1))

    def _split_kv_decode(self, query: torch.Tensor, keys: torch.Tensor, cache) -> bool:
        """A cached step of one token per row over at least `SPLIT_KV_MIN_KEYS` keys, on CUDA, with the SDPA
        implementation chosen: `decode_attention` (the keys split across the GPU) rather than SDPA."""
        return (cache is not None and query.is_cuda and not self.training and keys.shape[2] >= SPLIT_KV_MIN_KEYS
                and self.config._attn_implementation == "sdpa" and split_kv_supported(query, keys))

    def _attend_per_document(self, attention, q, k, v, packed, kwargs) -> torch.Tensor:
        """Causal attention inside each document of packed rows, with no `[T, T]` mask: `q [B, T, Hq, Dh]`, `k, v [B,
        T, Hkv, Dh]` -> `[B, T, Hq, Dh]`. With `varlen_packed`, one `varlen_attn` call over the flattened tokens and
        the documents' offsets; else one SDPA call per document, `split` off the flattened tokens (the backward joins
        their gradients in one concatenation)."""
        if varlen_packed(q.device, q.dtype, self.config, self.training) and k.shape[:2] == q.shape[:2]:
            kw = _varlen_kwargs(self.num_key_value_groups)
            flat_k, flat_v = k.flatten(0, 1), v.flatten(0, 1)  # [B*T, Hkv, Dh]
            if "enable_gqa" not in kw and self.num_key_value_groups > 1:
                flat_k, flat_v = (x.repeat_interleave(self.num_key_value_groups, 1) for x in (flat_k, flat_v))
            longest = packed.longest_document
            out = varlen_attn(q.flatten(0, 1), flat_k, flat_v, packed.cu_seqlens_device, packed.cu_seqlens_device,
                              longest, longest, scale=self.scaling, **kw)
            return out.view(q.shape)
        lengths = packed.cu_seqlens.diff().tolist()  # host offsets in the flattened B*T tokens (none crosses a row)
        pieces = zip(*(x.flatten(0, 1).split(lengths) for x in (q, k, v)))
        outs = []
        for length, piece in zip(lengths, pieces):
            with _backends_for(length, length, True, q.is_cuda):
                outs.append(attention(self, *(x.unsqueeze(0).transpose(1, 2) for x in piece), None, **kwargs)[0])
        return torch.cat(outs, dim=1).view(q.shape)  # each piece [1, L, Hq, Dh]


# ----------------------------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------------------------


def _plain(norm: nn.Module) -> bool:
    """A `KDAMoERMSNorm` without hooks, which a fused op may compute from its weight (hooks would be bypassed)."""
    return type(norm) is KDAMoERMSNorm and not (norm._forward_hooks or norm._forward_pre_hooks)


def check_no_attention_output(kwargs: dict, config: KDAMoEConfig) -> None:
    """`output_attentions` is refused with a clear error rather than answered with None."""
    if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None and config.output_attentions):
        raise ValueError("output_attentions is not supported: the KDA layers form no attention matrix and the "
                         "attention layers run fused SDPA / varlen kernels (output_hidden_states and "
                         "`DepthAttention.depth_weights` are available)")


def projection_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a sublayer's projections run x in under autocast (None without it): a plain norm whose output feeds
    only projections stores it so, the rounding autocast's cast of its fp32 output would make, without writing the
    fp32 output, casting it and reading it back (and the same for its gradient)."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None


def normed_input(state: ResidualState, depth_attention: DepthAttention | None, norm: KDAMoERMSNorm,
                 keep_input: bool, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(norm(h), h or None)` for the input h that `state` gives a sublayer (or the final norm). Depth attention and a
    plain norm (no hooks, which the fused op would bypass) run as one op, which never writes h nor keeps it for the
    backward (h is None then, unless `keep_input`). A plain norm's output in `out_dtype` unless None."""
    if depth_attention is not None and _plain(norm) and not keep_input:
        return depth_attention(state.sources(), norm=(norm.weight, norm.eps), out_dtype=out_dtype), None
    h = state.read(depth_attention)
    if _plain(norm):
        return rms_norm(h, norm.weight, norm.eps, out_dtype=out_dtype), h
    return norm(h), h


def add_and_norm(state: ResidualState, output: torch.Tensor, close_block: bool,
                 depth_attention: DepthAttention | None, norm: KDAMoERMSNorm,
                 out_dtype: torch.dtype | None = None) -> tuple[ResidualState, torch.Tensor]:
    """`state.add(output, close_block)` and the next sublayer's normed input (`normed_input`, in `out_dtype`). With
    the standard residual and a plain norm the add and the norm run as one op (`add_rms_norm`), which writes h beside
    the norm's output and adds h's gradient into the norm's in its backward."""
    if depth_attention is None and not state.completed and _plain(norm):
        h, normed = add_rms_norm(state.partial, output, norm.weight, norm.eps, out_dtype=out_dtype)
        return ResidualState(state.completed, h), normed
    state = state.add(output, close_block)
    return state, normed_input(state, depth_attention, norm, keep_input=False, out_dtype=out_dtype)[0]


class KDAMoEDecoderLayer(GradientCheckpointingLayer):
    """`mixer` (KDA or attention) then `ffn` (dense MLP or MoE), each a PreNorm sublayer whose input comes from the
    residual stream or from depth attention over block sources (`residual_mode`)."""

    def __init__(self, config: KDAMoEConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.mixer_norm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.mixer = KDAMoEKimiDeltaAttention(config, layer_idx)
        else:
            self.mixer = KDAMoEAttention(config, layer_idx)
        self.ffn_norm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.ffn = KDAMoESparseMoeBlock(config) if self.is_moe else KDAMoEMLP(config, config.intermediate_size)

        mode = config.residual_mode
        attnres = mode != "standard"
        self.mixer_attn_res = DepthAttention(config.hidden_size, config.rms_norm_eps) if attnres else None
        self.ffn_attn_res = DepthAttention(config.hidden_size, config.rms_norm_eps) if attnres else None
        self.close_block_after_mixer = mode == "full_attnres"
        self.close_block_after_ffn = mode == "full_attnres" or (
            mode == "block_attnres" and (layer_idx + 1) % config.attnres_block_layers == 0
        )

    def forward(
        self,
        partial: torch.Tensor | None,
        *completed: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        packed: PackedDocuments | None = None,
        token_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        shard: RowShard | None = None,
        keep_input: bool = True,
    ):
        """`partial: [B, T, D] | None` and the `completed` sources, each `[B, T, D]` (see `ResidualState`; passed as
        positional tensors so that gradient checkpointing sees them); `positions`: the new tokens' places in a static
        cache; `shard`: this rank's part of context-parallel rows. Returns the new partial sum, the mixer input
        `[B, T, D]` (this layer's hidden state; None unless `keep_input` where depth attention and the norm run as
        one op, which never forms it), the router logits `[B*T, E]` and the auxiliary loss (MoE layers; None
        otherwise), then the new completed sources."""
        state = ResidualState(completed, partial)
        # under autocast the norms before a single projection GEMM (the KDA layer's fused projections, the dense MLP's
        # gate | up) store the autocast dtype; not before several projections (the attention's three, adapters),
        # whose input gradients autograd would then sum in 16 bits, nor the MoE block's router, which takes fp32
        proj_dtype = projection_dtype(state.sources()[0])
        single = isinstance(self.mixer, KDAMoEKimiDeltaAttention) and self.mixer.fused_inputs()
        x, mixer_input = normed_input(state, self.mixer_attn_res, self.mixer_norm, keep_input,
                                      proj_dtype if single else None)
        if self.layer_type == "linear_attention":
            x = self.mixer(x, cache=cache, packed=packed, token_mask=token_mask, shard=shard)
        else:
            x = self.mixer(x, attention_mask=attention_mask, cache=cache, packed=packed, positions=positions,
                           shard=shard)
        single = isinstance(self.ffn, KDAMoEMLP) and self.ffn.fused_inputs()
        state, x = add_and_norm(state, x, self.close_block_after_mixer, self.ffn_attn_res, self.ffn_norm,
                                proj_dtype if single else None)
        router_logits = aux_loss = None
        if self.is_moe:
            x, router_logits, aux_loss = self.ffn(x, token_mask=token_mask)
        else:
            x = self.ffn(x)
        state = state.add(x, close_block=self.close_block_after_ffn)
        return state.partial, mixer_input, router_logits, aux_loss, *state.completed


# ----------------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------------


class KDAMoEPreTrainedModel(PreTrainedModel):
    config_class = KDAMoEConfig
    config: KDAMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDAMoEDecoderLayer"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _keep_in_fp32_modules_strict = ["router"]  # routing scores and the selection bias are fp32 (docs/design.md §3)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, output_loading_info: bool = False, **kwargs):
        """`PreTrainedModel.from_pretrained`, but an incomplete checkpoint is an error rather than a warning that
        leaves randomly initialised weights behind (only a causal-LM head over a base-model checkpoint may be new,
        and the routers' bias filter state of a checkpoint saved without it starts fresh),
        and a damaged weights file is named (safetensors' own message names none)."""
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except Exception as error:
            if not is_safetensors_error(error):
                raise
            raise OSError(
                f"{unreadable_weights(pretrained_model_name_or_path)} cannot be read (safetensors: {error}): "
                "the file is truncated or overwritten"
            ) from error
        missing = sorted(k for k in info.get("missing_keys", ())
                         if k != "lm_head.weight" and not k.endswith(".router.bias_filter"))  # zeros: a fresh filter
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"The checkpoint is incomplete: {len(missing)} weights are missing ({shown}).")
        return (model, info) if output_loading_info else model

    def save_pretrained(self, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; a ValueError for a model whose experts are sharded across ranks (each
        rank holds only its own: `expert_parallel.py`)."""
        if any(getattr(m, "expert_parallel", None) is not None for m in self.modules()):
            raise ValueError("this model's experts are sharded across ranks (expert parallelism): each rank holds "
                             "only its own, so there is no whole model to save here")
        return super().save_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear / Embedding: normal(0, initializer_range); RMSNorm: ones
        std = self.config.initializer_range
        if isinstance(module, KDAMoEKimiDeltaAttention):
            init.uniform_(module.conv_weight, -1 / math.sqrt(module.conv_size), 1 / math.sqrt(module.conv_size))
            if module.gate == "bounded":
                init.zeros_(module.A_log)
            else:
                init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log())
            # dt ~ logUniform[1e-3, 1e-1]; dt_bias = softplus^-1(dt) = dt + log(-expm1(-dt))
            log_dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))
            dt = log_dt.exp()
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, DepthAttention):
            init.zeros_(module.query)
            init.ones_(module.key_norm_weight)
        elif isinstance(module, KDAMoERouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.bias)
            init.zeros_(module.bias_filter)
        elif isinstance(module, KDAMoEExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)


class KDAMoEModel(KDAMoEPreTrainedModel):
    """The decoder stack: embeddings → layers → depth aggregation (AttnRes) → final RMSNorm."""

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(KDAMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        attnres = config.residual_mode != "standard"
        self.final_attn_res = DepthAttention(config.hidden_size, config.rms_norm_eps) if attnres else None
        self.norm = KDAMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.token_id_check = TokenIdCheck()
        self.post_init()

    @property
    def vocab_size(self) -> int:
        """The embedding's rows (it follows `resize_token_embeddings`)."""
        return self.embed_tokens.num_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        context_parallel: ContextParallel | None = None,
        **kwargs,
    ):
        """transformers' base-model forward; `context_parallel`: the inputs are this rank's columns of rows split
        across its group (`context_parallel.py`; no cache)."""
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        if context_parallel is not None:
            if cache is not None:
                raise ValueError("context parallelism runs without a cache (training and scoring, not generation)")
            if self.training and self.config.router_balancing == "aux_loss":
                raise ValueError('router_balancing="aux_loss" is not supported under context parallelism (its '
                                 'loss would be each rank\'s): use "quantile" or "loss_free"')
            use_cache = False
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        check_no_attention_output(kwargs, self.config)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if input_ids is not None:
            inputs_embeds = self.embed_tokens(self.token_id_check(input_ids, self.vocab_size))
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = KDAMoECache(self.config)
        if not use_cache:
            cache = None

        batch, seq_len, _ = inputs_embeds.shape
        if batch == 0 or seq_len == 0:
            raise ValueError(f"the inputs hold no tokens (shape [{batch}, {seq_len}]): a forward needs at least one "
                             "row of at least one token")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("`attention_mask` must be a 2-D padding mask [batch, past + new tokens].")
        # Under torch.compile or a CUDA graph's recording a given mask is applied whatever it holds (no host read).
        traced = torch.compiler.is_compiling() or (inputs_embeds.is_cuda and torch.cuda.is_current_stream_capturing())
        padding_mask = None
        if attention_mask is not None and (traced or not bool(attention_mask.bool().all())):
            padding_mask = attention_mask.bool()
        positions = None
        if isinstance(cache, KDAMoEStaticCache):
            # The cache keeps the padding flags of the tokens it holds: a mask's last T columns are the new tokens'.
            if padding_mask is not None and (padding_mask.shape[0] != batch or padding_mask.shape[1] < seq_len):
                raise ValueError(f"`attention_mask` has shape {tuple(padding_mask.shape)}, expected [{batch}, >= "
                                 f"{seq_len}] (with a static cache its last {seq_len} columns are the new tokens)")
            token_mask = padding_mask[:, -seq_len:] if padding_mask is not None else None
            first, positions = cache.advance(batch, seq_len, token_mask)
            past_len, padding_mask = (0, token_mask) if first else (None, None)
        else:
            past_len = cache.get_seq_length() if cache is not None else 0
            if padding_mask is not None and padding_mask.shape != (batch, past_len + seq_len):
                raise ValueError(
                    f"`attention_mask` has shape {tuple(padding_mask.shape)}, expected {(batch, past_len + seq_len)}"
                )
            token_mask = padding_mask[:, -seq_len:] if padding_mask is not None else None
        packed = None
        if position_ids is not None and past_len == 0:
            packed = PackedDocuments.from_position_ids(position_ids, inputs_embeds.device, token_mask)
        shard = None
        if context_parallel is not None:
            shard = RowShard.build(context_parallel, batch, seq_len, inputs_embeds.device, self.config.kda_conv_size,
                                   position_ids, attention_mask, packed.cu_seqlens if packed is not None else None)
            attends = "full_attention" in self.config.layer_types
            mask = shard.attention_mask(DENSE_MASK_ELEMENTS) if attends else None
        elif past_len is None:  # a static cache's later forwards attend to everything it holds
            mask = cache.attention_mask(positions) if positions is not None else None
        else:
            attended = padding_mask
            if isinstance(cache, KDAMoECache):  # after a packed prefill, attention sees each row's last document only
                if past_len == 0:
                    cache.document_start = packed.last_doc_start if packed is not None else None
                elif cache.document_start is not None:
                    visible = torch.arange(past_len + seq_len, device=inputs_embeds.device)
                    visible = visible >= cache.document_start[:, None]
                    attended = visible if attended is None else attended & visible
            elif isinstance(cache, KDAMoEStaticCache) and packed is not None:  # its first forward
                cache.keep_from(packed.last_doc_start)
            # the attention inputs' dtype: the autocast dtype under autocast
            device, dtype = inputs_embeds.device, projection_dtype(inputs_embeds) or inputs_embeds.dtype
            if packed is not None and attended is None and varlen_packed(device, dtype, self.config, self.training):
                mask = None  # the attention layers attend within each document through varlen_attn (packed rows
                # come without a past: this forward's keys are all there are)
            else:
                mask = build_attention_mask(attended, packed, seq_len, past_len, inputs_embeds.device)

        start = ResidualState.start(inputs_embeds, self.config.residual_mode)
        completed, partial = start.completed, start.partial
        all_hidden_states = []
        all_router_logits = []
        aux_losses = []
        for layer in self.layers:
            partial, layer_input, router_logits, aux_loss, *completed = layer(
                partial, *completed, attention_mask=mask, cache=cache, packed=packed, token_mask=token_mask,
                positions=positions, shard=shard, keep_input=output_hidden_states,
            )
            if output_hidden_states:
                all_hidden_states.append(layer_input)
            if router_logits is not None and output_router_logits:
                all_router_logits.append(router_logits)
            if aux_loss is not None:
                aux_losses.append(aux_loss)
        if isinstance(cache, KDAMoECache):
            cache.num_seen_tokens += seq_len

        hidden_states = normed_input(ResidualState(tuple(completed), partial), self.final_attn_res, self.norm,
                                     keep_input=False)[0]
        if output_hidden_states:
            all_hidden_states.append(hidden_states)
        output = KDAMoEModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            router_logits=tuple(all_router_logits) if output_router_logits else None,
            aux_loss=torch.stack(aux_losses).sum() if aux_losses else None,
            **{CACHE_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()


class KDAMoEForCausalLM(KDAMoEPreTrainedModel, GenerationMixin):
    """`KDAMoEModel` with a language-modelling head; `apply_load_balancing()` updates every MoE router bias."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config)
        self.model = KDAMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # The model builds its own `KDAMoECache` (a `DynamicCache` that counts tokens), see `KDAMoEModel.forward`.
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """`generate`'s cache: with `cache_implementation="static"` a `KDAMoEStaticCache` for the batch (times the
        beams or returned sequences) and `max_length` (or `max_cache_len` when larger); a static cache passed in must
        hold as much. Otherwise transformers' handling (the model builds its `KDAMoECache` itself). Assisted
        (speculative) decoding is refused with a clear error: rolling a KDA layer's recurrent state back to the last
        accepted draft token needs its state after every token of the verification forward, which the chunked
        kernels do not keep (transformers' own error would say only that a cache is missing)."""
        if (getattr(generation_mode, "value", generation_mode) == "assisted_generation"
                or getattr(generation_config, "is_assistant", False)):
            raise ValueError("kdamoe does not support assisted (speculative) decoding (`assistant_model`, "
                             "`prompt_lookup_num_tokens`), as the model or as the assistant: its KDA layers' recurrent "
                             "states cannot be rolled back to the accepted draft tokens")
        rows = batch_size * max(generation_config.num_beams, generation_config.num_return_sequences or 1)
        given = model_kwargs.get(CACHE_FIELD)
        if isinstance(given, KDAMoEStaticCache):
            if rows > given.max_batch_size:
                raise ValueError(f"the static cache holds {given.max_batch_size} rows, generate needs {rows} (batch "
                                 f"{batch_size} x {rows // batch_size} beams or returned sequences)")
            if given.has_attention and max_cache_length > given.max_cache_len:
                raise ValueError(f"the static cache holds {given.max_cache_len} tokens per row, generate needs "
                                 f"{max_cache_length} (the prompt and max_new_tokens)")
        elif (generation_config.cache_implementation == "static" and given is None
              and generation_config.use_cache is not False):
            length = max(max_cache_length, getattr(generation_config, "max_cache_len", None) or 0)
            model_kwargs[CACHE_FIELD] = KDAMoEStaticCache(self.config, rows, length, device=self.device,
                                                          dtype=self.dtype)
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """What `generate` makes of the 2-D mask for a compileable cache (the static one): the mask itself, as the
        model builds its attention masks from it."""
        return attention_mask

    def prepare_inputs_for_generation(self, *args, inputs_embeds=None, **kwargs):
        """transformers' inputs; with a static cache the attention mask's columns of the new tokens only (the cache
        keeps the padding flags of the tokens it holds), so every decode step has the same shapes. `inputs_embeds`
        named in the signature: `generate(inputs_embeds=...)` (soft prompts, PEFT's prompt tuning) checks for it."""
        inputs = super().prepare_inputs_for_generation(*args, inputs_embeds=inputs_embeds, **kwargs)
        mask, new = inputs.get("attention_mask"), inputs.get("input_ids")
        new = new if new is not None else inputs.get("inputs_embeds")
        if isinstance(inputs.get(CACHE_FIELD), KDAMoEStaticCache) and mask is not None and mask.dim() == 2:
            inputs["attention_mask"] = mask[:, -new.shape[1]:]
        return inputs

    def get_compiled_call(self, compile_config=None):
        """The forward `generate` runs its decode steps with when the cache is compileable (the static one) on an
        accelerator. Without a `compile_config`: `self.__call__` with each decode step on a static cache replayed as
        a CUDA graph (`decode_graphs.py`: recorded from the eager kernels, nothing compiled, no host synchronisation
        per token). With one: transformers' `torch.compile` of the forward (the static decode step compiles without
        graph breaks, and later steps without recompiling)."""
        if compile_config is None and self.device.type == "cuda":
            return functools.partial(graphed_decode_step, self)
        return super().get_compiled_call(compile_config)

    @torch.no_grad()
    def apply_load_balancing(self, to_host: bool = True) -> dict[int, dict]:
        """Apply the pending router-bias update of every MoE layer (once per optimizer step) and return per-layer
        statistics `{layer_index: {"loads", "max_vio", "dead_experts", "bias_norm"}}`, read to the host in one copy;
        `to_host=False` leaves them as 0-d tensors on the device (no host synchronisation: the update itself is
        decided on the device; `moe.summary_to_host` reads them later)."""
        moe_layers = [i for i, layer in enumerate(self.model.layers) if layer.is_moe]
        stats = dict(zip(moe_layers, apply_balancing([self.model.layers[i].ffn for i in moe_layers])))
        if to_host:
            pending = [i for i, s in stats.items() if s]  # a layer without pending statistics reports {}
            stats.update(zip(pending, summary_to_host([stats[i] for i in pending])))
        return stats

    def _fused_loss(self, hidden_states, labels, shift_labels, num_items_in_batch):
        """transformers' causal-LM loss (position t predicts label t+1, -100 ignored, a sum over `num_items_in_batch`
        when given) from `hidden_states [B, T, D]` through `lm_head`, chunk by chunk, without `[B*T, V]` logits."""
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        loss = linear_cross_entropy(
            hidden_states.reshape(-1, hidden_states.shape[-1]), self.lm_head.weight,
            shift_labels.reshape(-1).to(hidden_states.device),
            reduction="mean" if num_items_in_batch is None else "sum",
            validate=False if torch.compiler.is_compiling() else None,  # traced: a bad label makes the loss NaN
        )
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
        return loss

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        context_parallel: ContextParallel | None = None,
        **kwargs,
    ):
        """`labels: [B, T]` are shifted inside (position t predicts token t+1); -100 is ignored. With
        `router_balancing="aux_loss"` in training, the auxiliary loss is added to `loss` and returned as `aux_loss`.
        `context_parallel`: the inputs and labels are this rank's columns of rows split across its group
        (`context_parallel.py`); the logits are this rank's, the loss the mean over every rank's labelled tokens (the
        same on every rank; its backward gives each rank its share of the gradients, which average over the group
        to the single process's)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        check_no_attention_output(kwargs, self.config)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_router_logits=output_router_logits,
            return_dict=True,
            context_parallel=context_parallel,
        )
        hidden_states = outputs.last_hidden_state
        if labels is not None and labels.shape != hidden_states.shape[:2]:
            raise ValueError(f"`labels` has shape {tuple(labels.shape)}, expected {tuple(hidden_states.shape[:2])}")
        if labels is not None and context_parallel is not None:  # this rank's summed loss first
            if kwargs.get("shift_labels") is None:
                kwargs["shift_labels"] = context_parallel.shift_labels(labels)
            num_items, kwargs["num_items_in_batch"] = kwargs.get("num_items_in_batch"), 1
        loss = logits = None
        fused_loss = self.config.fuse_linear_cross_entropy and plain_linear(self.lm_head)  # else lm_head's hooks run
        if labels is not None and self.training and fused_loss:
            loss = self._fused_loss(hidden_states, labels, kwargs.get("shift_labels"), kwargs.get("num_items_in_batch"))
        else:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden_states[:, keep, :])
            if labels is not None:
                loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if loss is not None and context_parallel is not None:
            loss = context_parallel.mean(loss, kwargs["shift_labels"], num_items)
        if loss is not None and outputs.aux_loss is not None:
            loss = loss + outputs.aux_loss.to(loss.device)

        output = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=outputs.aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            router_logits=outputs.router_logits,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )
        return output if return_dict else output.to_tuple()


KDAMoEConfig.register_for_auto_class()
KDAMoEModel.register_for_auto_class("AutoModel")
KDAMoEForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["KDAMoECache", "KDAMoEForCausalLM", "KDAMoEModel", "KDAMoEPreTrainedModel", "KDAMoEStaticCache"]

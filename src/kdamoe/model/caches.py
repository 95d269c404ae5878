"""The generation caches of kdamoe, on transformers' `Cache` API: KDA layers keep a conv state `[B, C, W]` (the last W
inputs of the q | k | v projections, `C = 2·H·K + H·V`) and a recurrent state `[B, H, K, V]` fp32
(`layers[i].conv_states[0]`, `.recurrent_states[0]`, `has_previous_state(i)`); attention layers keep keys and values
`[B, H_kv, T, D]`.

- `KDAMoECache`, the default: the stock `DynamicCache`, whose attention layers grow with every token, counting tokens
  itself so that configs without an attention layer generate too.
- `KDAMoEStaticCache` (`generate(..., cache_implementation="static")`): every state allocated once for a maximum
  batch and length and updated in place, so that a decode step has static shapes and fixed addresses, which CUDA
  graphs and `torch.compile` need. The position of the next token lives on the device: no step reads it back.
"""

import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from .configuration_kdamoe import KDAMoEConfig

# transformers renamed the cache field of model outputs, and generate's cache keyword, from `past_key_values` to
# `cache` (5.2x); support both.
CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(MoeCausalLMOutputWithPast)} else "past_key_values"
)


class KDAMoECache(DynamicCache):
    """The stock `DynamicCache` (conv + recurrent state for KDA layers, KV for attention layers) that also counts
    tokens itself, so that `generate` works for configs without any full-attention layer.

    `document_start` (`[B]` or None): after a packed prefill, the column where each row's last document starts.
    KDA layers keep only that document's state, so later tokens attend to the attention layers' keys from there on.
    """

    def __init__(self, config: KDAMoEConfig):
        super().__init__(config=config)
        self.num_seen_tokens = 0
        self.document_start = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.num_seen_tokens

    @property
    def is_compileable(self) -> bool:
        return False


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Tag a cache tensor as living at a fixed address (torch.compile's CUDA graphs then neither copy it nor skip a
    graph that writes it), as transformers' static layers do; tagging is not traceable, so not under compile."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class KDAMoEStaticKDALayer(LinearAttentionCacheLayerMixin):
    """A KDA layer's conv state `[max_batch, C, W]` (in the model's dtype) and recurrent state `[max_batch, H, K, V]`
    (fp32), allocated at construction. `conv_states[0]` and `recurrent_states[0]` are views of the rows in use (the
    first ones), so the model reads and writes them as it does the dynamic cache's; writes go into the buffers."""

    is_compileable = True  # a property of the base class in newer transformers (False while recording the past)
    supports_early_init = False

    def __init__(self, max_batch_size: int, channels: int, width: int, num_heads: int, k_dim: int, v_dim: int,
                 device, dtype: torch.dtype):
        super().__init__(number_of_states=1)
        self.conv = _static(torch.zeros(max_batch_size, channels, width, dtype=dtype, device=device))
        self.recurrent = _static(torch.zeros(max_batch_size, num_heads, k_dim, v_dim, dtype=torch.float32,
                                             device=device))
        self.device, self.dtype = self.conv.device, dtype
        self.conv_kernel_size[0] = width
        self.is_conv_states_initialized[0] = self.is_recurrent_states_initialized[0] = True
        self.use_rows(max_batch_size)

    def use_rows(self, rows: int) -> None:
        self.conv_states[0] = _static(self.conv[:rows])
        self.recurrent_states[0] = _static(self.recurrent[:rows])

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        """Nothing to do: the states are allocated at construction."""

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Write the conv state `[B, C, W]` of the rows in use (the prefill's, or a multi-token step's)."""
        self.conv_states[0].copy_(conv_states[..., -self.conv_kernel_size[0]:])
        self.has_previous_state[0] = True
        return self.conv_states[0]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states[0].copy_(recurrent_states)
        return self.recurrent_states[0]

    def reset(self) -> None:
        self.conv.zero_()
        self.recurrent.zero_()
        self.has_previous_state[0] = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: rows `beam_idx` of the rows in use, in place (the addresses stay)."""
        for state in (self.conv_states[0], self.recurrent_states[0]):
            state.copy_(state.index_select(0, beam_idx.to(state.device)))

    def activate_past_recording(self):
        raise ValueError("the static cache cannot record past states to roll back (assisted decoding, which kdamoe "
                         "does not support)")


class KDAMoEStaticAttentionLayer(CacheLayerMixin):
    """An attention layer's keys and values `[max_batch, H_kv, max_cache_len, D]`, allocated at construction; `keys`
    and `values` are views of the rows in use. `update` writes the new ones at the cache positions it is given
    (a device tensor: no host read) and returns the whole views, whose unwritten positions the model masks."""

    is_compileable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, max_batch_size: int, max_cache_len: int, num_heads: int, head_dim: int, device,
                 dtype: torch.dtype, cumulative_length: torch.Tensor):
        super().__init__()
        shape = (max_batch_size, num_heads, max_cache_len, head_dim)
        self.key_cache = _static(torch.zeros(shape, dtype=dtype, device=device))
        self.value_cache = _static(torch.zeros(shape, dtype=dtype, device=device))
        self.max_cache_len = max_cache_len
        self.device = self.key_cache.device
        self.cumulative_length = cumulative_length  # the cache's token count, shared by its layers
        self.is_initialized = True
        self.use_rows(max_batch_size)

    def use_rows(self, rows: int) -> None:
        self.keys, self.values = _static(self.key_cache[:rows]), _static(self.value_cache[:rows])

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the keys and values are allocated at construction."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, positions: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states, value_states [B, H_kv, T, D]` at cache positions `positions [T]` (int64)."""
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.key_cache.zero_()
        self.value_cache.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for state in (self.keys, self.values):
            state.copy_(state.index_select(0, beam_idx.to(state.device)))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("the static cache cannot be cropped: use the dynamic cache")


class KDAMoEStaticCache(Cache):
    """Every layer's state preallocated for `max_batch_size` rows and, in attention layers, `max_cache_len` tokens,
    and updated in place: a decode step has static shapes and reads no length on the host, so it can be recorded as
    a CUDA graph or compiled without recompilation. `generate(..., cache_implementation="static")` builds one for the
    batch (times beams) and `max_length`; pass one as `past_key_values` (`cache` in newer transformers) to reuse it
    across calls (`reset()` it between prompts).

    A forward uses the first B <= `max_batch_size` rows; the first forward after construction or `reset()` (the
    prefill) sets B for the generation. KDA layers keep a fixed-size state whatever the length; attention layers
    hold up to `max_cache_len` tokens per row (prompt and generated tokens), and the cache remembers which of them
    were padding (`key_mask`, from the attention masks of the forwards that wrote them), so a forward needs the
    padding flags of its new tokens only.

    Args:
        config (`KDAMoEConfig`): the model's config (layer types and shapes).
        max_batch_size (`int`): rows the cache holds.
        max_cache_len (`int`): tokens per row the attention layers hold.
        device: where the states live (the model's device).
        dtype (`torch.dtype`): of the conv states, keys and values (the model's); recurrent states are fp32.
    """

    def __init__(self, config: KDAMoEConfig, max_batch_size: int, max_cache_len: int, device=None,
                 dtype: torch.dtype = torch.float32):
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        self._max_batch_size, self._max_cache_len = max_batch_size, max_cache_len
        self.seen_tokens = _static(torch.zeros((), dtype=torch.int64, device=device))
        h, k = config.kda_num_heads, config.kda_head_dim
        layers = []
        for layer_type in config.layer_types:
            if layer_type == "linear_attention":
                layers.append(KDAMoEStaticKDALayer(max_batch_size, 3 * h * k, config.kda_conv_size, h, k, k, device,
                                                   dtype))
            else:
                layers.append(KDAMoEStaticAttentionLayer(max_batch_size, max_cache_len, config.num_key_value_heads,
                                                         config.head_dim, device, dtype, self.seen_tokens))
        super().__init__(layers=layers)
        self.has_attention = "full_attention" in config.layer_types
        self.key_mask = None  # [max_batch, max_cache_len] bool: which cached positions hold real tokens
        self._key_positions = None
        if self.has_attention:
            self.key_mask = _static(torch.zeros(max_batch_size, max_cache_len, dtype=torch.bool, device=device))
            self._key_positions = torch.arange(max_cache_len, device=device)
        self.rows = 0  # rows in use: 0 until the first forward after construction or reset()
        self.first_forward = False  # the forward under way writes the cache's first tokens
        self.decode_graphs = None  # the CUDA graphs recorded on this cache (`decode_graphs.py`)

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def advance(self, batch: int, seq_len: int, token_mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
        """Take a forward of `seq_len` new tokens in `batch` rows (the model calls it once per forward).

        `token_mask [B, T]` bool marks the new tokens that are real (None: all). Returns `(first, positions)`: whether
        these are the cache's first tokens (then the attention layers attend to them alone, as the dynamic cache's
        prefill does) and, with attention layers, their cache positions `[T]` int64 on the device (None without).
        """
        if batch > self.max_batch_size:
            raise ValueError(f"the static cache holds {self.max_batch_size} rows, got a batch of {batch}")
        first = self.rows == 0
        if not first and batch != self.rows:
            raise ValueError(f"the static cache holds a generation of {self.rows} rows, got a batch of {batch}: "
                             "reset() it before another batch")
        if self.has_attention and seq_len > self.max_cache_len:
            raise ValueError(f"the static cache holds {self.max_cache_len} tokens per row, got {seq_len} at once")
        self.first_forward = first
        if first:
            self.rows = batch
            for layer in self.layers:
                layer.use_rows(batch)
        positions = None
        if self.has_attention and seq_len:
            positions = self.seen_tokens + torch.arange(seq_len, device=self.seen_tokens.device)
            torch._assert_async(positions[-1] < self.max_cache_len,
                                f"the static cache is full: it holds {self.max_cache_len} tokens per row")
            real = token_mask if token_mask is not None else torch.ones(
                batch, seq_len, dtype=torch.bool, device=self.key_mask.device)
            self.key_mask[:batch].index_copy_(1, positions, real)
        self.seen_tokens.add_(seq_len)
        return first, positions

    def keep_from(self, starts: torch.Tensor) -> None:
        """After a packed prefill (one forward from the empty cache): later tokens continue each row's last
        document, so the keys before its start `starts [B]` (the KDA layers kept that document's state only) are
        flagged as not attendable."""
        if self.has_attention:
            rows = self.key_mask[: starts.shape[0]]
            rows &= self._key_positions >= starts[:, None]

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        """`[B, 1, T, max_cache_len]` bool (True = attend) for queries at `positions [T]`: causal over the cache,
        without padded keys; a query always attends to itself (a padded query yields no NaN)."""
        keys = self._key_positions
        allowed = (keys <= positions[:, None]) & self.key_mask[: self.rows, None, :]
        return (allowed | (keys == positions[:, None])).unsqueeze(1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               positions: torch.Tensor | None = None, *args, **kwargs):
        """Write an attention layer's new keys and values at `positions` (from `advance`) and return what it
        attends to: the new ones alone in the cache's first forward, else the whole cache rows."""
        if positions is None:
            raise ValueError("the static cache writes keys and values at `positions`, which `advance()` gives")
        keys, values = self.layers[layer_idx].update(key_states, value_states, positions)
        return (key_states, value_states) if self.first_forward else (keys, values)

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """Tokens per row so far: 0 for an unused cache, else a 0-d device tensor (as transformers' static layers
        return), which a decode step never reads on the host."""
        return 0 if self.rows == 0 else self.seen_tokens

    def reset(self) -> None:
        super().reset()
        self.seen_tokens.zero_()
        if self.key_mask is not None:
            self.key_mask.zero_()
        self.rows = 0
        for layer in self.layers:
            layer.use_rows(self.max_batch_size)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.key_mask is not None:
            rows = self.key_mask[: self.rows]
            rows.copy_(rows.index_select(0, beam_idx.to(rows.device)))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("the static cache cannot be cropped (KDA states cannot be rolled back): use the dynamic cache")

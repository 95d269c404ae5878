"""Model presets for `kdamoe-train`: `KDAMoEConfig` keyword arguments, the longest sequence the preset allows, the
tokenizer size, and the training defaults the preset was tuned with.

- `tiny`: trains on 2 CPU cores in a few minutes (the README's main job).
- `small`: 170M parameters (79M active per token, 54M of them outside the embedding), for one GPU.

`vocab_size`, `pad/bos/eos_token_id` are always taken from the tokenizer at training time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import UsageError


@dataclass(frozen=True)
class Preset:
    """A named model size.

    Attributes:
        model: `KDAMoEConfig` keyword arguments.
        max_seq_len: the longest training sequence allowed (a stage above it is a `ValueError`).
        tokenizer_vocab_size: vocabulary of the BPE trained when no tokenizer is given.
        training: defaults of `kdamoe-train` flags (flag name with underscores -> value).
    """

    model: dict
    max_seq_len: int
    tokenizer_vocab_size: int
    training: dict = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        model=dict(
            hidden_size=128,
            num_hidden_layers=4,
            intermediate_size=384,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            kda_num_heads=2,
            kda_head_dim=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            num_shared_experts=1,
            attnres_block_layers=2,
            tie_word_embeddings=True,
        ),
        max_seq_len=2048,
        tokenizer_vocab_size=4096,
        training=dict(stages="256:300", micro_batch_size=8, grad_accum=1, lr=6e-3, warmup_steps=30,
                      val_rows=64, save_every=100),
    ),
    "small": Preset(
        model=dict(
            hidden_size=768,
            num_hidden_layers=12,
            intermediate_size=2048,
            kda_num_heads=6,
            kda_head_dim=128,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=16,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            num_shared_experts=1,
            attnres_block_layers=3,
            tie_word_embeddings=True,
        ),
        max_seq_len=32768,
        tokenizer_vocab_size=32768,
        training=dict(stages="2048:2000,8192:500", micro_batch_size=16, grad_accum=1, lr=1e-3,
                      warmup_steps=200, val_rows=64, save_every=500),
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called `name`; `UsageError` listing the known ones otherwise."""
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]


__all__ = ["PRESETS", "Preset", "get_preset"]

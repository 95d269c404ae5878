import pytest
import torch

import kdamoe


def tiny_config(**overrides) -> "kdamoe.KDAMoEConfig":
    """A model small enough for CPU tests: 4 layers (3 KDA + 1 attention), 8 experts top-2."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "moe", "moe", "moe"],
        kda_num_heads=2,
        kda_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_shared_experts=1,
        attnres_block_layers=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return kdamoe.KDAMoEConfig(**kwargs)


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

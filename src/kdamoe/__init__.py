"""kdamoe: KDA linear attention with bounded decay, a Quantile-Balanced MoE and Block Attention Residuals.

The model code itself lives in `kdamoe.model`, a flat folder that `save_pretrained` copies into every
checkpoint as remote code. Importing `kdamoe` registers the model with the transformers Auto classes.
Public names are imported lazily so that `import kdamoe` stays cheap.
"""

import importlib

_PUBLIC = {
    "KDAMoEConfig": "kdamoe.model.configuration_kdamoe",
    "KDAMoEModel": "kdamoe.model.modeling_kdamoe",
    "KDAMoEForCausalLM": "kdamoe.model.modeling_kdamoe",
    "KDAMoEPreTrainedModel": "kdamoe.model.modeling_kdamoe",
    "chunk_kda": "kdamoe.model.kda",
    "recurrent_kda": "kdamoe.model.kda",
    "naive_recurrent_kda": "kdamoe.model.kda",
    "kda_gate": "kdamoe.model.kda",
    "situ_glu": "kdamoe.model.moe",
    "quantile_balance": "kdamoe.model.moe",
    "QuantileHistogram": "kdamoe.model.moe",
    "LoadBalancingCallback": "kdamoe.balancing",
    "register_load_balancing_hook": "kdamoe.balancing",
}

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kdamoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value

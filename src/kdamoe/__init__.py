"""kdamoe: KDA linear attention with bounded decay, a Quantile-Balanced MoE and Block Attention Residuals.

The model code lives in `kdamoe.model`, a flat folder that `save_pretrained` copies into every checkpoint as
remote code. Importing `kdamoe` registers the config and models with the transformers Auto classes, so
`AutoModelForCausalLM.from_pretrained(path)` works locally without `trust_remote_code` as well.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .balancing import LoadBalancingCallback, register_load_balancing_hook, summarize_balancing
from .model.configuration_kdamoe import KDAMoEConfig
from .model.kda import chunk_kda, kda_gate, naive_recurrent_kda, recurrent_kda
from .model.modeling_kdamoe import (
    KDAMoECache,
    KDAMoEForCausalLM,
    KDAMoEModel,
    KDAMoEPreTrainedModel,
    KDAMoEStaticCache,
)
from .model.moe import (
    QuantileHistogram,
    balanced_bias,
    loss_free_balance,
    max_violation,
    quantile_balance,
    quantile_fixed_point,
    selection_thresholds,
    situ_glu,
    smoothed_bias,
    swiglu,
)

AutoConfig.register(KDAMoEConfig.model_type, KDAMoEConfig, exist_ok=True)
AutoModel.register(KDAMoEConfig, KDAMoEModel, exist_ok=True)
AutoModelForCausalLM.register(KDAMoEConfig, KDAMoEForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "KDAMoECache",
    "KDAMoEConfig",
    "KDAMoEForCausalLM",
    "KDAMoEModel",
    "KDAMoEPreTrainedModel",
    "KDAMoEStaticCache",
    "LoadBalancingCallback",
    "QuantileHistogram",
    "balanced_bias",
    "chunk_kda",
    "kda_gate",
    "loss_free_balance",
    "max_violation",
    "naive_recurrent_kda",
    "quantile_balance",
    "quantile_fixed_point",
    "recurrent_kda",
    "register_load_balancing_hook",
    "selection_thresholds",
    "smoothed_bias",
    "situ_glu",
    "summarize_balancing",
    "swiglu",
]

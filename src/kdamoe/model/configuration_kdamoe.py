"""Configuration of kdamoe: KDA linear attention + Quantile-Balanced MoE + Block Attention Residuals."""

from transformers import PretrainedConfig

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")  # transformers' vocabulary: "sparse" is an MoE layer
LEGACY_MLP_LAYER_TYPES = {"moe": "sparse"}  # what configs saved before kdamoe used "sparse" call an MoE layer
KDA_GATES = ("bounded", "softplus")
EXPERT_ACTIVATIONS = ("situ_glu", "swiglu")
ROUTER_BALANCING = ("quantile", "loss_free", "aux_loss", "none")
RESIDUAL_MODES = ("block_attnres", "full_attnres", "standard")
AUTO_MAP = {
    "AutoConfig": "configuration_kdamoe.KDAMoEConfig",
    "AutoModel": "modeling_kdamoe.KDAMoEModel",
    "AutoModelForCausalLM": "modeling_kdamoe.KDAMoEForCausalLM",
}


class KDAMoEConfig(PretrainedConfig):
    r"""Configuration of a [`KDAMoEForCausalLM`].

    Every layer is a mixer sublayer (KDA or full attention, chosen by `layer_types`) followed by an FFN sublayer
    (dense MLP or MoE, chosen by `mlp_layer_types`). No positional encoding is used anywhere (NoPE).

    Args:
        vocab_size (`int`): number of tokens.
        hidden_size (`int`): model width `d`.
        num_hidden_layers (`int`): number of decoder layers.
        intermediate_size (`int`): width of the dense MLP layers.
        layer_types (`list[str]`): per layer `"linear_attention"` (KDA) or `"full_attention"`. Defaults to three
            KDA layers for every full-attention layer (the last of each group of four).
        mlp_layer_types (`list[str]`): per layer `"dense"` or `"sparse"` (MoE; transformers' names, so that its
            generic config code reads a kdamoe config). Defaults to layer 0 dense, the rest MoE. `"moe"`, the name
            older kdamoe checkpoints saved, is read as `"sparse"`.
        kda_num_heads, kda_head_dim (`int`): KDA heads and their (key = value) dimension.
        kda_conv_size (`int`): kernel size of the causal depthwise short convolutions on q, k, v.
        kda_gate (`str`): `"bounded"` (`g = lower_bound * sigmoid(...)`) or `"softplus"` (unbounded, legacy).
        kda_gate_lower_bound (`float`): lower bound of the bounded log-decay gate, in `[-5, 0)`.
        num_attention_heads, num_key_value_heads, head_dim (`int`): full-attention (GQA, NoPE) shape.
        num_experts, num_experts_per_tok, moe_intermediate_size, num_shared_experts: MoE shape.
        routed_scaling_factor (`float`): the normalised routing weights are multiplied by this.
        expert_activation (`str`): `"situ_glu"` (bounded SwiGLU) or `"swiglu"`; used by experts and dense MLPs.
        router_balancing (`str`): `"quantile"`, `"loss_free"`, `"aux_loss"` or `"none"`.
        loss_free_update_rate (`float`): step of the sign update of `"loss_free"` balancing.
        router_aux_loss_coef (`float`): coefficient of the switch-style auxiliary loss of `"aux_loss"` balancing
            (default 1e-2). Any other balancing has no auxiliary loss and the field is 0.0 whatever was passed, so
            trainers that read transformers' MoE fields (TRL's `SFTTrainer`) add none.
        output_router_logits (`bool`): return the router logits (off by default).
        quantile_num_bins (`int`): histogram bins per expert for the Quantile Balancing statistics (each quantile is
            read twice, coarse then inside the bin found: a resolution of the range over `quantile_num_bins**2`).
        quantile_iterations (`int`): Quantile Balancing steps per optimizer step (default 4). Each sets every
            expert's bias to the k/E quantile of its selection thresholds on the step's logits (rescored for the
            router update just taken); repeating converges to the bias that balances the step's tokens exactly
            (1: one step, which leaves a batch that collapsed onto a few experts at MaxVio of about 0.2-0.3).
        quantile_window (`int`): W > 1 (default 16): the router bias follows the per-step fixed points through a
            filter whose gain comes from their own statistics over the last W steps (`moe.smoothed_bias`, state in
            the router's `bias_filter` buffer): 1 while the router drifts faster than one batch's sampling noise,
            down to 1/W once it settles, so that the bias averages the noise of up to about W batches. 1: each
            optimizer step sets the bias to the step's fixed point.
        residual_mode (`str`): `"block_attnres"`, `"full_attnres"` or `"standard"`.
        attnres_block_layers (`int`): decoder layers per Block AttnRes block.
        fuse_linear_cross_entropy (`bool`): in training with `labels`, compute the loss chunk by chunk from the hidden
            states (`loss.linear_cross_entropy`) without materialising `[tokens, vocab]` logits; the output's
            `logits` are then None. An `lm_head` with hooks or an adapter runs as its module instead. Off by default
            (trainers that read the logits, as TRL's `SFTTrainer` does for its metrics, need them); `kdamoe-train`
            turns it on.
    """

    model_type = "kdamoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 12,
        intermediate_size: int = 2816,
        layer_types: list[str] | None = None,
        mlp_layer_types: list[str] | None = None,
        kda_num_heads: int = 8,
        kda_head_dim: int = 128,
        kda_conv_size: int = 4,
        kda_gate: str = "bounded",
        kda_gate_lower_bound: float = -5.0,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 2,
        head_dim: int = 128,
        attention_dropout: float = 0.0,
        num_experts: int = 64,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 512,
        num_shared_experts: int = 1,
        routed_scaling_factor: float = 1.0,
        expert_activation: str = "situ_glu",
        router_balancing: str = "quantile",
        loss_free_update_rate: float = 1e-3,
        router_aux_loss_coef: float | None = None,
        quantile_num_bins: int = 1000,
        quantile_iterations: int = 4,
        quantile_window: int = 16,
        output_router_logits: bool = False,
        residual_mode: str = "block_attnres",
        attnres_block_layers: int = 2,
        max_position_embeddings: int = 1_048_576,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        fuse_linear_cross_entropy: bool = False,
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        if layer_types is None:
            layer_types = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)
            ]
        if mlp_layer_types is None:
            mlp_layer_types = ["dense" if i == 0 else "sparse" for i in range(num_hidden_layers)]
        self.layer_types = list(layer_types)
        self.kda_num_heads = kda_num_heads
        self.kda_head_dim = kda_head_dim
        self.kda_conv_size = kda_conv_size
        self.kda_gate = kda_gate
        self.kda_gate_lower_bound = float(kda_gate_lower_bound)
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.attention_dropout = attention_dropout
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.num_shared_experts = num_shared_experts
        self.routed_scaling_factor = routed_scaling_factor
        self.expert_activation = expert_activation
        self.router_balancing = router_balancing
        self.loss_free_update_rate = loss_free_update_rate
        if router_balancing != "aux_loss":
            router_aux_loss_coef = 0.0
        self.router_aux_loss_coef = 1e-2 if router_aux_loss_coef is None else router_aux_loss_coef
        self.quantile_num_bins = quantile_num_bins
        self.quantile_iterations = quantile_iterations
        self.quantile_window = quantile_window
        self.output_router_logits = output_router_logits
        self.residual_mode = residual_mode
        self.attnres_block_layers = attnres_block_layers
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.fuse_linear_cross_entropy = fuse_linear_cross_entropy
        self.mlp_layer_types = [LEGACY_MLP_LAYER_TYPES.get(t, t) for t in mlp_layer_types]
        self.pad_token_id = pad_token_id
        self._validate()  # before the base class, so that our errors (plain ValueErrors naming the field) come first
        # Every saved folder maps all three Auto classes to its own remote code (`save_pretrained` copies the files).
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    def validate(self) -> None:
        """transformers' config validators (run again at save time), then kdamoe's own checks."""
        super().validate()
        self._validate()

    def _validate(self) -> None:
        """Raise `ValueError` naming the field for every invalid value or combination."""

        def positive(*names: str) -> None:
            for name in names:
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise ValueError(f"`{name}` must be a positive integer, got {value!r}")

        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}")

        positive("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "kda_num_heads",
                 "kda_head_dim", "kda_conv_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "attnres_block_layers",
                 "quantile_num_bins", "quantile_iterations", "quantile_window")
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"`{name}` has {len(types)} entries but `num_hidden_layers` is {self.num_hidden_layers}"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"`{name}` entries must be one of {allowed}, got {bad}")
        one_of("kda_gate", KDA_GATES)
        one_of("expert_activation", EXPERT_ACTIVATIONS)
        one_of("router_balancing", ROUTER_BALANCING)
        one_of("residual_mode", RESIDUAL_MODES)
        if self.kda_gate == "bounded" and not -5.0 <= self.kda_gate_lower_bound < 0.0:
            raise ValueError(
                f"`kda_gate_lower_bound` must lie in [-5, 0) with the bounded gate, got {self.kda_gate_lower_bound}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) cannot exceed `num_experts` ({self.num_experts})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                f"`num_key_value_heads` ({self.num_key_value_heads})"
            )
        if self.num_shared_experts < 0:
            raise ValueError(f"`num_shared_experts` must be >= 0, got {self.num_shared_experts}")
        for name in ("routed_scaling_factor", "rms_norm_eps", "initializer_range"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)}")
        for name in ("loss_free_update_rate", "router_aux_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"`attention_dropout` must lie in [0, 1), got {self.attention_dropout}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"`pad_token_id` ({self.pad_token_id}) must lie in [0, vocab_size={self.vocab_size})")


__all__ = ["KDAMoEConfig"]

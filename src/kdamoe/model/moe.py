"""Sparse MoE of kdamoe: sigmoid router with a selection-only bias, Quantile Balancing (and its baselines),
SiTU-GLU / SwiGLU experts with a CPU loop path and a grouped-GEMM GPU path (docs/design.md §3).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

try:
    from .moe_triton import (
        combine_bwd_triton,
        gather_rows_triton,
        gather_sum_triton,
        situ_glu_bwd_triton,
        situ_glu_fwd_triton,
    )
except ImportError:
    situ_glu_fwd_triton = situ_glu_bwd_triton = gather_sum_triton = combine_bwd_triton = gather_rows_triton = None
try:
    from .moe_balancing_triton import histogram_quantile, threshold_histogram
except ImportError:
    histogram_quantile = threshold_histogram = None

from .expert_parallel import dispatch

logger = logging.get_logger(__name__)

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


# ----------------------------------------------------------------------------------------------- activations


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, but `x` itself when the dtype matches: torch.compile (torch 2.11) gives an `autograd.Function`
    output made by a no-op `.to` a zero gradient."""
    return x if x.dtype == dtype else x.to(dtype)


def _situ_glu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(gate)
    g, u = gate.to(dtype), up.to(dtype)
    return _cast(4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0)), gate.dtype)


def _situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad_h: torch.Tensor):
    """Hand-derived gradient: with a = 4 tanh(g/4) σ(g), b = 25 tanh(u/25),
    da/dg = (1 - tanh²(g/4)) σ(g) + a (1 - σ(g)),  db/du = 1 - tanh²(u/25)."""
    dtype = _compute_dtype(gate)
    g, u, dh = gate.to(dtype), up.to(dtype), grad_h.to(dtype)
    tg, sg, tu = torch.tanh(g / 4.0), torch.sigmoid(g), torch.tanh(u / 25.0)
    a = 4.0 * tg * sg
    da = (1.0 - tg * tg) * sg + a * (1.0 - sg)
    return (dh * 25.0 * tu * da).to(gate.dtype), (dh * a * (1.0 - tu * tu)).to(up.dtype)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """`[..., I]` -> 2-D `[M, I]` view with unit column stride (copies only when no such view exists)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _use_triton(x: torch.Tensor) -> bool:
    return situ_glu_fwd_triton is not None and x.is_cuda


class _SiTUGLU(torch.autograd.Function):
    """SiTU-GLU saving only its inputs. `up=None` means `gate` is a packed `[..., 2I]` tensor `[gate | up]`, whose
    gradient is then written as one packed tensor (no concatenation in the backward)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        ctx.packed = up is None
        g, u = gate.chunk(2, dim=-1) if up is None else (gate, up)
        ctx.save_for_backward(g, u)
        if not _use_triton(g):
            return _situ_glu_forward(g, u)
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        situ_glu_fwd_triton(_as_rows(g), _as_rows(u), out.view(-1, out.shape[-1]))
        return out

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        g, u = ctx.saved_tensors
        return _situ_glu_grad(g, u, grad_h, ctx.packed)


def _situ_glu_grad(g: torch.Tensor, u: torch.Tensor, grad_h: torch.Tensor, packed: bool):
    """SiTU-GLU's input gradients for `g, u, grad_h [..., I]`: `(grad_gate_up [..., 2I], None)` when `packed`,
    else `(grad_gate, grad_up)`, in the inputs' dtype."""
    if _use_triton(g):
        shape = (*g.shape[:-1], 2 * g.shape[-1]) if packed else g.shape
        grad_g = torch.empty(shape, dtype=g.dtype, device=g.device)
        grad_gate, grad_up = grad_g.chunk(2, dim=-1) if packed else (grad_g, torch.empty_like(u))
        situ_glu_bwd_triton(_as_rows(g), _as_rows(u), _as_rows(grad_h), grad_gate.view(-1, g.shape[-1]),
                            grad_up.view(-1, g.shape[-1]))
        return (grad_g, None) if packed else (grad_gate, grad_up)
    grad_gate, grad_up = _situ_glu_backward(g, u, grad_h)
    return (torch.cat([grad_gate, grad_up], dim=-1), None) if packed else (grad_gate, grad_up)


def situ_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU, a bounded SwiGLU: `h = [4 tanh(g/4) sigmoid(g)] * [25 tanh(u/25)]`, `|h| <= 100`; same shapes."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return _SiTUGLU.apply(gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: `silu(gate) * up`."""
    return F.silu(gate) * up


def _packed_activation(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    """Activation of a packed `[..., 2I]` tensor `[gate | up]` -> `[..., I]`."""
    if name == "situ_glu":
        return _SiTUGLU.apply(gate_up, None)
    return swiglu(*gate_up.chunk(2, dim=-1))


def _packed_activation_grad(name: str, gate_up: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
    """The gradient `[..., 2I]` of `_packed_activation(name, gate_up)` for `grad_h [..., I]`, from the derivatives
    written out: no autograd graph, so that a backward can call it (and torch.compile trace it)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if name == "situ_glu":
        return _situ_glu_grad(gate, up, grad_h, packed=True)[0]
    dtype = _compute_dtype(gate)
    g, u, dh = gate.to(dtype), up.to(dtype), grad_h.to(dtype)
    sg = torch.sigmoid(g)  # d silu(g) / dg = σ(g) (1 + g (1 - σ(g)))
    return torch.cat([dh * u * sg * (1.0 + g * (1.0 - sg)), dh * g * sg], dim=-1).to(gate_up.dtype)


# ----------------------------------------------------------------------------------------------- experts


def plain_linear(module: nn.Module) -> bool:
    """A bias-free `nn.Linear` without hooks, whose weight a fused op may use directly. Anything else (PEFT's LoRA
    layers, quantised linears, hooks) must run as a module, or its adapter would be bypassed."""
    return (type(module) is nn.Linear and module.bias is None
            and not (module._forward_hooks or module._forward_pre_hooks))


class KDAMoEMLP(nn.Module):
    """Gated MLP `down(act(gate(x), up(x)))` (dense layers and shared experts); `[..., D] -> [..., D]`.

    With plain projections (`plain_linear`) gate and up run as one GEMM on the concatenated weights `[2I, D]` (a copy
    of 2·I·D weights per call): one wider GEMM instead of two, one GEMM for the input's gradient instead of two and
    their sum, and the packed activation path (no split or concatenation of `[..., 2I]` activations). Otherwise
    (adapters, hooks) each projection runs as its module."""

    def __init__(self, config, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.activation = config.expert_activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused_inputs() or not plain_linear(self.down_proj):
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # [..., 2I]
            return self.down_proj(_packed_activation(self.activation, gate_up))
        gate_up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight]))  # [..., 2I]
        return _ActivationDown.apply(self.activation, gate_up, self.down_proj.weight)

    def fused_inputs(self) -> bool:
        """x enters one GEMM (gate | up), not one per projection."""
        return plain_linear(self.gate_proj) and plain_linear(self.up_proj)


class _ActivationDown(torch.autograd.Function):
    """`act(gate_up) @ down.T` keeping only `gate_up` and the weight: the backward recomputes the activation rather
    than keeping its `[..., I]` output for the down projection (a third of the MLP's saved activations)."""

    @staticmethod
    def forward(ctx, activation: str, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.activation = activation
        ctx.save_for_backward(gate_up, weight)
        return F.linear(_packed_activation(activation, gate_up), weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate_up, weight = ctx.saved_tensors
        h = _packed_activation(ctx.activation, gate_up)  # [..., I], in the dtype the forward's linear saw
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().to(h.dtype) @ h.reshape(-1, h.shape[-1])
        grad_h = grad_out.to(h.dtype) @ weight.to(h.dtype)
        return None, _packed_activation_grad(ctx.activation, gate_up, grad_h), grad_w.to(weight.dtype)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows `offs[g-1]:offs[g]` of `x [M, K]` times `weight[g].T` (`weight [G, N, K]`) -> `[M, N]`.

    Uses `grouped_mm` where torch has a kernel (CUDA bf16; CPU float32 without autograd), else a loop over groups.
    """
    no_grad = not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    if _GROUPED_MM is not None and (
        (x.is_cuda and x.dtype == torch.bfloat16) or (x.device.type == "cpu" and x.dtype == torch.float32 and no_grad)
    ):
        return _GROUPED_MM(x, weight.to(x.dtype).transpose(-2, -1), offs=offs)  # cast: fp32 master weights
    out, start = [], 0
    for group, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ weight[group].T)
        start = end
    return torch.cat(out)


def _gather_sum(y: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor | None, top_k: int) -> torch.Tensor:
    """`out[n] = sum_j weights[n, j] * y[inverse[n*k + j]]` (weights 1 when None): `y [M, D]` -> `[M / k, D]` in
    `y.dtype`, the k rows of a token summed in a fixed order with fp32 (or wider) accumulation, no atomics."""
    if _use_triton(y):
        out = torch.empty(inverse.numel() // top_k, y.shape[-1], dtype=y.dtype, device=y.device)
        return gather_sum_triton(_as_rows(y), inverse.contiguous(),
                                 None if weights is None else weights.contiguous(), out)
    dtype = _compute_dtype(y)
    rows = y.index_select(0, inverse).view(-1, top_k, y.shape[-1]).to(dtype)
    if weights is None:
        return _cast(rows.sum(1), y.dtype)
    return _cast(torch.bmm(weights.to(dtype).unsqueeze(1), rows).squeeze(1), y.dtype)


class _PermuteTokens(torch.autograd.Function):
    """`hidden[token_of]` (`[N, D] -> [N*k, D]`); the backward sums the k copies of each token in a fixed order
    (through the inverse permutation) instead of with atomic adds."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, token_of: torch.Tensor, inverse: torch.Tensor, top_k: int):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        if _use_triton(hidden):
            out = torch.empty(token_of.numel(), hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
            return gather_rows_triton(_as_rows(hidden), token_of.contiguous(), out)
        return hidden.index_select(0, token_of)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _gather_sum(grad, inverse, None, ctx.top_k), None, None, None


class _CombineTokens(torch.autograd.Function):
    """Weighted combine of the expert outputs in sorted order: `out[n] = sum_j weights[n, j] * y[inverse[n*k + j]]`
    (`y [N*k, D]`, `weights [N, k]` -> `[N, D]` in `y.dtype`), `order` = sorted position -> flat (token, slot)
    position, `inverse` its inverse. Fixed summation order, no atomics, fp32 (or wider) accumulation. Backward:
    `dy[p] = weights.flat[order[p]] * dout[order[p] // k]` (every row written once, no index_add) and
    `dweights[n, j] = <y[inverse[n*k + j]], dout[n]>`, returned in `weights.dtype`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor):
        ctx.need_dw = ctx.needs_input_grad[1]
        ctx.save_for_backward(y if ctx.need_dw else None, weights, order, inverse)
        ctx.y_dtype = y.dtype
        return _gather_sum(y, inverse, weights, weights.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        y, weights, order, inverse = ctx.saved_tensors
        top_k = weights.shape[1]
        if _use_triton(grad_out):
            grad_y = torch.empty(order.numel(), grad_out.shape[-1], dtype=ctx.y_dtype, device=grad_out.device)
            grad_w = torch.empty(weights.shape, dtype=weights.dtype, device=weights.device) if ctx.need_dw else None
            combine_bwd_triton(_as_rows(grad_out), None if y is None else _as_rows(y), weights.contiguous(),
                               inverse.contiguous(), grad_y, grad_w)
            return grad_y, grad_w, None, None
        dtype = _compute_dtype(grad_out)
        dout = grad_out.to(dtype)
        grad_y = dout.index_select(0, order // top_k) * weights.reshape(-1).to(dtype).index_select(0, order)[:, None]
        grad_w = None
        if ctx.need_dw:
            rows = y.index_select(0, inverse).view(-1, top_k, y.shape[-1]).to(dtype)
            grad_w = torch.bmm(rows, dout.unsqueeze(2)).squeeze(2).to(weights.dtype)
        return grad_y.to(ctx.y_dtype), grad_w, None, None


class KDAMoEExperts(nn.Module):
    """Routed experts with 3-D weights `gate_up_proj [E, 2I, D]` (rows `[gate | up]`) and `down_proj [E, D, I]`.

    `forward(hidden [N, D], top_k_index [N, k], top_k_weights [N, k]) -> [N, D]`: on CUDA in bf16 the tokens are
    sorted by expert and run through grouped GEMMs with the group offsets on the device (`forward_grouped`, no host
    synchronisation: also the decode path); elsewhere a loop over the experts that received tokens (`forward_loop`),
    or under torch.compile or a CUDA graph's recording every expert on every token (`forward_dense`: the loop's
    shapes depend on the routing). All compute the same function. With `expert_parallel` set
    (`expert_parallel.shard_experts`) the weights hold this rank's experts only and tokens travel to theirs
    (`expert_parallel.dispatch`).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size
        self.activation = config.expert_activation
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, self.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, self.intermediate_size))
        self.expert_parallel = None  # ExpertParallel when the experts are sharded across ranks

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.expert_parallel is not None:
            self._check(hidden, top_k_index, top_k_weights)
            return dispatch(self, hidden, top_k_index, top_k_weights)
        if (dtype := self.grouped_dtype(hidden)) is not None:
            return self.forward_grouped(hidden.to(dtype), top_k_index, top_k_weights)
        if torch.compiler.is_compiling() or (hidden.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.forward_dense(hidden, top_k_index, top_k_weights)
        return self.forward_loop(hidden, top_k_index, top_k_weights)

    def grouped_dtype(self, hidden: torch.Tensor) -> torch.dtype | None:
        """The dtype the grouped GEMMs run `hidden` in (bf16 on CUDA, autocast's dtype under autocast), or None
        where they do not run."""
        dtype = hidden.dtype
        if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        if (hidden.is_cuda and dtype == torch.bfloat16 and _GROUPED_MM is not None
                and self.hidden_size % 8 == 0 and self.intermediate_size % 8 == 0):
            return dtype
        return None

    def forward_sorted(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows `x [M, D]` sorted by expert, `counts [E]` rows for each of this module's experts -> the experts'
        unweighted outputs `[M, D]`: two grouped GEMMs where `grouped_dtype` says so, else a loop over the experts
        (reads `counts` on the host)."""
        if (dtype := self.grouped_dtype(x)) is not None:
            offs = counts.cumsum(0).to(torch.int32)
            h = _packed_activation(self.activation, _grouped_linear(x.to(dtype), self.gate_up_proj, offs))
            return _grouped_linear(h, self.down_proj, offs)
        parts = x.split(counts.tolist())
        return torch.cat([self.expert_mlp(part, e) if len(part) else part for e, part in enumerate(parts)])

    def _check(self, hidden, top_k_index, top_k_weights) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [N, {self.hidden_size}], got {tuple(hidden.shape)}")
        if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden.shape[0]:
            raise ValueError(
                f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both "
                f"be [N={hidden.shape[0]}, k]"
            )

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` of this module's weights on rows `x [M, D]` -> `[M, D]` (unweighted)."""
        return _packed_activation(self.activation, x @ self.gate_up_proj[expert].T) @ self.down_proj[expert].T

    def forward_loop(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Plain loop over the experts that received tokens."""
        self._check(hidden, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden)
        for expert in torch.unique(top_k_index).tolist():
            token, slot = torch.nonzero(top_k_index == expert, as_tuple=True)
            y = self.expert_mlp(hidden[token], expert) * top_k_weights[token, slot, None].to(hidden.dtype)
            out = out.index_add(0, token, y)
        return out

    def forward_dense(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Every expert on every token (`[E, N, 2I]` activations, E / k times the FLOPs of the routed paths), each
        output weighted by the token's routing weight for that expert (0 where not routed): static shapes."""
        self._check(hidden, top_k_index, top_k_weights)
        dense_weights = torch.zeros(hidden.shape[0], self.num_experts, dtype=top_k_weights.dtype,
                                    device=hidden.device).scatter_add(1, top_k_index, top_k_weights)  # [N, E]
        h = _packed_activation(self.activation, hidden @ self.gate_up_proj.transpose(1, 2))  # [E, N, I]
        y = h @ self.down_proj.transpose(1, 2)  # [E, N, D]
        return (y * dense_weights.t().unsqueeze(-1).to(hidden.dtype)).sum(0)

    def forward_grouped(self, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        """Tokens sorted by expert, two grouped GEMMs, fixed-order weighted combine (no host synchronisation)."""
        self._check(hidden, top_k_index, top_k_weights)
        top_k = top_k_index.shape[1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # sorted position -> flat (token, slot) position
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=hidden.device)
        counts.scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        offs = counts.cumsum(0).to(torch.int32)
        x = _PermuteTokens.apply(hidden, order // top_k, inverse, top_k)
        h = _packed_activation(self.activation, _grouped_linear(x, self.gate_up_proj, offs))
        return _CombineTokens.apply(_grouped_linear(h, self.down_proj, offs), top_k_weights, order, inverse)


# ----------------------------------------------------------------------------------------------- router + balancing


class _RouterLogits(torch.autograd.Function):
    """`x [N, D] @ weight [E, D]ᵀ -> logits [N, E]` in fp32 whatever autocast says: expert selection and
    the balancing statistics come from these. 16-bit CUDA operands of one dtype take a 16-bit GEMM with fp32 output
    (exact products, fp32 sums: the same logits as widening first, at tensor-core speed); the backward rounds the
    logits' gradient to that dtype, as any 16-bit linear layer does. Anything else is computed in fp32, or in fp64
    when an operand is fp64 (a float64 model routes in float64: the tests' references)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            if _fp32_output_gemm(x, weight):
                return torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(
                    *x.shape[:-1], -1)
            wide = _router_dtype(x, weight)
            return x.to(wide) @ weight.to(wide).t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        with torch.autocast(x.device.type, enabled=False):
            if _fp32_output_gemm(x, weight):
                g = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
                if ctx.needs_input_grad[0]:
                    grad_x = (g @ weight).view_as(x)
                if ctx.needs_input_grad[1]:
                    grad_w = torch.mm(g.t(), x.reshape(-1, x.shape[-1]), out_dtype=torch.float32).to(weight.dtype)
            else:
                wide = _router_dtype(x, weight)
                if ctx.needs_input_grad[0]:
                    grad_x = (grad.to(wide) @ weight.to(wide)).to(x.dtype)
                if ctx.needs_input_grad[1]:
                    g, xs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
                    grad_w = (g.to(wide).t() @ xs.to(wide)).to(weight.dtype)
        return grad_x, grad_w


def _router_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)


def _fp32_output_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)


class KDAMoERouter(nn.Module):
    """Sigmoid router. `weight [E, D]`; persistent fp32 buffer `bias [E]` used for expert selection only.

    `forward(x [N, D]) -> (logits [N, E], scores [N, E], top_k_index [N, k], top_k_weights [N, k], cutoff [N])`,
    all fp32 (fp64 in a float64 model): `scores = sigmoid(logits)`, experts = top-k of `scores + bias`, weights =
    the unbiased scores there, normalised to sum 1 and times `routed_scaling_factor`; `cutoff` = the (k+1)-th
    largest biased score (`None` when k equals the number of experts).
    """

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("bias", torch.zeros(config.num_experts, dtype=torch.float32), persistent=True)
        # the state of `smoothed_bias` (quantile_window > 1): zeros are a fresh filter (and what a checkpoint without
        # it loads as)
        self.register_buffer("bias_filter", torch.zeros(2 * config.num_experts + 3, dtype=torch.float32),
                             persistent=True)

    def _apply(self, fn, recurse=True):
        """Keep the selection bias and its filter state in their dtype whatever `.to(dtype)` / `.bfloat16()` does to
        the rest of the model."""
        bias, bias_filter = self.bias, self.bias_filter
        super()._apply(fn, recurse)
        self.bias = bias.to(device=self.bias.device)
        self.bias_filter = bias_filter.to(device=self.bias_filter.device)
        return self

    def forward(self, x: torch.Tensor):
        logits = _RouterLogits.apply(x, self.weight)
        scores = torch.sigmoid(logits)
        with torch.no_grad():
            num_experts = scores.shape[-1]
            values, index = torch.topk(scores + self.bias.float(), min(self.top_k + 1, num_experts), dim=-1)
            cutoff = values[:, self.top_k] if self.top_k < num_experts else None
            top_k_index = index[:, : self.top_k]
        weights = scores.gather(1, top_k_index)
        weights = weights / weights.sum(-1, keepdim=True) * self.routed_scaling_factor
        return logits, scores, top_k_index, weights, cutoff


def _centre(bias: torch.Tensor) -> torch.Tensor:
    return bias - bias.mean(-1, keepdim=True)


def _check_batch(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> int:
    """The number of experts E of one batch's `scores [N, E]` and `bias [E]`; ValueError for other shapes or a top-k
    outside [1, E - 1]."""
    if scores.dim() != 2 or bias.shape != (scores.shape[1],):
        raise ValueError(f"scores must be [N, E] and bias [E], got {tuple(scores.shape)} and {tuple(bias.shape)}")
    num_experts = scores.shape[1]
    if not 0 < top_k < num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts - 1}], got {top_k}")
    return num_experts


def quantile_balance(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Exact Quantile Balancing update for one batch of router scores.

    `scores [N, E]` (sigmoid scores), `bias [E]` (the bias they were routed with). With the cutoff `c_i` = the
    (k+1)-th largest `scores_i + bias`, the new bias of expert j is the k/E quantile (linear interpolation) of
    `r_ij = c_i - scores_ij` over the tokens, mean-centred. Returns `[E]` in `bias.dtype`.
    """
    num_experts = _check_batch(scores, bias, top_k)
    s = scores.double()
    cutoff = torch.topk(s + bias.double(), top_k + 1, dim=-1).values[:, top_k]
    new = torch.quantile(cutoff[:, None] - s, top_k / num_experts, dim=0)
    return _centre(new).to(bias.dtype)


def selection_thresholds(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """`r [..., N, E]` with token i picking expert j iff `bias_j > r_ij`: `r_ij` = the k-th largest
    `scores_il + bias_l` over the other experts `l != j`, minus `scores_ij`. For a token that picks j this is
    `quantile_balance`'s `c_i - scores_ij`; for the others `c_i` (the (k+1)-th largest of all) can lie below it,
    which makes that update undershoot for an underloaded expert. The k/E quantile of `r_{:, j}` balances expert j
    exactly while the other biases stay. `scores [..., N, E]`, `bias [..., E]` (leading dims: layers); computed in
    scores' dtype (float64 for the oracle; the block's fp32 scores resolve a threshold to ~1e-7, far finer than the
    histogram's bins), at least fp32."""
    s = scores if scores.dtype == torch.float64 else scores.float()
    values, index = torch.topk(s + bias.to(s.dtype).unsqueeze(-2), top_k + 1, dim=-1)
    picked = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, index[..., :top_k], True)
    return torch.where(picked, values[..., top_k:], values[..., top_k - 1 : top_k]) - s


def quantile_fixed_point(scores: torch.Tensor, bias: torch.Tensor, top_k: int, iterations: int) -> torch.Tensor:
    """Exact float64 counterpart of the block's Quantile Balancing update: `iterations` times, every expert's bias
    becomes the k/E quantile of its `selection_thresholds` (linear interpolation), mean-centred. One step balances
    each expert given the others; repeating settles how the cutoffs move with the bias (three steps take a batch
    routed onto a few experts to MaxVio of a few hundredths). `scores [N, E]`, `bias [E]`; returns `[E]` in
    `bias.dtype`."""
    num_experts = _check_batch(scores, bias, top_k)
    new = bias.double()
    for _ in range(iterations):
        new = _centre(torch.quantile(selection_thresholds(scores, new, top_k), top_k / num_experts, dim=0))
    return new.to(bias.dtype)


def balanced_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int, iterations: int, num_bins: int,
                  token_mask: torch.Tensor | None = None, reduce=None) -> torch.Tensor:
    """`quantile_fixed_point` with the quantiles read from histograms, so that the window is a sum: `reduce(counts)`
    (e.g. an all-reduce) sums each histogram's int64 counts across ranks in place before it is read. Each step reads
    the k/E quantile twice, from `num_bins` bins over `[min(bias) - 1, max(bias) + 1]` (which holds every threshold,
    since scores lie in (0, 1)) and then from `num_bins` bins inside the bin found: within `span / num_bins**2` of
    the exact quantile, finer than the spread of a router whose scores barely differ between tokens.

    `scores [..., N, E]`, `bias [..., E]`: the leading dims are independent problems (the MoE layers of a model, one
    batched computation for all); only the rows where `token_mask [..., N]` (or `[N]`) is True count. On a GPU with
    fp32 scores the histograms come from the Triton kernels of `moe_balancing_triton` (the same counts and
    read-outs, bit for bit, without the `[..., N, E]` float64 intermediates). On the device, no host
    synchronisation; returns `[..., E]` float64."""
    q = top_k / scores.shape[-1]
    new = bias.double()
    if _use_balancing_kernels(scores, num_bins):
        return _balanced_bias_fused(scores, new, top_k, iterations, num_bins, q, token_mask, reduce)
    for _ in range(iterations):
        r = selection_thresholds(scores, new, top_k)  # [..., N, E]
        low = (new.amin(-1, keepdim=True) - 1.0).expand_as(new).reshape(-1)
        high = (new.amax(-1, keepdim=True) + 1.0).expand_as(new).reshape(-1)
        coarse = QuantileHistogram(new.numel(), num_bins, low, high)
        coarse.add(r, token_mask)
        if reduce is not None:
            reduce(coarse.counts)
        fine = coarse.refine(q)
        fine.add(r, token_mask)
        if reduce is not None:
            reduce(fine.counts)
        new = _centre(fine.quantile(q).view_as(new))
    return new


def _use_balancing_kernels(scores: torch.Tensor, num_bins: int) -> bool:
    return (threshold_histogram is not None and scores.is_cuda and scores.dtype == torch.float32
            and 1 < num_bins <= 1 << 14 and scores.shape[-1] <= 1024)


def _balanced_bias_fused(scores, new, top_k, iterations, num_bins, q, token_mask, reduce) -> torch.Tensor:
    """`balanced_bias` with the Triton kernels of `moe_balancing_triton`: per step two histograms of two kernels
    each (the coarse range read from the bias inside them, the refined range and the zeroed counts left by the
    reading kernel), then the centring; `new [..., E]` float64."""
    shape = new.shape
    scores = scores.reshape(-1, *scores.shape[-2:]).contiguous()  # [L, N, E]
    if token_mask is not None:  # [L, N], or [N] for every layer
        token_mask = token_mask.reshape(-1, token_mask.shape[-1])
        token_mask = token_mask[0] if token_mask.shape[0] == 1 else token_mask
    columns = new.numel()
    counts = torch.zeros(columns, num_bins, dtype=torch.int64, device=scores.device)
    low, width = torch.empty(2, columns, dtype=torch.float64, device=scores.device)
    q = torch.full((), q, dtype=torch.float64, device=scores.device)
    for _ in range(iterations):
        bias = new.reshape(scores.shape[0], -1).contiguous()
        threshold_histogram(scores, bias, top_k, counts, token_mask=token_mask)
        if reduce is not None:
            reduce(counts)
        histogram_quantile(counts, bias, q, low, width, coarse=True)
        threshold_histogram(scores, bias, top_k, counts, low, width, token_mask)
        if reduce is not None:
            reduce(counts)
        new = _centre(histogram_quantile(counts, bias, q, low, width, coarse=False).view(shape))
    return new


def smoothed_bias(fixed_point: torch.Tensor, bias: torch.Tensor, state: torch.Tensor, window: int):
    """Quantile Balancing over steps (`quantile_window > 1`): the bias to route the next batch with, a local-level
    Kalman filter of the per-step fixed points. `fixed_point [L, E]` (this step's, centred), `bias [L, E]` (the one
    the step routed with), `state [L, 2E + 3]` (zeros before the first step: the last fixed point, the last
    difference, two moments, the count of fixed points) -> `(new bias [L, E], state, gain [L])`, all float64; the
    leading dim holds independent layers.

    A fixed point is the drifting bias the router needs plus the batch's own sampling noise (each batch routes by
    its documents). The differences of successive fixed points d_t then have `E[d²] = drift + 2·noise` and
    `E[d_t d_{t-1}] = -noise` (independent noise; a trend only adds positive covariance, so it can only raise the
    gain), both pooled over the experts and averaged over the last `window` steps. The steady-state gain of that
    filter, `2 / (1 + sqrt(1 + 4 noise / drift))`, weighs the new fixed point: 1 while the drift dominates (early
    training: QB's single-batch bias), towards `1 / window` as the router settles (the bias averages the fixed
    points of about `window` batches). Gain 1 until 4 pairs of differences are seen. On the device, no host
    synchronisation."""
    E = fixed_point.shape[-1]
    fixed_point, bias, state = fixed_point.double(), bias.double(), state.double()
    last, last_diff = state[:, :E], state[:, E : 2 * E]
    second, cross, seen = state[:, 2 * E], state[:, 2 * E + 1], state[:, 2 * E + 2]
    diff = torch.where(seen[:, None] >= 1, fixed_point - last, 0.0)
    pairs = seen - 1  # difference pairs including this step's (when >= 1)
    rate = torch.where(pairs >= 1, 1.0 / pairs.clamp(1, window), 0.0)  # a running mean, then the last `window` steps
    second = second + rate * ((diff * diff).mean(-1) - second)
    cross = cross + rate * ((diff * last_diff).mean(-1) - cross)
    noise = (-cross).clamp_min(0.0)
    drift = (second - 2.0 * noise).clamp_min(0.0)
    gain = 2.0 / (1.0 + torch.sqrt(1.0 + 4.0 * noise / drift))  # noise 0: 1; drift 0: 0 (noise / 0 = inf)
    gain = torch.where(noise > 0, gain, 1.0).clamp_min(1.0 / window)
    gain = torch.where(pairs >= 4, gain, 1.0)
    new = torch.where(gain[:, None] == 1.0, fixed_point, _centre(bias + gain[:, None] * (fixed_point - bias)))
    state = torch.cat([fixed_point, diff, second[:, None], cross[:, None], (seen + 1)[:, None]], dim=-1)
    return new, state, gain


def loss_free_balance(loads: torch.Tensor, bias: torch.Tensor, rate: float) -> torch.Tensor:
    """Sign-step baseline: `bias_j + rate * sign(mean(loads) - loads_j)`; `loads [..., E]`, returns `[..., E]`."""
    if loads.shape != bias.shape:
        raise ValueError(f"loads {tuple(loads.shape)} and bias {tuple(bias.shape)} must have the same shape")
    loads = loads.double()
    return (bias.double() + rate * torch.sign(loads.mean(-1, keepdim=True) - loads)).to(bias.dtype)


def max_violation(loads: torch.Tensor) -> float:
    """`MaxVio = (max_j load_j - mean load) / mean load` for token counts `loads [E]`."""
    loads = loads.double()
    if loads.dim() != 1 or loads.numel() == 0 or not loads.sum() > 0:
        raise ValueError(f"loads must be a non-empty [E] tensor with a positive total, got {loads}")
    mean = loads.mean()
    return ((loads.max() - mean) / mean).item()


class QuantileHistogram:
    """Per-column histograms of values in a fixed range `[low, high]`, for quantiles over large token windows.

    A column is an expert, or a (layer, expert) pair when several layers are binned at once. `low`, `high`: scalars
    or `[C]` (a range per column). `add(r [..., N, E])` bins every value (clamped into the range) into `num_bins`
    equal bins of its column `l·E + j`; `counts` (int64 `[C, num_bins]`) is the whole state, so windows add up by
    summing counts (micro-batches, or an all-reduce across ranks). `quantile(q)` reads the q-quantile per column by
    linear interpolation inside the bin where the cumulative count reaches `q * total`; it lies within one bin width
    of the exact quantile. `refine(q)` gives the histogram of that bin, for a second pass `num_bins` times finer.
    """

    def __init__(self, num_columns: int, num_bins: int, low: torch.Tensor | float, high: torch.Tensor | float,
                 device=None):
        low = torch.as_tensor(low, dtype=torch.float64, device=device)
        high = torch.as_tensor(high, dtype=torch.float64, device=device)
        if num_bins < 1:
            raise ValueError(f"num_bins must be positive, got {num_bins}")
        if low.shape not in ((), (num_columns,)) or high.shape != low.shape:
            raise ValueError(f"low and high must be scalars or [{num_columns}], got {tuple(low.shape)} and "
                             f"{tuple(high.shape)}")
        self.num_bins = num_bins
        self.low, self.high = low.expand(num_columns), high.expand(num_columns)
        # times the reciprocal, as torch's CUDA division by a scalar computes it: the same bits on every device and
        # in the Triton kernels (moe_balancing_triton)
        self.width = (self.high - self.low) * (1.0 / num_bins)
        self.counts = torch.zeros(num_columns, num_bins, dtype=torch.int64, device=low.device)

    def add(self, r: torch.Tensor, token_mask: torch.Tensor | None = None) -> None:
        """Accumulate `r [..., N, E]` (the leading dims and E make the columns), only the rows where `token_mask`
        (bool `[..., N]` or `[N]`) is True when it is given."""
        num_columns = self.counts.shape[0]
        if r.dim() < 2 or r[..., 0, :].numel() != num_columns:
            raise ValueError(f"r must be [..., N, E] with {num_columns} columns in all, got {tuple(r.shape)}")
        shape = (*r.shape[:-2], 1, r.shape[-1])
        bins = ((r.double() - self.low.view(shape)) / self.width.view(shape)).floor_().clamp_(0, self.num_bins - 1)
        flat = bins.long() + torch.arange(num_columns, device=r.device).view(shape) * self.num_bins
        ones = torch.ones_like(flat) if token_mask is None else token_mask.long().unsqueeze(-1).expand_as(flat)
        self.counts.view(-1).scatter_add_(0, flat.reshape(-1), ones.reshape(-1))

    def _locate(self, q: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per expert, the bin `[E, 1]` where the cumulative count reaches `q * total` and the fraction `[E, 1]` of
        that bin's count below the target."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must lie in [0, 1], got {q}")
        counts = self.counts.double()
        cum = counts.cumsum(1)
        target = q * cum[:, -1:]
        b = torch.searchsorted(cum, target).clamp_(max=self.num_bins - 1)  # first bin with cum >= target
        below = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
        inside = counts.gather(1, b)
        return b, torch.where(inside > 0, (target - below) / inside.clamp(min=1), torch.zeros_like(target))

    def _edge(self, position: torch.Tensor) -> torch.Tensor:
        """`low + position * width` per expert, for `position [E, 1]` in bins; returns `[E]`."""
        return (self.low.unsqueeze(-1) + position * self.width.unsqueeze(-1)).squeeze(1)

    def quantile(self, q: float) -> torch.Tensor:
        """q-quantile per expert, `[E]` float64."""
        b, frac = self._locate(q)
        return self._edge(b + frac)

    def refine(self, q: float) -> "QuantileHistogram":
        """An empty histogram with the same number of bins spanning, per expert, the bin that holds the q-quantile.
        Adding the same values to it reads the quantile within `width / num_bins`: values below or above that bin
        land in its first or last bin, so every cumulative count at an inner edge stays exact."""
        b, _ = self._locate(q)
        return QuantileHistogram(self.counts.shape[0], self.num_bins, self._edge(b), self._edge(b + 1))


# Inference forwards (no grad) run the experts on at most this many tokens at a time: a 1M-token prefill's sorted
# rows and expert activations (top-8 at hidden 1024: 16 GiB of rows alone) stay at an eighth of that. Training keeps
# one pass (autograd keeps every chunk's activations anyway); with expert parallelism every rank must make the same
# collective calls, so it keeps one pass too.
MOE_INFERENCE_TOKENS = 1 << 17
# Training forwards whose Quantile Balancing statistics may wait for `apply_balancing` before a warning says that
# nothing applies them (they grow by the router logits, [tokens, E] fp32, every forward)
PENDING_FORWARDS_WARNING = 256


class KDAMoESparseMoeBlock(nn.Module):
    """Router + routed experts + optional shared experts, with the per-optimizer-step balancing of docs/design.md §3.

    `forward(hidden_states [B, T, D], token_mask [B, T] bool or None) -> (out [B, T, D], router_logits [B*T, E]
    fp32, aux_loss or None)`; without grad, more than MOE_INFERENCE_TOKENS tokens go through the experts in parts.
    In training mode with grad enabled (and outside a backward pass, so the recompute of non-reentrant activation
    checkpointing is not counted twice), balancing statistics of the real tokens (`token_mask` True) accumulate
    until `apply_balancing()`: the loads, and for Quantile Balancing the router logits (`[tokens, E]` fp32, kept
    until the optimizer step) and the sum of the router inputs (`[D]`).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.balancing = config.router_balancing
        self.loss_free_update_rate = config.loss_free_update_rate
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.quantile_num_bins = config.quantile_num_bins
        self.quantile_iterations = config.quantile_iterations
        self.quantile_window = config.quantile_window
        self.router = KDAMoERouter(config)
        self.experts = KDAMoEExperts(config)
        self.shared_experts = (
            KDAMoEMLP(config, config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0 else None
        )
        self._loads = None  # int64 [E] token counts of the pending window
        self._logits = None  # (router logits [M, E] fp32, real-token mask [M]) of the window (quantile balancing)
        self._input_sum = None  # fp32 [D]: sum of the window's real router inputs (quantile balancing)
        self._pending_forwards = 0  # forwards in the window (quantile balancing)
        self._weight_dtype = torch.float32  # the router weight's dtype in the training forwards (FSDP may cast it)

    def forward(self, hidden_states: torch.Tensor, token_mask: torch.Tensor | None = None):
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [B, T, D], got {tuple(hidden_states.shape)}")
        if token_mask is not None and token_mask.shape != hidden_states.shape[:2]:
            raise ValueError(
                f"token_mask must be [B, T] = {tuple(hidden_states.shape[:2])}, got {tuple(token_mask.shape)}"
            )
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits, scores, top_k_index, top_k_weights, _ = self.router(x)
        mask = None if token_mask is None else token_mask.reshape(-1).to(torch.bool)
        if self.training and torch.is_grad_enabled() and _outside_backward():
            self._accumulate(x, logits, top_k_index, mask)
        if torch.is_grad_enabled() or x.shape[0] <= MOE_INFERENCE_TOKENS or self.experts.expert_parallel is not None:
            out = self._expert_outputs(x, top_k_index, top_k_weights)
        else:  # a long inference forward, MOE_INFERENCE_TOKENS tokens at a time
            out = None
            for s in range(0, x.shape[0], MOE_INFERENCE_TOKENS):
                part = self._expert_outputs(*(t[s:s + MOE_INFERENCE_TOKENS] for t in (x, top_k_index, top_k_weights)))
                out = part.new_empty(x.shape[0], part.shape[1]) if out is None else out
                out[s:s + part.shape[0]] = part
        aux_loss = None
        if self.training and self.balancing == "aux_loss":
            aux_loss = self._aux_loss(scores, top_k_index, mask)
        return out.view_as(hidden_states), logits, aux_loss

    def _expert_outputs(self, x, top_k_index, top_k_weights) -> torch.Tensor:
        """The routed experts' weighted sum plus the shared experts' output, `[N, D]`."""
        out = self.experts(x, top_k_index, top_k_weights)
        return out + self.shared_experts(x) if self.shared_experts is not None else out

    def _aux_loss(self, scores, top_k_index, mask) -> torch.Tensor:
        """Switch-style `coef * E * sum_j f_j P_j`: f_j = share of routed slots, P_j = mean normalised score."""
        if mask is not None:
            scores, top_k_index = scores[mask], top_k_index[mask]
        with torch.no_grad():
            f = torch.zeros(self.num_experts, device=scores.device)
            f.scatter_add_(0, top_k_index.reshape(-1), torch.ones(top_k_index.numel(), device=scores.device))
            f = f / max(top_k_index.numel(), 1)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0) if scores.shape[0] else scores.sum(0)
        return self.router_aux_loss_coef * self.num_experts * (f * p).sum()

    @torch.no_grad()
    def _accumulate(self, x, logits, top_k_index, mask) -> None:
        """Add the batch (router inputs `x [N, D]`, `logits [N, E]`) to the pending statistics (masks as 0/1 counts
        and weights: no host synchronisation)."""
        if self._loads is None:
            self._loads = torch.zeros(self.num_experts, dtype=torch.int64, device=logits.device)
        ones = torch.ones_like(top_k_index) if mask is None else mask.long()[:, None].expand_as(top_k_index)
        self._loads.scatter_add_(0, top_k_index.reshape(-1), ones.reshape(-1))
        if self.balancing == "quantile" and self.top_k < self.num_experts:
            real = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device) if mask is None else mask
            x = x.detach() if mask is None else x.detach() * mask[:, None]
            input_sum = x.sum(0, dtype=torch.float32)
            logits = logits.detach()
            if self._logits is not None:
                logits, real = torch.cat([self._logits[0], logits]), torch.cat([self._logits[1], real])
                input_sum = input_sum + self._input_sum
            self._logits, self._input_sum = (logits, real), input_sum
            self._weight_dtype = self.router.weight.dtype
            self._pending_forwards += 1
            if self._pending_forwards == PENDING_FORWARDS_WARNING:
                logger.warning_once(
                    f"kdamoe: {PENDING_FORWARDS_WARNING} training forwards' routing statistics wait for the "
                    "router-bias update, and they grow every forward: call model.apply_load_balancing() after each "
                    "optimizer step (HF Trainer, TRL: callbacks=[kdamoe.LoadBalancingCallback()])")

    @torch.no_grad()
    def apply_balancing(self) -> dict:
        """Apply the pending update (statistics all-reduced first when torch.distributed is initialised, so every
        rank sets the same bias), reset the statistics and return `{"loads": int64 [E], "max_vio": float,
        "dead_experts": int, "bias_norm": float}`. Without pending statistics: no change, returns `{}`.
        `apply_balancing` (the module function) updates several blocks at once."""
        stats = apply_balancing([self])[0]
        return {} if not stats else summary_to_host([stats])[0]

    def _take_window(self):
        """The pending statistics `(loads, (logits, real) or None, input_sum or None)`, reset."""
        window = self._loads, self._logits, self._input_sum
        self._loads = self._logits = self._input_sum = None
        self._pending_forwards = 0
        return window


@torch.no_grad()
def apply_balancing(blocks: list[KDAMoESparseMoeBlock]) -> list[dict]:
    """Apply the pending router-bias update of every block in `blocks` (once per optimizer step) and return, per
    block, `{"loads": int64 [E] as routed with the bias before the update, "max_vio", "dead_experts", "bias_norm":
    0-d device tensors}` (`summary_to_host` reads those of every block in one copy), `{}` for a block with nothing
    pending. Decided on the device: no host synchronisation.

    The MoE layers of a model see the same tokens, so their updates run as one batched computation (`balanced_bias`
    over a leading layer dim, in groups of at most `BALANCE_GROUP_ELEMENTS` thresholds) with one all-reduce per
    statistic for all layers when torch.distributed is initialised: a per-layer update is a few hundred small ops
    whose launches would cost more host time than the layer's compute."""
    out = [{} for _ in blocks]
    pending = [(i, block, block._take_window()) for i, block in enumerate(blocks) if block._loads is not None]
    if not pending:
        return out
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    loads = torch.stack([window[0] for _, _, window in pending])  # [L, E] (every block of a model has E experts)
    if distributed:
        torch.distributed.all_reduce(loads)
    counted = loads.sum(-1) > 0  # a window whose tokens were all masked keeps its bias
    groups: dict[tuple, list[int]] = {}  # blocks updated together: same mode and window shape, or same rate
    for p, (_, block, (_, logits, _)) in enumerate(pending):
        if logits is not None:
            groups.setdefault(("quantile", logits[0].shape), []).append(p)
        elif block.balancing == "loss_free":
            groups.setdefault(("loss_free", block.loss_free_update_rate), []).append(p)
    rows = loads.unbind(0)  # per block, as views (indexing by a host list would copy the list to the device)
    for (mode, setting), members in groups.items():
        if mode == "quantile":
            size = max(1, BALANCE_GROUP_ELEMENTS // max(1, setting[0] * setting[1]))
            for first in range(0, len(members), size):
                part = members[first : first + size]
                _quantile_update([pending[p][1:] for p in part], torch.stack([rows[p] for p in part]), distributed)
        else:
            biases = torch.stack([pending[p][1].router.bias for p in members])
            part_loads = torch.stack([rows[p] for p in members])
            new = loss_free_balance(part_loads, biases, setting)
            new = torch.where(part_loads.sum(-1, keepdim=True) > 0, new, biases)
            _copy_rows([pending[p][1].router.bias for p in members], new)
    mean = loads.double().mean(-1)
    max_vio = torch.where(counted, (loads.amax(-1) - mean) / mean.clamp_min(1e-30), 0.0)
    dead = (loads == 0).sum(-1)
    bias_norm = torch.stack([block.router.bias for _, block, _ in pending]).double().norm(dim=-1)
    for (i, _, _), *values in zip(pending, rows, max_vio.unbind(0), dead.unbind(0), bias_norm.unbind(0)):
        out[i] = dict(zip(("loads", "max_vio", "dead_experts", "bias_norm"), values))
    return out


def _copy_rows(targets: list[torch.Tensor], rows: torch.Tensor) -> None:
    """``targets[i].copy_(rows[i])`` for every i, in one launch (a per-layer copy is a few host ops each)."""
    torch._foreach_copy_(targets, list(rows.unbind(0)))


BALANCE_GROUP_ELEMENTS = 1 << 26  # thresholds per batched Quantile Balancing update (float64, a few such buffers)


def _quantile_update(pending, loads: torch.Tensor, distributed: bool) -> None:
    """One batched Quantile Balancing update of the blocks in `pending` (`(block, window)` pairs with windows of the
    same shape; `loads [L, E]`): the logits rescored by `_logit_drift`, then `balanced_bias`."""
    blocks = [block for block, _ in pending]
    logits = torch.stack([window[1][0] for _, window in pending])  # [L, N, E] fp32
    real = torch.stack([window[1][1] for _, window in pending])  # [L, N] bool
    input_sum = torch.stack([window[2] for _, window in pending])  # [L, D] fp32
    first = blocks[0]
    scores = torch.sigmoid(logits + _logit_drift(blocks, logits, real, input_sum, loads, distributed))
    bias = torch.stack([block.router.bias for block in blocks])
    counted = loads.sum(-1, keepdim=True) > 0  # all tokens masked: keep the bias (and the filter)
    window = first.quantile_window
    state = torch.stack([block.router.bias_filter for block in blocks]).double() if window > 1 else None
    start = bias if state is None else torch.where(state[:, -1:] >= 1, state[:, : bias.shape[-1]], bias.double())
    new = balanced_bias(scores, start, first.top_k, first.quantile_iterations, first.quantile_num_bins, real,
                        torch.distributed.all_reduce if distributed else None)  # from the last fixed point if any
    if state is not None:
        new, new_state, _ = smoothed_bias(new, bias, state, window)
        _copy_rows([block.router.bias_filter for block in blocks], torch.where(counted, new_state, state))
    _copy_rows([block.router.bias for block in blocks], torch.where(counted, new, bias.double()))


def _logit_drift(blocks, logits, real, input_sum, loads, distributed: bool) -> torch.Tensor:
    """`[L, 1, E]` fp32: how the optimizer step just taken moved each expert's logit at the window's mean router input,
    `W_now · mean(x) - mean(logits)` over the real tokens (the logits were computed before the step). Adding it to
    the window's logits scores them as the updated router will route the next batch: early in training the router's
    own update moves an expert's logit by more than its spread across tokens, so a bias fitted to the logits as they
    were is stale before it is used. Exact when the inputs differ little between tokens, which is when it matters."""
    width = input_sum.shape[-1]
    sums = torch.cat([input_sum.double(), torch.bmm(real.double().unsqueeze(1), logits.double()).squeeze(1)], dim=-1)
    if distributed:
        torch.distributed.all_reduce(sums)
    count = (loads.sum(-1, keepdim=True) / blocks[0].top_k).clamp_min(1).double()  # [L, 1] real tokens
    mean_input, mean_logit = sums[:, :width] / count, sums[:, width:] / count
    weights = [block.router.weight for block in blocks]  # apply_balancing runs without grad
    weights = [w.full_tensor() if hasattr(w, "full_tensor") else w for w in weights]  # FSDP2 shards
    weights = torch.stack(weights).to(blocks[0]._weight_dtype)  # as the forwards read them (the blocks share it)
    moved = torch.bmm(weights.double(), mean_input.unsqueeze(-1)).squeeze(-1)  # [L, E]
    return (moved - mean_logit).float().unsqueeze(1)


def _outside_backward() -> bool:
    """True unless autograd is running a backward (the recompute of non-reentrant checkpointing). A graph that
    torch.compile traces cannot ask (the graph task is not traceable): it is taken to run outside."""
    return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1


def summary_to_host(stats: list[dict]) -> list[dict]:
    """The device statistics of `apply_balancing` (the module function) of several layers as Python numbers, in one
    copy."""
    keys = ("max_vio", "dead_experts", "bias_norm")
    values = torch.stack([s[k].double() for s in stats for k in keys]).tolist() if stats else []
    out = []
    for i, s in enumerate(stats):
        row = dict(zip(keys, values[3 * i : 3 * i + 3]))
        row["dead_experts"] = int(row["dead_experts"])
        out.append({"loads": s["loads"], **row})
    return out


__all__ = [
    "KDAMoEExperts",
    "KDAMoEMLP",
    "KDAMoERouter",
    "KDAMoESparseMoeBlock",
    "QuantileHistogram",
    "apply_balancing",
    "balanced_bias",
    "loss_free_balance",
    "max_violation",
    "quantile_balance",
    "quantile_fixed_point",
    "selection_thresholds",
    "smoothed_bias",
    "situ_glu",
    "swiglu",
]

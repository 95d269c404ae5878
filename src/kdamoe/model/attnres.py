"""Attention Residuals: softmax attention over depth in place of the residual sum (docs/design.md §4).

A sublayer's input is a convex combination of *sources* (the token embedding, the summaries of completed
blocks, and the running partial sum of the current block):

    h = Σ_s softmax_s( w · RMSNorm_γ(V_s) ) · V_s          (per token, softmax over s in fp32)

with a learned pseudo-query `w` (zero-initialised: training starts from the uniform average) and a key-norm
gain `γ`. Values are mixed un-normalised. The stream of sources is held as a `ResidualState`, which also
covers the standard residual (`x + f(norm(x))`) so the decoder layer has one code path for every mode.

The sources are separate tensors, never stacked: `depth_attention` reads each once in the forward and keeps only
references to them and three `[S, B, T]` fp32 statistics for the backward, so a sublayer's depth attention costs
no copy of the sources (a stacked fp32 copy per sublayer would cost S times the residual stream's memory). With
``norm=(weight, eps)`` the kernels also apply the sublayer's RMSNorm, so the mix h itself is neither written nor kept
for the backward, which recomputes it from the sources.

A block's source is read by every later sublayer's depth attention. Each backward would return its own gradient
tensor of the source for autograd to add up (per reader after the first: the kernel writes a tensor, then an add reads
two and writes one); instead `ResidualState` marks each source with a gradient sink (`with_gradient_sink`), into which
every reader's backward adds its part in place (the kernels read and write the one buffer), and the sink hands the sum
to autograd once all readers are done. A partial sum p is also read by the add that forms the next one (p + output),
whose backward runs first: it lends its gradient to p's sink (`add_to_partial`), and the depth attention reading p
adds its part to the lent tensor out of place (other nodes hold it), so p's gradient costs no separate add either.
Where no gradient is recorded, or under torch.compile, sources are left unmarked and autograd sums as usual.

Dispatch: the Triton kernels of `attnres_triton.py` (each pass reads every source once; the torch code here reads
each about 5 times through fp32 temporaries) for CUDA sources when triton imports and the kernels take them (at most
`MAX_SOURCES` sources of one shape, each of a 16/32-bit float dtype, rows of at most `MAX_D`), else the torch code,
which is the reference and the CPU path. The output takes the first source's dtype. `backend="torch" | "triton"`
forces one (the tests run the kernels on CPU tensors under `TRITON_INTERPRET=1`).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .attnres_triton import depth_attention_bwd, depth_attention_fwd, unsupported
from .fused_norm import rms_norm, use_triton


def _wide(x):
    """fp32 (fp64 for fp64 inputs): the dtype of the softmax and of the mixing."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _source_logits(sources, u, eps):
    """``(logits, rstd)``, each ``[S, B, T]`` (fp32): ``rstd_s = rsqrt(mean(V_s²) + eps)``, ``logit_s = rstd_s (V_s · u)``."""
    rstd = torch.stack([torch.rsqrt(_wide(v).pow(2).mean(-1) + eps) for v in sources])
    dots = torch.stack([_wide(v) @ u for v in sources])
    return dots * rstd, rstd


def _use_kernels(backend, sources):
    """True to run the Triton kernels (module docstring); ``backend="triton"`` with sources they cannot take raises."""
    if not use_triton(backend, sources[0]):
        return False
    reason = unsupported(sources)
    if reason is not None and backend == "triton":
        raise ValueError(f"the depth attention kernels cannot take {reason}")
    return reason is None


def _forward_torch(sources, u, eps):
    """``(out, logits, rstd, weights)`` of the torch path (the reference of the kernels)."""
    logits, rstd = _source_logits(sources, u, eps)
    weights = logits.softmax(0)  # [S, B, T]
    out = weights[0, ..., None] * _wide(sources[0])
    # Under torch.compile out of place, and never a no-op `.to`: torch 2.11 gives an `autograd.Function` output that
    # an in-place op or a no-op `.to` produced a zero gradient.
    compiling = torch.compiler.is_compiling()
    for s in range(1, len(sources)):
        if compiling:
            out = out + weights[s, ..., None] * sources[s]
        else:
            out.addcmul_(weights[s, ..., None], sources[s])
    return out if out.dtype == sources[0].dtype else out.to(sources[0].dtype), logits, rstd, weights


def _backward_torch(dout, sources, u, logits, rstd, weights, needs_grad, accumulate, addend=None):
    """``(du [D], [dv_s or None])`` of the torch path; ``accumulate`` and ``addend`` as for `depth_attention_bwd`."""
    D = u.shape[0]
    dout = _wide(dout)
    g = torch.stack([(dout * v).sum(-1) for v in sources])  # [S, B, T]: ∂L/∂weight_s
    dlogit = weights * (g - (weights * g).sum(0, keepdim=True))  # through the softmax
    # logit = r (V · u), r = rsqrt(mean(V²) + eps): ∂logit/∂V = r u − r² logit V / D
    a, c = dlogit * rstd, dlogit * rstd * rstd * logits / D
    du = sum((a[s].reshape(-1) @ _wide(v).reshape(-1, D)) for s, v in enumerate(sources))
    dsources = []
    for s, v in enumerate(sources):
        if not needs_grad[s]:
            dsources.append(None)
            continue
        dv = weights[s, ..., None] * dout + a[s, ..., None] * u - c[s, ..., None] * _wide(v)
        if addend is not None and addend[0] == s:
            dv = dv + addend[1]
        dv = dv.to(v.dtype)
        dsources.append(dv if accumulate[s] is None else accumulate[s].add_(dv))
    return du, dsources


def _depth_attention_forward(query, key_norm_weight, eps, kernels, sources, norm=None, out_dtype=None):
    """``(out, logits, rstd, weights, rstd_h, sources)``: the forward of the kernels (``kernels``, as `_use_kernels`
    decided) or of the torch path, and what the backward needs. ``norm = (weight, eps)`` (the kernels only): out is
    ``RMSNorm_weight(h)`` of the mix h in ``out_dtype`` (None: the first source's), rstd_h its statistic; else rstd_h
    is None."""
    if kernels:
        sources = tuple(v.contiguous() for v in sources)  # a copy only for a non-contiguous source
        out, logits, rstd, weights, rstd_h = depth_attention_fwd(sources, query, key_norm_weight, eps, norm, out_dtype)
    else:  # w · (γ ⊙ x) = (w ⊙ γ) · x
        out, logits, rstd, weights = _forward_torch(sources, _wide(query) * _wide(key_norm_weight), eps)
        rstd_h = None
    return out, logits, rstd, weights, rstd_h, sources


class _GradientSink:
    """The gradient of one source, which every depth attention reading it adds to (`grad`: None until the first, in
    backward order, stores or lends its part). `owned`: `grad` is the sink's own buffer, added to in place; a lent
    gradient (`lend`) is also held by other nodes, so the next part is added to it out of place."""

    __slots__ = ("grad", "owned")

    def __init__(self):
        self.grad, self.owned = None, False

    def store(self, grad: torch.Tensor) -> None:
        """A reader's result, which includes what the sink held: the sink owns it."""
        self.grad, self.owned = grad, True

    def lend(self, grad: torch.Tensor) -> None:
        """A gradient that other nodes may still hold (never written in place)."""
        if self.grad is None:
            self.grad, self.owned = grad, False
        elif self.owned:
            self.grad.add_(grad)
        else:
            self.store(self.grad + grad)

    def take(self) -> torch.Tensor | None:
        grad, self.grad, self.owned = self.grad, None, False
        return grad


class _SummedGradient(torch.autograd.Function):
    """Identity on a source; its backward runs after every reader's (they all take its output) and hands autograd
    the sink's sum, plus any gradient that reached the output the usual way."""

    @staticmethod
    def forward(ctx, source, sink):
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # readers that used the sink return no gradient: no zeros to allocate
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        summed = ctx.sink.take()
        if grad is not None:
            summed = grad if summed is None else summed + grad
        return summed, None


class _AddToPartial(torch.autograd.Function):
    """``partial + output``, whose backward lends the sum's gradient to the partial's sink rather than returning it
    (module docstring)."""

    @staticmethod
    def forward(ctx, partial, output, sink):
        ctx.sink, ctx.dtypes = sink, (partial.dtype, output.dtype)
        return partial + output

    @staticmethod
    def backward(ctx, grad):
        ctx.sink.lend(grad.to(ctx.dtypes[0]))
        return None, grad.to(ctx.dtypes[1]), None


def add_to_partial(partial: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``partial + output`` (same shape); its gradient goes to ``partial``'s sink when it is marked."""
    sink = getattr(partial, "_gradient_sink", None)
    if sink is None or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return partial + output
    return _AddToPartial.apply(partial, output, sink)


def with_gradient_sink(source: torch.Tensor) -> torch.Tensor:
    """``source`` marked so that the depth attentions reading it sum its gradient in one buffer (module docstring);
    ``source`` itself when no gradient is recorded for it, or under torch.compile."""
    if not (torch.is_grad_enabled() and source.requires_grad) or torch.compiler.is_compiling():
        return source
    sink = _GradientSink()
    marked = _SummedGradient.apply(source, sink)
    marked._gradient_sink = sink
    return marked


def _lent_gradient(sinks, accumulate) -> tuple[int, torch.Tensor] | None:
    """``(s, gradient)`` of the one source whose sink holds a lent gradient (a partial sum's: there is at most one in a
    call), for the backward to add out of place; any other lent gradient is copied into ``accumulate``."""
    lent = [s for s, sink in enumerate(sinks) if sink is not None and sink.grad is not None and not sink.owned]
    for s in lent[1:]:
        accumulate[s] = sinks[s].grad.clone()
    return (lent[0], sinks[lent[0]].grad) if lent else None


class _DepthAttentionFunction(torch.autograd.Function):
    """``Σ_s softmax_s(logit_s) V_s`` with ``logit_s = RMSNorm_γ(V_s) · w``, or with a norm weight (the kernels only)
    ``RMSNorm_weight`` of it; saves the sources by reference (and never the mix h). ``sinks[s]``: None, or the
    `_GradientSink` that source s's gradient is added to (its gradient output is then None)."""

    @staticmethod
    def forward(ctx, query, key_norm_weight, norm_weight, eps, norm_eps, out_dtype, kernels, sinks, *sources):
        norm = None if norm_weight is None else (norm_weight, norm_eps)
        out, logits, rstd, weights, rstd_h, sources = _depth_attention_forward(
            query, key_norm_weight, eps, kernels, sources, norm, out_dtype)
        ctx.kernels = kernels
        ctx.norm_eps = norm_eps
        ctx.sinks = sinks
        ctx.save_for_backward(query, key_norm_weight, norm_weight, rstd_h, logits, rstd, weights, *sources)
        return out

    @staticmethod
    def backward(ctx, dout):
        query, gamma, norm_weight, rstd_h, logits, rstd, weights, *sources = ctx.saved_tensors
        sinks = ctx.sinks
        needs = [need or sink is not None for need, sink in zip(ctx.needs_input_grad[8:], sinks)]
        accumulate = [sink.grad if sink is not None and sink.owned else None for sink in sinks]
        addend = _lent_gradient(sinks, accumulate)
        if ctx.kernels:  # the parameters' gradients in their dtypes, from the kernels
            norm = None if norm_weight is None else (norm_weight, ctx.norm_eps)
            dquery, dgamma, dsources, dnorm = depth_attention_bwd(dout, sources, query, gamma, logits, rstd, weights,
                                                                  needs, norm, rstd_h, accumulate, addend)
        else:
            du, dsources = _backward_torch(dout, sources, _wide(query) * _wide(gamma), logits, rstd, weights, needs,
                                           accumulate, addend)
            dquery, dgamma, dnorm = (du * _wide(gamma)).to(query.dtype), (du * _wide(query)).to(gamma.dtype), None
        for s, sink in enumerate(sinks):  # the sink's sum so far, with this reader's part added
            if sink is not None:
                sink.store(dsources[s])
                dsources[s] = None
        needs_params = ctx.needs_input_grad[:3]
        return (dquery if needs_params[0] else None, dgamma if needs_params[1] else None,
                dnorm if needs_params[2] else None, None, None, None, None, None, *dsources)


class DepthAttention(nn.Module):
    """One pseudo-query attending over depth: S sources, each `[B, T, D]` (a sequence, or stacked `[S, B, T, D]`)
    -> `[B, T, D]`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.query = nn.Parameter(torch.empty(hidden_size))  # zero-initialised in `_init_weights`
        self.key_norm_weight = nn.Parameter(torch.empty(hidden_size))  # ones in `_init_weights`
        self.eps = eps

    def depth_weights(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """The softmax weights over sources, `[S, B, T]` in fp32 (also used for analysis and plots)."""
        u = _wide(self.query) * _wide(self.key_norm_weight)
        return _source_logits(tuple(sources), u, self.eps)[0].softmax(dim=0)

    def forward(self, sources: Sequence[torch.Tensor], backend: str | None = None,
                norm: tuple[torch.Tensor, float] | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``backend``: None (Triton kernels for CUDA sources they take), ``"torch"`` or ``"triton"``. ``norm =
        (weight [D], eps)``: return ``rms_norm(out, weight, eps)`` instead, in ``out_dtype`` (None: the first
        source's dtype), in one kernel with the mix each way when the kernels run (the mix is then never written nor
        kept for the backward), else as a separate op.

        Without gradients the forward runs outside the `autograd.Function`: nothing is saved, and torch.compile,
        which inlines such a call, binds the `*sources` of its forward wrongly when their count matches the
        number of its named parameters."""
        sources = tuple(sources)
        kernels = _use_kernels(backend, sources)
        if norm is not None and not kernels:
            return rms_norm(self._mix(sources, False, None), norm[0], norm[1], backend, out_dtype)
        return self._mix(sources, kernels, norm, out_dtype if norm is not None else None)

    def _mix(self, sources: tuple[torch.Tensor, ...], kernels: bool, norm: tuple[torch.Tensor, float] | None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
        params = (self.query, self.key_norm_weight) + ((norm[0],) if norm is not None else ())
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*params, *sources)):
            sinks = tuple(getattr(v, "_gradient_sink", None) for v in sources)
            return _DepthAttentionFunction.apply(self.query, self.key_norm_weight, None if norm is None else norm[0],
                                                 self.eps, None if norm is None else norm[1], out_dtype, kernels,
                                                 sinks, *sources)
        return _depth_attention_forward(self.query, self.key_norm_weight, self.eps, kernels, sources, norm,
                                        out_dtype)[0]


@dataclass
class ResidualState:
    """The residual stream between sublayers.

    `completed`: the sources of closed blocks (the embedding first), each `[B, T, D]` and marked by
    `with_gradient_sink`; empty in `standard` mode.
    `partial`: `[B, T, D]` running sum of the current block (None when the block is empty), marked too; in
    `standard` mode it is the residual stream `x` itself.
    """

    completed: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None

    @classmethod
    def start(cls, embeddings: torch.Tensor, mode: str) -> "ResidualState":
        if mode == "standard":
            return cls(completed=(), partial=embeddings)
        return cls(completed=(with_gradient_sink(embeddings),), partial=None)

    def sources(self) -> tuple[torch.Tensor, ...]:
        return self.completed if self.partial is None else (*self.completed, self.partial)

    def read(self, depth_attention: DepthAttention | None) -> torch.Tensor:
        """The input of the next sublayer: the residual stream, or depth attention over the sources."""
        if depth_attention is None:
            return self.partial
        return depth_attention(self.sources())

    def add(self, output: torch.Tensor, close_block: bool) -> "ResidualState":
        """Add a sublayer's output to the partial sum; closing the block turns the sum into a source. With depth
        attention (completed sources) the partial sum is marked with a gradient sink too."""
        partial = output if self.partial is None else add_to_partial(self.partial, output)
        if not self.completed:  # the standard residual
            return ResidualState(self.completed, partial)
        if close_block:
            return ResidualState((*self.completed, with_gradient_sink(partial)), None)
        return ResidualState(self.completed, with_gradient_sink(partial))


__all__ = ["DepthAttention", "ResidualState"]

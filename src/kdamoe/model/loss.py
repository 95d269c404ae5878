"""Chunked linear cross-entropy: the language-modelling loss without materialising fp32 `[N, V]` logits.

`linear_cross_entropy(hidden, weight, labels)` equals `F.cross_entropy((hidden @ weight.T).float(), labels)` but
walks the rows in chunks: each chunk's logits are computed in the weight's dtype (the autocast dtype under
autocast), upcast to fp32 for the log-softmax (fp64 weights stay fp64: the float64 references of the tests), and turned at once into that chunk's share of the loss and of the
gradients w.r.t. `hidden` and `weight`. The backward only scales the stored gradients by `grad_output`. Live
memory beyond the inputs: one chunk of logits, `grad_hidden [N, D]`, `grad_weight [V, D]` (fp32 while it
accumulates).

Labels outside `[0, V)` (other than `ignore_index`) are a `ValueError` when they are checked. Checking needs
their values on the host: free for CPU tensors, one host synchronisation for accelerator tensors. So
`validate=None` (the default) checks CPU labels only; accelerator labels are instead detected on the device,
without synchronising: an out-of-range label makes the loss and every gradient NaN (it never indexes out of
bounds). `validate=True` always checks (and synchronises on an accelerator); `validate=False` never raises.

On CUDA (triton installed) each chunk's logits stay in the GEMM's dtype and one Triton kernel (`loss_triton.py`)
computes the rows' losses and overwrites the logits with their gradient; elsewhere the torch code below, the
reference, upcasts the chunk to fp32. The logits are rounded to the same dtype either way, and the GEMMs that
consume their gradient take it in the same 16-bit dtype under autocast or with 16-bit weights.

Sizes: torch's indices are 64-bit, and so is the kernel's row offset (a `chunk_size` of more than 2^31 / V rows
puts a chunk's logits past 2^31); a default chunk holds about `CHUNK_LOGITS` logits (2^26), so only `hidden`,
`grad_hidden` and `grad_weight` pass 2^31 elements (1M rows x 4096, or a 256K x 8192 vocab projection).
"""

from __future__ import annotations

import torch

from .fused_norm import use_triton
from .loss_triton import KERNEL_DTYPES, cross_entropy_rows

# Rows per chunk when `chunk_size` is None: about this many logits a chunk (256 MiB in fp32).
CHUNK_LOGITS = 1 << 26


def _accumulate_product(acc, a, b):
    """``acc += a @ b``. On CUDA with a 16-bit ``a`` and an fp32 ``acc`` (the weight's gradient across chunks)
    the GEMM adds into acc in its epilogue (cuBLAS, ``out_dtype``): the fp32 sum of products is never rounded to
    16 bits, and no ``[V, D]`` product is written and read back by a separate add. Under torch.compile the plain
    expression (torch 2.11's fake-tensor rule for ``addmm(..., out_dtype=, out=)`` fails)."""
    fused = acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16)
    if fused and not torch.compiler.is_compiling():
        with torch.autocast("cuda", enabled=False):  # b in a's dtype, as autocast would cast it for a @ b
            torch.addmm(acc, a, b.to(a.dtype), out_dtype=torch.float32, out=acc)
    else:
        acc += a @ b


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, reduction, validate, backend):
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        wide = torch.promote_types(weight.dtype, torch.float32)  # the dtype of the log-softmax and the sums
        counted = labels != ignore_index
        in_range = (labels >= 0) & (labels < vocab)
        bad = counted & ~in_range
        if validate and bool(bad.any()):
            found = labels[bad]
            raise ValueError(
                f"`labels` hold {found.numel()} ids outside [0, vocab_size={vocab}) that are not ignore_index "
                f"({ignore_index}): min {int(found.min())}, max {int(found.max())}"
            )
        counted = counted & in_range
        target = torch.where(counted, labels, 0)
        # Gradient of the reduced loss w.r.t. one row's loss: 1/count for the mean (1 for the sum), 0 for rows that
        # do not count; NaN everywhere when a label is out of range, so a bad batch can never pass silently.
        if reduction == "mean":
            scale = 1.0 / counted.sum().clamp(min=1).to(wide)
        else:
            scale = torch.ones((), dtype=wide, device=labels.device)
        scale = scale + torch.where(bad.any(), float("nan"), 0.0)
        row_scale = counted.to(wide) * scale

        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_weight else None
        loss_sum = torch.zeros((), dtype=wide, device=hidden.device)
        kernel = use_triton(backend, hidden)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, min(start + chunk_size, num_rows))
            h = hidden[rows].to(weight.dtype)
            grad = need_hidden or need_weight
            if kernel:  # one pass for the loss and, in place, d loss / d logits (loss_triton.py)
                logits = h @ weight.T  # [C, V] in the GEMM's dtype
                row_loss = cross_entropy_rows(logits, target[rows], row_scale[rows] if grad else None)
                loss_sum += torch.where(counted[rows], row_loss, 0.0).sum()
                grad_logits = logits
            else:
                logits = (h @ weight.T).to(wide)  # [C, V]
                lse = torch.logsumexp(logits, dim=-1)
                tgt = target[rows]
                picked = logits.gather(1, tgt[:, None]).squeeze(1)
                loss_sum += torch.where(counted[rows], lse - picked, 0.0).sum()
                if grad:
                    # d loss / d logits = (softmax - onehot(target)) * row_scale, in place over the fp32 logits
                    probs = logits.sub_(lse[:, None]).exp_()
                    probs.scatter_add_(1, tgt[:, None], torch.full_like(lse[:, None], -1.0))
                    grad_logits = torch.empty(probs.shape, dtype=weight.dtype, device=probs.device)
                    torch.mul(probs, row_scale[rows, None], out=grad_logits)  # scaled and cast in one pass
            if not grad:
                continue
            if need_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if need_weight:
                _accumulate_product(grad_weight, grad_logits.T, h)
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss_sum * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Always multiply: testing grad_output == 1 first would synchronise with the device.
        return (
            None if grad_hidden is None else grad_hidden * grad_output,
            None if grad_weight is None else grad_weight * grad_output,
            None, None, None, None, None, None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "mean",
    validate: bool | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Cross-entropy of the logits `hidden @ weight.T` against `labels`, chunked over rows.

    Args:
        hidden: `[N, D]` final hidden states. weight: `[V, D]` output projection (may be the tied input
            embedding: its gradient then adds to the embedding's). labels: `[N]` int64 target ids.
        ignore_index: label of rows that do not count.
        chunk_size: rows per chunk; None picks about `CHUNK_LOGITS` logits a chunk.
        reduction: `"mean"` over the counted rows (0, with zero gradients, when none counts) or `"sum"`.
        validate: check labels for ids outside `[0, V)`; None checks CPU labels only (see the module docstring).
        backend: None (the Triton kernel of `loss_triton.py` for CUDA tensors when triton imports), `"torch"` or
            `"triton"` (the tests run the kernel on CPU tensors under `TRITON_INTERPRET=1`).
    Returns:
        scalar loss, fp32 (fp64 for fp64 weights).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"`labels` has shape {tuple(labels.shape)}, expected ({hidden.shape[0]},)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size is None:
        chunk_size = max(1, CHUNK_LOGITS // weight.shape[0])
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be positive, got {chunk_size}")
    if validate is None:
        validate = labels.device.type == "cpu"
    if weight.dtype not in KERNEL_DTYPES:  # fp64: the torch code
        if backend == "triton":
            raise ValueError(f"the cross-entropy kernel takes {KERNEL_DTYPES} weights, got {weight.dtype}")
        backend = "torch"
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size, reduction, validate, backend)


__all__ = ["linear_cross_entropy"]

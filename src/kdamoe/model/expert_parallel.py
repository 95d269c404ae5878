"""Expert parallelism: the routed experts of every MoE layer sharded across the ranks of a process group.

Rank e of a group of P holds experts ``[e·E/P, (e+1)·E/P)`` of each layer (``shard_experts``); the router, shared
experts and everything else stay whole on every rank, and each rank routes its own tokens. A layer's forward sends
each (token, slot) to the rank holding its expert with one ``all_to_all_single`` (the split sizes first, one small
exchange of ``[E]`` counts, read on the host), runs the local experts on what it received (sorted by expert: the
grouped GEMMs on CUDA in bf16, else a loop, ``KDAMoEExperts.forward_sorted``), and sends the results back with a
second all-to-all; the source rank weights them by the routing weights and sums each token's slots. Each all-to-all's
backward is the reverse all-to-all, so the expert weights' gradients hold every rank's tokens' contributions and the
router's and the tokens' their own.

Gradients, under data parallelism over the same ranks (each rank's loss its own tokens' mean, gradients averaged):
a replicated parameter's gradient is averaged as usual; an expert's gradient on its rank is already the sum over the
group's ranks' losses, so it takes ``1 / (data-parallel world)`` and a sum over the ranks holding the same shard
(``expert_gradients``), and data parallelism must leave the expert weights alone.

Quantile Balancing is unchanged: the router sees every rank's own tokens, and the statistics are all-reduced over
every rank (the default group), so every rank sets the same biases.
"""

import dataclasses

import torch
import torch.distributed as dist

from .context_parallel import RankGroup


@dataclasses.dataclass(frozen=True)
class ExpertParallel(RankGroup):
    """The process group whose ranks share the routed experts (None: the default group), expert shard = rank."""


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` sent in blocks of ``send`` rows to the ranks in order, ``receive`` rows arriving from each; the
    backward sends the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def dispatch(experts, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """``KDAMoEExperts.forward`` with its experts sharded (``experts.expert_parallel``): ``hidden [N, D]`` this rank's
    tokens, ``top_k_index`` global expert ids ``[N, k]``, ``top_k_weights [N, k]`` -> ``[N, D]``."""
    parallel = experts.expert_parallel
    group, ranks = parallel.group, parallel.size
    local = experts.gate_up_proj.shape[0]
    top_k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, so by destination rank
    counts = torch.bincount(flat, minlength=experts.num_experts)  # [E] rows for each expert
    arriving = torch.empty_like(counts)  # [P, local]: rows from each rank for each local expert
    dist.all_to_all_single(arriving, counts, group=group)
    send = counts.view(ranks, local).sum(1).tolist()
    receive = arriving.view(ranks, local).sum(1).tolist()
    x = _AllToAll.apply(hidden[order // top_k], send, receive, group)  # [M, D], by source rank, then expert
    expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ranks), arriving.view(-1))
    by_expert = torch.argsort(expert_of, stable=True)
    arrival = torch.empty_like(by_expert)
    arrival[by_expert] = torch.arange(len(by_expert), device=x.device)
    y = experts.forward_sorted(x[by_expert], arriving.view(ranks, local).sum(0))[arrival]
    back = _AllToAll.apply(y, receive, send, group)  # [N·k, D] in `order`
    weights = top_k_weights.reshape(-1)[order].to(back.dtype)
    return hidden.new_zeros(hidden.shape).index_add(0, order // top_k, back * weights[:, None])


def shard_experts(model: torch.nn.Module, parallel: ExpertParallel) -> torch.nn.Module:
    """Keep on this rank only its experts of every MoE layer of ``model`` (in place, new parameters: build the
    optimizer after; the same full weights on every rank beforehand, e.g. one seed). A ValueError when the group's
    size does not divide the number of experts."""
    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "expert_parallel"):
            if module.expert_parallel is not None:
                raise ValueError("the experts are sharded already")
            if module.num_experts % parallel.size:
                raise ValueError(f"{parallel.size} expert-parallel ranks do not divide the {module.num_experts} "
                                 "experts of a layer")
            local = module.num_experts // parallel.size
            mine = slice(parallel.rank * local, (parallel.rank + 1) * local)
            for name in ("gate_up_proj", "down_proj"):
                setattr(module, name, torch.nn.Parameter(getattr(module, name).data[mine].clone()))
            module.expert_parallel = parallel
    return model


def gather_experts(model: torch.nn.Module) -> torch.nn.Module:
    """The inverse of ``shard_experts``: every rank holds every expert again (in place; a collective)."""
    for module in _sharded(model):
        parallel = module.expert_parallel
        for name in ("gate_up_proj", "down_proj"):
            shard = getattr(module, name).data.contiguous()
            parts = [torch.empty_like(shard) for _ in range(parallel.size)]
            dist.all_gather(parts, shard, group=parallel.group)
            setattr(module, name, torch.nn.Parameter(torch.cat(parts)))
        module.expert_parallel = None
    return model


def _sharded(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "expert_parallel", None) is not None]


def expert_parameter_names(model: torch.nn.Module) -> list[str]:
    """The names of the sharded expert weights (for DDP to ignore)."""
    return [f"{name}.{leaf}" for name, module in model.named_modules()
            if getattr(module, "expert_parallel", None) is not None for leaf in ("gate_up_proj", "down_proj")]


def expert_gradients(model: torch.nn.Module, data_world: int, replicas=None) -> None:
    """Scale the sharded experts' gradients for data parallelism over ``data_world`` ranks (module docstring):
    summed over ``replicas`` (the group of ranks holding the same shard, None when each shard lives on one rank),
    divided by ``data_world``."""
    for module in _sharded(model):
        for param in (module.gate_up_proj, module.down_proj):
            if param.grad is not None:
                if replicas is not None:
                    dist.all_reduce(param.grad, group=replicas)
                param.grad /= data_world


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model across the expert-parallel ranks: the replicated
    gradients (the same on every rank) once, each expert shard's once (summed over the group), so every rank scales
    by the same factor. Returns the total norm."""
    sharded = {id(p) for m in _sharded(model) for p in (m.gate_up_proj, m.down_proj)}
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = torch.zeros(2, dtype=torch.float64, device=grads[0].device)  # [replicated, sharded]
    for p in model.parameters():
        if p.grad is not None:
            squares[int(id(p) in sharded)] += p.grad.double().pow(2).sum()
    if sharded:
        shard_sum = squares[1:].clone()
        dist.all_reduce(shard_sum, group=_sharded(model)[0].expert_parallel.group)
        squares[1:] = shard_sum
    total = squares.sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return total.float()


__all__ = ["ExpertParallel", "clip_grad_norm_", "dispatch", "expert_gradients", "expert_parameter_names",
           "gather_experts", "shard_experts"]

"""Expert parallelism (`kdamoe.model.expert_parallel`), the routed experts sharded across gloo ranks on the CPU,
against the unsharded block and model in one process, in float64: outputs, gradients, Quantile Balancing's biases
(identical on every rank and equal to the single process's), and the gradients of data parallelism over the same
ranks. On two GPUs: NCCL and the grouped GEMMs."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import tiny_config
from kdamoe import KDAMoEForCausalLM
from kdamoe.model.expert_parallel import ExpertParallel, expert_gradients, expert_parameter_names, shard_experts
from kdamoe.model.moe import KDAMoESparseMoeBlock


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close(got, want, rtol=1e-10):
    return float((got - want).detach().norm()) <= rtol * float(want.detach().norm()) + 1e-13


def make_block(seed=0):
    torch.manual_seed(seed)
    block = KDAMoESparseMoeBlock(tiny_config(num_experts=8, num_experts_per_tok=2)).double().train()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


def block_inputs(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(world, 6, 32, generator=g, dtype=torch.float64)  # rank r's tokens: row r
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def block_step(block, x, cotangent):
    x = x.clone().requires_grad_()
    out, _, _ = block(x)
    (out * cotangent).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    stats = block.apply_balancing()
    return out.detach(), x.grad, grads, block.router.bias.clone(), stats["loads"]


def block_case(rank, world):
    """The unsharded block on every rank's tokens (before the process group exists), then the sharded one."""
    x, cotangent = block_inputs(world)
    ref = block_step(make_block(), x, cotangent)
    yield
    block = shard_experts(make_block(), ExpertParallel())
    assert block.experts.gate_up_proj.shape[0] == 8 // world
    out, dx, grads, bias, loads = block_step(block, x[rank:rank + 1], cotangent[rank:rank + 1])
    assert close(out, ref[0][rank:rank + 1]) and close(dx, ref[1][rank:rank + 1])
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    for name, grad in grads.items():
        if name.startswith("experts."):  # this rank's experts: every rank's tokens reached them
            assert close(grad, ref[2][name][local]), name
        else:  # replicated: each rank's share, summed over the ranks
            dist.all_reduce(grad)
            assert close(grad, ref[2][name]), name
    assert torch.equal(bias, ref[3]) and bias.abs().sum() > 0  # balancing over every rank's tokens
    assert torch.equal(loads, ref[4])


def make_model():
    torch.manual_seed(0)
    return KDAMoEForCausalLM(tiny_config(fuse_linear_cross_entropy=True)).double().train()


def model_case(rank, world):
    """Data parallelism over the expert-parallel ranks: each rank its own row and loss, replicated gradients averaged
    (as DDP does), expert gradients through `expert_gradients`: the single process's gradients of the rows' mean
    loss."""
    ids = torch.randint(3, 97, (world, 12), generator=torch.Generator().manual_seed(2))
    ref_model = make_model()
    ref_model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    yield
    model = shard_experts(make_model(), ExpertParallel())
    assert len(expert_parameter_names(model)) == 2 * sum(layer.is_moe for layer in model.model.layers)
    model(input_ids=ids[rank:rank + 1], labels=ids[rank:rank + 1]).loss.backward()
    expert_gradients(model, data_world=world)
    local = slice(rank * 8 // world, (rank + 1) * 8 // world)
    sharded = set(expert_parameter_names(model))
    for name, p in model.named_parameters():
        if name in sharded:
            assert close(p.grad, ref[name][local]), name
        else:
            dist.all_reduce(p.grad)
            assert close(p.grad / world, ref[name]), name
    with pytest.raises(ValueError, match="sharded across ranks"):
        model.save_pretrained("unused")


def worker(rank, world, port):
    torch.set_num_threads(1)
    cases = [block_case(rank, world), model_case(rank, world)]
    for case in cases:
        next(case)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in cases:
            next(case, None)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_experts_equal_the_unsharded_block_and_model(world):
    mp.spawn(worker, args=(world, free_port()), nprocs=world, join=True)


def test_sorted_rows_through_the_grouped_gemms_equal_the_loop(monkeypatch):
    """`forward_sorted`, what a rank runs on the rows it received: its grouped-GEMM branch (CUDA bf16 in use; here
    through `_grouped_linear`'s loop in float64) against the expert loop, outputs and gradients."""
    experts = make_block().experts
    counts = torch.tensor([3, 0, 2, 5, 0, 1, 0, 4])
    x = torch.randn(int(counts.sum()), 32, dtype=torch.float64)
    cotangent = torch.randn_like(x)

    def run():
        rows = x.clone().requires_grad_()
        out = experts.forward_sorted(rows, counts)
        grads = torch.autograd.grad((out * cotangent).sum(), [rows, experts.gate_up_proj, experts.down_proj])
        return out, grads

    loop = run()
    monkeypatch.setattr(type(experts), "grouped_dtype", lambda self, hidden: hidden.dtype)
    grouped = run()
    assert close(grouped[0], loop[0], 1e-12)
    assert all(close(g, r, 1e-12) for g, r in zip(grouped[1], loop[1]))


def test_experts_that_do_not_divide_are_refused():
    block = make_block()
    with pytest.raises(ValueError, match="3 expert-parallel ranks do not divide the 8 experts"):
        shard_experts(block, type("Three", (), {"size": 3, "rank": 0})())


def gpu_worker(rank, world, port):
    """NCCL, one GPU a rank, bf16: the sharded block (its experts as grouped GEMMs) against the unsharded one on
    this rank's GPU."""
    torch.cuda.set_device(rank)
    x, cotangent = (t.cuda().bfloat16() for t in block_inputs(world))
    ref = block_step(make_block().cuda().bfloat16(), x, cotangent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        block = shard_experts(make_block().cuda().bfloat16(), ExpertParallel())
        assert block.experts.grouped_dtype(x) == torch.bfloat16
        out, dx, grads, bias, _ = block_step(block, x[rank:rank + 1], cotangent[rank:rank + 1])
        assert close(out.double(), ref[0][rank:rank + 1].double(), 2e-2)
        local = slice(rank * 8 // world, (rank + 1) * 8 // world)
        for name, grad in grads.items():
            want = ref[2][name][local] if name.startswith("experts.") else ref[2][name]
            if not name.startswith("experts."):
                dist.all_reduce(grad)
            assert close(grad.double(), want.double(), 5e-2), name
        biases = [torch.empty_like(bias) for _ in range(world)]
        dist.all_gather(biases, bias)
        assert all(torch.equal(b, bias) for b in biases)  # identical on every rank
        assert torch.allclose(bias, ref[3], atol=1e-3)  # the router's fp32 logits of other GEMM shapes
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_two_ranks_nccl_grouped_experts_equal_the_unsharded_block():
    mp.spawn(gpu_worker, args=(2, free_port()), nprocs=2, join=True)

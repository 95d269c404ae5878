"""Context parallelism (`kdamoe.context_parallel`): a sequence split across gloo ranks on the CPU gives the
single-process outputs, final state and gradients, in float64 (the torch KDA path), for batches, packed documents
crossing rank boundaries (and starting on one), an initial state, and the gate and L2 norm inside the op."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdamoe.model import kda
from kdamoe.context_parallel import context_parallel_kda, gather_sequence, previous_tail

H, K, V = 2, 8, 6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return {"q": r(B, T, H, K), "k": r(B, T, H, K), "v": r(B, T, H, V), "g": r(B, T, H, K),
            "beta": torch.rand(B, T, H, generator=g, dtype=torch.float64)}


OP_KW = {"use_gate_in_kernel": True, "use_qk_l2norm_in_kernel": True, "A_log": torch.zeros(H, dtype=torch.float64),
         "dt_bias": torch.linspace(-1, 1, H * K, dtype=torch.float64), "lower_bound": -5.0, "backend": "torch"}


def local_documents(cu, lo, hi):
    """This rank's cu_seqlens (tokens [lo, hi) of a packed row) and whether its first token continues a document."""
    inside = [c - lo for c in cu if lo < c < hi]
    return torch.tensor([0, *inside, hi - lo]), lo == 0 or lo not in cu


def run_case(rank, splits, B, cu, with_h0, seed):
    lo, hi = splits[rank], splits[rank + 1]
    T = splits[-1]
    full = inputs(B, T, seed)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) \
        if with_h0 else None
    cot = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    # single process, whole sequence
    ref = {n: t.clone().requires_grad_() for n, t in full.items()}
    ref_h0 = None if h0 is None else h0.clone().requires_grad_()
    cu_full = None if cu is None else torch.tensor(cu)
    init = ref_h0
    if cu is not None and ref_h0 is not None:  # the state enters the first document only
        init = torch.cat([ref_h0, ref_h0.new_zeros(len(cu) - 2, H, K, V)])
    o_ref, s_ref = kda.chunk_kda(*ref.values(), initial_state=init, output_final_state=True, cu_seqlens=cu_full,
                                 **OP_KW)
    (o_ref * cot).sum().backward()
    # this rank's part
    mine = {n: t[:, lo:hi].clone().requires_grad_() for n, t in full.items()}
    my_h0 = None if h0 is None else h0.clone().requires_grad_()
    local_cu, continues = (None, True) if cu is None else local_documents(cu, lo, hi)
    o, state = context_parallel_kda(kda.chunk_kda, *mine.values(), initial_state=my_h0, output_final_state=True,
                                    cu_seqlens=local_cu, continues=continues, **OP_KW)
    (o * cot[:, lo:hi]).sum().backward()
    torch.testing.assert_close(o, o_ref[:, lo:hi], rtol=1e-10, atol=1e-10)
    last = s_ref if cu is None else s_ref[-1:]
    torch.testing.assert_close(state, last, rtol=1e-10, atol=1e-10)
    for n in mine:
        torch.testing.assert_close(mine[n].grad, ref[n].grad[:, lo:hi], rtol=1e-9, atol=1e-10, msg=n)
    if h0 is not None:  # every rank's part of dh0, summed over the ranks
        grad = my_h0.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref_h0.grad, rtol=1e-9, atol=1e-10)


def run_helpers(rank, world):
    """`gather_sequence` and `previous_tail` (the attention and conv exchanges) and their gradients."""
    x = torch.arange(world * 4 * 3, dtype=torch.float64).view(1, world * 4, 3)
    part = x[:, rank * 4:(rank + 1) * 4].clone().requires_grad_()
    whole = gather_sequence(part)
    torch.testing.assert_close(whole, x)
    tail = previous_tail(part, 2)
    want = x[:, rank * 4 - 2:rank * 4] if rank > 0 else torch.zeros(1, 2, 3, dtype=torch.float64)
    torch.testing.assert_close(tail, want)
    (whole.sum() + 10 * tail.sum()).backward()
    # every rank's sum of `whole` reaches each element once per rank; the next rank's tail reads my last 2 rows
    expected = torch.full_like(part, float(world))
    if rank < world - 1:
        expected[:, -2:] += 10
    torch.testing.assert_close(part.grad, expected)


def worker(rank, world, port, cases):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        run_helpers(rank, world)
        for case in cases:
            run_case(rank, **case)
    finally:
        dist.destroy_process_group()


def spawn(world, cases):
    mp.spawn(worker, args=(world, free_port(), cases), nprocs=world, join=True)


def test_three_ranks_batches_and_packed_documents():
    spawn(3, [
        # a batch of 2 rows, unequal parts, with and without an initial state
        {"splits": [0, 5, 12, 16], "B": 2, "cu": None, "with_h0": False, "seed": 0},
        {"splits": [0, 70, 75, 140], "B": 2, "cu": None, "with_h0": True, "seed": 1},  # parts over a 64-token chunk
        # packed documents: one crossing two boundaries, one starting on a boundary, an initial state
        {"splits": [0, 6, 14, 20], "B": 1, "cu": [0, 4, 14, 17, 20], "with_h0": True, "seed": 2},
        {"splits": [0, 6, 14, 20], "B": 1, "cu": [0, 3, 20], "with_h0": False, "seed": 3},
    ])

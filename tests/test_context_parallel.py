"""Context parallelism (`kdamoe.model.context_parallel`), rows split across gloo ranks on the CPU against one
process, in float64 on the torch path: the KDA op (outputs, final state, gradients; batches, packed documents
crossing rank boundaries and starting on one, an initial state, the gate and L2 norm inside the op) and the whole
model (logits, loss, group-averaged parameter gradients, Quantile Balancing's biases; all-KDA, the hybrid with
attention, MoE and Block AttnRes, packed documents, padding). On two GPUs: NCCL and the Triton kernels."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kdamoe.model import kda
from kdamoe.model.context_parallel import context_parallel_kda, gather_sequence, previous_tail

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


# ---------------------------------------------------------------------------------------------------------------------
# The model: `KDAMoEForCausalLM(..., context_parallel=ContextParallel(group))` against the single process
# ---------------------------------------------------------------------------------------------------------------------

ALL_KDA = {"layer_types": ["linear_attention"] * 3, "mlp_layer_types": ["dense"] * 3, "num_hidden_layers": 3,
           "residual_mode": "standard"}
HYBRID = {}  # conftest's tiny config: KDA, KDA, attention, KDA; MoE in layers 1-3 (Quantile Balancing); Block AttnRes


def model_batch(rows, length, starts, seed, padding=None):
    """Token ids, position_ids (restarting at the documents' `starts` per row; None without) and labels (-100 at
    document starts), as kdamoe-train builds packed rows; with `padding` (left-padded tokens per row) also an
    attention mask (labels -100 there)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (rows, length), generator=g)
    if padding is not None:
        mask = (torch.arange(length) >= torch.tensor(padding)[:, None]).long()
        return ids, None, torch.where(mask.bool(), ids, -100), mask
    if starts is None:
        return ids, None, ids.clone()
    first = torch.zeros(rows, length, dtype=torch.bool)
    for row, columns in enumerate(starts):
        first[row, columns] = True
    first[:, 0] = True
    columns = torch.arange(length)
    positions = columns - torch.where(first, columns, 0).cummax(1).values
    return ids, positions, torch.where(first, -100, ids)


def make_model(overrides, seed=0):
    from conftest import tiny_config
    from kdamoe import KDAMoEForCausalLM

    torch.manual_seed(seed)
    return KDAMoEForCausalLM(tiny_config(fuse_linear_cross_entropy=True, **overrides)).double().train()


def model_step(model, ids, positions, labels, mask=None, **kwargs):
    """(loss, logits, {name: grad}, {layer: router bias after the balancing update}, scoring loss) of one training
    step; the scoring loss is the eval-mode forward's (transformers' fp32 cross-entropy of the logits)."""
    if mask is not None:
        kwargs["attention_mask"] = mask
    loss = model(input_ids=ids, position_ids=positions, labels=labels, **kwargs).loss
    loss.backward()
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, **kwargs).logits
        scored = model.eval()(input_ids=ids, position_ids=positions, labels=labels, **kwargs).loss
    model.train()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    model.apply_load_balancing()
    biases = {i: layer.ffn.router.bias.clone() for i, layer in enumerate(model.model.layers) if layer.is_moe}
    return loss.detach(), logits, grads, biases, scored


def close(got, want, rtol=1e-9):
    return float((got - want).norm()) <= rtol * float(want.norm()) + 1e-13


def run_model_cases(rank, world, cases):
    """Each case: the single-process step (computed before the process group exists, so its balancing reduces over
    nothing), then the context-parallel step on this rank's columns."""
    from kdamoe.model.context_parallel import ContextParallel

    references = []
    for case in cases:
        model = make_model(case["config"])
        references.append(model_step(model, *model_batch(**case["batch"])))
    yield  # the process group is created here
    for case, (loss, logits, grads, biases, scored) in zip(cases, references):
        ids, positions, labels, *mask = model_batch(**case["batch"])
        part = ids.shape[1] // world
        mine = slice(rank * part, (rank + 1) * part)
        model = make_model(case["config"])
        got = model_step(model, ids[:, mine], None if positions is None else positions[:, mine], labels[:, mine],
                         *(m[:, mine] for m in mask), context_parallel=ContextParallel())
        assert close(got[0], loss, 1e-12), (case, float(got[0]), float(loss))
        assert close(got[1], logits[:, mine]), case
        for name, grad in got[2].items():  # each rank's share; data parallelism averages them over the ranks
            dist.all_reduce(grad)
            assert close(grad / world, grads[name]), (case, name)
        for layer, bias in got[3].items():  # Quantile Balancing reduces over every rank that saw tokens
            assert torch.equal(bias, biases[layer]) and bias.abs().sum() > 0, (case, layer)
        torch.testing.assert_close(got[4], scored, rtol=1e-6, atol=0)


def model_worker(rank, world, port, cases):
    torch.set_num_threads(1)
    steps = run_model_cases(rank, world, cases)
    next(steps)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        next(steps, None)
    finally:
        dist.destroy_process_group()


def test_model_two_ranks_all_kda_and_hybrid():
    """2 ranks: an all-KDA model over rows longer than a KDA chunk per rank; the hybrid on a batch of whole rows, and
    on left-padded rows (one padded past the rank boundary) with an attention mask."""
    mp.spawn(model_worker, args=(2, free_port(), [
        {"config": ALL_KDA, "batch": {"rows": 2, "length": 140, "starts": None, "seed": 0}},
        {"config": HYBRID, "batch": {"rows": 2, "length": 16, "starts": None, "seed": 1}},
        {"config": HYBRID, "batch": {"rows": 2, "length": 16, "starts": None, "seed": 3, "padding": [3, 10]}},
    ]), nprocs=2, join=True)


def test_model_three_ranks_packed_documents_cross_rank_boundaries():
    """3 ranks, the hybrid model on packed rows: documents crossing one and two rank boundaries, one starting on a
    boundary, one of a single token."""
    mp.spawn(model_worker, args=(3, free_port(), [
        {"config": HYBRID, "batch": {"rows": 2, "length": 24, "starts": [[5, 8, 17], [16, 21, 22]], "seed": 2}},
    ]), nprocs=3, join=True)


def gpu_worker(rank, world, port):
    """NCCL, one GPU a rank, the Triton kernels (fp32 with tf32 dots): the context-parallel hybrid (dense FFNs, so
    that no near-tie in routing flips an expert) on packed rows against the whole rows on this rank's GPU."""
    torch.cuda.set_device(rank)
    config = {"mlp_layer_types": ["dense"] * 4, "router_balancing": "none"}
    ids, positions, labels = model_batch(rows=2, length=300, starts=[[70, 150, 151], [149]], seed=4)

    def step(model, ids, positions, labels, **kwargs):
        loss = model(input_ids=ids.cuda(), position_ids=positions, labels=labels.cuda(), **kwargs).loss
        loss.backward()
        with torch.no_grad():
            logits = model(input_ids=ids.cuda(), position_ids=positions, **kwargs).logits
        return loss.detach(), logits, {n: p.grad for n, p in model.named_parameters()}

    ref = step(make_model(config).float().cuda(), ids, positions, labels)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        from kdamoe.model.context_parallel import ContextParallel

        mine = slice(rank * 150, (rank + 1) * 150)
        got = step(make_model(config).float().cuda(), ids[:, mine], positions[:, mine], labels[:, mine],
                   context_parallel=ContextParallel())
        assert abs(float(got[0] - ref[0])) <= 1e-4 * float(ref[0])
        assert (got[1] - ref[1][:, mine]).norm() <= 5e-3 * ref[1][:, mine].norm()
        for name, grad in got[2].items():
            dist.all_reduce(grad)
            assert (grad / world - ref[2][name]).norm() <= 2e-2 * ref[2][name].norm() + 1e-6, name
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_two_ranks_nccl_triton_equal_one_gpu():
    mp.spawn(gpu_worker, args=(2, free_port()), nprocs=2, join=True)

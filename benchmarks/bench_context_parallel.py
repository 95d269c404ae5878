"""A training step of one long row split across the GPUs of one host (context parallelism) against one GPU.

    torchrun --standalone --nproc_per_node 2 benchmarks/bench_context_parallel.py \
        --out benchmarks/results/context_parallel_2xh200.json
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_context_parallel.py --tiny   # smoke run (gloo on CPU)

The model is bench_model.py's twin (226M: all-KDA, hidden 1024, 12 layers, 8 heads of 128, dense MLP of 2816, bf16
weights; `--tiny`: its tiny sizes in fp32 on the CPU), a step what bench_long_context.py's `train` part does:
forward with labels of one row of `--length` random tokens (2^20; 1024 with `--tiny`), activation checkpointing,
backward, AdamW, `apply_load_balancing`. First rank 0 alone runs the whole row on its GPU (the one-GPU baseline;
`--no-single` skips it), then every rank runs its `1/N` of the row with `context_parallel=ContextParallel()` (the
default group: the N processes of the launch) and the gradients averaged over the ranks with one all-reduce of each
(what DDP does). Per setting: seconds of a step after an untimed one (the device synchronised around it, the slowest
rank's), tokens/s, the largest peak allocated memory of a rank (weights, gradients, AdamW state, activations) and
the loss of the timed step (the same in both settings, to bf16 rounding: one row, the same weights after one step).
Targets (issue 32): memory per GPU <= 0.55 x one GPU's, tokens/s >= 1.7 x one GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import bench_model
import kdamoe
from kdamoe.evaluate import Resources
from kdamoe.model.context_parallel import ContextParallel


def make_step(s: dict, length: int, device, dtype, context_parallel: ContextParallel | None):
    """A function running one training step of the twin on this rank's part of the row."""
    row = bench_model.Row("long", 1, length, checkpointing=True)
    torch.manual_seed(0)
    with device:
        model = kdamoe.KDAMoEForCausalLM(bench_model.ours_config(row, s))
    model.to(dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, s["vocab"], (1, length), generator=torch.Generator().manual_seed(1)).to(device)
    if context_parallel is not None:
        part = length // context_parallel.size
        ids = ids[:, context_parallel.rank * part:(context_parallel.rank + 1) * part]

    def step():
        loss = model(input_ids=ids, labels=ids, context_parallel=context_parallel).loss
        loss.backward()
        if context_parallel is not None:  # each rank's share, averaged (gloo has no AVG)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= context_parallel.size
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.apply_load_balancing(to_host=False)
        return loss.detach()

    return step, sum(p.numel() for p in model.parameters())


def timed(step, device) -> dict:
    step()
    with Resources(device) as used:
        loss = step()
    return {"seconds": used.seconds, "peak_gib": used.peak_gib, "loss": float(loss)}


def slowest(figures: dict, device) -> dict:
    """The largest seconds and peak memory over the ranks."""
    values = torch.tensor([figures["seconds"], figures["peak_gib"] or 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {**figures, "seconds": float(values[0]), "peak_gib": float(values[1]) if figures["peak_gib"] else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=None, help="tokens of the row (2^20; 1024 with --tiny)")
    p.add_argument("--tiny", action="store_true", help="bench_model's tiny sizes, fp32 on the CPU")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default benchmarks/results/context_parallel_2xh200.json; none with --tiny)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    s = bench_model.sizes(args.tiny)
    length = args.length or (1024 if args.tiny else 1 << 20)
    world, rank = dist.get_world_size(), dist.get_rank()
    if length % world:
        p.error(f"--length {length} is not a multiple of the {world} processes")
    report = {"environment": bench_model.environment(device, "not used"), "dtype": str(dtype).removeprefix("torch."),
              "tiny": args.tiny, "tokens": length, "ranks": world}
    if not args.no_single:
        if rank == 0:
            step, report["parameters"] = make_step(s, length, device, dtype, None)
            report["single"] = timed(step, device)
            del step
            bench_model.free_memory(device)
        dist.barrier()
    step, report["parameters"] = make_step(s, length, device, dtype, ContextParallel())
    report["split"] = slowest(timed(step, device), device)
    for key in ("single", "split"):
        if key in report:
            report[key]["tokens_per_second"] = length / report[key]["seconds"]
    if "single" in report:
        single, split = report["single"], report["split"]
        report["speedup"] = split["tokens_per_second"] / single["tokens_per_second"]
        report["memory_ratio"] = split["peak_gib"] / single["peak_gib"] if single["peak_gib"] else None
        report["targets"] = {"speedup >= 1.7": report["speedup"] >= 1.7,
                             "memory per GPU <= 0.55x": None if report["memory_ratio"] is None
                             else report["memory_ratio"] <= 0.55}
    out = args.out or (None if args.tiny else Path("benchmarks/results/context_parallel_2xh200.json"))
    if rank == 0:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

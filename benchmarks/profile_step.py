"""Where one training step of a preset spends its time: torch.profiler over forward + backward + optimizer step.

    python benchmarks/profile_step.py --preset small --rows 16 --seq-len 2048      # on the GPU (bf16 autocast)
    python benchmarks/profile_step.py --preset tiny --rows 2 --seq-len 256          # CPU smoke run

Random tokens packed as documents of random lengths (`position_ids` restart at each document, as in training),
so the varlen KDA path, the packed attention (`varlen_attn` on CUDA, block-diagonal masks elsewhere) and the MoE
permutation all run; fp32 weights under bf16 autocast and the fused loss, as `kdamoe-train` trains. Prints the step
time (the median of `--timed-steps` steps, each synchronised), tokens/s, the GPU kernels by total time (CUDA) and
the operators (device time on CUDA, CPU time otherwise); writes a JSON summary and a Chrome trace next to `--out`.
"""

import argparse
import json
import time
from pathlib import Path

import torch

import kdamoe
from kdamoe.presets import PRESETS


def packed_batch(rows: int, seq_len: int, vocab: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    position_ids = torch.empty_like(ids)
    for r in range(rows):
        t = 0
        while t < seq_len:
            n = int(torch.randint(16, seq_len // 2 + 17, (1,), generator=g))
            position_ids[r, t : t + n] = torch.arange(min(n, seq_len - t))
            t += n
    return {"input_ids": ids.to(device), "position_ids": position_ids.to(device), "labels": ids.to(device)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timed-steps", type=int, default=5, help="steps timed one by one; the median is reported")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("profile_step.json"))
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the loss as kdamoe-train computes it: chunk by chunk from the hidden states, no [tokens, vocab] logits
    config = kdamoe.KDAMoEConfig(vocab_size=args.vocab_size, fuse_linear_cross_entropy=True,
                                 **PRESETS[args.preset].model)
    model = kdamoe.KDAMoEForCausalLM(config)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    batch = packed_batch(args.rows, args.seq_len, args.vocab_size, device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.apply_load_balancing()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        sync()
    sort_key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_key, row_limit=args.top)
    tokens = args.rows * args.seq_len
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "preset": args.preset, "rows": args.rows, "seq_len": args.seq_len,
        "step_ms": 1e3 * step_s, "tokens_per_second": tokens / step_s,
        "aten_calls_per_step": sum(e.count for e in averages if e.key.startswith("aten::")),
        "top": [
            {"name": e.key, "calls": e.count, "ms": getattr(e, sort_key) / 1e3}
            for e in sorted(averages, key=lambda e: -getattr(e, sort_key))[: args.top]
        ],
    }
    if device.type == "cuda":
        kernels = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in kernels)
        summary["kernel_ms"] = total / 1e3
        summary["kernels"] = [{"name": e.key, "launches": e.count, "ms": e.device_time_total / 1e3}
                              for e in kernels[: args.top]]
        print(f"GPU kernels: {total / 1e3:.2f} ms in all\n     ms    share  launches  kernel")
        for e in kernels[: args.top]:
            share = 100 * e.device_time_total / total
            print(f"{e.device_time_total / 1e3:9.3f} {share:6.2f}% {e.count:8d}  {e.key[:100]}")
    print(table)
    print(f"step {summary['step_ms']:.1f} ms, {summary['tokens_per_second']:.0f} tokens/s, "
          f"{summary['aten_calls_per_step']} aten calls")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    prof.export_chrome_trace(str(args.out.with_suffix(".trace.json")))


if __name__ == "__main__":
    main()

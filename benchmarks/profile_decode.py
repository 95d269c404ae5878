"""Where the time of one cached decode step goes (batch 1): tokens/s of the `tiny` and `small` presets on the
GPU in fp32 and bf16, and a torch.profiler table (CPU and CUDA) of a few decode steps.

    PYTHONPATH=src python benchmarks/profile_decode.py [--preset tiny] [--context 512] [--steps 32]
"""

import argparse
import json
import os
import time

import torch

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM
from kdamoe.presets import get_preset


def decode_rate(model, context, steps, vocab):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=gen).cuda()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(3):  # warm: compilation and first-call costs
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        rate = steps / (time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
    return rate, prof


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_decode.json"))
    args = ap.parse_args()
    res = {}
    for preset in args.presets.split(","):
        cfg = KDAMoEConfig(vocab_size=4096, **get_preset(preset).model)
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            model = KDAMoEForCausalLM(cfg).to("cuda", dtype).eval()
            rate, prof = decode_rate(model, args.context, args.steps, cfg.vocab_size)
            key = f"{preset} {str(dtype).replace('torch.', '')}"
            res[key] = rate
            print(f"\n== {key}: {rate:.1f} tokens/s (context {args.context}, batch 1)", flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""What the router-bias update costs a training step: the ablation model's step with each balancing mode, split into
forward + backward + optimizer and `apply_load_balancing`, in one run (GPU; a tiny shape runs on the CPU).

The model is a `kdamoe-ablate` base config (`--config`: its preset and `model` fields, the tokenizer's vocabulary
size `--vocab-size`) trained as `kdamoe-train` does on the GPU: fp32 weights under bf16 autocast, fused AdamW,
`--rows` rows of `--seq-len` random tokens packed as documents of 1,024 tokens, `apply_load_balancing(to_host=False)`
after each optimizer step. Every mode's model starts from the same weights (the router bias differs only by its
own updates). Table: the median step and its parts over `--steps` timed steps after `--warmup` (CUDA events; the
cases' steps interleaved, one of each in turn, so that a drift of the machine reaches all alike), the update's
share of the step; then a torch.profiler table of one Quantile Balancing update (the kernels it launches and their
device time). With `--alt NAME=PATH` the Quantile Balancing step of another copy of the model folder runs too, for
an A/B of two versions; first both folders' `balanced_bias` run on the same scores (the window shape of the model)
and must give the same bias to 1e-9, and each is timed alone.

    python benchmarks/bench_balancing.py --config configs/ablate_h200.json --out balancing_h200.json
    python benchmarks/bench_balancing.py --tiny        # CPU: checks that everything runs
"""

import argparse
import json
import statistics
import time

import torch
from model_folder import import_model_folder, load_model_classes

import kdamoe
from kdamoe.presets import get_preset


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/ablate_h200.json", help="kdamoe-ablate base config (JSON)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--modes", default="quantile,loss_free,aux_loss,none")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                   help="also time the Quantile Balancing step of the model folder at PATH; repeatable")
    p.add_argument("--top", type=int, default=20, help="rows of the profiler table")
    p.add_argument("--tiny", action="store_true", help="the tiny preset with 16 experts, 2 rows of 256 tokens")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def model_kwargs(args) -> dict:
    if args.tiny:
        args.rows, args.seq_len, args.steps, args.warmup = 2, 256, 2, 1
        return {**get_preset("tiny").model, "num_experts": 16, "num_experts_per_tok": 2}
    with open(args.config) as f:
        config = json.load(f)
    return {**get_preset(config.get("preset", "small")).model, **config.get("model", {})}


def batch(rows: int, seq_len: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    position_ids = (torch.arange(seq_len) % 1024).expand(rows, -1).contiguous()
    return {"input_ids": ids.to(device), "position_ids": position_ids.to(device), "labels": ids.to(device)}


class Run:
    """One model and its optimizer; `step()` returns (forward + backward + optimizer ms, update ms) on CUDA events
    (host time on the CPU)."""

    def __init__(self, lib, kwargs, mode, state, device, data):
        torch.manual_seed(0)
        config = lib.KDAMoEConfig(**{**kwargs, "router_balancing": mode})
        self.model = lib.KDAMoEForCausalLM(config).to(device).train()
        self.model.load_state_dict(state, strict=False)  # the same weights for every mode (buffers may differ)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=device.type == "cuda")
        self.device, self.data = device, data

    def step(self):
        t0 = mark(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(**self.data).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t1 = mark(self.device)
        self.model.apply_load_balancing(to_host=False)
        t2 = mark(self.device)
        return elapsed_ms(t0, t1), elapsed_ms(t1, t2)


def mark(device):
    """A point in time: a recorded CUDA event, or the host clock on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(a, b) -> float:
    """ms between two `mark`s (synchronises on CUDA)."""
    if isinstance(a, float):
        return 1e3 * (b - a)
    b.synchronize()
    return a.elapsed_time(b)


def _time(fn, device, reps: int) -> float:
    """Median ms of `fn()` over `reps` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = mark(device)
        fn()
        times.append(elapsed_ms(t0, mark(device)))
    return statistics.median(times)


def main():
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {**model_kwargs(args), "vocab_size": args.vocab_size}
    data = batch(args.rows, args.seq_len, args.vocab_size, device)
    torch.manual_seed(0)
    state = kdamoe.KDAMoEForCausalLM(kdamoe.KDAMoEConfig(**kwargs)).state_dict()
    libs = {"ours": kdamoe}
    for alt in args.alt:
        name, _, path = alt.partition("=")
        libs[name] = load_model_classes(name, path)
    cases = [("ours", mode) for mode in args.modes.split(",")] + [(name, "quantile") for name in libs if name != "ours"]

    rows, update_check = [], []
    if len(libs) > 1:  # the alternatives' update on the same window: the same bias, and its time alone
        config = kdamoe.KDAMoEConfig(**kwargs)
        L = config.mlp_layer_types.count("sparse")
        g = torch.Generator(device=device).manual_seed(0)
        E, k = kwargs["num_experts"], kwargs["num_experts_per_tok"]
        mu = torch.linspace(-2.0, 1.0, E, device=device)
        scores = torch.sigmoid(mu + torch.randn(L, args.rows * args.seq_len, E, generator=g, device=device))
        bias = torch.zeros(L, E, dtype=torch.float64, device=device)
        reference = None
        for name, path in [("ours", None)] + [tuple(a.partition("=")[::2]) for a in args.alt]:
            module = kdamoe.model.moe if path is None else import_model_folder(name, path, "moe")
            update = lambda: module.balanced_bias(scores, bias, k, config.quantile_iterations,  # noqa: E731
                                                  config.quantile_num_bins)
            new = update()
            reference = new if reference is None else reference
            diff = (new - reference).abs().max().item()
            ms = _time(update, device, args.steps)
            update_check.append({"model": name, "ms": ms, "max_abs_diff_to_ours": diff})
            print(f"balanced_bias of {name} on [{L}, {scores.shape[1]}, {E}] fp32 scores: {ms:.2f} ms, "
                  f"max |bias - ours| {diff:.3g}")
            if diff > 1e-9:
                raise SystemExit(f"{name}: balanced_bias differs from ours by {diff:.3g}")
    print(f"{device}: {args.rows} x {args.seq_len} tokens, {kwargs['num_experts']} experts top-"
          f"{kwargs['num_experts_per_tok']}, hidden {kwargs['hidden_size']}, {kwargs['num_hidden_layers']} layers")
    print(f"{'model':>8} {'mode':>10} {'step ms':>9} {'fwd+bwd+opt':>12} {'update ms':>10} {'update share':>13}")
    runs = [Run(libs[lib_name], kwargs, mode, state, device, data) for lib_name, mode in cases]
    for run in runs:
        for _ in range(args.warmup):
            run.step()
    times = [[] for _ in runs]
    for _ in range(args.steps):  # round robin: a drift of the machine over the run reaches every case alike
        for run, out in zip(runs, times):
            out.append(run.step())
    for (lib_name, mode), run, steps in zip(cases, runs, times):
        main_ms = statistics.median(t[0] for t in steps)
        update_ms = statistics.median(t[1] for t in steps)
        step_ms = statistics.median(t[0] + t[1] for t in steps)
        rows.append({"model": lib_name, "mode": mode, "step_ms": step_ms, "forward_backward_optimizer_ms": main_ms,
                     "update_ms": update_ms, "update_share": update_ms / step_ms})
        print(f"{lib_name:>8} {mode:>10} {step_ms:9.2f} {main_ms:12.2f} {update_ms:10.2f} "
              f"{100 * update_ms / step_ms:12.1f}%")
    for (lib_name, mode), run, row in zip(cases, runs, rows):
        if mode != "quantile":
            continue
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            run.model(**data).loss.backward()  # pending statistics for the profiled update
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run.model.apply_load_balancing(to_host=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
        key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        averages = prof.key_averages()
        print(f"-- one Quantile Balancing update of {lib_name}: "
              f"{sum(e.count for e in averages if e.key.startswith('aten::'))} aten calls")
        print(averages.table(sort_by=key, row_limit=args.top))
        row["profile"] = [{"name": e.key, "calls": e.count, "ms": getattr(e, key) / 1e3}
                          for e in sorted(averages, key=lambda e: -getattr(e, key))[: args.top]]
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                "rows": args.rows, "seq_len": args.seq_len, "config": args.config, "model": kwargs}
        with open(args.out, "w") as f:
            json.dump({**meta, "balanced_bias": update_check, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

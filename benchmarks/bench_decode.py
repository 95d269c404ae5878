"""Decoding speed against context length and batch: kdamoe's static cache with its decode steps replayed as CUDA
graphs, its default dynamic cache, and flash-linear-attention's `KDAForCausalLM`, all in one process.

    PYTHONPATH=src python benchmarks/bench_decode.py                          # every cell, ours and fla
    python benchmarks/bench_decode.py --models kda --contexts 1024,1048576 --batches 1
    python benchmarks/bench_decode.py --tiny                                   # a smoke run on any device

Models (as `bench_model.py` builds them): `kda`, the twin (hidden 1024, 12 layers all KDA with 8 heads x 128, dense
MLP 2816, vocab 32000, standard residual; 226M parameters), and fla's `KDAForCausalLM` with the same sizes; `hybrid`,
the hybrid MoE (3 KDA : 1 attention, layer 0 dense, the rest 64 experts top-8 of width 384 plus a shared expert,
Block AttnRes with 3 layers a block; ours only, fla has no MoE KDA model). bf16 weights, random (seeded), and random
prompt ids uniform in [0, V).

Per model, context L and batch B, with a fresh cache:
- prefill: the B x L prompt through the forward with the cache, in chunks of `--prefill-chunk` tokens (all rows
  together); the hybrid in one forward (a later chunk's attention would take a [chunk, L] mask). Then the cache's
  states must be finite and not zero (no step is timed on zeros). Cells above `--max-prefill-tokens` (B x L), or the
  hybrid's above `--max-forward-tokens`, are skipped.
- decode: greedy steps, each feeding the argmax of the last step's logits back on the device (no host read):
  `--warmup` steps, then `--steps` steps between two CUDA events; ms per step is their time over the steps, tokens/s
  is B / ms per step. `graph`: ours, static cache, each step through `model.get_compiled_call(None)`, what `generate`
  runs (the first step eager, the second recorded, the rest replayed); `eager`: ours, the default dynamic cache,
  `model(...)` (contexts up to `--eager-max-context`); `fla`: fla's cache, `model(...)`.
- host synchronisations per step: `--sync-steps` more steps under `torch.cuda.set_sync_debug_mode("warn")`,
  counted as `bench_model.py` counts them (per step).

`generate` (what users call), at `--generate-context` tokens, per model and batch: `generate(prompt,
max_new_tokens=N, min_new_tokens=N, do_sample=False)` for N = `--generate-tokens` and 2N after a warm-up call, each
time t the median of `--generate-repeats` calls; tokens/s = B N / (t(2N) - t(N)), so the prefill, the cache's
construction and the graph's recording cancel. Ours with `cache_implementation="static"` and with the default cache;
fla with its default. Then the greedy tokens: ours static (graphs) against ours dynamic (eager, uncompiled),
`--generate-tokens` tokens; where they differ, the first step that does and the eager path's gap between its two
largest logits there (a near tie flips on the last bit of a bf16 sum; a bug does not wait for one).

An exception in a cell (out of memory included) is recorded as its `error` and the run goes on. The JSON (`--out`)
is rewritten after every cell; markdown tables come last.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
from bench_model import Row, count_syncs, environment, fla_config, import_fla, ours_config, sizes

import kdamoe
from kdamoe.model.caches import CACHE_FIELD

MODELS = {"kda": Row("kda", 1, 1), "hybrid": Row("hybrid", 1, 1, residual="block_attnres", moe=True)}
GIB = 2**30


def build(model: str, lib: str, s: dict, device, dtype, fla_models):
    torch.manual_seed(0)
    row = MODELS[model]
    with device:
        net = (kdamoe.KDAMoEForCausalLM(ours_config(row, s)) if lib == "ours"
               else fla_models.KDAForCausalLM(fla_config(row, s, fla_models)))
    return net.to(dtype).eval()


def forward_fn(net, lib: str, call=None):
    """`(ids, cache) -> (last position's logits, cache)`: one forward with the cache through `call` (the model's
    `__call__` by default)."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(net.forward).parameters else {}
    call = net if call is None else call

    def forward(ids, cache):
        out = call(input_ids=ids, use_cache=True, **{"cache" if lib == "ours" else "past_key_values": cache}, **keep)
        return out.logits[:, -1:], (getattr(out, CACHE_FIELD) if lib == "ours" else out.past_key_values)

    return forward


def state_norm(obj, depth=0) -> float:
    """The sum of the norms of the floating-point tensors a cache holds (in its attributes, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return torch.linalg.vector_norm(obj.flatten()).float().item() if obj.is_floating_point() else 0.0
    if depth > 5 or isinstance(obj, torch.nn.Module):
        return 0.0
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).values()
    else:
        return 0.0
    return sum(state_norm(x, depth + 1) for x in items)


class Timer:
    """Elapsed ms of a block: CUDA events on a GPU (the device's timeline), the host's clock elsewhere."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def decode_cell(net, lib: str, path: str, L: int, B: int, args, device, dtype) -> dict:
    """Prefill B x L prompt tokens, then time greedy decode steps (module docstring)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, net.config.vocab_size, (B, L), generator=torch.Generator().manual_seed(L + B)).to(device)
    extra = args.warmup + args.steps + (args.sync_steps if cuda else 0)
    cache = None
    if path == "graph":
        cache = kdamoe.KDAMoEStaticCache(net.config, B, L + extra, device=device, dtype=dtype)
    one_forward = lib == "ours" and "full_attention" in net.config.layer_types
    chunk = L if one_forward else max(1, args.prefill_chunk // B)
    forward = forward_fn(net, lib)
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, L, chunk):
            logits, cache = forward(ids[:, start : start + chunk], cache)
        token = logits.argmax(-1)
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        norm = state_norm(cache)
        if not 0 < norm < float("inf"):
            raise RuntimeError(f"the cache after the prefill is zero or not finite (norms summed: {norm})")
        if path == "graph" and cuda:
            forward = forward_fn(net, lib, net.get_compiled_call(None))

        def step(tok):
            nonlocal cache
            logits, cache = forward(tok, cache)
            return logits.argmax(-1)

        for _ in range(args.warmup):
            token = step(token)
        with Timer(device) as timer:
            for _ in range(args.steps):
                token = step(token)
        result = {"ms_per_step": timer.ms / args.steps, "prefill_s": prefill_s, "state_norms": norm}
        result["tokens_per_s"] = B * 1e3 / result["ms_per_step"]
        if cuda:
            state = {"token": token}

            def more():
                for _ in range(args.sync_steps):
                    state["token"] = step(state["token"])

            result["syncs_per_step"] = count_syncs(more) / args.sync_steps
            result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return result


def generate_cell(net, lib: str, B: int, args, device) -> dict:
    """tokens/s of `generate` per implementation and, for ours, the greedy-tokens check (module docstring)."""
    L, n = args.generate_context, args.generate_tokens
    prompt = torch.randint(0, net.config.vocab_size, (B, L), generator=torch.Generator().manual_seed(7)).to(device)
    base = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    impls = {"static": dict(cache_implementation="static"), "dynamic": {}} if lib == "ours" else {"fla": {}}
    out = {}
    for name, kwargs in impls.items():
        net.generate(prompt, max_new_tokens=4, **base, **kwargs)  # warm: kernels compiled, cuBLAS set up
        ms = {}
        for m in (n, 2 * n):
            times = []
            for _ in range(args.generate_repeats):
                with Timer(device) as timer:
                    net.generate(prompt, max_new_tokens=m, min_new_tokens=m, **base, **kwargs)
                times.append(timer.ms)
            ms[m] = statistics.median(times)
        out[name] = {"tokens_per_s": B * n * 1e3 / (ms[2 * n] - ms[n]), "ms_per_step": (ms[2 * n] - ms[n]) / n}
    if lib == "ours":
        ref = net.generate(prompt, max_new_tokens=n, return_dict_in_generate=True, output_logits=True, **base)
        got = net.generate(prompt, max_new_tokens=n, cache_implementation="static", **base)
        new_ref, new_got = ref.sequences[:, L:], got[:, L:]
        check = {"tokens": n, "identical": bool(torch.equal(new_ref, new_got))}
        if not check["identical"]:
            differs = (new_ref != new_got).any(0).nonzero()[0, 0].item()
            row = (new_ref[:, differs] != new_got[:, differs]).nonzero()[0, 0].item()
            top2 = ref.logits[differs][row].float().topk(2).values
            check.update(first_mismatch_step=differs, row=row, eager_top2_gap=(top2[0] - top2[1]).item())
        out["greedy_check"] = check
    return out


def run(fn, *a) -> dict:
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - one cell's failure must not end the run
        text = str(e).strip().splitlines()
        return {"error": f"{type(e).__name__}: {text[0] if text else ''}"[:500]}
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def markdown(report: dict) -> str:
    def cell(r, key, fmt):
        if r is None:
            return "—"
        if "error" in r:
            return "OOM" if "out of memory" in r["error"].lower() else "error"
        if "skipped" in r or r.get(key) is None:
            return "—"
        return fmt.format(r[key])

    paths = ("graph", "eager", "fla")
    head = ["model", "context", "batch"] + [f"{p} {c}" for p in paths for c in ("ms", "tok/s")]
    head += ["graph / fla", "graph syncs/step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for rec in report["decode"]:
        res = rec["results"]
        cells = [rec["model"], f"{rec['context']:,}", str(rec["batch"])]
        for p in paths:
            cells += [cell(res.get(p), "ms_per_step", "{:.3f}"), cell(res.get(p), "tokens_per_s", "{:,.0f}")]
        g, f = res.get("graph", {}), res.get("fla", {})
        cells.append(f"{f['ms_per_step'] / g['ms_per_step']:.1f}x" if "ms_per_step" in g and "ms_per_step" in f
                     else "—")
        cells.append(cell(g, "syncs_per_step", "{:g}"))
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"- {rec['model']}, {rec['context']:,} x {rec['batch']}, {p}: {r.get('error') or r.get('skipped')}"
                  for p, r in res.items() if "error" in r or "skipped" in r]
    for model in sorted({r["model"] for r in report["decode"]}):
        for batch in sorted({r["batch"] for r in report["decode"]}):
            ms = [r["results"]["graph"]["ms_per_step"] for r in report["decode"] if r["model"] == model
                  and r["batch"] == batch and "ms_per_step" in r["results"].get("graph", {})]
            if len(ms) > 1:
                notes.append(f"- {model}, batch {batch}: graph ms per step over the contexts, slowest / fastest "
                             f"{max(ms) / min(ms):.2f}x")
    head = ["model", "batch", "generate static tok/s", "generate dynamic tok/s", "fla generate tok/s",
            "greedy tokens static = dynamic"]
    gen = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rec in report["generate"]:
        res = rec["results"]
        check = res.get("greedy_check")
        same = "—" if check is None else ("yes" if check["identical"] else
                                          f"no: step {check['first_mismatch_step']}, eager top-2 gap "
                                          f"{check['eager_top2_gap']:.3g}")
        gen.append("| " + " | ".join([rec["model"], str(rec["batch"]), cell(res.get("static"), "tokens_per_s",
                   "{:,.0f}"), cell(res.get("dynamic"), "tokens_per_s", "{:,.0f}"),
                   cell(res.get("fla"), "tokens_per_s", "{:,.0f}"), same]) + " |")
        notes += [f"- generate {rec['model']} x {rec['batch']}, {k}: {v['error']}" for k, v in res.items()
                  if isinstance(v, dict) and "error" in v]
    return "\n".join(lines + [""] + gen + ([""] + notes if notes else []))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="kda,hybrid", help="kda, hybrid or both")
    p.add_argument("--libs", default="ours,fla", help="ours,fla or one of them (fla: the kda model only)")
    p.add_argument("--contexts", default=None, help="prompt tokens per row (1024,32768,131072,1048576)")
    p.add_argument("--batches", default=None, help="rows (1,16,64)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per cell")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before the timed ones")
    p.add_argument("--sync-steps", type=int, default=4, help="steps under the sync debug mode (CUDA)")
    p.add_argument("--prefill-chunk", type=int, default=1 << 18, help="prompt tokens per prefill forward (all rows)")
    p.add_argument("--max-prefill-tokens", type=int, default=1 << 24, help="skip cells with more prompt tokens")
    p.add_argument("--max-forward-tokens", type=int, default=1 << 20,
                   help="skip hybrid cells whose prompt does not fit one forward of this many tokens")
    p.add_argument("--eager-max-context", type=int, default=32768, help="ours eager (dynamic cache) up to this")
    p.add_argument("--generate-context", type=int, default=1024, help="prompt tokens of the generate rows")
    p.add_argument("--generate-tokens", type=int, default=64, help="N of the generate rows (N and 2N are timed)")
    p.add_argument("--generate-repeats", type=int, default=3, help="timed generate calls per length (the median)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_decode_h200.json"), help="results JSON")
    p.add_argument("--tiny", action="store_true", help="a 2-layer tiny config, short contexts, any device")
    args = p.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.libs = [lib for lib in args.libs.split(",") if lib]
    default_contexts, default_batches = ("64,256", "1,2") if args.tiny else ("1024,32768,131072,1048576", "1,16,64")
    args.contexts = [int(x) for x in (args.contexts or default_contexts).split(",")]
    args.batches = [int(x) for x in (args.batches or default_batches).split(",")]
    if args.tiny:
        args.steps, args.generate_context, args.generate_tokens = min(args.steps, 8), 32, 8
    if unknown := sorted(set(args.models) - set(MODELS)):
        p.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    if unknown := sorted(set(args.libs) - {"ours", "fla"}):
        p.error(f"unknown libs {unknown}; known: ours, fla")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fla_models, fla_note = import_fla(args.libs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    s = sizes(args.tiny)
    report = {"environment": environment(device, fla_note), "dtype": str(dtype).removeprefix("torch."),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "decode": [], "generate": []}
    if device.type == "cuda":
        report["sync_counter_check"] = count_syncs(lambda: torch.ones(1, device=device).item())
    for model in args.models:
        libs = [lib for lib in args.libs if lib == "ours" or model == "kda"]
        for lib in libs:
            net = build(model, lib, s, device, dtype, fla_models)
            paths = ("graph", "eager") if lib == "ours" else ("fla",)
            for L in args.contexts:
                for B in args.batches:
                    rec = next((r for r in report["decode"] if (r["model"], r["context"], r["batch"]) == (model, L, B)),
                               None)
                    if rec is None:
                        rec = {"model": model, "context": L, "batch": B, "results": {}}
                        report["decode"].append(rec)
                    for path in paths:
                        if B * L > args.max_prefill_tokens:
                            rec["results"][path] = {"skipped": f"{B * L:,} prompt tokens > --max-prefill-tokens"}
                        elif model == "hybrid" and B * L > args.max_forward_tokens:
                            rec["results"][path] = {"skipped": f"{B * L:,} prompt tokens > --max-forward-tokens"}
                        elif path == "eager" and L > args.eager_max_context:
                            rec["results"][path] = {"skipped": "context > --eager-max-context"}
                        else:
                            print(f"[{model} {L:,} x {B}] {path} ...", flush=True)
                            rec["results"][path] = run(decode_cell, net, lib, path, L, B, args, device, dtype)
                            print(f"[{model} {L:,} x {B}] {path}: {json.dumps(rec['results'][path])}", flush=True)
                        args.out.write_text(json.dumps(report, indent=2) + "\n")
            for B in args.batches:
                rec = next((r for r in report["generate"] if (r["model"], r["batch"]) == (model, B)), None)
                if rec is None:
                    rec = {"model": model, "batch": B, "context": args.generate_context, "results": {}}
                    report["generate"].append(rec)
                print(f"[{model} generate x {B}] {lib} ...", flush=True)
                result = run(generate_cell, net, lib, B, args, device)
                rec["results"].update(result if "error" not in result else {lib: result})
                print(f"[{model} generate x {B}] {lib}: {json.dumps(result)}", flush=True)
                args.out.write_text(json.dumps(report, indent=2) + "\n")
            del net
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report["markdown"] = markdown(report)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}\n")
    print(report["markdown"])


if __name__ == "__main__":
    main()

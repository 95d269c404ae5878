"""Million-token contexts on one GPU: prefill, the attention layers' SDPA, cached decoding and the training step,
every figure with its config, in one run.

    PYTHONPATH=src python benchmarks/bench_long_context.py --out benchmarks/results/long_context_h200.json
    python benchmarks/bench_long_context.py --parts prefill,decode --models twin
    python benchmarks/bench_long_context.py --tiny              # smoke run on any device

Models, from bench_model.py's builders (`ours_config`): the twin (226M: all-KDA, hidden 1024, 12 layers, 8 heads of
128, dense MLP of 2816, standard residual) and the hybrid MoE (same dims, 3 KDA : 1 NoPE attention, layer 0 dense,
64 experts top-8 of width 384 + 1 shared, Block AttnRes with 3 layers a block; 969M). bf16 weights, batch 1, random
token ids; `--tiny` takes bench_model's tiny sizes, fp32 on the CPU.

Parts:
- `prefill`: a forward of `--length` tokens (2^20) with a cache, no grad, `logits_to_keep=1`, after an untimed one of
  `--warmup-length` tokens (kernel compilation): seconds (median of `--repeats`, the device synchronised around
  each), peak allocated memory (weights included), whether the logits are finite;
- `sdpa`: the hybrid's attention call alone at `--length` tokens: random bf16 `q [1, Hq, T, Dh]`, `k, v [1, Hkv, T,
  Dh]`, causal, through the attention function and the SDPA backends the model's attention layer uses with a cache,
  times the number of attention layers. Target: hybrid prefill <= 1.5 x twin prefill + this;
- `decode`: ms per token over `--decode-tokens` greedy cached steps (after 3 untimed ones) after a prefill of
  `--short-length` (4096) tokens and after the `--length` prefill. Target for the all-KDA twin: within 1.5x;
- `train`: a training step of the twin at `--length` tokens as bench_model.py's long rows build it (activation
  checkpointing, AdamW, fused loss, `apply_load_balancing(to_host=False)`): ours, ours with the layers' inputs in
  host memory (`kdamoe.offload.HostOffload`), and fla's `KDAForCausalLM` when fla imports (its config from
  `bench_model.fla_config`): seconds of one step after an untimed one, its peak allocated memory (weights, gradients
  and AdamW state included). Target: ours <= 1.1 x fla's memory.

An exception in a part (out of memory included) is recorded as its `error` and the run goes on; the JSON is
rewritten after every part; a table and the targets are printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import bench_model
import kdamoe
from kdamoe.evaluate import Resources
from kdamoe.model import modeling_kdamoe
from kdamoe.offload import HostOffload

MODELS = {"twin": bench_model.Row("twin", 1, 0), "hybrid": bench_model.Row("hybrid", 1, 0, "block_attnres", moe=True)}
PARTS = ("prefill", "sdpa", "decode", "train")


def describe(model) -> dict:
    """The figures' config: sizes, layer pattern, attention and MoE shapes where there are such layers, residual."""
    c = model.config
    out = {"hidden_size": c.hidden_size, "layers": c.num_hidden_layers,
           "kda_layers": c.layer_types.count("linear_attention"), "kda_heads": f"{c.kda_num_heads}x{c.kda_head_dim}",
           "kda_gate": c.kda_gate, "attention_layers": c.layer_types.count("full_attention"),
           "moe_layers": c.mlp_layer_types.count("sparse"), "residual_mode": c.residual_mode,
           "vocab_size": c.vocab_size, "parameters": sum(p.numel() for p in model.parameters())}
    if out["attention_layers"]:
        out["attention_heads"] = f"{c.num_attention_heads}x{c.head_dim}, {c.num_key_value_heads} kv (NoPE)"
    if out["moe_layers"]:
        out["experts"] = (f"{c.num_experts} top-{c.num_experts_per_tok} of {c.moe_intermediate_size} + "
                          f"{c.num_shared_experts} shared")
    else:
        out["mlp"] = c.intermediate_size
    return out


def build(name: str, s: dict, device, dtype):
    torch.manual_seed(0)
    with device:
        model = kdamoe.KDAMoEForCausalLM(bench_model.ours_config(MODELS[name], s))
    return model.to(dtype).eval()


def random_ids(length: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)


@torch.no_grad()
def prefill(model, length: int, repeats: int, device, warmup_length: int = 0):
    """`(figures, output of the last timed forward)` of a cached prefill of `length` random tokens, after an untimed
    one of `warmup_length` (module docstring)."""
    vocab = model.config.vocab_size
    if warmup_length:
        model(input_ids=random_ids(warmup_length, vocab, device), use_cache=True, logits_to_keep=1)
    ids = random_ids(length, vocab, device, seed=1)
    times, peaks, out = [], [], None
    for _ in range(repeats):
        out = None  # the previous cache is freed before the next forward
        with Resources(device) as used:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        times.append(used.seconds)
        peaks.append(used.peak_gib)
    figures = {"tokens": length, "seconds": statistics.median(times), "seconds_all": times,
               "peak_gib": None if peaks[0] is None else max(peaks),
               "finite": bool(torch.isfinite(out.logits).all())}
    return figures, out


@torch.no_grad()
def decode_ms(model, out, steps: int, device) -> float:
    """ms per greedy cached decode step from a prefill's output."""
    cache, token = out.cache if hasattr(out, "cache") else out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(3):
        token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    with Resources(device) as used:
        for _ in range(steps):
            token = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return 1e3 * used.seconds / steps


@torch.no_grad()
def sdpa(model, length: int, warmup_length: int, repeats: int, device, dtype) -> dict:
    """The attention layers' SDPA at `length` tokens, as a cached prefill calls it (module docstring)."""
    layers = [layer.mixer for layer in model.model.layers if layer.layer_type == "full_attention"]
    attention = layers[0]
    function = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]

    def call(tokens: int) -> None:
        q = torch.randn(1, attention.num_heads, tokens, attention.head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, attention.num_key_value_heads, tokens, attention.head_dim, device=device, dtype=dtype)
                for _ in range(2))
        with modeling_kdamoe._backends_for(tokens, tokens, True, device.type == "cuda"):
            function(attention, q, k, v, None, dropout=0.0, scaling=attention.scaling)

    call(warmup_length)
    times = []
    for _ in range(repeats):
        with Resources(device) as used:
            call(length)
        times.append(used.seconds)
    per_layer = statistics.median(times)
    return {"tokens": length, "layers": len(layers), "seconds_per_layer": per_layer, "seconds": per_layer * len(layers),
            "q": [1, attention.num_heads, length, attention.head_dim],
            "kv": [1, attention.num_key_value_heads, length, attention.head_dim],
            "backends": ([b.name for b in modeling_kdamoe.sdpa_backends(length, length, True)]
                         if device.type == "cuda" else None)}


def train_step(lib: str, s: dict, length: int, device, dtype, fla_models, offload: bool = False) -> dict:
    """One timed training step after an untimed one (module docstring)."""
    row = bench_model.Row("long", 1, length, checkpointing=True)
    case = bench_model.Case(row, lib, s, device, dtype, fla_models)
    hooks = HostOffload if offload else contextlib.nullcontext

    def step():
        with hooks():
            loss = case.model(**case.batch).loss
        loss.backward()
        case.update()
        return loss

    step()
    with Resources(device) as used:
        loss = step()
    return {"tokens": length, "seconds": used.seconds, "peak_gib": used.peak_gib,
            "loss_finite": bool(torch.isfinite(loss.detach()).all()), "checkpointing": True,
            "offload": offload, "parameters": sum(p.numel() for p in case.model.parameters()),
            "model": "fla KDAForCausalLM" if lib == "fla" else "kdamoe twin"}


def error_of(e: Exception) -> dict:
    text = str(e).strip().splitlines()
    return {"error": f"{type(e).__name__}: {text[0] if text else ''}"[:500]}


def attempt(fn, device) -> dict:
    """`fn()`, or the error it raised as `{"error": ...}`; memory is freed either way."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one part's failure must not end the run
        return error_of(e)
    finally:
        bench_model.free_memory(device)


def model_parts(name: str, args, s: dict, device, dtype, record) -> None:
    """The prefill, decode and (hybrid) SDPA parts of one model; `record(part, key, figures)` keeps each."""
    model = build(name, s, device, dtype)
    record("models", name, describe(model))
    out = None
    if {"prefill", "decode"} & set(args.parts):
        try:
            figures, out = prefill(model, args.length, args.repeats, device, args.warmup_length)
        except Exception as e:  # noqa: BLE001
            figures = error_of(e)
        record("prefill", name, figures)
    if "decode" in args.parts and out is not None:
        def decode():
            long_ms = decode_ms(model, out, args.decode_tokens, device)
            short_ms = decode_ms(model, prefill(model, args.short_length, 1, device)[1], args.decode_tokens, device)
            return {"short_tokens": args.short_length, "short_ms": short_ms, "long_tokens": args.length,
                    "long_ms": long_ms, "ratio": long_ms / short_ms}

        record("decode", name, attempt(decode, device))
    out = None
    bench_model.free_memory(device)
    if name == "hybrid" and "sdpa" in args.parts:
        record("sdpa", None, attempt(lambda: sdpa(model, args.length, args.warmup_length, args.repeats, device,
                                                  dtype), device))


def targets(report: dict) -> dict:
    """The issue's targets from the figures that are there."""
    out = {}
    pre, sd = report.get("prefill", {}), report.get("sdpa", {})
    twin, hybrid = pre.get("twin", {}), pre.get("hybrid", {})
    if "seconds" in twin and "seconds" in hybrid and "seconds" in sd:
        bound = 1.5 * twin["seconds"] + sd["seconds"]
        out["hybrid_prefill"] = {"seconds": hybrid["seconds"], "bound": bound, "met": hybrid["seconds"] <= bound,
                                 "rule": "hybrid prefill <= 1.5 x twin prefill + SDPA"}
    dec = report.get("decode", {}).get("twin", {})
    if "ratio" in dec:
        out["decode"] = {"ratio": dec["ratio"], "met": dec["ratio"] <= 1.5,
                         "rule": "twin decode ms/token after the long prefill <= 1.5 x after the short one"}
    train = report.get("train", {})
    if "peak_gib" in train.get("ours", {}) and "peak_gib" in train.get("fla", {}):
        for key in ("ours", "ours_offload"):
            if "peak_gib" in train.get(key, {}):
                ratio = train[key]["peak_gib"] / train["fla"]["peak_gib"]
                out[f"train_memory_{key}"] = {"ratio": ratio, "met": ratio <= 1.1,
                                              "rule": "twin training step memory <= 1.1 x fla's"}
    return out


def table(report: dict) -> str:
    def cell(r, key, fmt):
        if "error" in r:
            return "OOM" if "out of memory" in r["error"].lower() else "error"
        return fmt.format(r[key]) if r.get(key) is not None else "—"

    lines = ["| part | model | tokens | seconds | peak GiB | note |", "|---|---|---|---|---|---|"]
    for name, r in report.get("prefill", {}).items():
        lines.append(f"| prefill | {name} | {r.get('tokens', '—')} | {cell(r, 'seconds', '{:.3f}')} | "
                     f"{cell(r, 'peak_gib', '{:.1f}')} | finite: {r.get('finite', '—')} |")
    if sd := report.get("sdpa"):
        lines.append(f"| SDPA x {sd.get('layers', '—')} layers | hybrid | {sd.get('tokens', '—')} | "
                     f"{cell(sd, 'seconds', '{:.3f}')} | — | {cell(sd, 'seconds_per_layer', '{:.3f}')} s a layer |")
    for name, r in report.get("decode", {}).items():
        note = (f"{r['short_ms']:.2f} ms/token after {r['short_tokens']}, {r['long_ms']:.2f} after "
                f"{r['long_tokens']} ({r['ratio']:.2f}x)" if "ratio" in r else r.get("error", ""))
        lines.append(f"| decode | {name} | — | — | — | {note} |")
    for name, r in report.get("train", {}).items():
        lines.append(f"| training step | {name} | {r.get('tokens', '—')} | {cell(r, 'seconds', '{:.2f}')} | "
                     f"{cell(r, 'peak_gib', '{:.1f}')} | {r.get('error', r.get('model', ''))} |")
    lines += [f"- target {k}: {v['rule']}: {'met' if v['met'] else 'NOT met'} "
              f"({', '.join(f'{x}={y:.3g}' for x, y in v.items() if isinstance(y, float))})"
              for k, v in report.get("targets", {}).items()]
    return "\n".join(lines)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--models", default="twin,hybrid", help="prefill and decode: twin,hybrid or one of them")
    p.add_argument("--length", type=int, default=None, help="the long context (2^20; 1024 with --tiny)")
    p.add_argument("--short-length", type=int, default=None, help="decode's short context (4096; 128 with --tiny)")
    p.add_argument("--warmup-length", type=int, default=None, help="untimed first forward (65536; 64 with --tiny)")
    p.add_argument("--repeats", type=int, default=1, help="timed prefills and SDPA calls (the median is reported)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--train-libs", default="ours,ours_offload,fla", help="training rows: ours,ours_offload,fla")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/long_context_h200.json"))
    p.add_argument("--tiny", action="store_true", help="bench_model's tiny sizes on whatever device is present")
    args = p.parse_args()
    args.length = args.length or (1024 if args.tiny else 1 << 20)
    args.short_length = args.short_length or (128 if args.tiny else 4096)
    args.warmup_length = args.warmup_length or (64 if args.tiny else 65536)
    for name, known in (("parts", PARTS), ("models", tuple(MODELS)), ("train_libs", ("ours", "ours_offload", "fla"))):
        values = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        if unknown := sorted(set(values) - set(known)):
            p.error(f"--{name.replace('_', '-')}: unknown {unknown}; known: {', '.join(known)}")
        setattr(args, name, values)
    return args


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    s = bench_model.sizes(args.tiny)
    fla_models, fla_note = None, "not requested"
    if "train" in args.parts:
        fla_models, fla_note = bench_model.import_fla(args.train_libs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"environment": bench_model.environment(device, fla_note), "dtype": str(dtype).removeprefix("torch."),
              "tiny": args.tiny, "length": args.length, "short_length": args.short_length,
              "warmup_length": args.warmup_length, "repeats": args.repeats, "decode_tokens": args.decode_tokens}

    def record(part: str, key: str | None, figures: dict) -> None:
        if key is None:
            report[part] = figures
        else:
            report.setdefault(part, {})[key] = figures
        report["targets"] = targets(report)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{part}{' ' + key if key else ''}] {json.dumps(figures)}", flush=True)

    names = list(args.models) if {"prefill", "decode"} & set(args.parts) else []
    if "sdpa" in args.parts and "hybrid" not in names:
        names.append("hybrid")
    for name in names:
        model_parts(name, args, s, device, dtype, record)
        bench_model.free_memory(device)
    if "train" in args.parts:
        for key in args.train_libs:
            lib = "fla" if key == "fla" else "ours"
            record("train", key, attempt(lambda: train_step(lib, s, args.length, device, dtype, fla_models,
                                                            offload=key == "ours_offload"), device))
    print(f"\nwrote {args.out}\n\n{table(report)}")


if __name__ == "__main__":
    main()

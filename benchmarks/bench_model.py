"""Whole-model training step: kdamoe against flash-linear-attention's `KDAForCausalLM`, both in one process.

    PYTHONPATH=src python benchmarks/bench_model.py                                  # every row, ours and fla
    python benchmarks/bench_model.py --rows dense,attnres --steps 20 --profile dense
    python benchmarks/bench_model.py --rows long_1m --libs ours
    python benchmarks/bench_model.py --tiny --libs ours                             # smoke run on any device
    python benchmarks/bench_model.py --rows dense --libs ours --alt before=alt/before  # A/B of two model folders

Models (issue 27). fla: `KDAForCausalLM(fla.models.KDAConfig(hidden_size=1024, num_hidden_layers=12,
head_dim=128, num_heads=8, vocab_size=32000, safe_gate=True, lower_bound=-5.0, intermediate_size=2816
[, attnres_block_size=6]))` (2816 is also what fla derives from its default `hidden_ratio=4`; untied embeddings,
fla's default; in training fla computes the loss with its fused linear cross-entropy). Ours, the twin:
`KDAMoEConfig` with the same sizes, every layer KDA (`kda_gate="bounded"`, lower bound -5) with a dense MLP of
2816, untied embeddings, `residual_mode="standard"` or `"block_attnres"` with 3 layers a block (= fla's 6
sublayers). The hybrid MoE (ours only: fla has no MoE KDA model): 3 KDA : 1 attention, layer 0 dense, the
rest 64 experts top-8 of width 384 plus 1 shared expert, Block AttnRes with 3 layers a block (969M parameters).

Rows: `dense` (8x4096), `attnres` (8x4096, Block AttnRes), `packed` (8x4096 as documents of 1024 tokens: ours gets
`position_ids` restarting every 1024 tokens, on the host as `kdamoe-train` passes them, and labels -100 at document
starts, as `kdamoe.data.rows_to_batch` makes them; fla gets the rows flattened to 1x32768 with `cu_seqlens`, its
varlen interface), `moe` (8x4096, the hybrid), `moe_packed` (the hybrid on packed documents of 1024, as `packed`),
`long_64k` / `long_256k` / `long_1m` (1 row of 65536 / 262144 / 1048576 tokens, activation checkpointing through
`gradient_checkpointing_enable()` on both).

A step is what a trainer does: forward with `labels` (both models shift them inside), backward, AdamW step
(fused on CUDA), `zero_grad(set_to_none=True)` and, for ours, `apply_load_balancing(to_host=False)` (the bias update;
its statistics stay on the device, reading them is one more copy). `--precision bf16` (the default): bf16 weights
(`model.to(torch.bfloat16)`, no autocast); `--precision amp`: fp32 weights, forward under bf16 autocast (what
`kdamoe-train` runs on a GPU: Accelerate's `mixed_precision="bf16"`), both libraries alike. Random token ids uniform
in [0, V), a fresh model per row.

Per row and library:
- step time: median over `--steps` timed steps after `--warmup` (`--long-steps` / `--long-warmup` for the long
  rows), each between two CUDA events recorded back to back (no host synchronisation between steps); `wall_ms`
  is the host's mean over the same steps;
- tokens/s = tokens per step / step time;
- MFU = F / (step time * `--peak-tflops`), with the model FLOPs of one step (activation recompute not counted)
      F = 6 * P * T + 18 * H * K * V * T * L_kda + 12 * H_a * d_a * n * T * L_attn
  T tokens; P the parameters that multiply each token (all but the input embedding, a lookup, when untied;
  routed experts at k/E of their count); per KDA layer the recurrent state's three products with a token,
  2*K*V FLOPs each (read with k for the delta, rank-1 write, read with q), forward and twice that backward
  (the chunked kernels' extra intra-chunk work is the algorithm's choice and not counted); per attention layer
  QK^T and PV at 2*d_a FLOPs per query-key pair each, n the mean number of keys a query sees ((L+1)/2 for
  causal documents of L tokens), times 3 with the backward;
- peak memory: `torch.cuda.max_memory_allocated`, reset before the model is built (weights, gradients, AdamW
  state and activations);
- host synchronisations per step: one more step under `torch.cuda.set_sync_debug_mode("warn")`, counting the
  "called a synchronizing CUDA operation" warnings with `warnings.catch_warnings(record=True)` and the "always"
  filter (c10's `warn_or_error_on_sync` issues a TORCH_WARN per synchronising call; warnings raised in the
  autograd engine's device threads are buffered and replayed on the calling thread, so the backward's count too).
  Only calls torch instruments are seen (`.item()`, `.tolist()`, `nonzero`, blocking copies, stream syncs...);
  `sync_counter_check` in the JSON is the count for one `.item()`, which must be 1;
- ratios ours/fla: speed = fla step time / ours, memory = ours peak / fla peak.
An exception in one library (out of memory included) is recorded as that cell's `error`; memory is freed and the
run goes on. The JSON is rewritten after every row; a markdown table is printed last. `--profile ROWS` writes a
torch.profiler table of one step of each of those rows per library (GPU kernels by total CUDA time, then operators by
self CUDA time) next to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import re
import statistics
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from model_folder import load_model_classes

import kdamoe

SYNC_MESSAGE = "called a synchronizing CUDA operation"
GIB = 2**30


@dataclass(frozen=True)
class Row:
    name: str
    batch: int
    seq_len: int
    residual: str = "standard"  # "standard" or "block_attnres"
    doc_len: int | None = None  # packed documents of this length
    moe: bool = False  # the hybrid MoE (ours only)
    checkpointing: bool = False

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


def rows_for(tiny: bool) -> list[Row]:
    b, t, doc = (2, 128, 32) if tiny else (8, 4096, 1024)
    longs = (256, 512, 1024) if tiny else (65536, 262144, 1048576)
    return [
        Row("dense", b, t),
        Row("attnres", b, t, residual="block_attnres"),
        Row("packed", b, t, doc_len=doc),
        Row("moe", b, t, residual="block_attnres", moe=True),
        Row("moe_packed", b, t, residual="block_attnres", doc_len=doc, moe=True),
        *(Row(name, 1, n, checkpointing=True) for name, n in zip(("long_64k", "long_256k", "long_1m"), longs)),
    ]


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(vocab=512, hidden=64, layers=2, heads=2, head_dim=32, inter=128, block_layers=1,
                    moe_layers=4, experts=8, top_k=2, expert_inter=32, attn_heads=2, kv_heads=1)
    return dict(vocab=32000, hidden=1024, layers=12, heads=8, head_dim=128, inter=2816, block_layers=3,
                moe_layers=12, experts=64, top_k=8, expert_inter=384, attn_heads=8, kv_heads=2)


def ours_config(row: Row, s: dict, ours=kdamoe) -> kdamoe.KDAMoEConfig:
    """The twin (or the hybrid MoE) as a config of `ours` (kdamoe, or an `--alt` model folder)."""
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                  kda_num_heads=s["heads"], kda_head_dim=s["head_dim"], kda_gate="bounded",
                  kda_gate_lower_bound=-5.0, residual_mode=row.residual, attnres_block_layers=s["block_layers"],
                  tie_word_embeddings=False, fuse_linear_cross_entropy=True)  # as fla's training loss
    if row.moe:  # the config's default layer pattern: 3 KDA : 1 attention, layer 0 dense, the rest MoE
        return ours.KDAMoEConfig(
            num_hidden_layers=s["moe_layers"],
            num_attention_heads=s["attn_heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
            num_experts=s["experts"], num_experts_per_tok=s["top_k"], moe_intermediate_size=s["expert_inter"],
            num_shared_experts=1, **common)
    n = s["layers"]
    return ours.KDAMoEConfig(num_hidden_layers=n, layer_types=["linear_attention"] * n,
                               mlp_layer_types=["dense"] * n, **common)


OURS = {"ours": kdamoe}  # library name -> namespace with KDAMoEConfig and KDAMoEForCausalLM (`--alt` adds)


def fla_config(row: Row, s: dict, fla_models):
    return fla_models.KDAConfig(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], head_dim=s["head_dim"], num_heads=s["heads"],
        vocab_size=s["vocab"], safe_gate=True, lower_bound=-5.0, intermediate_size=s["inter"],
        attnres_block_size=2 * s["block_layers"] if row.residual == "block_attnres" else None)


def make_batch(row: Row, lib: str, vocab: int, device: torch.device) -> dict:
    """Model inputs of one step: random ids, labels = ids (-100 at document starts when packed)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (row.batch, row.seq_len), generator=g)
    labels = ids.clone()
    extra = {}
    if row.doc_len is not None:
        position_ids = (torch.arange(row.seq_len) % row.doc_len).expand(row.batch, -1).contiguous()
        labels[position_ids == 0] = -100
        if lib in OURS:
            extra["position_ids"] = position_ids
        else:  # fla's varlen interface: one flat row and the document boundaries
            ids, labels = ids.reshape(1, -1), labels.reshape(1, -1)
            extra["cu_seqlens"] = torch.arange(0, row.tokens + 1, row.doc_len, dtype=torch.int32)
    batch = {"input_ids": ids, "labels": labels, **extra}
    # position_ids stay on the host, as kdamoe-train passes them (`train.rows_to_device`)
    return {k: v if k == "position_ids" else v.to(device) for k, v in batch.items()}


def step_flops(model, row: Row, lib: str) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    config = model.config
    params = dict(model.named_parameters())  # tied weights once
    total = sum(p.numel() for p in params.values())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel()
    if lib in OURS:
        routed = sum(p.numel() for n, p in params.items() if ".ffn.experts." in n)
        total -= routed * (1 - config.num_experts_per_tok / config.num_experts)
        kda_layers = config.layer_types.count("linear_attention")
        attn_layers = config.layer_types.count("full_attention")
        heads, k_dim, v_dim = config.kda_num_heads, config.kda_head_dim, config.kda_head_dim
        attn = config.num_attention_heads * config.head_dim
    else:
        kda_layers, attn_layers, attn = config.num_hidden_layers, 0, 0
        heads, k_dim = config.num_heads, config.head_dim
        v_dim = int(config.head_dim * config.expand_v)
    doc = row.doc_len or row.seq_len
    mean_keys = (doc + 1) / 2
    t = row.tokens
    return 6 * total * t + 18 * heads * k_dim * v_dim * t * kda_layers + 12 * attn * mean_keys * t * attn_layers


class Case:
    """One library's model, optimizer and batch for one row."""

    def __init__(self, row: Row, lib: str, s: dict, device: torch.device, dtype: torch.dtype, fla_models,
                 amp: bool = False):
        torch.manual_seed(0)
        self.amp = amp  # forward under bf16 autocast (fp32 weights)
        with device:
            if lib in OURS:
                self.model = OURS[lib].KDAMoEForCausalLM(ours_config(row, s, OURS[lib]))
            else:
                self.model = fla_models.KDAForCausalLM(fla_config(row, s, fla_models))
        if row.moe and not any(".ffn.experts." in name for name, _ in self.model.named_parameters()):
            raise ValueError("the hybrid MoE config built no MoE layer")
        self.model.to(dtype).train()
        if row.checkpointing:  # transformers >= 5.2x renames gradient_checkpointing_enable (a deprecated alias now)
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.batch = make_batch(row, lib, s["vocab"], device)
        self.lib = lib
        self.device = device

    def loss(self):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            return self.model(**self.batch).loss

    def forward_backward(self):
        self.loss().backward()

    def update(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lib in OURS:
            self.model.apply_load_balancing(to_host=False)  # statistics kept on the device: no host round trip

    def step(self):
        self.forward_backward()
        self.update()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def count_syncs(fn) -> int:
    """Host synchronisations torch reports while `fn()` runs (CUDA only)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_MESSAGE in str(w.message) for w in caught)


def time_steps(case: Case, steps: int) -> tuple[list[float], float]:
    """Per-step times in ms (CUDA events, or wall clock on the CPU) and the host's mean ms per step."""
    start_wall = time.perf_counter()
    if case.device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for start, end in events:
            start.record()
            case.step()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            case.step()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, (time.perf_counter() - start_wall) * 1e3 / steps


def profile_step(case: Case, path: Path, title: str) -> None:
    """One step under torch.profiler: GPU kernels by total CUDA time, then operators by self time."""
    cuda = case.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        case.step()
        case.sync()
    averages = prof.key_averages()
    lines = [f"# {title}", ""]
    if cuda:
        kernels = sorted((e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in kernels)
        lines += [f"## GPU kernels: {total / 1e3:.2f} ms in all", "", "     ms    share  launches  kernel"]
        lines += [f"{e.device_time_total / 1e3:9.3f} {100 * e.device_time_total / total:6.2f}% {e.count:8d}  {e.key}"
                  for e in kernels[:40]]
        lines += ["", "## operators by self CUDA time", ""]
    lines.append(averages.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40,
                                max_name_column_width=90))
    path.write_text("\n".join(lines) + "\n")


def memory_breakdown(case: Case) -> dict:
    """Where one step's memory goes (CUDA): what is allocated before the forward (weights, AdamW state), what the
    forward leaves for the backward, the backward's peak over that; and the tensors autograd saves, by the innermost
    module that saved them (layer indices as N; storages counted once, parameters left out), in GiB."""
    case.sync()
    params = {p.untyped_storage().data_ptr() for p in case.model.parameters()}
    stack, saved = [], {}

    names = {module: re.sub(r"\.\d+(?=\.|$)", ".N", name) or "(model)" for name, module in case.model.named_modules()}

    def enter(module, inputs):
        stack.append(names[module])

    def leave(module, inputs, output):
        stack.pop()

    handles = [h for m in case.model.modules() for h in (m.register_forward_pre_hook(enter),
                                                         m.register_forward_hook(leave))]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), (storage.nbytes(), stack[-1] if stack else "(no module)"))
        return t

    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = case.loss()
    finally:
        for h in handles:
            h.remove()
    case.sync()
    after_forward, forward_peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    case.sync()
    backward_peak = torch.cuda.max_memory_allocated()
    del loss
    case.update()
    by_module = {}
    for nbytes, owner in saved.values():
        by_module[owner] = by_module.get(owner, 0) + nbytes
    return {"before_forward_gib": base / GIB, "kept_by_forward_gib": (after_forward - base) / GIB,
            "forward_peak_gib": forward_peak / GIB, "backward_peak_gib": backward_peak / GIB,
            "saved_gib": sum(by_module.values()) / GIB,
            "saved_by_module_gib": {k: v / GIB for k, v in sorted(by_module.items(), key=lambda kv: -kv[1])}}


def checkpointing(model) -> bool:
    """Whether the model reports activation checkpointing on (the property's name depends on transformers)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(model.is_gradient_checkpointing)


def run_case(row: Row, lib: str, args, s: dict, device, dtype, fla_models) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    case = Case(row, lib, s, device, dtype, fla_models, amp=args.precision == "amp")
    steps, warmup = (args.long_steps, args.long_warmup) if row.checkpointing else (args.steps, args.warmup)
    for _ in range(warmup):
        case.step()
    case.sync()
    times, wall_ms = time_steps(case, steps)
    ms = statistics.median(times)
    flops = step_flops(case.model, row, lib)
    result = {
        "step_ms": ms,
        "step_ms_all": times,
        "wall_ms": wall_ms,
        "tokens_per_s": row.tokens / (ms / 1e3),
        "params": sum(p.numel() for p in case.model.parameters()),
        "flops_per_step": flops,
        "mfu": flops / (ms / 1e3) / (args.peak_tflops * 1e12) if cuda else None,
        "checkpointing": checkpointing(case.model),
    }
    if cuda:
        result["syncs_forward_backward"] = count_syncs(case.forward_backward)
        result["syncs_per_step"] = result["syncs_forward_backward"] + count_syncs(case.update)
    if row.name in args.profile:
        path = args.out.parent / f"{args.out.stem}_profile_{row.name}_{lib}.txt"
        profile_step(case, path, f"{lib}, row {row.name} ({row.batch}x{row.seq_len}), median step {ms:.1f} ms")
        result["profile"] = str(path)
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    if cuda and row.name in args.memory:  # after the peak is read: it resets the peak statistics
        result["memory"] = memory_breakdown(case)
    return result


def measure(row: Row, lib: str, args, s: dict, device, dtype, fla_models) -> dict:
    """`run_case`, or the error it raised (out of memory included) as `{"error": ...}`."""
    try:
        return run_case(row, lib, args, s, device, dtype, fla_models)
    except Exception as e:  # noqa: BLE001 - one library's failure must not end the run
        text = str(e).strip().splitlines()
        result = {"error": f"{type(e).__name__}: {text[0] if text else ''}"[:500]}
        if device.type == "cuda":
            result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        return result


def free_memory(device: torch.device) -> None:
    """Release what the last case left (its frames are gone once `measure` has returned)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ratios(results: dict) -> dict:
    ours, fla = results.get("ours", {}), results.get("fla", {})
    out = {}
    if "step_ms" in ours and "step_ms" in fla:
        out["speed"] = fla["step_ms"] / ours["step_ms"]
    if "peak_gib" in ours and "peak_gib" in fla and "error" not in ours and "error" not in fla:
        out["memory"] = ours["peak_gib"] / fla["peak_gib"]
    return out


def markdown(records: list[dict], libs: list[str]) -> str:
    def cell(r, key, fmt):
        if "error" in r:
            return "OOM" if "OutOfMemory" in r["error"] or "out of memory" in r["error"] else "error"
        if "skipped" in r or key not in r or r[key] is None:
            return "—"
        return fmt.format(r[key])

    cols = [("step ms", "step_ms", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"), ("MFU", "mfu", "{:.1%}"),
            ("peak GiB", "peak_gib", "{:.1f}"), ("syncs/step", "syncs_per_step", "{:d}")]
    head = ["row", "tokens"] + [f"{lib} {name}" for name, _, _ in cols for lib in libs]
    paired = "ours" in libs and "fla" in libs
    if paired:
        head += ["ours/fla speed", "ours/fla memory"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for rec in records:
        cells = [rec["row"], f"{rec['batch']}x{rec['seq_len']}"]
        for _, key, fmt in cols:
            cells += [cell(rec["results"].get(lib, {"skipped": ""}), key, fmt) for lib in libs]
        if paired:
            cells += [f"{rec['ratios'][k]:.2f}x" if k in rec["ratios"] else "—" for k in ("speed", "memory")]
        lines.append("| " + " | ".join(cells) + " |")
        for lib in libs:
            r = rec["results"].get(lib, {})
            if "error" in r or "skipped" in r:
                notes.append(f"- {rec['row']}, {lib}: {r.get('error') or r.get('skipped')}")
    return "\n".join(lines + ([""] + notes if notes else []))


def import_fla(libs: list[str]):
    """`(fla.models, note)` when "fla" is in `libs`; when fla cannot be imported, "fla" is removed from `libs` (the
    run goes on with ours only) and the note says why."""
    if "fla" not in libs:
        return None, "not requested"
    try:
        import fla.models as fla_models
    except Exception as e:  # noqa: BLE001 - any import failure means: run ours only
        libs.remove("fla")
        note = f"not importable ({type(e).__name__}: {e}); ran ours only"
        print(f"fla is {note}")
        return None, note
    return fla_models, "available"


def environment(device: torch.device, fla_note: str) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        commit = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "triton": version("triton"), "transformers": version("transformers"),
        "fla_core": version("fla-core"), "flash_linear_attention": version("flash-linear-attention"),
        "fla": fla_note, "commit": commit,
    }


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [r.name for r in rows_for(False)]
    p.add_argument("--rows", default=",".join(names), help=f"comma-separated subset of {','.join(names)}")
    p.add_argument("--libs", default="ours,fla", help="ours,fla or one of them (--alt adds its names)")
    p.add_argument("--alt", action="append", default=[], metavar="NAME=PATH",
                   help="also run the model of another copy of the model folder at PATH as library NAME, for an A/B "
                        "of two versions in one run (e.g. `git archive REV src/kdamoe/model | tar -x -C alt/NAME "
                        "--strip-components=3`); repeatable")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (10; 3 with --tiny)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (3; 1 with --tiny)")
    p.add_argument("--long-steps", type=int, default=None, help="timed steps of the long rows (3; 2 with --tiny)")
    p.add_argument("--long-warmup", type=int, default=1, help="warm-up steps of the long rows")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/model_h200.json"), help="results JSON")
    p.add_argument("--profile", metavar="ROWS", default="",
                   help="comma-separated rows: write a torch.profiler table of one step of each per library")
    p.add_argument("--memory", metavar="ROWS", default="",
                   help="comma-separated rows: also break one step's memory down (CUDA; `memory_breakdown`)")
    p.add_argument("--precision", choices=("bf16", "amp"), default="bf16",
                   help="bf16: bf16 weights, no autocast; amp: fp32 weights under bf16 autocast (kdamoe-train's numerics)")
    p.add_argument("--tiny", action="store_true", help="a few-layer tiny config on whatever device is present")
    p.add_argument("--kda-states-limit-gib", type=float, default=None,
                   help="ours: keep a KDA call's per-chunk states for the backward up to this many GiB (the model's "
                        "default: kda_chunk_fwd.STATES_LIMIT_BYTES); 0 recomputes them in the backward, as fla does")
    args = p.parse_args()
    args.steps = args.steps or (3 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.long_steps = args.long_steps or (2 if args.tiny else 3)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    args.libs = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    if unknown := sorted(set(args.rows) - set(names)):
        p.error(f"unknown rows {unknown}; known: {names}")
    if unknown := sorted(set(args.libs) - {"ours", "fla"}):
        p.error(f"unknown libs {unknown}; known: ours, fla")
    for alt in args.alt:
        name, sep, path = alt.partition("=")
        if not sep or not name.isidentifier() or name in ("ours", "fla") or not Path(path, "modeling_kdamoe.py").is_file():
            p.error(f"--alt {alt!r}: expected NAME=PATH, PATH a model folder holding modeling_kdamoe.py")
        OURS[name] = load_model_classes(name, path)
        args.libs.append(name)
    args.profile = [r.strip() for r in args.profile.split(",") if r.strip()]
    args.memory = [r.strip() for r in args.memory.split(",") if r.strip()]
    for flag, chosen in (("--profile", args.profile), ("--memory", args.memory)):
        if unknown := sorted(set(chosen) - set(args.rows)):
            p.error(f"{flag} {unknown} not among --rows")
    return args


def main() -> None:
    args = parse_args()
    if args.kda_states_limit_gib is not None:
        from kdamoe.model import kda_chunk_fwd

        kda_chunk_fwd.STATES_LIMIT_BYTES = int(args.kda_states_limit_gib * GIB)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and args.precision == "bf16" else torch.float32
    fla_models, fla_note = import_fla(args.libs)
    if not args.libs:
        raise SystemExit("no library left to run")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    s = sizes(args.tiny)
    report = {"environment": environment(device, fla_note), "dtype": str(dtype).removeprefix("torch."),
              "precision": args.precision,
              "tiny": args.tiny, "steps": args.steps, "warmup": args.warmup, "long_steps": args.long_steps,
              "long_warmup": args.long_warmup, "peak_tflops": args.peak_tflops,
              "kda_states_limit_gib": args.kda_states_limit_gib, "rows": []}
    if device.type == "cuda":
        report["sync_counter_check"] = count_syncs(lambda: torch.ones(1, device=device).item())
    for row in (r for r in rows_for(args.tiny) if r.name in args.rows):
        results = {}
        for lib in args.libs:
            if lib == "fla" and row.moe:
                results[lib] = {"skipped": "fla has no MoE KDA model"}
                continue
            print(f"[{row.name}] {lib} ...", flush=True)
            results[lib] = measure(row, lib, args, s, device, dtype, fla_models)
            free_memory(device)
            summary = {k: v for k, v in results[lib].items() if k != "step_ms_all"}
            print(f"[{row.name}] {lib}: {json.dumps(summary)}", flush=True)
        report["rows"].append({"row": row.name, "batch": row.batch, "seq_len": row.seq_len, "doc_len": row.doc_len,
                               "residual": row.residual, "moe": row.moe, "checkpointing": row.checkpointing,
                               "results": results, "ratios": ratios(results)})
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report["rows"], args.libs)
    if fla_note.startswith("not importable"):
        table += f"\n\nfla {fla_note}"
    report["markdown"] = table
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}\n")
    print(table)


if __name__ == "__main__":
    main()

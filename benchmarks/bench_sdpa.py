"""The attention layers' SDPA kernels at the hybrid MoE's shapes: which kernel the training step, packed documents and
a long prefill should run.

    PYTHONPATH=src python benchmarks/bench_sdpa.py --out benchmarks/results/sdpa_h100.json
    python benchmarks/bench_sdpa.py --shapes 8x4096:train,8x4096:train:doc1024 --methods flash,cudnn,mask,varlen

Shapes are ``BxT[:train][:docL]``: ``:train`` times forward+backward, else the forward under ``no_grad`` (as a
prefill runs it); ``:docL`` packs documents of L tokens in each row. Inputs: random bf16 ``q [B, Hq, T, Dh]``, ``k, v
[B, Hkv, T, Dh]`` (the hybrid's 8 query heads over 2 key-value heads of 128). Methods:

- causal rows: ``flash``, ``efficient``, ``cudnn`` — ``F.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)`` under that backend alone — and ``default``, no backend forced (what torch picks);
- packed rows: ``mask`` — the block-diagonal causal mask ``[B, 1, T, T]`` with k, v repeated to the query heads, as
  transformers' SDPA call runs a masked layer, torch's backend choice; ``per-document`` — one causal flash call a
  document (GQA); ``varlen`` — ``torch.nn.attention.varlen.varlen_attn`` over the flattened tokens with the
  documents' offsets (flash, one call).

Per cell: ms (median of ``--repeats`` after one untimed call, CUDA events), the first call's ms (cuDNN builds its
execution plan for the shape there: ``default`` runs after ``cudnn``, so a plan it reuses is cuDNN's), TFLOP/s
(causal FLOPs: half of ``4 B Hq T Tk Dh`` with Tk the document's length; forward+backward 3.5× the forward), and the
error of the output — and with ``:train``, of dq — at ``--rows`` sampled query rows of batch row 0 (the last among
them) against float64 attention over each row's keys (its document's, up to itself), relative: the largest error
over the largest reference entry. A method that refuses the inputs is recorded with its error message. Prints a
table, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kdamoe.model import modeling_kdamoe

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "default": None}
PACKED_METHODS = ("mask", "per-document", "varlen")


def parse_shape(text: str) -> tuple[int, int, bool, int | None]:
    """``BxT[:train][:docL]`` -> (B, T, train, L or None)."""
    size, *modes = text.split(":")
    b, t = (int(x) for x in size.split("x"))
    doc = next((int(m[3:]) for m in modes if m.startswith("doc")), None)
    if any(m != "train" and not m.startswith("doc") for m in modes) or (doc is not None and t % doc):
        raise SystemExit(f"bench_sdpa: shape {text!r}: BxT[:train][:docL] with L dividing T")
    return b, t, "train" in modes, doc


def reference_rows(q, k, v, rows, starts, do=None):
    """float64 attention of batch row 0's query positions ``rows`` ``[R]`` over keys ``starts[r] .. rows[r]``:
    ``(o [Hq, R, Dh], dq [Hq, R, Dh] or None)``, dq that of ``sum(o * do)`` when ``do`` is given."""
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[-1]
    group = hq // hkv
    qr = q[0, :, rows].double().reshape(hkv, group * len(rows), dim).requires_grad_(do is not None)
    scores = qr @ k[0].double().transpose(-1, -2) / math.sqrt(dim)  # [Hkv, group R, T]: the heads of a group stacked
    keys = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (keys > rows.repeat(group)[:, None]) | (keys < starts.repeat(group)[:, None])
    o = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v[0].double()  # [Hkv, group R, Dh]
    if do is None:
        return o.detach().view(hq, len(rows), dim), None
    o.backward(do[0, :, rows].double().reshape(o.shape))
    return o.detach().view(hq, len(rows), dim), qr.grad.view(hq, len(rows), dim)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def attend(method: str, q, k, v, doc: int | None):
    """``[B, Hq, T, Dh]`` attention of ``q`` over ``k, v`` by ``method`` (module docstring)."""
    b, hq, t, dim = q.shape
    group = hq // k.shape[1]
    if doc is None:
        with sdpa_kernel([BACKENDS[method]]) if BACKENDS[method] is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if method == "mask":
        pos = torch.arange(t, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] // doc == pos[:, None] // doc)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                              attn_mask=mask.expand(b, 1, t, t))
    if method == "per-document":
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            outs = [F.scaled_dot_product_attention(q[..., s:s + doc, :], k[..., s:s + doc, :], v[..., s:s + doc, :],
                                                   is_causal=True, enable_gqa=True) for s in range(0, t, doc)]
        return torch.cat(outs, dim=2)
    if modeling_kdamoe.varlen_attn is None:
        raise ImportError("this torch has no torch.nn.attention.varlen")
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], dim) for x in (q, k, v)]  # [B T, H, Dh]
    cu = torch.arange(0, b * t + 1, doc, device=q.device, dtype=torch.int32)
    kwargs = modeling_kdamoe._varlen_kwargs(group)  # as the model calls it
    if "enable_gqa" not in kwargs:
        flat[1:] = [x.repeat_interleave(group, 1) for x in flat[1:]]
    out = modeling_kdamoe.varlen_attn(*flat, cu, cu, doc, doc, **kwargs)
    return out.view(b, t, hq, dim).transpose(1, 2)


def run_cell(method: str, b: int, t: int, train: bool, doc: int | None, heads: tuple[int, int], dim: int,
             repeats: int, sample: int, gen: torch.Generator) -> dict:
    hq, hkv = heads
    dev = torch.device("cuda")
    q = torch.randn(b, hq, t, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, hkv, t, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, t, dim, device=dev, dtype=torch.bfloat16, generator=gen)
    do = torch.randn(b, hq, t, dim, device=dev, dtype=torch.bfloat16, generator=gen) if train else None
    for x in (q, k, v):
        x.requires_grad_(train)
    rows = torch.unique(torch.cat([torch.randint(0, t, (sample - 1,), device=dev, generator=gen),
                                   torch.tensor([t - 1], device=dev)]))
    starts = rows // doc * doc if doc else torch.zeros_like(rows)

    def timed():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.set_grad_enabled(train):
            o = attend(method, q, k, v, doc)
            if train:
                q.grad = k.grad = v.grad = None
                o.backward(do)
        end.record()
        torch.cuda.synchronize()
        return o, start.elapsed_time(end)

    cell = {"method": method, "shape": f"{b}x{t}", "doc": doc, "train": train}
    torch.cuda.synchronize()
    try:
        o, cell["first_ms"] = timed()
    except (RuntimeError, ImportError, TypeError) as e:  # the method refuses these inputs, or this torch lacks it
        cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return cell
    times = sorted(timed()[1] for _ in range(repeats))
    o = attend(method, q.detach(), k.detach(), v.detach(), doc)
    ms = times[len(times) // 2]
    span = doc or t
    flops = 4 * b * hq * t * span * dim / 2 * (3.5 if train else 1.0)
    ref_o, ref_dq = reference_rows(q.detach(), k.detach(), v.detach(), rows, starts, do)
    cell.update(ms=ms, tflops=flops / ms / 1e9, err_o=rel(o[0, :, rows], ref_o),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    if train:
        timed()  # q.grad of this method, for dq's error (dk, dv take every row: not checked)
        cell["err_dq"] = rel(q.grad[0, :, rows], ref_dq)
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x4096:train,8x4096:train:doc1024,1x65536:train,1x16384,1x65536,1x262144,"
                                       "1x1048576")
    p.add_argument("--methods", default="flash,efficient,cudnn,default,mask,per-document,varlen",
                   help="causal rows take flash/efficient/cudnn/default, packed rows mask/per-document/varlen")
    p.add_argument("--heads", default="8x2", help="query heads x key-value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=16, help="query rows checked against float64")
    p.add_argument("--skip", default="efficient@1x1048576", help="method@BxT cells left out (comma-separated)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sdpa: needs a CUDA GPU")
    heads = tuple(int(x) for x in args.heads.split("x"))
    skip = set(filter(None, args.skip.split(",")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "heads": args.heads, "head_dim": args.head_dim, "cells": []}
    for shape in args.shapes.split(","):
        b, t, train, doc = parse_shape(shape)
        for method in args.methods.split(","):
            if f"{method}@{b}x{t}" in skip or (method in PACKED_METHODS) != (doc is not None):
                continue
            torch.cuda.reset_peak_memory_stats()
            cell = run_cell(method, b, t, train, doc, heads, args.head_dim, args.repeats if t < 2**20 else 1,
                            args.rows, gen)
            report["cells"].append(cell)
            torch.cuda.empty_cache()
            print(json.dumps(cell), flush=True)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    print("\n| shape | documents | pass | method | ms | first call ms | TFLOP/s | err o | err dq |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in report["cells"]:
        head = f"| {c['shape']} | {c['doc'] or '—'} | {'fwd+bwd' if c['train'] else 'fwd'} | {c['method']} |"
        if "error" in c:
            print(f"{head} refused: {c['error'][:70]} | | | | |")
            continue
        print(f"{head} {c['ms']:.2f} | {c['first_ms']:.2f} | {c['tflops']:.0f} | {c['err_o']:.1e} | "
              f"{c.get('err_dq', float('nan')):.1e} |")


if __name__ == "__main__":
    main()

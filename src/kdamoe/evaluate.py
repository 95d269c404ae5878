"""`kdamoe-eval`: evaluate a saved kdamoe folder and write `eval.json` plus PNG plots.

    kdamoe-eval runs/tiny/final --output-dir runs/tiny/eval
    python -m kdamoe.evaluate PATH --output-dir DIR --dataset data/*.jsonl --seq-len 1024 --passkey-lengths 512,2048

Parts (each a top-level key of `eval.json`; every size is a flag, so tests can run them tiny):

- `perplexity`, `bits_per_byte`: next-token loss on packed rows of a held-out split (by default the training run's
  corpus and validation split, or its `--validation-dataset`, row length and row count, read from
  `training_info.json`, so the loss equals the training loop's validation loss). Bits per byte divide the summed
  loss (in bits) by the UTF-8 bytes of the predicted tokens (special tokens count 0 bytes).
- `length_extrapolation`: loss by token position in rows several times the training length (`loss_by_position.png`).
  Rows are the first tokens of held-out documents at least that long, topped up from the joined document stream.
- `passkey`: a number hidden at a ladder of depths in filler, at a ladder of context lengths; a trial is correct when
  greedy decoding reproduces every token of the number (checked in one teacher-forced forward); `passkey.png`.
- `moe`: per MoE layer, expert loads over the whole held-out split, `MaxVio_global = (max load - mean load) / mean
  load`, the mean per-batch MaxVio and the dead experts (load 0); `expert_load.png`.
- `attnres`: the mean softmax weight each AttnRes pseudo-query gives each source (source 0 = the embedding, source
  j = block j, or its running partial sum while open); `attnres_depth_weights.png`.
- `speed`: prefill tokens/s, decode tokens/s with the cache, and the bytes the cache holds (KDA conv + recurrent
  state vs attention keys/values) against context length; `speed.png`.
- `resources`: the seconds and, on CUDA, the peak allocated memory of each part.

Long contexts: `--max-context N` caps every length the parts use at N tokens (the defaults, which scale with the
training length, are cut to it; a length given above it is an error), so `--max-context 1048576` evaluates a model
trained on 1M-token rows at 1M and not beyond. No part makes `[tokens, vocab]` logits of a long row: the loss by
position runs the LM head over the final hidden states in chunks of `LOSS_CHUNK` positions, the passkey part keeps
the logits of the answer only, the speed part those of the last position.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data import SPLITS, STDLIB, TokenStream, load_corpus, tokenize_documents, validation_rows
from .errors import UsageError, check_safetensors, run_cli
from .model.moe import max_violation

PASSKEY_TEMPLATES = {
    # prefix, filler unit, needle, question, answer (all strings; the needle and answer hold `{key}`)
    "code": (
        "# A secret key is defined somewhere below. Remember it.\n",
        "x = x + 1  # keep going\n",
        "SECRET_KEY = {key}\n",
        "assert SECRET_KEY ==",
        " {key}",
    ),
    "text": (
        "There is an important number hidden inside a lot of irrelevant text. Find it and memorise it.\n",
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n",
        "The pass key is {key}. Remember it. {key} is the pass key.\n",
        "What is the pass key? The pass key is",
        " {key}",
    ),
}
LOSS_CHUNK = 16384  # positions per LM-head chunk of the loss by position (32K vocab: 2 GiB of fp32 logits)
LM_EVAL_TASK_DIR = Path(__file__).parent / "lm_eval_tasks"  # lm-evaluation-harness `--include_path` of the local task
PLOTS = {
    "length_extrapolation": "loss_by_position.png",
    "passkey": "passkey.png",
    "moe": "expert_load.png",
    "attnres": "attnres_depth_weights.png",
    "speed": "speed.png",
}


@dataclass
class EvalSettings:
    """Every knob of `kdamoe-eval`; None means "from the run's `training_info.json`, else the fallback"."""

    dataset: str | None = None  # fallback "stdlib"
    split: str | None = None  # "validation"; "all" of the run's --validation-dataset
    text_column: str | None = None  # fallback "text"
    validation_fraction: float | None = None  # fallback 0.05
    seq_len: int | None = None  # held-out row length; fallback 512
    rows: int | None = None  # held-out rows; fallback 32
    batch_size: int = 4
    position_length: int | None = None  # fallback 4 x training length
    position_rows: int = 4
    position_bins: int = 32
    passkey_lengths: list[int] | None = None  # fallback training length x (0.5, 1, 2, 4)
    passkey_depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    passkey_trials: int = 3
    passkey_style: str = "code"
    speed_lengths: list[int] | None = None  # fallback training length x (1, 2, 4, 8)
    decode_tokens: int = 32
    max_context: int | None = None  # the longest context any part uses (None: no cap)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0


# --------------------------------------------------------------------------------------------- helpers


def token_byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each token id stands for, `[vocab_size]` int64; special tokens count 0.

    Byte-level BPE tokens are strings over a 256-character byte alphabet (one character per byte); other
    tokenizers fall back to the bytes of each token decoded on its own.
    """
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and isinstance(backend.decoder, decoders.ByteLevel)
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    special = set(tokenizer.all_special_ids)
    lengths = [0] * vocab_size
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if i in added:
            lengths[i] = len(added[i].encode("utf-8"))
        elif byte_level:
            lengths[i] = len(piece)
        else:
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return torch.tensor(lengths, dtype=torch.int64)


def _cache_of(output):
    """The cache of a model output (transformers renamed `past_key_values` to `cache`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def cache_bytes(cache) -> list[int]:
    """Bytes held by each layer of a transformers cache (every tensor the layer object stores)."""
    return [sum(_tensor_bytes(v) for v in vars(layer).values()) for layer in cache.layers]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Resources:
    """Context manager measuring a block of work on `device`: `seconds` of wall time (the device synchronised at
    both ends) and, on CUDA, `peak_gib`, the peak allocated memory during it (None elsewhere)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = self.peak_gib = None

    def __enter__(self) -> "Resources":
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        _sync(self.device)
        self.seconds = time.perf_counter() - self._start
        if self.device.type == "cuda":
            self.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "peak_memory_gib": self.peak_gib}


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def attnres_source_layout(model) -> list[tuple[str, int]]:
    """`(name, number of sources)` of every AttnRes pseudo-query in forward order (empty in `standard` mode).

    Follows the residual stream: the embedding is source 0; a sublayer's output joins the running partial sum of
    the open block, which becomes a source when the block closes; a non-empty partial sum is the last source.
    """
    layout, completed, partial = [], 1, False
    for i, layer in enumerate(model.model.layers):
        for kind, closes in (("mixer", layer.close_block_after_mixer), ("ffn", layer.close_block_after_ffn)):
            if getattr(layer, f"{kind}_attn_res") is None:
                return []
            layout.append((f"layer{i}.{kind}", completed + int(partial)))
            partial = True
            if closes:
                completed, partial = completed + 1, False
    layout.append(("final", completed + int(partial)))
    return layout


def _depth_attention_modules(model) -> list:
    mods = []
    for layer in model.model.layers:
        mods += [layer.mixer_attn_res, layer.ffn_attn_res]
    return mods + [model.model.final_attn_res]


class _Probes:
    """Forward hooks on the MoE routers (expert loads) and AttnRes pseudo-queries (depth weights)."""

    def __init__(self, model):
        self.moe_layers = [i for i, layer in enumerate(model.model.layers) if layer.is_moe]
        self.num_experts = model.config.num_experts
        self.loads = {i: torch.zeros(self.num_experts, dtype=torch.int64) for i in self.moe_layers}
        self.batch_max_vio = {i: [] for i in self.moe_layers}
        self.layout = attnres_source_layout(model)
        self.weight_sums = [torch.zeros(n, dtype=torch.float64) for _, n in self.layout]
        self.tokens = 0
        self._handles = []
        for i in self.moe_layers:
            self._handles.append(model.model.layers[i].ffn.router.register_forward_hook(self._router_hook(i)))
        if self.layout:
            for j, module in enumerate(_depth_attention_modules(model)):
                self._handles.append(module.register_forward_hook(self._depth_hook(j)))

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            top_k_index = output[2]
            counts = torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.num_experts)
            self.loads[layer] += counts
            self.batch_max_vio[layer].append(max_violation(counts))
        return hook

    def _depth_hook(self, index: int):
        def hook(module, args, output):
            weights = module.depth_weights(args[0])  # [S, B, T]
            self.weight_sums[index] += weights.sum(dim=(1, 2)).double().cpu()
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# --------------------------------------------------------------------------------------------- parts


@torch.no_grad()
def heldout_metrics(model, tokenizer, val: dict[str, torch.Tensor], batch_size: int, device, bar) -> dict:
    """Loss, perplexity and bits per byte over packed held-out rows, with MoE loads and AttnRes depth weights.

    `val`: `input_ids`, `position_ids`, `labels` `[N, L]` (labels shifted inside: position t predicts t + 1).
    """
    byte_len = token_byte_lengths(tokenizer, model.config.vocab_size)
    probes = _Probes(model)
    nll_sum, tokens, n_bytes = 0.0, 0, 0
    try:
        for start in range(0, val["input_ids"].shape[0], batch_size):
            batch = {k: v[start:start + batch_size].to(device) for k, v in val.items()}
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            target = batch["labels"][:, 1:]
            nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, ignore_index=-100, reduction="sum")
            valid = target != -100
            nll_sum += float(nll)
            tokens += int(valid.sum())
            n_bytes += int(byte_len[target[valid].cpu()].sum())
            probes.tokens += batch["input_ids"].numel()
            bar.update(1)
    finally:
        probes.remove()
    if tokens == 0:
        raise UsageError("the held-out rows hold no labelled tokens")
    loss = nll_sum / tokens
    ppl = {"value": math.exp(loss), "loss": loss, "bits_per_token": loss / math.log(2), "tokens": tokens,
           "rows": int(val["input_ids"].shape[0]), "seq_len": int(val["input_ids"].shape[1])}
    bpb = {"value": nll_sum / math.log(2) / n_bytes if n_bytes else float("nan"), "bytes": n_bytes,
           "bytes_per_token": n_bytes / tokens}
    moe_layers = {}
    for i in probes.moe_layers:
        loads = probes.loads[i]
        moe_layers[str(i)] = {
            "loads": loads.tolist(),
            "load_fraction": (loads.double() / loads.sum()).tolist(),
            "max_vio_global": max_violation(loads),
            "max_vio_batch_mean": float(np.mean(probes.batch_max_vio[i])),
            "dead_experts": int((loads == 0).sum()),
        }
    moe = {"num_experts": model.config.num_experts, "top_k": model.config.num_experts_per_tok,
           "router_balancing": model.config.router_balancing, "tokens": probes.tokens, "layers": moe_layers}
    if moe_layers:
        moe["max_vio_global_mean"] = float(np.mean([v["max_vio_global"] for v in moe_layers.values()]))
        moe["dead_experts_total"] = sum(v["dead_experts"] for v in moe_layers.values())
    attnres = {"mode": model.config.residual_mode, "tokens": probes.tokens, "sublayers": [
        {"name": name, "weights": (sums / probes.tokens).tolist()}
        for (name, _), sums in zip(probes.layout, probes.weight_sums)
    ]}
    return {"perplexity": ppl, "bits_per_byte": bpb, "moe": moe, "attnres": attnres}


def long_rows(ds, tokenizer, length: int, rows: int) -> tuple[torch.Tensor, int]:
    """`[rows', length]` token rows: the first `length` tokens of held-out documents at least that long, then rows
    cut from the joined document stream (documents + eos) when too few are long enough. Returns (rows, number of
    single-document rows)."""
    out = []
    for ids in tokenize_documents((row["text"] for row in ds), tokenizer):
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == rows:
                break
    from_documents = len(out)
    stream = TokenStream(lambda epoch: tokenize_documents((row["text"] for row in ds), tokenizer),
                         tokenizer.eos_token_id, cycle=False)
    while len(out) < rows:
        tokens, _ = stream.read(length)
        if len(tokens) < length:
            break
        out.append(tokens.tolist())
    if not out:
        raise UsageError(f"the held-out split has fewer than {length} tokens (needed for --position-length)")
    return torch.tensor(out, dtype=torch.long), from_documents


@torch.no_grad()
def next_token_losses(model, ids: torch.Tensor, chunk: int = LOSS_CHUNK) -> torch.Tensor:
    """Next-token loss at every position of one row `ids [1, T]` -> `[T - 1]` fp32: the decoder's final hidden states,
    then the LM head `chunk` positions at a time, so no `[T, vocab]` logits exist (1M tokens x 32K vocab in fp32 is
    128 GiB)."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    targets = ids[0, 1:]
    losses = torch.empty(targets.shape, dtype=torch.float32, device=ids.device)
    for a in range(0, targets.numel(), chunk):
        logits = model.lm_head(hidden[a:a + chunk]).float()
        losses[a:a + chunk] = F.cross_entropy(logits, targets[a:a + chunk], reduction="none")
    return losses


@torch.no_grad()
def length_extrapolation(model, rows: torch.Tensor, from_documents: int, train_length: int, bins: int, device,
                         bar) -> dict:
    """Mean next-token loss by position over `rows [N, P]` (one forward each), in `bins` equal position bins."""
    length = rows.shape[1]
    total = torch.zeros(length - 1, dtype=torch.float64)
    for row in rows:
        total += next_token_losses(model, row[None].to(device)).double().cpu()
        bar.update(1)
    per_position = total / rows.shape[0]
    edges = np.linspace(0, length - 1, min(bins, length - 1) + 1).round().astype(int)
    by_bin = [float(per_position[a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]
    # position p of `per_position` is the loss of predicting token p + 1 from p + 1 tokens of context
    inside = per_position[: max(1, min(train_length, length) - 1)]
    beyond = per_position[train_length - 1:] if train_length < length else None
    return {"length": length, "train_length": train_length, "rows": int(rows.shape[0]),
            "rows_from_single_documents": from_documents, "bin_edges": edges.tolist(), "loss_by_bin": by_bin,
            "loss_within_train_length": float(inside.mean()),
            "loss_beyond_train_length": float(beyond.mean()) if beyond is not None else None}


def passkey_example(tokenizer, style: str, length: int, depth: float, key: int) -> tuple[list[int], list[int]]:
    """Token ids of one passkey prompt of about `length` tokens (needle at `depth` in [0, 1]) and of its answer."""
    if style not in PASSKEY_TEMPLATES:
        raise ValueError(f"unknown passkey style {style!r}; known: {sorted(PASSKEY_TEMPLATES)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must lie in [0, 1], got {depth}")
    prefix, unit, needle, question, answer = PASSKEY_TEMPLATES[style]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix_ids, unit_ids, question_ids = encode(prefix), encode(unit), encode(question)
    needle_ids, answer_ids = encode(needle.format(key=key)), encode(answer.format(key=key))
    fixed = len(prefix_ids) + len(needle_ids) + len(question_ids) + len(answer_ids)
    units = max(0, (length - fixed) // len(unit_ids))
    before = round(depth * units)
    prompt = prefix_ids + unit_ids * before + needle_ids + unit_ids * (units - before) + question_ids
    return prompt, answer_ids


@torch.no_grad()
def passkey(model, tokenizer, lengths: list[int], depths: list[float], trials: int, style: str, seed: int, device,
            bar) -> dict:
    """Greedy exact-match accuracy of the hidden number; `accuracy[i][j]` is for lengths[i] and depths[j]."""
    rng = np.random.default_rng(seed)
    accuracy, logprob, actual, per_length = [], [], [], []
    for length in lengths:
        acc_row, lp_row, sizes = [], [], []
        with Resources(device) as used:
            for depth in depths:
                hits, lps = 0, []
                for _ in range(trials):
                    prompt, answer = passkey_example(tokenizer, style, length, depth,
                                                     int(rng.integers(10_000, 100_000)))
                    ids = torch.tensor([prompt + answer], device=device)
                    # the logits predicting the answer only: positions len(prompt) - 1 ... T - 2
                    logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(answer) + 1).logits
                    logits = logits[0, :-1].float()
                    target = ids[0, len(prompt):]
                    hits += int(bool((logits.argmax(-1) == target).all()))
                    lps.append(float(logits.log_softmax(-1).gather(1, target[:, None]).sum()))
                    sizes.append(ids.shape[1])
                    bar.update(1)
                acc_row.append(hits / trials)
                lp_row.append(float(np.mean(lps)))
        accuracy.append(acc_row)
        logprob.append(lp_row)
        actual.append(int(np.mean(sizes)))
        per_length.append({"length": length, "seconds_per_trial": used.seconds / len(sizes),
                           "peak_memory_gib": used.peak_gib})
    return {"style": style, "target_lengths": lengths, "lengths": actual, "depths": depths, "trials": trials,
            "accuracy": accuracy, "answer_logprob": logprob, "mean_accuracy": float(np.mean(accuracy)),
            "resources_by_length": per_length}


@torch.no_grad()
def speed(model, lengths: list[int], decode_tokens: int, device, bar) -> dict:
    """Prefill and cached-decode throughput (batch 1) and cache bytes by layer kind, per context length."""
    layer_types = model.config.layer_types
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # One untimed prefill + decode at the first length: kernel compilation and first-call overheads stay out.
    warm = model(input_ids=torch.randint(0, vocab, (1, lengths[0]), generator=gen).to(device), use_cache=True,
                 logits_to_keep=1)
    for _ in range(min(2, decode_tokens)):
        model(input_ids=warm.logits[:, -1:].argmax(-1), past_key_values=_cache_of(warm), use_cache=True)
    del warm
    results = []
    for length in lengths:
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(device)
        with Resources(device) as prefill:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = _cache_of(out)
        per_layer = cache_bytes(cache)
        kda_before = sum(b for b, t in zip(per_layer, layer_types) if t == "linear_attention")
        next_id = out.logits[:, -1:].argmax(-1)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            out = model(input_ids=next_id, past_key_values=cache, use_cache=True)
            next_id = out.logits[:, -1:].argmax(-1)
        _sync(device)
        decode_s = time.perf_counter() - t0
        per_layer_after = cache_bytes(cache)
        kda = sum(b for b, t in zip(per_layer_after, layer_types) if t == "linear_attention")
        attn = sum(b for b, t in zip(per_layer_after, layer_types) if t == "full_attention")
        results.append({
            "context": length, "prefill_tokens_per_s": length / prefill.seconds,
            "prefill_peak_memory_gib": prefill.peak_gib,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens else None,
            "cache_bytes_kda": kda, "cache_bytes_attention": attn, "cache_bytes_kda_after_prefill": kda_before,
            "cache_tokens": length + decode_tokens,
        })
        del out, cache  # before the next length's prefill: one cache at a time
        bar.update(1)
    precision = _precision_name(next(model.parameters()).dtype, torch.is_autocast_enabled(device.type))
    return {"device": str(device), "dtype": precision, "batch_size": 1, "decode_tokens": decode_tokens, "results": results}


# --------------------------------------------------------------------------------------------- plots


def write_plots(report: dict, output_dir: Path) -> dict[str, str]:
    """Draw the PNGs of `PLOTS` that the report has data for; returns `{part: file name}`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = {}

    def save(fig, part: str) -> None:
        fig.tight_layout()
        fig.savefig(output_dir / PLOTS[part], dpi=110)
        plt.close(fig)
        written[part] = PLOTS[part]

    ext = report["length_extrapolation"]
    edges = np.array(ext["bin_edges"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot((edges[:-1] + edges[1:]) / 2 + 1, ext["loss_by_bin"], marker="o", ms=3)
    ax.axvline(ext["train_length"], color="grey", ls="--", label=f"training length {ext['train_length']}")
    ax.set(xlabel="token position", ylabel="loss (nats/token)", title="Loss by position (NoPE length extrapolation)")
    ax.legend()
    save(fig, "length_extrapolation")

    pk = report["passkey"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(pk["lengths"]), 1.2 + 0.5 * len(pk["depths"])))
    im = ax.imshow(np.array(pk["accuracy"]).T, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(len(pk["lengths"])), [str(n) for n in pk["lengths"]])
    ax.set_yticks(range(len(pk["depths"])), [f"{d:.0%}" for d in pk["depths"]])
    ax.set(xlabel="context length (tokens)", ylabel="needle depth", title="Passkey retrieval accuracy")
    fig.colorbar(im, ax=ax)
    save(fig, "passkey")

    layers = report["moe"]["layers"]
    if layers:
        frac = np.array([v["load_fraction"] for v in layers.values()])
        fig, ax = plt.subplots(figsize=(2 + 0.35 * frac.shape[1], 1.5 + 0.35 * frac.shape[0]))
        im = ax.imshow(frac * frac.shape[1], cmap="viridis", aspect="auto")
        ax.set_yticks(range(len(layers)), [f"layer {k} (MaxVio {v['max_vio_global']:.2f})" for k, v in layers.items()])
        ax.set(xlabel="expert", title="Expert load / uniform load (held-out split)")
        fig.colorbar(im, ax=ax)
        save(fig, "moe")

    subl = report["attnres"]["sublayers"]
    if subl:
        width = max(len(s["weights"]) for s in subl)
        grid = np.full((len(subl), width), np.nan)
        for r, s in enumerate(subl):
            grid[r, : len(s["weights"])] = s["weights"]
        fig, ax = plt.subplots(figsize=(4 + 0.5 * width, 1.2 + 0.28 * len(subl)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="magma", aspect="auto")
        ax.set_yticks(range(len(subl)), [s["name"] for s in subl])
        ax.set_xticks(range(width), ["embed"] + [f"block {j}" for j in range(1, width)])
        ax.set(xlabel="source", title="AttnRes depth weights\n(mean over held-out tokens)")
        fig.colorbar(im, ax=ax)
        save(fig, "attnres")

    res = report["speed"]["results"]
    ctx = [r["context"] for r in res]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    mib = 2.0**20
    axes[0].plot(ctx, [r["prefill_tokens_per_s"] for r in res], marker="o")
    axes[0].set(title="Prefill", ylabel="tokens/s")
    axes[1].plot(ctx, [r["decode_tokens_per_s"] or 0 for r in res], marker="o")
    axes[1].set(title="Decode with cache (batch 1)", ylabel="tokens/s")
    axes[2].plot(ctx, [r["cache_bytes_kda"] / mib for r in res], marker="o", label="KDA state (constant)")
    axes[2].plot(ctx, [r["cache_bytes_attention"] / mib for r in res], marker="s", label="attention KV (grows)")
    axes[2].set(title="Cache memory", ylabel="MiB")
    axes[2].legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.minorticks_off()
        ax.set(xlabel="context (tokens)")
    save(fig, "speed")
    return written


# --------------------------------------------------------------------------------------------- driver


def _resolve(settings: EvalSettings, info: dict) -> EvalSettings:
    """Fill the None fields of `settings` from the run record `info` (or the fallbacks); with `max_context`, cut the
    default lengths to it and refuse lengths given above it."""
    if settings.max_context is not None and settings.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {settings.max_context}")
    cap = settings.max_context or math.inf
    for name in ("seq_len", "position_length", "passkey_lengths", "speed_lengths"):
        value = getattr(settings, name)
        longest = max(value, default=0) if isinstance(value, list) else value or 0
        if longest > cap:
            raise UsageError(f"--{name.replace('_', '-')} asks for {longest} tokens, above --max-context {cap}")

    def capped(lengths: list[int]) -> list[int]:
        return sorted({min(n, cap) for n in lengths})

    s = EvalSettings(**asdict(settings))
    run = info.get("settings", {})
    stages = info.get("stages") or []
    train_length = max((st["seq_len"] for st in stages), default=None)
    first_length = stages[0]["seq_len"] if stages else None
    data = info.get("data", {})
    if s.dataset is None and data.get("validation_dataset"):  # the run validated on a corpus of its own
        s.dataset, s.split = data["validation_dataset"], s.split or "all"
    s.dataset = s.dataset or data.get("dataset") or STDLIB
    s.split = s.split or "validation"
    s.validation_fraction = s.validation_fraction or run.get("validation_fraction") or 0.05
    s.text_column = s.text_column or run.get("text_column") or "text"
    s.seq_len = s.seq_len or min(first_length or 512, cap)
    s.rows = s.rows or run.get("val_rows") or 32
    base = train_length or s.seq_len
    s.position_length = s.position_length or min(4 * base, cap)
    s.passkey_lengths = s.passkey_lengths or capped([max(16, base // 2), base, 2 * base, 4 * base])
    s.speed_lengths = s.speed_lengths or capped([base, 2 * base, 4 * base, 8 * base])
    for name in ("seq_len", "rows", "batch_size", "position_length", "position_rows", "position_bins",
                 "passkey_trials"):
        if getattr(s, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if s.seq_len < 2 or s.position_length < 2:
        raise UsageError("--seq-len and --position-length must be >= 2")
    if s.decode_tokens < 0:
        raise UsageError(f"--decode-tokens must be >= 0, got {s.decode_tokens}")
    if not s.passkey_lengths or not s.passkey_depths or not s.speed_lengths:
        raise UsageError("--passkey-lengths, --passkey-depths and --speed-lengths must not be empty")
    if s.passkey_style not in PASSKEY_TEMPLATES:
        raise UsageError(f"--passkey-style must be one of {sorted(PASSKEY_TEMPLATES)}, got {s.passkey_style!r}")
    return s


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _precision(settings: EvalSettings) -> tuple[torch.device, torch.dtype, bool]:
    """`(device, weight dtype, bf16 autocast)`. "autocast" (what "auto" means on CUDA): fp32 weights under bf16
    autocast, the numerics `kdamoe-train` trains in on a GPU; "auto" on the CPU: fp32."""
    name = settings.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    choice = settings.dtype
    if choice == "auto":
        choice = "autocast" if device.type == "cuda" else "float32"
    if choice == "autocast":
        return device, torch.float32, True
    if choice not in DTYPES:
        raise UsageError(f"--dtype must be 'auto', 'autocast' or one of {sorted(DTYPES)}, got {settings.dtype!r}")
    return device, DTYPES[choice], False


def _precision_name(dtype: torch.dtype, autocast: bool) -> str:
    return "float32 weights, bfloat16 autocast" if autocast else str(dtype).removeprefix("torch.")


def evaluate(path: str | Path, output_dir: str | Path, settings: EvalSettings | None = None,
             progress: bool = True, plots: bool = True) -> dict:
    """Run every part on the model folder `path`; write `output_dir/eval.json` and (unless `plots=False`, which
    needs no matplotlib) the plots; return the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, output_dir = Path(path), Path(output_dir)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a saved model folder (no config.json)")
    check_safetensors(path, "restore the folder, or for a kdamoe-train final/ delete it and rerun kdamoe-train "
                            "--resume, which writes it again from the last checkpoint")
    info_file = path / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    s = _resolve(settings or EvalSettings(), info)
    device, dtype, autocast = _precision(s)
    torch.manual_seed(s.seed)
    started = time.perf_counter()

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=dtype).to(device).eval()
    ds = load_corpus(s.dataset, s.split, text_column=s.text_column, validation_fraction=s.validation_fraction)
    val = validation_rows(ds, tokenizer, s.seq_len, s.rows)
    long, from_docs = long_rows(ds, tokenizer, s.position_length, s.position_rows)
    train_length = max((st["seq_len"] for st in info.get("stages") or []), default=s.seq_len)

    n_batches = math.ceil(val["input_ids"].shape[0] / s.batch_size)
    total = (n_batches + long.shape[0] + len(s.passkey_lengths) * len(s.passkey_depths) * s.passkey_trials
             + len(s.speed_lengths))
    resources = {}
    with (tqdm(total=total, desc="kdamoe-eval", disable=not progress, dynamic_ncols=True) as bar,
          torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)):
        bar.set_postfix_str("held-out loss")
        with Resources(device) as used:
            report = heldout_metrics(model, tokenizer, val, s.batch_size, device, bar)
        resources["heldout"] = used.as_dict()
        if not math.isfinite(report["perplexity"]["loss"]):
            raise UsageError(f"the model's held-out loss is not finite in {_precision_name(dtype, autocast)} on "
                             f"{device.type}: no metric of this run would mean anything; try --dtype float32")
        bar.set_postfix_str("loss by position")
        with Resources(device) as used:
            report["length_extrapolation"] = length_extrapolation(model, long, from_docs, train_length,
                                                                  s.position_bins, device, bar)
        resources["length_extrapolation"] = used.as_dict()
        bar.set_postfix_str("passkey")
        with Resources(device) as used:
            report["passkey"] = passkey(model, tokenizer, s.passkey_lengths, s.passkey_depths, s.passkey_trials,
                                        s.passkey_style, s.seed, device, bar)
        resources["passkey"] = used.as_dict()
        bar.set_postfix_str("speed")
        with Resources(device) as used:
            report["speed"] = speed(model, s.speed_lengths, s.decode_tokens, device, bar)
        resources["speed"] = used.as_dict()
    report["resources"] = resources

    report["perplexity"]["dataset"] = s.dataset
    report["perplexity"]["split"] = s.split
    report["model"] = {"path": str(path.resolve()), "parameters": sum(p.numel() for p in model.parameters()),
                       "train_length": train_length, "trained_val_loss": info.get("val_loss")}
    report["settings"] = asdict(s)
    report["environment"] = {"device": str(device), "dtype": _precision_name(dtype, autocast),
                             "torch": torch.__version__, "python": sys.version.split()[0],
                             "transformers": __import__("transformers").__version__}
    output_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, output_dir) if plots else {}
    report["elapsed_seconds"] = time.perf_counter() - started
    with open(output_dir / "eval.json", "w") as f:
        json.dump(report, f, indent=2, default=_json_default)
    return report


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    d = EvalSettings()
    p = argparse.ArgumentParser(prog="kdamoe-eval", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("path", help="saved model folder (save_pretrained + tokenizer)")
    p.add_argument("--output-dir", required=True, help="where eval.json and the plots go")
    p.add_argument("--dataset", help="held-out corpus: 'stdlib', local files, or a Hub name (default: the run's)")
    p.add_argument("--split", choices=SPLITS, help="split of --dataset (default: the run's held-out one)")
    p.add_argument("--text-column", help="default: the run's, else 'text'")
    p.add_argument("--validation-fraction", type=float, help="default: the run's")
    p.add_argument("--seq-len", type=int, help="held-out row length (default: the run's first stage)")
    p.add_argument("--rows", type=int, help="held-out rows (default: the run's --val-rows)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--position-length", type=int, help="row length of the loss-by-position part (default 4x train)")
    p.add_argument("--position-rows", type=int, default=d.position_rows)
    p.add_argument("--position-bins", type=int, default=d.position_bins)
    p.add_argument("--passkey-lengths", type=_ints, help="comma-separated token counts (default train x .5,1,2,4)")
    p.add_argument("--passkey-depths", type=_floats, default=d.passkey_depths, help="comma-separated, in [0, 1]")
    p.add_argument("--passkey-trials", type=int, default=d.passkey_trials)
    p.add_argument("--passkey-style", choices=sorted(PASSKEY_TEMPLATES), default=d.passkey_style)
    p.add_argument("--speed-lengths", type=_ints, help="comma-separated contexts (default train x 1,2,4,8)")
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens)
    p.add_argument("--max-context", type=int,
                   help="the longest context any part uses: the defaults are capped at it, longer lengths refused")
    p.add_argument("--device", default=d.device, help="auto: cuda when available, else cpu")
    p.add_argument("--dtype", default=d.dtype,
                   help="auto (autocast on cuda, float32 on cpu), autocast (float32 weights under bfloat16 autocast: "
                        "kdamoe-train's numerics on a GPU), float32, bfloat16 or float16")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true", help="write eval.json only (no matplotlib needed)")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of `kdamoe-eval` and `python -m kdamoe.evaluate`."""
    run_cli("kdamoe-eval", _main, argv)


def _main(argv: list[str] | None) -> None:
    args = vars(build_parser().parse_args(argv))
    path, output_dir, quiet = args.pop("path"), args.pop("output_dir"), args.pop("no_progress")
    plots = not args.pop("no_plots")
    report = evaluate(path, output_dir, EvalSettings(**args), progress=not quiet, plots=plots)
    ppl, bpb, pk = report["perplexity"], report["bits_per_byte"], report["passkey"]
    print(f"perplexity {ppl['value']:.3f} (loss {ppl['loss']:.4f} nats/token over {ppl['tokens']} tokens), "
          f"{bpb['value']:.4f} bits/byte; passkey accuracy {pk['mean_accuracy']:.2f}")
    if report["moe"]["layers"]:
        print("MaxVio_global per MoE layer: " + ", ".join(
            f"{k}: {v['max_vio_global']:.3f}" for k, v in report["moe"]["layers"].items()))
    print(f"wrote {Path(output_dir) / 'eval.json'} and {len(report['plots'])} plots")


__all__ = ["LM_EVAL_TASK_DIR", "EvalSettings", "Resources", "attnres_source_layout", "cache_bytes", "evaluate", "main",
           "next_token_losses", "passkey_example", "token_byte_lengths"]

if __name__ == "__main__":
    main()

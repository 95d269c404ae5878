"""Training-side glue for MoE load balancing: apply the pending update once per optimizer step, and measure what a
router bias can reach at all.

`model.apply_load_balancing()` (on `KDAMoEForCausalLM` / `KDAMoEModel`) applies every MoE layer's pending update
and returns `{layer_index: {"loads", "max_vio", "dead_experts", "bias_norm"}}`. Call it exactly once per
optimizer step, after `optimizer.step()`: with the HF Trainer through `LoadBalancingCallback`, in a plain loop
through `register_load_balancing_hook`.

`balance_floor(run)` measures, for a finished `kdamoe-train` run, the MaxVio_batch that a bias fitted before the
batch leaves when the router does not move at all: how far balance can go at that batch shape and corpus.
"""

import json
import logging
from pathlib import Path

import torch
from transformers import TrainerCallback

from .model.moe import max_violation, quantile_fixed_point

logger = logging.getLogger(__name__)


def summarize_balancing(stats: dict) -> dict:
    """Per-layer stats -> scalar metrics: `moe/max_vio_mean`, `moe/max_vio_max`, `moe/dead_experts`,
    `moe/bias_norm_mean` (empty dict when no layer had pending statistics)."""
    layers = [s for s in stats.values() if s]
    if not layers:
        return {}
    vio = [s["max_vio"] for s in layers]
    return {
        "moe/max_vio_mean": sum(vio) / len(vio),
        "moe/max_vio_max": max(vio),
        "moe/dead_experts": sum(s["dead_experts"] for s in layers),
        "moe/bias_norm_mean": sum(s["bias_norm"] for s in layers) / len(layers),
    }


class LoadBalancingCallback(TrainerCallback):
    """HF `TrainerCallback`: calls `model.apply_load_balancing()` at the end of every optimizer step.

    The latest per-layer stats are in `last_stats`; their summary (`summarize_balancing`, averaged over the steps
    since the previous log) is added to the Trainer's logs in `on_log` (to `logs` and to the last entry of
    `state.log_history`) and written to the `kdamoe.balancing` logger.
    """

    def __init__(self):
        self.last_stats: dict = {}
        self._window: list[dict] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("LoadBalancingCallback needs the model (the Trainer passes it as `model`)")
        model = getattr(model, "module", model)  # DDP / Accelerate wrappers
        self.last_stats = model.apply_load_balancing()
        summary = summarize_balancing(self.last_stats)
        if summary:
            self._window.append(summary)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._window:
            return
        summary = {key: sum(s[key] for s in self._window) / len(self._window) for key in self._window[0]}
        summary["moe/max_vio_max"] = max(s["moe/max_vio_max"] for s in self._window)
        self._window = []
        if logs is not None:
            logs.update(summary)
        if state.log_history:
            state.log_history[-1].update(summary)
        logger.info("step %d load balancing: %s", state.global_step, summary)


def register_load_balancing_hook(optimizer: torch.optim.Optimizer, model: torch.nn.Module):
    """Register an optimizer step post-hook that calls `model.apply_load_balancing()` after every real step.

    Wrappers exposing the wrapped torch optimizer as `.optimizer` (Accelerate's `AcceleratedOptimizer`) are
    unwrapped, so gradient-accumulation micro-steps that skip the inner step do not trigger it. Returns the hook
    handle (`handle.remove()` detaches it).
    """
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not hasattr(model, "apply_load_balancing"):
        model = getattr(model, "module", model)
    if not hasattr(model, "apply_load_balancing"):
        raise ValueError(f"{type(model).__name__} has no `apply_load_balancing()` method")
    return optimizer.register_step_post_hook(lambda opt, args, kwargs: model.apply_load_balancing())


def batch_max_vio(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> float:
    """MaxVio_batch of the tokens of `scores [N, E]` routed top-k with `bias [E]`."""
    top = torch.topk(scores + bias, top_k, dim=1).indices.flatten()
    return max_violation(torch.bincount(top, minlength=scores.shape[1]))


@torch.no_grad()
def router_scores_after(run: str | Path, batches: int, device: str) -> tuple[dict[int, list[torch.Tensor]], dict]:
    """The router scores of each MoE layer (`{layer: [batch scores [rows * seq_len, E] fp32 on the CPU, ...]}`) for
    the `batches` training batches that follow a finished `kdamoe-train` run in its own data order, routed with its
    final weights on `device`; and `{"rows", "seq_len", "top_k"}` of its first stage's batches."""
    from transformers import AutoTokenizer

    from .data import CorpusStream, PackedBatches, load_corpus, rows_to_batch
    from .model.modeling_kdamoe import KDAMoEForCausalLM

    run = Path(run)
    info = json.loads((run / "final" / "training_info.json").read_text())
    settings, stage = info["settings"], info["stages"][0]
    model = KDAMoEForCausalLM.from_pretrained(run / "final").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    split = load_corpus(settings["dataset"], "all" if settings["validation_dataset"] else "train",
                        text_column=settings["text_column"], validation_fraction=settings["validation_fraction"])
    rows = stage["micro_batch"] * stage["grad_accum"] * info["world_size"]
    data = PackedBatches(CorpusStream(split, tokenizer, settings["seed"]), [(stage["seq_len"], info["steps"] + batches,
                         rows)], settings["seed"], settings["shuffle_window_tokens"])
    scores: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.ffn.router.register_forward_hook(
        lambda m, a, out, i=i: scores.setdefault(i, []).append(out[1].float().cpu()))
        for i, layer in enumerate(model.model.layers) if layer.is_moe]
    for step in range(info["steps"], info["steps"] + batches):
        batch = rows_to_batch(*data.batch(step))
        model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device))
    for hook in hooks:
        hook.remove()
    return scores, {"rows": rows, "seq_len": stage["seq_len"], "top_k": model.config.num_experts_per_tok}


def balance_floor(run: str | Path, rows: list[int] | None = None, batches: int = 48, fit: int = 16,
                  iterations: int = 64, device: str | None = None) -> dict:
    """The MaxVio_batch that a bias fitted before the batch leaves when the router does not move: a finished
    `kdamoe-train` run's final weights route the `batches` training batches after its last step (its own data
    order, `router_scores_after`); per MoE layer the bias is the exact Quantile Balancing fixed point
    (`quantile_fixed_point`, `iterations` steps, float64 on `device`) of the first `fit` of them, and the other
    batches, regrouped into batches of R rows for each R of `rows` (default: the run's rows per step), are routed
    with it. Rows route by document, so a batch of few rows is off balance by its content alone.

    Returns `{"fitted", "rows_per_step", "seq_len", "table"}`: the fitted batches' own MaxVio (0 when the fit has
    converged) and per R `{"rows", "floor", "iid", "previous", "batches_x_layers"}`, means over the layers and
    batches: `floor` with the fitted bias; `iid` the same tokens shuffled across the fresh batches' rows; `previous`
    each fresh batch routed with the exact fixed point of the fresh batch before it (what a bias from the last step
    alone reaches at fixed weights)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not 0 < fit < batches:
        raise ValueError(f"fit must lie in [1, batches), got fit={fit}, batches={batches}")
    scores, shape = router_scores_after(run, batches, device)
    if not scores:
        raise ValueError(f"{run}: the model has no MoE layer")
    top_k = shape["top_k"]
    fits = []
    for layer in scores.values():
        fitted = torch.cat(layer[:fit]).double()
        zero = torch.zeros(fitted.shape[1], dtype=torch.float64, device=device)
        bias = quantile_fixed_point(fitted.to(device), zero, top_k, iterations).cpu()
        fits.append((bias, torch.cat(layer[fit:]).double(), batch_max_vio(fitted, bias, top_k)))
    table = []
    for r in rows or [shape["rows"]]:
        n = r * shape["seq_len"]
        floor, iid, previous = [], [], []
        for bias, rest, _ in fits:
            shuffled = rest[torch.randperm(rest.shape[0], generator=torch.Generator().manual_seed(0))]
            fresh = [rest[i:i + n] for i in range(0, rest.shape[0] - n + 1, n)]
            floor += [batch_max_vio(batch, bias, top_k) for batch in fresh]
            iid += [batch_max_vio(shuffled[i:i + n], bias, top_k) for i in range(0, rest.shape[0] - n + 1, n)]
            for before, batch in zip(fresh, fresh[1:]):
                last = quantile_fixed_point(before.to(device), bias.to(device), top_k, iterations).cpu()
                previous.append(batch_max_vio(batch, last, top_k))
        if not floor:
            raise ValueError(f"{batches - fit} fresh batches of {shape['rows']} rows hold no batch of {r} rows")
        table.append({"rows": r, "floor": sum(floor) / len(floor), "iid": sum(iid) / len(iid),
                      "previous": sum(previous) / len(previous) if previous else None,
                      "batches_x_layers": len(floor)})
    return {"fitted": sum(f[2] for f in fits) / len(fits), "rows_per_step": shape["rows"],
            "seq_len": shape["seq_len"], "table": table}


__all__ = ["LoadBalancingCallback", "balance_floor", "batch_max_vio", "register_load_balancing_hook",
           "router_scores_after", "summarize_balancing"]

"""Training-side glue for MoE load balancing: apply the pending update once per optimizer step.

`model.apply_load_balancing()` (on `KDAMoEForCausalLM` / `KDAMoEModel`) applies every MoE layer's pending update
and returns `{layer_index: {"loads", "max_vio", "dead_experts", "bias_norm"}}`. Call it exactly once per
optimizer step, after `optimizer.step()`: with the HF Trainer through `LoadBalancingCallback`, in a plain loop
through `register_load_balancing_hook`.
"""

import logging

import torch
from transformers import TrainerCallback

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


__all__ = ["LoadBalancingCallback", "register_load_balancing_hook", "summarize_balancing"]

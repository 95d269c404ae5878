"""`kdamoe-train`: train a kdamoe model with Accelerate (CPU, one GPU, DDP or FSDP2).

    kdamoe-train --preset tiny --output-dir runs/tiny                     # embedded corpus, 2 CPU cores
    kdamoe-train --preset small --dataset data/*.jsonl --stages 2048:2000,8192:500 --output-dir runs/small
    accelerate launch --config_file configs/accelerate_fsdp2.yaml -m kdamoe.train --preset small ...
    torchrun --nproc_per_node 2 -m kdamoe.train --preset tiny ...

Settings resolve as: built-in defaults < the preset's `training` defaults < `--config` file < explicit flags.
A config file is JSON: `{"preset": "tiny", "model": {KDAMoEConfig overrides}, "max_seq_len": int,
"tokenizer_vocab_size": int, "training": {flag_name: value}}` (every key optional).

**Stages.** `--stages 512:200,2048:100` trains 200 optimizer steps at 512 tokens per row, then 100 at 2048. Tokens
per optimizer step stay those of the first stage (`micro_batch_size * L1 * grad_accum * world_size`): a later
stage with rows `r` times longer uses `r` times fewer rows per micro-batch (at least 1), then more accumulation.
`--max-steps N` without `--stages` on the command line rescales the preset's (or config file's) stages to N steps
in total, and its warmup by the same factor unless `--warmup-steps` is given; with `--stages` it stops after N steps
of the staged run (the learning-rate schedule, warmup included, still spans every stage, so `--resume` continues the
same run).

**Validation** uses the held-out split of `--dataset` (see `kdamoe.data`), or with `--validation-dataset` every
document of that corpus, and then every document of `--dataset` trains.

**Data order** is a function of the step only: the global batch of step s is `rows` packed rows drawn from a
shuffled window of one deterministic token stream (`kdamoe.data.PackedBatches`); data-parallel rank r of `world`,
micro-batch m takes rows `(m * world + r) * micro ...`. A resumed run therefore sees exactly the batches of an
uninterrupted one.

**Context parallelism.** `--context-parallel N` splits every row across N consecutive ranks (a torch `DeviceMesh`
`("dp", "cp")`, see `parallel_layout`): rank c of a group trains columns `[c·L/N, (c+1)·L/N)` of its replica's rows
through the model's `context_parallel` argument (`kdamoe.model.context_parallel`), whose loss is the mean over the
group's tokens; world size / N data-parallel replicas split the rows, and DDP / FSDP2 average the gradients over
every rank (which gives the gradient of the replicas' mean loss, as without it). `torchrun --nproc_per_node 2 -m
kdamoe.train --context-parallel 2 ...` trains one process's batches on two.

**Expert parallelism.** `--expert-parallel N` shards every MoE layer's experts across N consecutive ranks (a
`DeviceMesh` `("ep_replicate", "ep")`, see `expert_layout` and `kdamoe.model.expert_parallel`); each rank still
trains its own rows. DDP leaves the expert weights to `expert_gradients`; clipping counts each shard once;
checkpoints keep each rank's shards and optimizer state (`rank{R}.pt`); `final/` holds the gathered model.

**Optimizer.** AdamW; no weight decay for 1-D parameters and for names with `A_log`, `dt_bias`, a `bias`, `norm`
or `attn_res` (see `param_groups`). Learning rate: linear warmup then cosine to `min_lr_ratio * lr`, or WSD
(warmup, constant, linear decay over the last `wsd_decay_fraction` of the steps), a pure function of the step.
`model.apply_load_balancing()` runs once per optimizer step, after `optimizer.step()`.

**Long contexts.** `--gradient-checkpointing` recomputes each decoder layer in the backward, keeping only its input;
`--offload-activations` keeps those inputs in pinned host memory until the backward (`kdamoe.offload.HostOffload`).
Packed rows of any length attend within their documents (per document past `DENSE_MASK_ELEMENTS`, see
`model_inputs.build_attention_mask`). `configs/small_staged_1m.json` runs the `small` preset 8K -> 64K -> 256K -> 1M
tokens a row on one GPU.

**Outputs** in `--output-dir`: `run_config.json`, `metrics.jsonl` (one JSON line per optimizer step; on CUDA with
the step's peak allocated memory, `peak_memory_gib`),
`tensorboard/`, `tokenizer/`, `checkpoints/step_XXXXXXXX` (`accelerator.save_state`, written to a hidden temp
dir and renamed when complete) and `final/` (`save_pretrained` + tokenizer + generation config +
`training_info.json`). `--resume` on a finished run changes nothing; one that trains further rewrites `final/` but
keeps what other tools added there (the model card, `eval/`).

**Errors** in what was asked for (flags, config file, data, output folder) are one line on stderr and exit status 2.
So is a step whose loss or gradient norm is not finite: the run stops before that optimizer step and saves the
weights of the step before it as a checkpoint (`stop_on_non_finite`), so diverged weights are never written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from tqdm.auto import tqdm

from .data import (STDLIB, CorpusStream, PackedBatches, describe_corpus, load_corpus, rows_to_batch, unigram_entropy,
                   validation_rows)
from .errors import UsageError, check_safetensors, run_cli
from .offload import HostOffload
from .presets import PRESETS, get_preset

if TYPE_CHECKING:
    from .model.context_parallel import ContextParallel
    from .model.expert_parallel import ExpertParallel

NO_DECAY_MARKERS = ("A_log", "dt_bias", "norm", "attn_res")
CHECKPOINT_PATTERN = re.compile(r"^step_(\d{8})$")
RUN_ARTEFACTS = ("run_config.json", "metrics.jsonl", "checkpoints", "final", "tokenizer", "tensorboard")
# Flags that may differ between an interrupted run and its --resume (everything else must match).
RESUME_FREE = {"max_steps", "save_every", "keep_checkpoints", "resume", "overwrite", "eval_every", "output_dir",
               "threads", "offload_activations"}
DEFAULTS = dict(
    dataset=STDLIB, validation_dataset=None, text_column="text", streaming=False, validation_fraction=0.05,
    tokenizer=None, tokenizer_vocab_size=None, stages=None, max_steps=None, micro_batch_size=8, grad_accum=1, lr=1e-3,
    min_lr_ratio=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95, adam_eps=1e-8, warmup_steps=100,
    schedule="cosine", wsd_decay_fraction=0.2, max_grad_norm=1.0, save_every=0, keep_checkpoints=2,
    seed=0, val_rows=32, eval_every=0, shuffle_window_tokens=1 << 20, threads=0, mixed_precision="auto", gradient_checkpointing=False,
    offload_activations=False, context_parallel=1, expert_parallel=1,
)


# --------------------------------------------------------------------------------------------- settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdamoe-train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a kdamoe model with Accelerate (see `python -c 'import kdamoe.train; "
                    "help(kdamoe.train)'`).",
        epilog="A flag left out takes the config file's value, else the preset's, else the built-in default:\n  "
               + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items()))
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model preset (default tiny)")
    p.add_argument("--config", default=None, help="JSON config file (see the module doc)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its last checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete the run already in --output-dir")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", help="'stdlib' (embedded), local text/jsonl/parquet files, dir or glob, or a Hub name")
    g.add_argument("--validation-dataset",
                   help="validate on every document of this corpus (same forms as --dataset); all of --dataset trains")
    g.add_argument("--text-column")
    g.add_argument("--streaming", action="store_true", default=None, help="stream the training corpus")
    g.add_argument("--validation-fraction", type=float)
    g.add_argument("--tokenizer", help="tokenizer folder (default: train a byte-level BPE on the train split)")
    g.add_argument("--tokenizer-vocab-size", type=int)
    g.add_argument("--val-rows", type=int, help="validation rows (of the first stage's length)")
    g.add_argument("--shuffle-window-tokens", type=int,
                   help="rows of a batch are drawn from shuffled windows of about this many consecutive tokens")
    t = p.add_argument_group("schedule")
    t.add_argument("--stages", help="seq_len:steps[,seq_len:steps...]")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--micro-batch-size", type=int, help="rows per device per micro-batch in the first stage")
    t.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step in the first stage")
    t.add_argument("--lr", type=float)
    t.add_argument("--min-lr-ratio", type=float)
    t.add_argument("--weight-decay", type=float)
    t.add_argument("--beta1", type=float)
    t.add_argument("--beta2", type=float)
    t.add_argument("--adam-eps", type=float)
    t.add_argument("--warmup-steps", type=int, help="(scaled with the stages by --max-steps unless given)")
    t.add_argument("--schedule", choices=("cosine", "wsd"))
    t.add_argument("--wsd-decay-fraction", type=float)
    t.add_argument("--max-grad-norm", type=float)
    t.add_argument("--seed", type=int)
    t.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), help="auto: bf16 on GPU, fp32 on CPU")
    t.add_argument("--gradient-checkpointing", action="store_true", default=None)
    t.add_argument("--offload-activations", action="store_true", default=None,
                   help="keep the activations saved for the backward in host memory (with --gradient-checkpointing: "
                        "the layers' inputs; see kdamoe.offload)")
    t.add_argument("--threads", type=int, help="CPU threads for torch (0: torch's default, one per core)")
    t.add_argument("--context-parallel", type=int, metavar="N",
                   help="split every row across groups of N ranks (N divides the number of processes and every "
                        "stage's sequence length; the other factor is data parallel)")
    t.add_argument("--expert-parallel", type=int, metavar="N",
                   help="shard every MoE layer's experts across groups of N ranks (N divides the number of "
                        "processes and of experts; DDP only)")
    o = p.add_argument_group("checkpoints and logging")
    o.add_argument("--save-every", type=int, help="checkpoint every N optimizer steps (0: only at the end)")
    o.add_argument("--keep-checkpoints", type=int, help="how many recent checkpoints to keep")
    o.add_argument("--eval-every", type=int, help="validation loss every N steps (0: only before and after)")
    return p


def resolve_settings(argv: list[str] | None = None) -> tuple[dict, dict, dict]:
    """Parse flags and merge them with the config file, the preset and the defaults.

    Returns `(settings, model_kwargs, limits)`: the training settings (flag name -> value), the `KDAMoEConfig`
    keyword arguments and `{"max_seq_len", "tokenizer_vocab_size"}`.
    """
    args = vars(build_parser().parse_args(argv))
    file_cfg = {}
    if args["config"]:
        try:
            file_cfg = json.loads(Path(args["config"]).read_text())
        except (OSError, ValueError) as error:
            raise UsageError(f"--config {args['config']}: {error}") from error
        unknown = set(file_cfg) - {"preset", "model", "max_seq_len", "tokenizer_vocab_size", "training"}
        if unknown:
            raise UsageError(f"config file {args['config']}: unknown keys {sorted(unknown)}")
    preset_name = args["preset"] or file_cfg.get("preset") or "tiny"
    preset = get_preset(preset_name)
    file_training = file_cfg.get("training", {})
    unknown = (set(file_training) | set(preset.training)) - set(DEFAULTS)
    if unknown:
        raise UsageError(f"unknown training settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    settings = {}
    for key, default in DEFAULTS.items():
        value = args.get(key)
        if value is None:
            value = file_training.get(key, preset.training.get(key, default))
        settings[key] = value
    settings.update(preset=preset_name, config=args["config"], output_dir=args["output_dir"],
                    resume=args["resume"], overwrite=args["overwrite"])
    model_kwargs = {**preset.model, **file_cfg.get("model", {})}
    limits = {"max_seq_len": int(file_cfg.get("max_seq_len", preset.max_seq_len)),
              "tokenizer_vocab_size": int(settings["tokenizer_vocab_size"]
                                          or file_cfg.get("tokenizer_vocab_size", preset.tokenizer_vocab_size))}
    if settings["stages"] is None:
        raise UsageError("no --stages given and the preset / config file defines none")
    if args["stages"] is None and settings["max_steps"] is not None:
        stages = parse_stages(settings["stages"], limits["max_seq_len"])
        scale = settings["max_steps"] / sum(steps for _, steps in stages)
        settings["stages"] = ",".join(f"{length}:{steps}" for length, steps in
                                      rescale_stages(stages, settings["max_steps"]))
        if args["warmup_steps"] is None:
            settings["warmup_steps"] = round(settings["warmup_steps"] * scale)
    return settings, model_kwargs, limits


def parse_stages(spec: str, max_seq_len: int) -> list[tuple[int, int]]:
    """`"512:200,2048:100"` -> `[(512, 200), (2048, 100)]`; `UsageError` on bad syntax or a length above the max."""
    stages = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if not match:
            raise UsageError(f"bad stage {part!r} in --stages {spec!r}; expected seq_len:steps[,seq_len:steps...]")
        length, steps = int(match[1]), int(match[2])
        if length < 2 or steps < 1:
            raise UsageError(f"stage {part!r}: seq_len must be >= 2 and steps >= 1")
        if length > max_seq_len:
            raise UsageError(f"stage {part!r}: sequence length {length} is above the preset's maximum {max_seq_len}")
        stages.append((length, steps))
    return stages


def rescale_stages(stages: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """Scale the steps of `stages` to sum to `total` (proportionally; stages that would get 0 steps are dropped)."""
    if total < 1:
        raise UsageError(f"--max-steps must be >= 1, got {total}")
    old = sum(s for _, s in stages)
    bounds = [round(total * sum(s for _, s in stages[: i + 1]) / old) for i in range(len(stages))]
    steps = [b - a for a, b in zip([0, *bounds[:-1]], bounds)]
    return [(length, n) for (length, _), n in zip(stages, steps) if n > 0]


@dataclass(frozen=True)
class StagePlan:
    seq_len: int
    steps: int
    micro_batch: int  # rows per device per micro-batch
    grad_accum: int  # micro-batches per optimizer step

    def rows(self, world: int) -> int:
        """Rows of the global batch of one optimizer step."""
        return self.micro_batch * self.grad_accum * world


def plan_stages(stages: list[tuple[int, int]], micro_batch_size: int, grad_accum: int, world: int) -> list[StagePlan]:
    """Micro-batch and accumulation per stage, keeping the first stage's tokens per optimizer step."""
    if micro_batch_size < 1 or grad_accum < 1:
        raise UsageError("--micro-batch-size and --grad-accum must be >= 1")
    first = stages[0][0]
    tokens_per_step = micro_batch_size * first * grad_accum * world
    plans = []
    for length, steps in stages:
        micro = max(1, micro_batch_size * first // length)
        accum = max(1, round(tokens_per_step / (micro * length * world)))
        plans.append(StagePlan(length, steps, micro, accum))
    return plans


def learning_rate(step: int, total: int, s: dict) -> float:
    """Learning rate of optimizer step `step` (0-based) of `total`: warmup, then cosine or WSD."""
    peak, warmup, floor = s["lr"], s["warmup_steps"], s["min_lr_ratio"]
    if step < warmup:
        return peak * (step + 1) / warmup
    if s["schedule"] == "cosine":
        progress = (step - warmup) / max(1, total - 1 - warmup)
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
    decay_steps = max(1, round(s["wsd_decay_fraction"] * total))
    decay_start = total - decay_steps
    if step < decay_start:
        return peak
    return peak * (1 - (1 - floor) * (step - decay_start + 1) / decay_steps)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay for 1-D tensors and for names holding `A_log`, `dt_bias`, `norm`,
    `attn_res`, or ending in `bias`; decay for every other (matrix / expert) weight."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        skip = param.ndim < 2 or leaf.endswith("bias") or any(m in name for m in NO_DECAY_MARKERS)
        (no_decay if skip else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# --------------------------------------------------------------------------------------------- run directory


def _fingerprint(settings: dict, model_config: dict, world_size: int) -> dict:
    """What must match between a checkpoint and the run resuming it (the world size sets the rows per step)."""
    config = {k: v for k, v in model_config.items() if k not in ("transformers_version", "architectures")}
    return {"settings": {k: v for k, v in settings.items() if k not in RESUME_FREE}, "model_config": config,
            "world_size": world_size}


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}: checkpoint {x!r} vs now {y!r}")
    return out


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step (temp dirs of interrupted writes are ignored)."""
    root = output_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = [d for d in root.iterdir() if CHECKPOINT_PATTERN.match(d.name) and (d / "trainer_state.json").is_file()]
    return max(done, key=lambda d: d.name, default=None)


def check_output_dir(settings: dict) -> list[str]:
    """Refuse to mix runs: an output dir holding a run needs --resume or --overwrite. Returns the run's artefacts."""
    out = Path(settings["output_dir"])
    existing = [name for name in RUN_ARTEFACTS if (out / name).exists()]
    if existing and not (settings["resume"] or settings["overwrite"]):
        raise UsageError(f"output directory {out} holds another run ({', '.join(existing)}); pass --resume to "
                         f"continue it or --overwrite to replace it")
    if settings["resume"] and settings["overwrite"]:
        raise UsageError("--resume and --overwrite exclude each other")
    return existing


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, state: dict, keep: int,
                    rank_state: dict | None = None) -> Path:
    """`accelerator.save_state` into `checkpoints/.tmp-step_N` (and `rank_state`, what differs between ranks, into
    `rank{R}.pt` by every rank), then `trainer_state.json`, then rename."""
    root = output_dir / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if rank_state is not None:
        torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(tmp / "trainer_state.json", "w") as f:
            json.dump(state, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted(d for d in root.iterdir() if CHECKPOINT_PATTERN.match(d.name))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def stop_on_non_finite(output_dir: Path, step: int, loss: float, grad_norm: float, precision: str,
                       save: Callable[[], Path] | None) -> None:
    """Raise `UsageError` for optimizer step `step + 1`, whose loss or gradient norm is not finite, before the
    optimizer takes it: the weights are still those after `step` steps. `save` writes them as that step's checkpoint
    (None where it exists: the step a run resumed from, a `--save-every` one), so no finite work is lost and no
    non-finite weights are written. Every rank calls this alike (both values are reduced over the ranks)."""
    kept = save() if save is not None else output_dir / "checkpoints" / f"step_{step:08d}"
    where = f"the weights after step {step} are in {kept}" if step > 0 else "no optimizer step was taken"
    raise UsageError(f"step {step + 1}: the loss ({loss}) or the gradient norm ({grad_norm}) is not finite "
                     f"(mixed precision: {precision}); stopped before the optimizer step, {where}")


# --------------------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Layout:
    """Where this process's share of a batch lies: the `data` data-parallel replicas take different rows (this one
    is `data_rank`), the `context_size` ranks of a context-parallel group the columns of the same rows (this one is
    `context_rank`; `context` is the group as the model takes it, None for whole rows)."""

    data: int
    data_rank: int
    context: ContextParallel | None = None
    context_size: int = 1
    context_rank: int = 0

    def columns(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's columns of every `[B, L]` tensor of `batch` (all of them without context parallelism)."""
        if self.context is None:
            return batch
        part = next(iter(batch.values())).shape[1] // self.context_size
        return {k: v[:, self.context_rank * part:(self.context_rank + 1) * part] for k, v in batch.items()}


def _check_degree(flag: str, degree: int, world: int) -> int:
    """`world` once the parallel degree given by `flag` is >= 1 and divides it; a `UsageError` otherwise."""
    if degree < 1:
        raise UsageError(f"{flag} must be >= 1, got {degree}")
    if world % degree:
        raise UsageError(f"{flag} {degree} does not divide the number of processes ({world}); launch a multiple of "
                         "it with torchrun or accelerate launch")
    return world


def parallel_layout(accelerator: Accelerator, context_parallel: int, lengths: list[int]) -> Layout:
    """The data x context layout of the processes: with `context_parallel` > 1 a torch `DeviceMesh` `("dp", "cp")`
    whose `cp` groups (consecutive ranks) split every row, with a process group of their own (so that their
    collectives never interleave with data parallelism's gradient all-reduce on the default group); DDP / FSDP2 run
    over every rank as without it. `UsageError` when N does not divide the processes or a stage's row length."""
    world = _check_degree("--context-parallel", context_parallel, accelerator.num_processes)
    for length in lengths:
        if length % context_parallel:
            raise UsageError(f"--context-parallel {context_parallel} does not divide the sequence length {length} of "
                             "a stage: every rank holds an equal part of each row")
    if context_parallel == 1:
        return Layout(world, accelerator.process_index)
    from torch.distributed.device_mesh import init_device_mesh

    from .model.context_parallel import ContextParallel

    mesh = init_device_mesh(accelerator.device.type, (world // context_parallel, context_parallel),
                            mesh_dim_names=("dp", "cp"), backend_override={"cp": torch.distributed.get_backend()})
    return Layout(world // context_parallel, mesh.get_local_rank("dp"), ContextParallel(mesh.get_group("cp")),
                  context_parallel, mesh.get_local_rank("cp"))


@dataclass(frozen=True)
class ExpertLayout:
    """Expert parallelism of a run: `group` (an `ExpertParallel`) shards the experts, `replicas` is the process
    group of the ranks holding the same shard (None when each shard lives on one rank)."""

    group: ExpertParallel
    replicas: object = None


def expert_layout(accelerator: Accelerator, expert_parallel: int) -> ExpertLayout | None:
    """`--expert-parallel N`: a torch `DeviceMesh` `("ep_replicate", "ep")` of shape `(world / N, N)`, its groups of
    their own (beside DDP's). `UsageError` when N does not divide the processes, or under FSDP (which would shard
    the experts' shards again)."""
    world = _check_degree("--expert-parallel", expert_parallel, accelerator.num_processes)
    if expert_parallel == 1:
        return None
    if accelerator.distributed_type == DistributedType.FSDP:
        raise UsageError("--expert-parallel runs under DDP (torchrun or accelerate launch without an FSDP config)")
    from torch.distributed.device_mesh import init_device_mesh

    from .model.expert_parallel import ExpertParallel

    backend = torch.distributed.get_backend()
    mesh = init_device_mesh(accelerator.device.type, (world // expert_parallel, expert_parallel),
                            mesh_dim_names=("ep_replicate", "ep"),
                            backend_override={"ep": backend, "ep_replicate": backend})
    replicas = mesh.get_group("ep_replicate") if world > expert_parallel else None
    return ExpertLayout(ExpertParallel(mesh.get_group("ep")), replicas)


@torch.no_grad()
def evaluate(model, accelerator: Accelerator, val: dict[str, torch.Tensor], micro_batch: int,
             layout: Layout) -> float:
    """Mean next-token loss (nats) over the labelled validation tokens; rows are split across the data-parallel
    replicas, columns across a context-parallel group (whose ranks return their rows' loss, counted once a rank)."""
    world, rank = layout.data, layout.data_rank
    n = val["input_ids"].shape[0] // world * world
    mine = {k: v[rank:n:world] for k, v in val.items()}
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i in range(0, mine["input_ids"].shape[0], micro_batch):
        batch = {k: v[i:i + micro_batch].to(accelerator.device) for k, v in mine.items()}
        count = (batch["labels"][:, 1:] != -100).sum()
        loss = model(**layout.columns(batch), context_parallel=layout.context).loss
        total += torch.stack([loss.double() * count, count.double()])
    total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return float(total[0] / total[1])


def stage_summary(records: list[dict]) -> list[dict]:
    """Per stage of a run's `metrics.jsonl` records: its row length and steps, the median tokens/s of its steps (the
    first step of a process also compiles kernels), the largest peak memory of a step (CUDA runs; else None), its
    first and last losses and whether every loss of the stage is finite."""
    out = []
    for stage in sorted({r["stage"] for r in records}):
        rows = [r for r in records if r["stage"] == stage]
        peaks = [r["peak_memory_gib"] for r in rows if "peak_memory_gib" in r]
        out.append({"stage": stage, "seq_len": rows[0]["seq_len"], "steps": len(rows),
                    "tokens_per_second": float(np.median([r["tokens_per_second"] for r in rows])),
                    "peak_memory_gib": max(peaks) if peaks else None, "loss_first": rows[0]["loss"],
                    "loss_last": rows[-1]["loss"], "loss_finite": all(math.isfinite(r["loss"]) for r in rows)})
    return out


def _load_or_train_tokenizer(settings: dict, limits: dict, train_ds, accelerator: Accelerator, out: Path):
    from transformers import AutoTokenizer

    from .tokenizer import train_tokenizer

    path = settings["tokenizer"] or str(out / "tokenizer")
    need_training = settings["tokenizer"] is None and not (out / "tokenizer" / "tokenizer.json").is_file()
    accelerator.wait_for_everyone()  # every rank has decided before the main process writes
    if need_training and accelerator.is_main_process:
        train_tokenizer((row["text"] for row in train_ds), limits["tokenizer_vocab_size"], save_dir=path)
    accelerator.wait_for_everyone()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"--tokenizer {path}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise UsageError(f"tokenizer {path} has no eos token (needed to separate packed documents)")
    return tokenizer


def _json_safe(value):
    """A TensorBoard hparam value: numbers, strings and booleans pass, anything else becomes its string."""
    return value if isinstance(value, (int, float, str, bool)) else str(value)


def train(argv: list[str] | None = None, return_model: bool = False):
    """Run `kdamoe-train` with `argv`; returns the run summary (also written to `final/training_info.json`), and
    with `return_model=True` also this process's trained (unwrapped) model: `(summary, model)`."""
    from transformers import GenerationConfig

    from .model.configuration_kdamoe import KDAMoEConfig
    from .model.expert_parallel import (clip_grad_norm_, expert_gradients, expert_parameter_names, gather_experts,
                                        shard_experts)
    from .model.modeling_kdamoe import KDAMoEForCausalLM

    settings, model_kwargs, limits = resolve_settings(argv)
    stages = parse_stages(settings["stages"], limits["max_seq_len"])
    total_steps = sum(steps for _, steps in stages)
    end_step = total_steps if settings["max_steps"] is None else min(settings["max_steps"], total_steps)
    for key, low in (("val_rows", 1), ("keep_checkpoints", 0), ("save_every", 0), ("eval_every", 0),
                     ("warmup_steps", 0), ("max_steps", 1), ("shuffle_window_tokens", 1), ("threads", 0)):
        if settings[key] is not None and settings[key] < low:
            raise UsageError(f"--{key.replace('_', '-')} must be >= {low}, got {settings[key]}")
    if settings["max_grad_norm"] <= 0 or settings["lr"] <= 0:
        raise UsageError("--lr and --max-grad-norm must be > 0")
    out = Path(settings["output_dir"])
    if settings["threads"]:
        torch.set_num_threads(settings["threads"])

    mixed = settings["mixed_precision"]
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() else "no"
    # Router biases are buffers that every rank updates identically (balancing statistics are all-reduced), so DDP
    # need not broadcast buffers; some experts of a MoE layer may see no token in a micro-batch.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=True)
    # cpu=True without CUDA: Accelerate then runs torchrun / accelerate-launch processes as a gloo group.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed, log_with="tensorboard",
                              project_dir=str(out), kwargs_handlers=[ddp])
    world = accelerator.num_processes
    previous_run = check_output_dir(settings)
    layout = parallel_layout(accelerator, settings["context_parallel"], [length for length, _ in stages])
    experts = expert_layout(accelerator, settings["expert_parallel"])
    data_world = layout.data  # rows are split across the data-parallel replicas only
    plans = plan_stages(stages, settings["micro_batch_size"], settings["grad_accum"], data_world)
    set_seed(settings["seed"])

    # data (read before anything is written, so that a bad corpus leaves the output folder as it was)
    corpus_kwargs = dict(streaming=settings["streaming"], text_column=settings["text_column"],
                         validation_fraction=settings["validation_fraction"])
    held_out = settings["validation_dataset"]
    train_ds = load_corpus(settings["dataset"], "all" if held_out else "train", **corpus_kwargs)
    val_ds = load_corpus(held_out or settings["dataset"], "all" if held_out else "validation", **corpus_kwargs)
    created = not out.exists()
    if accelerator.is_main_process:
        for name in previous_run if settings["overwrite"] else []:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    new = [out / name for name in RUN_ARTEFACTS if not (out / name).exists()]
    try:
        tokenizer = _load_or_train_tokenizer(settings, limits, train_ds, accelerator, out)
        corpus = CorpusStream(train_ds, tokenizer, settings["seed"])
        val = validation_rows(val_ds, tokenizer, plans[0].seq_len, settings["val_rows"])
        try:
            config = KDAMoEConfig(**{**model_kwargs, "vocab_size": len(tokenizer),
                                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                                     "eos_token_id": tokenizer.eos_token_id})
        except ValueError as error:
            raise UsageError(f"model config: {error}") from error
        if experts is not None and ("sparse" not in config.mlp_layer_types
                                    or config.num_experts % experts.group.size):
            raise UsageError(f"--expert-parallel {experts.group.size} needs MoE layers whose experts it divides "
                             f"(the model has {config.num_experts} experts, "
                             f"{config.mlp_layer_types.count('sparse')} MoE layers)")
    except UsageError:  # a user error before training: leave no half-made run behind
        if accelerator.is_main_process:
            for path in [out] if created else new:
                shutil.rmtree(path, ignore_errors=True)
        raise
    baseline = unigram_entropy(val["labels"])

    # model and optimizer
    fingerprint = _fingerprint(settings, config.to_dict(), world)
    model = KDAMoEForCausalLM(config)
    model.config.fuse_linear_cross_entropy = True  # the loss without [tokens, vocab] logits; saved folders say False
    n_params = sum(p.numel() for p in model.parameters())  # the whole model's, before any sharding
    sharded = []
    if experts is not None:  # every rank built the same weights (one seed); each keeps its experts
        shard_experts(model, experts.group)
        sharded = expert_parameter_names(model)
        model._ddp_params_and_buffers_to_ignore = sharded  # DDP leaves them alone: expert_gradients reduces them
    if settings["gradient_checkpointing"]:  # transformers >= 5.2x names it activation_checkpointing_enable
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    optimizer = torch.optim.AdamW(param_groups(model, settings["weight_decay"]), lr=settings["lr"],
                                  betas=(settings["beta1"], settings["beta2"]), eps=settings["adam_eps"])
    model, optimizer = accelerator.prepare(model, optimizer)
    raw_model = accelerator.unwrap_model(model)

    def rank_state() -> dict | None:
        """What a checkpoint keeps per rank: its expert shards and its optimizer state (theirs included)."""
        if experts is None:
            return None
        named = dict(raw_model.named_parameters())
        return {"experts": {name: named[name].detach() for name in sharded}, "optimizer": optimizer.state_dict()}

    start_step = 0
    checkpoint = latest_checkpoint(out) if settings["resume"] else None
    if checkpoint is not None:
        with open(checkpoint / "trainer_state.json") as f:
            state = json.load(f)
        diffs = _differences(state["fingerprint"], json.loads(json.dumps(fingerprint)))
        if diffs:
            raise UsageError(f"checkpoint {checkpoint} comes from a different config: " + "; ".join(diffs))
        check_safetensors(checkpoint, f"delete {checkpoint} to resume from the checkpoint before it")
        accelerator.load_state(str(checkpoint))
        if experts is not None:  # load_state gave every rank the main process's shards
            mine = torch.load(checkpoint / f"rank{accelerator.process_index}.pt", map_location="cpu",
                              weights_only=True)
            named = dict(raw_model.named_parameters())
            with torch.no_grad():
                for name, value in mine["experts"].items():
                    named[name].copy_(value)
            optimizer.load_state_dict(mine["optimizer"])
        start_step = state["step"]
        accelerator.print(f"resumed from {checkpoint} at step {start_step}")
        info = out / "final" / "training_info.json"
        if start_step >= end_step and info.is_file():
            accelerator.print(f"the run already reached step {end_step}: nothing to train, {out / 'final'} is kept")
            summary = json.loads(info.read_text())
            return (summary, raw_model) if return_model else summary
    elif settings["resume"]:
        accelerator.print(f"--resume: no checkpoint in {out}, starting from scratch")

    # step -> (stage plan, tokens trained before it); batches are a function of the step alone
    step_plan, offsets, consumed = [], [], 0
    for plan in plans:
        for _ in range(plan.steps):
            step_plan.append(plan)
            offsets.append(consumed)
            consumed += plan.rows(data_world) * plan.seq_len
    batches = PackedBatches(corpus, [(p.seq_len, p.steps, p.rows(data_world)) for p in plans], settings["seed"],
                            settings["shuffle_window_tokens"])

    metrics_path = out / "metrics.jsonl"
    if accelerator.is_main_process:
        keep = []
        if start_step and metrics_path.exists():
            keep = [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= start_step]
        metrics_path.write_text("".join(line + "\n" for line in keep))
        with open(out / "run_config.json", "w") as f:
            json.dump({"settings": settings, "limits": limits, "model_config": config.to_dict(),
                       "stages": [plan.__dict__ for plan in plans], "world_size": world}, f, indent=2)
    accelerator.init_trackers("tensorboard", config={k: _json_safe(v) for k, v in settings.items()})
    if accelerator.is_main_process and not accelerator.trackers:
        raise RuntimeError("TensorBoard logging is unavailable; install the `tensorboard` package")

    split = f" ({data_world} data parallel x {layout.context_size} context parallel)" if layout.context else ""
    split += f"; experts sharded over {experts.group.size} ranks" if experts else ""
    accelerator.print(f"model: {n_params / 1e6:.2f}M parameters; world size {world}{split}; mixed precision {mixed}")
    for i, plan in enumerate(plans):
        accelerator.print(f"stage {i}: seq_len {plan.seq_len}, {plan.steps} steps, {plan.rows(data_world)} rows/step "
                          f"(micro-batch {plan.micro_batch} x accum {plan.grad_accum} x {data_world} ranks)")
    accelerator.print(f"validation: {val['input_ids'].shape[0]} rows x {plans[0].seq_len} tokens; "
                      f"unigram entropy baseline {baseline:.4f} nats")
    val_before = evaluate(model, accelerator, val, plans[0].micro_batch, layout)
    accelerator.print(f"validation loss before training: {val_before:.4f} (ppl {math.exp(val_before):.1f})")

    cuda = accelerator.device.type == "cuda"
    offload = HostOffload if settings["offload_activations"] else contextlib.nullcontext
    model.train()
    bar = tqdm(total=end_step, initial=start_step, disable=not accelerator.is_local_main_process,
               desc="train", dynamic_ncols=True)
    started = time.perf_counter()
    trained_tokens = 0
    for step in range(start_step, end_step):
        if cuda:
            torch.cuda.reset_peak_memory_stats(accelerator.device)
        t0 = time.perf_counter()
        plan = step_plan[step]
        rows = plan.rows(data_world)
        tokens, starts = batches.batch(step)
        lr = learning_rate(step, total_steps, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=accelerator.device)
        for micro in range(plan.grad_accum):
            first = (micro * data_world + layout.data_rank) * plan.micro_batch
            batch = layout.columns(rows_to_device(tokens[first:first + plan.micro_batch],
                                                  starts[first:first + plan.micro_batch], accelerator.device))
            sync = micro == plan.grad_accum - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                with offload():
                    loss = model(**batch, context_parallel=layout.context).loss
                accelerator.backward(loss / plan.grad_accum)
            loss_sum += loss.detach()
        if experts is not None:
            expert_gradients(raw_model, world, experts.replicas)
            grad_norm = clip_grad_norm_(raw_model, settings["max_grad_norm"])
        else:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        step_loss = float(accelerator.reduce(loss_sum / plan.grad_accum, reduction="mean"))
        grad_norm = float(grad_norm)
        if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
            optimizer.zero_grad(set_to_none=True)
            saved = step == start_step or (settings["save_every"] and step % settings["save_every"] == 0)
            stop_on_non_finite(out, step, step_loss, grad_norm, mixed, None if saved else (
                lambda: save_checkpoint(accelerator, out, step, {"step": step, "fingerprint": fingerprint},
                                        settings["keep_checkpoints"], rank_state())))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balance = raw_model.apply_load_balancing()
        elapsed = time.perf_counter() - t0
        step_tokens = rows * plan.seq_len
        trained_tokens += step_tokens
        record = {"step": step + 1, "stage": plans.index(plan), "seq_len": plan.seq_len, "loss": step_loss,
                  "ppl": math.exp(min(step_loss, 50.0)), "lr": lr, "grad_norm": grad_norm,
                  "tokens": offsets[step] + step_tokens, "tokens_per_second": step_tokens / elapsed,
                  "max_vio": {str(k): float(v["max_vio"]) for k, v in balance.items()},
                  "dead_experts": {str(k): int(v["dead_experts"]) for k, v in balance.items()}}
        if cuda:
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(accelerator.device) / 2**30
        if settings["eval_every"] and (step + 1) % settings["eval_every"] == 0 and step + 1 < end_step:
            record["val_loss"] = evaluate(model, accelerator, val, plans[0].micro_batch, layout)
        if accelerator.is_main_process:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {"train/loss": step_loss, "train/ppl": record["ppl"], "train/lr": lr,
                   "train/grad_norm": record["grad_norm"], "train/tokens_per_second": record["tokens_per_second"],
                   "train/seq_len": plan.seq_len}
        scalars.update({f"moe/max_vio_layer{k}": v for k, v in record["max_vio"].items()})
        if "val_loss" in record:
            scalars["val/loss"] = record["val_loss"]
        accelerator.log(scalars, step=step + 1)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_second']:.0f}")
        if settings["save_every"] and (step + 1) % settings["save_every"] == 0 and step + 1 < end_step:
            save_checkpoint(accelerator, out, step + 1, {"step": step + 1, "fingerprint": fingerprint},
                            settings["keep_checkpoints"], rank_state())
    bar.close()
    train_seconds = time.perf_counter() - started

    if end_step > start_step:
        save_checkpoint(accelerator, out, end_step, {"step": end_step, "fingerprint": fingerprint},
                        settings["keep_checkpoints"], rank_state())
    val_after = evaluate(model, accelerator, val, plans[0].micro_batch, layout)
    accelerator.print(f"validation loss after {end_step} steps: {val_after:.4f} (ppl {math.exp(val_after):.1f}); "
                      f"before {val_before:.4f}; unigram baseline {baseline:.4f}")
    stages_run = []
    if accelerator.is_main_process:
        stages_run = stage_summary([json.loads(line) for line in metrics_path.read_text().splitlines()])
    for st in stages_run:
        peak = f", peak {st['peak_memory_gib']:.1f} GiB" if st["peak_memory_gib"] is not None else ""
        accelerator.print(f"stage {st['stage']}: {st['seq_len']} tokens a row, {st['steps']} steps, "
                          f"{st['tokens_per_second']:,.0f} tokens/s{peak}, loss {st['loss_first']:.4f} -> "
                          f"{st['loss_last']:.4f}")
    summary = {
        "preset": settings["preset"], "settings": settings, "stages": [plan.__dict__ for plan in plans],
        "world_size": world, "context_parallel": layout.context_size,
        "expert_parallel": experts.group.size if experts else 1, "mixed_precision": mixed,
        "parameters": n_params, "steps": end_step,
        "tokens_trained": (offsets[end_step - 1]
                           + step_plan[end_step - 1].rows(data_world) * step_plan[end_step - 1].seq_len),
        "train_seconds_this_process": train_seconds, "tokens_trained_this_process": trained_tokens,
        "stage_summary": stages_run,
        "val_loss_before": val_before, "val_loss": val_after, "unigram_entropy": baseline,
        "val_tokens": int((val["labels"][:, 1:] != -100).sum()),
        "data": describe_corpus(settings["dataset"], train_ds, settings["validation_fraction"], held_out),
        "tokenizer": {"vocab_size": len(tokenizer), "path": settings["tokenizer"] or "tokenizer/ (trained by this run)"},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
    }
    if experts is not None:  # every rank holds every expert again, for the whole model's folder
        gather_experts(raw_model)
    save_final(accelerator, model, tokenizer, out, summary,
               GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, max_new_tokens=128))
    accelerator.end_training()
    return (summary, raw_model) if return_model else summary


def rows_to_device(tokens: np.ndarray, starts: np.ndarray, device) -> dict[str, torch.Tensor]:
    """`rows_to_batch` moved to `device`, but for `position_ids`: the model builds its document tables from them on
    the host, so they stay there (no device round trip in the step)."""
    return {k: v if k == "position_ids" else v.to(device) for k, v in rows_to_batch(tokens, starts).items()}


def save_final(accelerator: Accelerator, model, tokenizer, out: Path, summary: dict, generation_config) -> Path:
    """Write `final/` (model, remote code, tokenizer, generation config, training_info.json) via a temp dir; what
    other tools added to an earlier `final/` (model card, `eval/`) moves into the new one."""
    state_dict = accelerator.get_state_dict(model)
    final, tmp = out / "final", out / ".tmp-final"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        config = accelerator.unwrap_model(model).config
        fused, config.fuse_linear_cross_entropy = config.fuse_linear_cross_entropy, False  # logits for other trainers
        try:
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        finally:
            config.fuse_linear_cross_entropy = fused
        tokenizer.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        with open(tmp / "training_info.json", "w") as f:
            json.dump(summary, f, indent=2, default=str)
        kept = sorted(p.name for p in final.iterdir() if not (tmp / p.name).exists()) if final.is_dir() else []
        for name in kept:
            os.replace(final / name, tmp / name)
        if kept:
            print(f"kept {', '.join(kept)} in {final}: they describe the model before this resume, so rerun "
                  f"kdamoe-eval / kdamoe-card")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def main(argv: list[str] | None = None) -> None:
    """Entry point of `kdamoe-train` and `python -m kdamoe.train`."""
    run_cli("kdamoe-train", train, argv)


__all__ = ["learning_rate", "main", "param_groups", "parse_stages", "plan_stages", "resolve_settings", "stage_summary",
           "train"]

if __name__ == "__main__":
    main()

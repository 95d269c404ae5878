"""`kdamoe-ablate`: matched `kdamoe-train` runs that differ in one factor, and a report of what each factor changes.

    kdamoe-ablate --output-dir runs/ablate --max-steps 80                   # tiny preset on the CPU, every factor
    kdamoe-ablate --factors router_balancing --seeds 0,1 --output-dir runs/qb --config configs/ablate_h200.json
    kdamoe-ablate --merge runs/qb-seed0,runs/qb-seed1 --output-dir runs/qb       # one report from partial ones

Every run is `kdamoe.train.train` with the same flags (any flag ablate does not know passes through to
kdamoe-train: `--max-steps`, `--stages`, `--lr`, `--dataset`, ...), the same seed per replicate (so the same data
order and the same initial weights wherever the factor leaves them alike) and one `KDAMoEConfig` field changed.
The device is kdamoe-train's: the CPU without CUDA, else one GPU. The runs of `router_balancing` and `length` are
evaluated with `kdamoe-eval` (held-out MoE loads, loss by position to 4x the training length, passkey).

Factors and what the report compares (mean ± sample standard deviation over the seeds):

- `kda_gate` (bounded, softplus): val loss, tokens/s.
- `router_balancing` (quantile, loss_free, aux_loss, none): MaxVio_batch per step (mean over the MoE layers, from
  metrics.jsonl; the table gives the mean over the second half of the steps and that of the worst layer), dead
  experts at the last step, MaxVio_global and dead experts on the held-out rows, val loss, and the floor of
  MaxVio_batch at the run's batch shape (`kdamoe.balancing.balance_floor` on its final weights: the training batches
  after its last step routed with the exact fixed point of 16 other batches, and with that of the batch before).
- `residual_mode` (block_attnres, standard, full_attnres): val loss, seconds per step.
- `length` (the base config alone): loss by position to 4x the training length, passkey accuracy.

Tokens/s and seconds per step are medians over the steps after the first tenth (warm-up, compilation). A run that
two factors share (each factor's base value is the base config) trains once. A finished run with the same
arguments is reused, so an interrupted ablation continues where it stopped (`--retrain` trains again); unless
`--tokenizer` is given, the first run trains the tokenizer and every later run reuses it.

Outputs in `--output-dir`: `report.md` (a table and a verdict per factor), `results.json` (every number of the
report and the per-run metrics it comes from), PNG plots when matplotlib is installed (`loss_<factor>.png`,
`max_vio.png`, `loss_by_position.png`) and `runs/<name>/seed<k>/` (the kdamoe-train folders, `eval/` inside); the
report is rewritten after every finished run, so an ablation killed part way keeps the report of the runs it finished.
`--merge DIR,DIR,...` trains nothing: it writes the report of the runs in those folders' `results.json` (ablations
of other factors or seeds with the same kdamoe-train flags and config, e.g. run in separate jobs or on separate
machines, each bringing back its results.json); a run (name and seed) in several of them is taken from the first,
except that each factor compares the runs of the jobs that ran it: its copy of a shared run (the base config) that
differs from the first is reported as "<run> (<factor>)".
User errors are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from .errors import UsageError, run_cli

FACTORS = {
    "kda_gate": ("bounded", "softplus"),
    "router_balancing": ("quantile", "loss_free", "aux_loss", "none"),
    "residual_mode": ("block_attnres", "standard", "full_attnres"),
    "length": ("base",),
}
METRICS = {  # per factor: (metric key, column title, decimals)
    "kda_gate": [("val_loss", "val loss", 4), ("tokens_per_second", "tokens/s", 0)],
    "router_balancing": [("max_vio_second_half", "MaxVio_batch, 2nd half", 3),
                         ("max_vio_worst_layer_second_half", "worst layer", 3),
                         ("dead_experts_last_step", "dead experts (last step)", 1),
                         ("max_vio_global", "MaxVio_global (held-out)", 3),
                         ("dead_experts_heldout", "dead experts (held-out)", 1), ("val_loss", "val loss", 4),
                         ("max_vio_floor", "floor: fit to 16 other batches", 3),
                         ("max_vio_floor_previous", "floor: the batch before", 3)],
    "residual_mode": [("val_loss", "val loss", 4), ("seconds_per_step", "s/step", 4)],
    "length": [("loss_near_train_length", "loss, positions L/2..L", 4), ("loss_beyond", "loss, L..4L", 4),
               ("loss_beyond_worst_bin", "worst bin beyond L", 4), ("passkey_accuracy", "passkey", 2)],
}
EVALUATED = ("router_balancing", "length")  # the factors whose metrics need kdamoe-eval of the trained model
OWNED_FLAGS = ("--output-dir", "--seed", "--resume", "--overwrite", "--config")
FLAT_TOLERANCE = 0.02  # loss by position counts as flat when no bin beyond L exceeds the loss near L by more


# --------------------------------------------------------------------------------------------- settings


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are `UsageError`s: one line on stderr, exit status 2 (`--help` still exits 0)."""

    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kdamoe-ablate", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Matched kdamoe-train runs that differ in one factor; writes report.md, results.json and plots. "
                    "Flags it does not know pass through to kdamoe-train.",
        epilog="factors: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in FACTORS.items()))
    p.add_argument("--output-dir", required=True, help="report folder (runs go to OUTPUT_DIR/runs)")
    p.add_argument("--factors", default=",".join(FACTORS), help="comma-separated factors (default: all)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds, one matched replicate each (default 0,1)")
    p.add_argument("--config", help="base kdamoe-train JSON config (the factor's field is changed in its `model`)")
    p.add_argument("--retrain", action="store_true", help="train again even where a finished run exists")
    p.add_argument("--merge", metavar="DIRS",
                   help="comma-separated folders of earlier ablations: report their runs together, train nothing")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Ablate's own flags and the kdamoe-train flags passed through; `UsageError` for bad values."""
    args, train_argv = build_parser().parse_known_args(argv)
    owned = [a for a in train_argv if a.split("=")[0] in OWNED_FLAGS]
    if owned:
        raise UsageError(f"kdamoe-ablate sets {', '.join(OWNED_FLAGS)} of each run itself; got {owned[0]}")
    args.factors = [f.strip() for f in args.factors.split(",") if f.strip()]
    unknown = [f for f in args.factors if f not in FACTORS]
    if unknown or not args.factors:
        name = unknown[0] if unknown else "(none)"
        raise UsageError(f"--factors: unknown factor {name}; known: {', '.join(FACTORS)}")
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise UsageError(f"--seeds must name at least one seed, each once, got {args.seeds}")
    if args.config and not Path(args.config).is_file():
        raise UsageError(f"--config {args.config}: no such file")
    if args.merge is not None:
        flags = [a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("-")]
        other = [f for f in flags if f not in ("--merge", "--output-dir")]
        if other:
            raise UsageError(f"--merge reports earlier runs and takes only --output-dir, got {other[0]}")
        args.merge = [Path(d.strip()) for d in args.merge.split(",") if d.strip()]
        if not args.merge:
            raise UsageError("--merge needs at least one folder")
    return args, train_argv


def check_train_flags(train_argv: list[str]) -> tuple[dict, dict]:
    """kdamoe-train's settings and model keyword arguments for the flags passed through (one-line `UsageError`s for
    flags kdamoe-train would refuse), before anything trains."""
    from . import train

    def refuse(message: str):
        raise UsageError(f"kdamoe-train flags: {message}")

    parser = train.build_parser()
    parser.error = refuse
    parser.parse_args(train_argv)
    settings, model_kwargs, _ = train.resolve_settings(train_argv)
    return settings, model_kwargs


def run_name(factor: str, value: str, base_model: dict) -> tuple[str, dict]:
    """The run of one factor value and its `KDAMoEConfig` overrides: "base" where the base config has the value
    already (so that the factors share it), else `"<factor>=<value>"`."""
    from .model.configuration_kdamoe import KDAMoEConfig

    if factor == "length" or base_model.get(factor, getattr(KDAMoEConfig(), factor)) == value:
        return "base", {}
    return f"{factor}={value}", {factor: value}


# --------------------------------------------------------------------------------------------- runs


def train_run(folder: Path, overrides: dict, seed: int, base_config: dict, train_argv: list[str], retrain: bool):
    """Train (or reuse) one run in `folder`; returns the folder. The run's config file is the base config with
    `overrides` in its `model`."""
    from .train import train

    config = {**base_config, "model": {**base_config.get("model", {}), **overrides}}
    argv = [*train_argv, "--config", str(folder / "ablate_config.json"), "--seed", str(seed),
            "--output-dir", str(folder)]
    record = {"config": config, "argv": argv}
    done = folder / "final" / "training_info.json"
    marker = folder / "ablate_run.json"
    if not retrain and done.is_file() and marker.is_file() and json.loads(marker.read_text()) == record:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ablate_config.json").write_text(json.dumps(config, indent=2))
    marker.unlink(missing_ok=True)
    train([*argv, "--overwrite"])
    marker.write_text(json.dumps(record, indent=2))
    return folder


def evaluate_run(folder: Path) -> dict:
    """kdamoe-eval of the run's `final/` into `eval/`: the
    held-out part, loss by position to 4x the training length and a small passkey and speed part (reused when it is
    newer than the run)."""
    from .evaluate import EvalSettings, evaluate

    report = folder / "eval" / "eval.json"
    if report.is_file() and report.stat().st_mtime >= (folder / "ablate_run.json").stat().st_mtime:
        return json.loads(report.read_text())
    info = json.loads((folder / "final" / "training_info.json").read_text())
    length = max(stage["seq_len"] for stage in info["stages"])
    settings = EvalSettings(passkey_lengths=[length, 2 * length, 4 * length], passkey_depths=[0.5],
                            passkey_trials=1, speed_lengths=[length], decode_tokens=1)
    return evaluate(folder / "final", folder / "eval", settings, progress=False, plots=False)


def floor_run(folder: Path) -> dict | None:
    """`kdamoe.balancing.balance_floor` of the run at its rows per step (fitted to 16 batches, 32 fresh ones) into
    `eval/balance_floor.json` (reused when it is newer than the run); None for a model without MoE layers."""
    from .balancing import balance_floor

    first_step = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    if not first_step.get("max_vio"):
        return None
    path = folder / "eval" / "balance_floor.json"
    if path.is_file() and path.stat().st_mtime >= (folder / "ablate_run.json").stat().st_mtime:
        return json.loads(path.read_text())
    floor = balance_floor(folder, batches=48, fit=16)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(floor, indent=2))
    return floor


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _median_steady(values: list[float]) -> float:
    """Median over the steps after the first tenth (warm-up and compilation)."""
    return statistics.median(values[max(1, len(values) // 10):] if len(values) > 1 else values)


def run_metrics(folder: Path, report: dict | None, floor: dict | None = None) -> dict:
    """The numbers of one run: from its metrics.jsonl (one line per step), final/training_info.json, the
    kdamoe-eval `report` and the `balance_floor` result `floor` (None: those numbers are None)."""
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    info = json.loads((folder / "final" / "training_info.json").read_text())
    tokens = [s["tokens"] for s in steps]
    step_tokens = [b - a for a, b in zip([0, *tokens[:-1]], tokens)]
    vio = [_mean(list(s["max_vio"].values())) for s in steps]
    half = steps[len(steps) // 2:]
    layers = sorted(steps[0]["max_vio"]) if steps and steps[0]["max_vio"] else []
    worst = max((_mean([s["max_vio"][k] for s in half]) for k in layers), default=None)
    moe = report["moe"] if report else {}
    out = {
        "val_loss": info["val_loss"],
        "loss": [s["loss"] for s in steps],
        "tokens_per_second": _median_steady([s["tokens_per_second"] for s in steps]),
        "seconds_per_step": _median_steady([n / s["tokens_per_second"] for n, s in zip(step_tokens, steps)]),
        "max_vio": vio,
        "max_vio_second_half": _mean([v for v in vio[len(vio) // 2:] if v is not None]),
        "max_vio_worst_layer_second_half": worst,
        "dead_experts_last_step": sum(steps[-1]["dead_experts"].values()) if steps else None,
        "max_vio_global": moe.get("max_vio_global_mean"),
        "dead_experts_heldout": moe.get("dead_experts_total"),
        "passkey_accuracy": report["passkey"]["mean_accuracy"] if report else None,
        "max_vio_floor": floor["table"][0]["floor"] if floor else None,
        "max_vio_floor_previous": floor["table"][0]["previous"] if floor else None,
    }
    out.update(position_metrics(report["length_extrapolation"]) if report else
               dict.fromkeys(("loss_by_position", "loss_near_train_length", "loss_beyond", "loss_beyond_worst_bin")))
    return out


def position_metrics(ext: dict) -> dict:
    """Loss by position bins of kdamoe-eval: the mean over the bins inside positions [L/2, L), over those beyond L,
    and the worst bin beyond L (L = the training length)."""
    length = ext["train_length"]
    edges, losses = ext["bin_edges"], ext["loss_by_bin"]
    bins = list(zip(edges[:-1], edges[1:], losses))  # position p predicts token p + 1 from p + 1 tokens
    near = [x for a, b, x in bins if length / 2 - 1 <= a and b <= length - 1]
    beyond = [x for a, _, x in bins if a >= length - 1]
    return {"loss_by_position": {"bin_edges": edges, "loss_by_bin": losses, "train_length": length},
            "loss_near_train_length": _mean(near), "loss_beyond": _mean(beyond),
            "loss_beyond_worst_bin": max(beyond, default=None)}


# --------------------------------------------------------------------------------------------- summary


def mean_spread(values: list[float | None]) -> dict:
    """`{"mean", "std", "n"}` over the seeds (sample standard deviation; 0 for one seed; None without values)."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarise(factor: str, runs: dict[str, dict[int, dict]]) -> dict:
    """Per factor value, mean ± spread of each of the factor's metrics over the seeds; for `router_balancing` also
    `max_vio_curve`, MaxVio_batch per step averaged over the seeds (None for a model without MoE layers)."""
    out = {value: {key: mean_spread([m.get(key) for m in per_seed.values()]) for key, _, _ in METRICS[factor]}
           for value, per_seed in runs.items()}
    if factor == "router_balancing":
        for value, per_seed in runs.items():
            curves = [m["max_vio"] for m in per_seed.values()]
            out[value]["max_vio_curve"] = (None if any(None in c for c in curves)
                                           else [statistics.fmean(step) for step in zip(*curves)])
    return out


def _fmt(stat: dict, decimals: int) -> str:
    if stat["mean"] is None:
        return "n/a"
    return f"{stat['mean']:.{decimals}f} ± {stat['std']:.{decimals}f}"


def _apart(a: dict, b: dict) -> bool:
    """Whether two means differ by more than the sum of their spreads (always, with one seed each)."""
    return abs(a["mean"] - b["mean"]) > a["std"] + b["std"]


def _pct(a: float, b: float) -> str:
    return f"{100 * (a - b) / abs(b):+.2f}%"


def verdict(factor: str, summary: dict) -> str:
    """The claim of the factor, checked against the numbers of `summary`, in words."""
    return {"kda_gate": _verdict_gate, "router_balancing": _verdict_balancing, "residual_mode": _verdict_residual,
            "length": _verdict_length}[factor](summary)


def _verdict_gate(s: dict) -> str:
    if not {"bounded", "softplus"} <= set(s):
        return "needs both gates"
    b, p = s["bounded"], s["softplus"]
    loss = _pct(b["val_loss"]["mean"], p["val_loss"]["mean"])
    quality = ("within 0.5% of softplus" if abs(b["val_loss"]["mean"] / p["val_loss"]["mean"] - 1) <= 0.005
               else "more than 0.5% from softplus")
    noise = "apart beyond" if _apart(b["val_loss"], p["val_loss"]) else "within"
    speed = b["tokens_per_second"]["mean"] / p["tokens_per_second"]["mean"]
    return (f"Bounded gate: val loss {loss} against softplus ({quality}; {noise} the seeds' spread); "
            f"{speed:.2f}x the tokens/s of softplus ({'faster' if speed > 1 else 'not faster'}).")


def _verdict_balancing(s: dict) -> str:
    vio = {m: v["max_vio_second_half"] for m, v in s.items() if v["max_vio_second_half"]["mean"] is not None}
    if not vio:
        return "no MoE layer: nothing to balance"
    order = sorted(vio, key=lambda m: vio[m]["mean"])
    best = order[0]
    ranking = ", ".join(f"{m} {vio[m]['mean']:.3f}" for m in order)
    text = f"Lowest MaxVio_batch over the second half of the steps: {best} ({ranking})."
    if "quantile" in vio and best != "quantile":
        text += f" Quantile Balancing is not the best balanced: {best} beats it"
        text += " beyond the seeds' spread." if _apart(vio["quantile"], vio[best]) else " within the seeds' spread."
    elif "quantile" in vio and len(order) > 1:
        runner = order[1]
        text += (" Quantile Balancing leads " + ("beyond" if _apart(vio["quantile"], vio[runner]) else "within")
                 + f" the seeds' spread of the next ({runner}).")
    losses = {m: v["val_loss"] for m, v in s.items() if v["val_loss"]["mean"] is not None}
    lowest = min(losses, key=lambda m: losses[m]["mean"])
    text += f" Lowest val loss: {lowest} ({losses[lowest]['mean']:.4f})"
    if "quantile" in losses and lowest != "quantile":
        near = "within" if not _apart(losses["quantile"], losses[lowest]) else "outside"
        text += f"; quantile {losses['quantile']['mean']:.4f}, {near} the seeds' spread of it"
    curves = {m: v["max_vio_curve"] for m, v in s.items() if v.get("max_vio_curve")}
    if "quantile" in curves and len(curves) > 1:
        qb = curves["quantile"]
        text += ". Quantile Balancing's MaxVio_batch (mean over the seeds) is below " + ", ".join(
            f"{m}'s at {sum(a < b for a, b in zip(qb, c))}/{len(qb)} steps" for m, c in curves.items() if m != "quantile")
    floor = s.get("quantile", {}).get("max_vio_floor_previous", {}).get("mean")
    if "quantile" in vio and floor:
        qb = vio["quantile"]["mean"]
        text += (f". At its final weights the exact fixed point of the batch before leaves a fresh batch at "
                 f"{floor:.3f} ({s['quantile']['max_vio_floor']['mean']:.3f} with that of 16 other batches): "
                 f"Quantile Balancing's {qb:.3f} is {qb / floor:.2f}x what a bias reaches at this batch shape "
                 "without the router moving")
    dead = {m: v["dead_experts_last_step"]["mean"] for m, v in s.items() if v["dead_experts_last_step"]["mean"]}
    text += "." + (" Dead experts at the last step: " + ", ".join(f"{m} {d:.1f}" for m, d in dead.items()) + "."
                   if dead else " No mode left a dead expert at the last step.")
    return text


def _verdict_residual(s: dict) -> str:
    if "standard" not in s:
        return "needs the standard residual as the reference"
    ref = s["standard"]
    parts = []
    for mode in (m for m in s if m != "standard"):
        v = s[mode]
        lower = v["val_loss"]["mean"] < ref["val_loss"]["mean"]
        noise = "beyond" if _apart(v["val_loss"], ref["val_loss"]) else "within"
        cost = _pct(v["seconds_per_step"]["mean"], ref["seconds_per_step"]["mean"])
        parts.append(f"{mode}: val loss {_pct(v['val_loss']['mean'], ref['val_loss']['mean'])} against standard "
                     f"({'lower' if lower else 'not lower'}, {noise} the seeds' spread), step time {cost}")
    return "; ".join(parts) + "."


def _verdict_length(s: dict) -> str:
    v = s["base"]
    near, worst = v["loss_near_train_length"]["mean"], v["loss_beyond_worst_bin"]["mean"]
    if near is None or worst is None:
        return "the evaluation rows do not reach beyond the training length"
    flat = worst <= near * (1 + FLAT_TOLERANCE)
    return (f"Loss by position to 4x the training length: worst bin beyond L {_pct(worst, near)} against the loss "
            f"at positions L/2..L ({'flat' if flat else 'not flat'} within {FLAT_TOLERANCE:.0%}); passkey accuracy "
            f"{v['passkey_accuracy']['mean']:.2f}.")


# --------------------------------------------------------------------------------------------- report


def write_report(out: Path, results: dict) -> None:
    lines = ["# kdamoe-ablate report", "",
             f"Seeds {results['seeds']}; kdamoe-train flags: `{' '.join(results['train_argv']) or '(defaults)'}`; "
             f"base config: {results['config'] or 'the preset'}. Each cell: mean ± sample standard deviation over "
             "the seeds. Runs: `runs/<name>/seed<k>/`.", ""]
    for factor, part in results["factors"].items():
        columns = METRICS[factor]
        lines += [f"## {factor}", "", "| value | run | " + " | ".join(title for _, title, _ in columns) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for value, stats in part["summary"].items():
            cells = " | ".join(_fmt(stats[key], decimals) for key, _, decimals in columns)
            lines.append(f"| {value} | {part['runs'][value]} | {cells} |")
        lines += ["", f"**Verdict.** {part['verdict']}", ""]
    if results["plots"]:
        lines += ["## Plots", ""] + [f"![{name}]({name})" for name in results["plots"]] + [""]
    else:
        lines += [f"Plots skipped: {results['plots_note']}", ""]
    (out / "report.md").write_text("\n".join(lines))


def write_plots(out: Path, results: dict, metrics: dict) -> list[str]:
    """Loss curves per factor, MaxVio_batch per step per balancing mode, loss by position; file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    def mean_curve(name: str, key: str) -> list[float]:
        curves = [m[key] for m in metrics[name].values()]
        return [statistics.fmean(c) for c in zip(*curves)]

    for factor, part in results["factors"].items():
        if factor == "length":
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for value, name in part["runs"].items():
            ax.plot(range(1, len(mean_curve(name, "loss")) + 1), mean_curve(name, "loss"), label=value)
        ax.set(xlabel="optimizer step", ylabel="training loss (mean over seeds)", title=f"Training loss: {factor}")
        ax.legend()
        save(fig, f"loss_{factor}.png")
    if "router_balancing" in results["factors"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for value, name in results["factors"]["router_balancing"]["runs"].items():
            curve = mean_curve(name, "max_vio") if all(None not in m["max_vio"] for m in metrics[name].values()) else []
            ax.plot(range(1, len(curve) + 1), curve, label=value)
        ax.set(xlabel="optimizer step", ylabel="MaxVio_batch (mean over layers, seeds)", yscale="log",
               title="Expert balance during training")
        ax.legend()
        save(fig, "max_vio.png")
    names = sorted({name for part in results["factors"].values() for name in part["runs"].values()
                    if next(iter(metrics[name].values()))["loss_by_position"]})
    if not names:
        return written
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in names:
        ext = next(iter(metrics[name].values()))["loss_by_position"]
        centres = [(a + b) / 2 + 1 for a, b in zip(ext["bin_edges"][:-1], ext["bin_edges"][1:])]
        losses = [statistics.fmean(c) for c in zip(*(m["loss_by_position"]["loss_by_bin"]
                                                      for m in metrics[name].values()))]
        ax.plot(centres, losses, marker="o", ms=2, label=name)
    ax.axvline(ext["train_length"], color="grey", ls="--", label="training length")
    ax.set(xlabel="token position", ylabel="loss (nats/token, mean over seeds)", title="Loss by position")
    ax.legend(fontsize=7)
    save(fig, "loss_by_position.png")
    return written


def ablate(argv: list[str] | None = None) -> dict:
    """Run `kdamoe-ablate` with `argv`; returns the results (also written to `results.json`)."""
    args, train_argv = parse_args(argv)
    out = Path(args.output_dir)
    if args.merge is not None:
        return merge(args.merge, out)
    try:
        base_config = json.loads(Path(args.config).read_text()) if args.config else {}
    except ValueError as error:
        raise UsageError(f"--config {args.config}: {error}") from error
    config_flag = ["--config", args.config] if args.config else []
    _, base_model = check_train_flags([*train_argv, *config_flag, "--output-dir", str(out / "runs")])
    names = {factor: {value: run_name(factor, value, base_model) for value in FACTORS[factor]}
             for factor in args.factors}
    runs = {name: overrides for per_value in names.values() for name, overrides in per_value.values()}
    evaluated = {name for factor in args.factors if factor in EVALUATED for name, _ in names[factor].values()}
    floored = {name for name, _ in names["router_balancing"].values()} if "router_balancing" in names else set()
    # the first run trains the tokenizer (unless one is given), every later run reads it
    tokenizer_given = any(a.split("=")[0] == "--tokenizer" for a in train_argv)
    tokenizer: list[str] = []
    metrics: dict[str, dict[int, dict]] = {}
    for name, overrides in runs.items():
        for seed in args.seeds:
            folder = out / "runs" / name / f"seed{seed}"
            train_run(folder, overrides, seed, base_config, [*train_argv, *tokenizer], args.retrain)
            if not (tokenizer or tokenizer_given):
                tokenizer = ["--tokenizer", str(folder / "tokenizer")]
            report = evaluate_run(folder) if name in evaluated else None
            floor = floor_run(folder) if name in floored else None
            metrics.setdefault(name, {})[seed] = run_metrics(folder, report, floor)
            # rewritten after every run: an ablation killed part way (a time limit) keeps the report of what finished
            factor_runs = {factor: done for factor in args.factors
                           if (done := {v: n for v, (n, _) in names[factor].items() if n in metrics})}
            results = write_results(out, args.seeds, train_argv, args.config, factor_runs, metrics)
    return results


def write_results(out: Path, seeds: list[int], train_argv: list[str], config: str | None,
                  factor_runs: dict[str, dict[str, str]], metrics: dict[str, dict[int, dict]]) -> dict:
    """Summaries, verdicts, plots, `results.json` and `report.md` in `out` from the per-run metrics; returns the
    results. `factor_runs`: factor -> value -> run name; `metrics`: run name -> seed -> `run_metrics`."""
    results = {"seeds": seeds, "train_argv": train_argv, "config": config, "factors": {}}
    for factor, runs in factor_runs.items():
        part = {"runs": runs}
        part["summary"] = summarise(factor, {v: metrics[n] for v, n in runs.items()})
        part["verdict"] = verdict(factor, part["summary"])
        results["factors"][factor] = part
    out.mkdir(parents=True, exist_ok=True)
    try:
        results["plots"], results["plots_note"] = write_plots(out, results, metrics), None
    except ImportError:
        results["plots"], results["plots_note"] = [], "matplotlib is not installed (pip install matplotlib)"
    results["runs"] = {name: {str(seed): m for seed, m in per_seed.items()} for name, per_seed in metrics.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    write_report(out, results)
    print(f"wrote {out / 'report.md'}, {out / 'results.json'} and {len(results['plots'])} plots")
    return results


def merge(folders: list[Path], out: Path) -> dict:
    """One report from the `results.json` of earlier ablations (same kdamoe-train flags and config): their factors
    and runs together; a run (name, seed) found in several is taken from the first folder that has it, and a factor
    whose own jobs hold another copy of it reports that copy as "<run> (<factor>)"."""
    parts = []
    for folder in folders:
        path = folder / "results.json"
        try:
            parts.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            raise UsageError(f"--merge: cannot read {path} ({error})") from None
    first = parts[0]
    for folder, part in zip(folders[1:], parts[1:]):
        if (part["train_argv"], part["config"]) != (first["train_argv"], first["config"]):
            raise UsageError(f"--merge: {folder} ran other kdamoe-train flags or another config than {folders[0]} "
                             f"({part['train_argv']} / {part['config']} against {first['train_argv']} / "
                             f"{first['config']}): its runs are not matched")
    metrics: dict[str, dict[int, dict]] = {}
    for part in parts:
        for name, per_seed in part["runs"].items():
            for seed, m in per_seed.items():
                metrics.setdefault(name, {}).setdefault(int(seed), m)
    # a factor compares the runs of the jobs that ran it (matched in data, in GPU nondeterminism and in what ran
    # beside them): where its shared run (the base config) was taken from a job of other factors, it keeps its own
    # jobs' copy under the name "<run> (<factor>)"
    own: dict[str, dict[str, tuple[str, dict[int, dict]]]] = {}  # factor -> value -> (run name, seed -> metrics)
    for part in parts:
        for factor, entry in part["factors"].items():
            for value, name in entry["runs"].items():
                _, per_seed = own.setdefault(factor, {}).setdefault(value, (name, {}))
                for seed, m in part["runs"].get(name, {}).items():
                    per_seed.setdefault(int(seed), m)
    factor_runs: dict[str, dict[str, str]] = {}
    for factor, values in own.items():
        for value, (name, per_seed) in values.items():
            if any(metrics[name].get(seed) is not m for seed, m in per_seed.items()):
                name = f"{name} ({factor})"
                metrics[name] = per_seed
            factor_runs.setdefault(factor, {})[value] = name
    seeds = sorted({seed for per_seed in metrics.values() for seed in per_seed})
    return write_results(out, seeds, first["train_argv"], first["config"], factor_runs, metrics)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `kdamoe-ablate` and `python -m kdamoe.ablate`."""
    run_cli("kdamoe-ablate", ablate, argv)


__all__ = ["FACTORS", "ablate", "main", "mean_spread", "merge", "position_metrics", "run_metrics", "verdict"]

if __name__ == "__main__":
    main()

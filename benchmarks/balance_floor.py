"""The MaxVio_batch that a bias fitted before the batch leaves at fixed weights, against rows per batch.

`kdamoe.balancing.balance_floor` on trained kdamoe-train folders: their final weights route the training batches
after their last step, with the exact Quantile Balancing fixed point of the first `--fit` of them (`floor`), the same
with the tokens shuffled across rows (`iid`), and with the fixed point of the batch before (`previous`), regrouped
into batches of each `--rows`; printed beside each run's own MaxVio_batch while it trained (metrics.jsonl).

    kdamoe-train --config configs/ablate_tiny16.json --seed S --output-dir runs/qb16-S        # S = 0, 1, 2
    PYTHONPATH=src python benchmarks/balance_floor.py runs/qb16-0 runs/qb16-1 runs/qb16-2 --rows 8,16,32 \\
        --out benchmarks/results/balance_floor_tiny16.json
    kdamoe-train --config configs/ablate_cpu64.json --seed S --output-dir runs/cpu64-S        # S = 0, 1
    kdamoe-train --config configs/ablate_cpu64.json --lr 1e-3 --warmup-steps 50 --output-dir runs/cpu64-lr1e-3-0
    PYTHONPATH=src python benchmarks/balance_floor.py runs/cpu64-0 runs/cpu64-1 runs/cpu64-lr1e-3-0 --batches 24 \\
        --fit 8 --rows 4,16,64 --after-step 50 --out benchmarks/results/balance_floor_cpu64.json
"""

import argparse
import json
from pathlib import Path

import torch

from kdamoe.balancing import balance_floor


def analyse(run: Path, args) -> dict:
    """The floor table of one run (`kdamoe.balancing.balance_floor`), printed and returned with the run's own
    MaxVio_batch from its metrics.jsonl."""
    print(f"== {run}")
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [sum(r["max_vio"].values()) / len(r["max_vio"]) for r in logged
               if r.get("max_vio") and r["step"] > args.after_step]
    in_training = sum(trained) / len(trained) if trained else None
    first, last = (int(x) for x in args.early.split("-"))
    early = [sum(r["max_vio"].values()) / len(r["max_vio"]) for r in logged
             if r.get("max_vio") and first <= r["step"] <= last]
    early = sum(early) / len(early) if early else None
    most_dead = max((sum(r["dead_experts"].values()) for r in logged if r.get("dead_experts")), default=None)
    if in_training is not None:
        print(f"the run's MaxVio_batch (layer mean) over steps {args.after_step + 1}+: {in_training:.3f}; "
              f"steps {args.early}: {early:.3f}; most dead experts at one step (all layers): {most_dead}")
    floor = balance_floor(run, [int(r) for r in args.rows.split(",")], args.batches, args.fit, args.iterations,
                          args.device)
    print(f"the fitted batches themselves: MaxVio {floor['fitted']:.3f} (0 when the fit has converged)")
    for row in floor["table"]:
        previous = row["previous"] if row["previous"] is not None else float("nan")
        print(f"{row['rows']:4d} rows of {floor['seq_len']}: MaxVio_batch floor {row['floor']:.3f} "
              f"(tokens shuffled across rows: {row['iid']:.3f}; the previous batch's fixed point: {previous:.3f}; "
              f"{row['batches_x_layers']} batches x layers)")
    return {"run": str(run), "in_training_max_vio": in_training, "early_max_vio": early, "most_dead_experts": most_dead,
            "fitted_max_vio": floor["fitted"], "table": [dict(row, seq_len=floor["seq_len"]) for row in floor["table"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="kdamoe-train output folders (with final/)")
    p.add_argument("--batches", type=int, default=48)
    p.add_argument("--fit", type=int, default=16, help="batches the bias is fitted on")
    p.add_argument("--rows", default="8,16,32,64", help="rows per evaluated batch")
    p.add_argument("--iterations", type=int, default=64,
                   help="fixed-point steps of the fit (with 64 experts the iteration needs tens to settle)")
    p.add_argument("--after-step", type=int, default=40,
                   help="each run's own MaxVio_batch (metrics.jsonl) is averaged over the steps after this one")
    p.add_argument("--early", default="11-40", help="FIRST-LAST: the steps of early training, reported apart")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, help="write the tables as JSON")
    args = p.parse_args()
    results = [analyse(run, args) for run in args.runs]
    if args.out:
        settings = {k: getattr(args, k) for k in ("batches", "fit", "iterations", "after_step", "early")}
        args.out.write_text(json.dumps({"settings": settings, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

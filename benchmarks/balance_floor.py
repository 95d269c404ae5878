"""The lowest MaxVio_batch a bias fitted before the batch can reach, at fixed weights, against rows per batch.

A trained kdamoe-train folder routes `--batches` training batches of its own data order (the steps after the run)
with its final weights, no update in between. The bias is the exact Quantile Balancing fixed point
(`quantile_fixed_point`, `--iterations` steps; the script prints how well it balances the tokens it was fitted on)
of the first `--fit` batches; the floor is the mean MaxVio_batch (over the MoE layers and the later batches) of the
other batches, regrouped into batches of R rows, routed with that bias: what balancing can do when the router does
not move at all. Rows route by document, so a batch of few rows is off balance by its content alone; `iid`
shuffles the same tokens across rows for comparison; `previous` routes each batch of R rows with the fixed point of
the batch of R rows before it (what a bias from the last step alone can do at fixed weights). Next to it, the run's
own MaxVio_batch while it trained.

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

from kdamoe.data import CorpusStream, PackedBatches, load_corpus, rows_to_batch
from kdamoe.model.moe import quantile_fixed_point


def max_vio(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> float:
    loads = torch.bincount(torch.topk(scores + bias, top_k, dim=1).indices.flatten(), minlength=scores.shape[1])
    return float((loads.max() - loads.double().mean()) / loads.double().mean())


@torch.no_grad()
def router_scores(run: Path, batches: int, device: str) -> tuple[dict[int, list[torch.Tensor]], int, int]:
    """Per MoE layer, the router scores `[rows * seq_len, E]` (on the CPU) of each of `batches` batches after the
    run's last step, routed on `device`; also the row length and top-k."""
    from transformers import AutoTokenizer

    from kdamoe.model.modeling_kdamoe import KDAMoEForCausalLM

    info = json.loads((run / "final" / "training_info.json").read_text())
    settings, (stage, *_) = info["settings"], info["stages"]
    model = KDAMoEForCausalLM.from_pretrained(run / "final").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    train_split = load_corpus(settings["dataset"], "all" if settings["validation_dataset"] else "train",
                              text_column=settings["text_column"], validation_fraction=settings["validation_fraction"])
    corpus = CorpusStream(train_split, tokenizer, settings["seed"])
    rows = stage["micro_batch"] * stage["grad_accum"] * info["world_size"]
    data = PackedBatches(corpus, [(stage["seq_len"], info["steps"] + batches, rows)], settings["seed"],
                         settings["shuffle_window_tokens"])
    scores = {}
    for i, layer in enumerate(model.model.layers):
        if layer.is_moe:
            layer.ffn.router.register_forward_hook(
                lambda m, a, out, i=i: scores.setdefault(i, []).append(out[1].float().cpu()))
    for step in range(info["steps"], info["steps"] + batches):
        batch = rows_to_batch(*data.batch(step))
        model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device))
    return scores, stage["seq_len"], model.config.num_experts_per_tok


def analyse(run: Path, args) -> dict:
    """The floor table of one run, printed and returned."""
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
    scores, seq_len, top_k = router_scores(run, args.batches, args.device)
    fits = {}
    for name, layer in scores.items():
        fit = torch.cat(layer[: args.fit]).double()
        bias = quantile_fixed_point(fit.to(args.device), torch.zeros(fit.shape[1], dtype=torch.float64,
                                    device=args.device), top_k, args.iterations).cpu()
        fits[name] = (bias, torch.cat(layer[args.fit:]).double(), max_vio(fit, bias, top_k))
    fitted = sum(f[2] for f in fits.values()) / len(fits)
    print(f"the fitted batches themselves: MaxVio {fitted:.3f} (0 when the fit has converged)")
    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        floor, iid, previous = [], [], []
        for bias, rest, _ in fits.values():
            shuffled = rest[torch.randperm(rest.shape[0], generator=torch.Generator().manual_seed(0))]
            n = rows * seq_len
            batches = [rest[i:i + n] for i in range(0, rest.shape[0] - n + 1, n)]
            floor += [max_vio(batch, bias, top_k) for batch in batches]
            iid += [max_vio(shuffled[i:i + n], bias, top_k) for i in range(0, rest.shape[0] - n + 1, n)]
            for before, batch in zip(batches, batches[1:]):
                last = quantile_fixed_point(before.to(args.device), bias.to(args.device), top_k, args.iterations)
                previous.append(max_vio(batch, last.cpu(), top_k))
        table.append({"rows": rows, "seq_len": seq_len, "floor": sum(floor) / len(floor), "iid": sum(iid) / len(iid),
                      "previous": sum(previous) / len(previous) if previous else None, "batches_x_layers": len(floor)})
        print(f"{rows:4d} rows of {seq_len}: MaxVio_batch floor {table[-1]['floor']:.3f} "
              f"(tokens shuffled across rows: {table[-1]['iid']:.3f}; the previous batch's fixed point: "
              f"{table[-1]['previous'] if previous else float('nan'):.3f}; {len(floor)} batches x layers)")
    return {"run": str(run), "in_training_max_vio": in_training, "early_max_vio": early, "most_dead_experts": most_dead,
            "fitted_max_vio": fitted, "table": table}


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

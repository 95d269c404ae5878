"""The lowest MaxVio_batch a bias fitted before the batch can reach, at fixed weights, against rows per batch.

A trained kdamoe-train folder routes `--batches` training batches of its own data order (the steps after the run)
with its final weights, no update in between. The bias is the exact Quantile Balancing fixed point
(`quantile_fixed_point`) of the first `--fit` batches; the floor is the mean MaxVio_batch (over the MoE layers and
the later batches) of the other batches, regrouped into batches of R rows, routed with that bias: what balancing can
do when the router does not move at all. Rows route by document, so a batch of few rows is off balance by its
content alone; `iid` shuffles the same tokens across rows for comparison.

    PYTHONPATH=src python benchmarks/balance_floor.py runs/qb16/runs/base/seed0 --rows 8,16,32,64
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
def router_scores(run: Path, batches: int) -> tuple[dict[int, list[torch.Tensor]], int, int]:
    """Per MoE layer, the router scores `[rows * seq_len, E]` of each of `batches` batches after the run's last
    step; also the row length and top-k."""
    from transformers import AutoTokenizer

    from kdamoe.model.modeling_kdamoe import KDAMoEForCausalLM

    info = json.loads((run / "final" / "training_info.json").read_text())
    settings, (stage, *_) = info["settings"], info["stages"]
    model = KDAMoEForCausalLM.from_pretrained(run / "final").eval()
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
            layer.ffn.router.register_forward_hook(lambda m, a, out, i=i: scores.setdefault(i, []).append(out[1]))
    for step in range(info["steps"], info["steps"] + batches):
        batch = rows_to_batch(*data.batch(step))
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    return scores, stage["seq_len"], model.config.num_experts_per_tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a kdamoe-train output folder (with final/)")
    p.add_argument("--batches", type=int, default=48)
    p.add_argument("--fit", type=int, default=16, help="batches the bias is fitted on")
    p.add_argument("--rows", default="8,16,32,64", help="rows per evaluated batch")
    args = p.parse_args()
    scores, seq_len, top_k = router_scores(args.run, args.batches)
    for rows in (int(r) for r in args.rows.split(",")):
        floor, iid = [], []
        for layer in scores.values():
            bias = quantile_fixed_point(torch.cat(layer[: args.fit]).double(),
                                        torch.zeros(layer[0].shape[1], dtype=torch.float64), top_k, 8)
            rest = torch.cat(layer[args.fit:]).double()
            shuffled = rest[torch.randperm(rest.shape[0], generator=torch.Generator().manual_seed(0))]
            n = rows * seq_len
            floor += [max_vio(rest[i:i + n], bias, top_k) for i in range(0, rest.shape[0] - n + 1, n)]
            iid += [max_vio(shuffled[i:i + n], bias, top_k) for i in range(0, rest.shape[0] - n + 1, n)]
        print(f"{rows:4d} rows of {seq_len}: MaxVio_batch floor {sum(floor) / len(floor):.3f} "
              f"(tokens shuffled across rows: {sum(iid) / len(iid):.3f}; {len(floor)} batches x layers)")


if __name__ == "__main__":
    main()

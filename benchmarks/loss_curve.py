"""Loss curves of two copies of the model code, trained on the same token rows from the same weights.

Checks that a change to the model's code (kernels, fused paths) trains as the code before it did: the current model
folder and a reference copy (e.g. an earlier commit's `src/kdamoe/model`) each train the same hybrid MoE config for
`--steps` optimizer steps on the same rows, from the same initial weights (the reference loads the current model's
state dict; a different layout of parameters is an error). The noise floor is the current code trained from a
second seed's weights. Reported: the mean absolute difference of the two curves (each smoothed over `--window`
steps) and the mean loss of the last 50 steps; the JSON holds every step's loss.

The config: vocab of the tokenizer, hidden 512, 8 layers (3 KDA : 1 attention, layer 0 dense, the rest 64 experts
top-4 of width 256 plus 1 shared expert), Block AttnRes, Quantile Balancing; rows of 1024 tokens, 16 rows a step,
AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1), 50 warmup steps then cosine to 10%, gradient clip 1.0, fp32
weights under bf16 autocast (as `kdamoe-train` with Accelerate's bf16 mixed precision), `apply_load_balancing()`
after every optimizer step.

    # where `datasets` is installed: the token rows (the embedded corpus, a BPE of 8192 tokens trained on it)
    PYTHONPATH=src python benchmarks/loss_curve.py rows --out .gpu/loss_curve_rows.pt
    # the reference code, e.g. an earlier commit's model folder
    mkdir -p .gpu/ref && git archive 731b342 src/kdamoe/model | tar -x -C .gpu/ref --strip-components=3
    # on the GPU (carry .gpu/loss_curve_rows.pt and .gpu/ref)
    PYTHONPATH=src python benchmarks/loss_curve.py train --rows .gpu/loss_curve_rows.pt --ref .gpu/ref \\
        --out benchmarks/results/loss_curve_h200.json
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from model_folder import import_model_folder

SEQ_LEN = 1024


def make_rows(out: Path, rows: int, vocab: int) -> None:
    """`rows` packed rows of the embedded corpus: int32 ids and int16 positions (restarting at document starts)."""
    from kdamoe.data import pack_documents, stdlib_dataset, tokenize_documents
    from kdamoe.tokenizer import train_tokenizer

    train = stdlib_dataset("train")
    tokenizer = train_tokenizer(train["text"], vocab_size=vocab)
    packed = pack_documents(tokenize_documents(train["text"], tokenizer), SEQ_LEN, tokenizer.eos_token_id)
    ids, pos = [], []
    for row in packed:
        ids.append(row["input_ids"].int())
        pos.append(row["position_ids"].short())
        if len(ids) == rows:
            break
    if len(ids) < rows:
        raise SystemExit(f"the corpus gives {len(ids)} rows of {SEQ_LEN} tokens, fewer than {rows}")
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": torch.stack(ids), "position_ids": torch.stack(pos), "vocab_size": len(tokenizer),
                "eos_token_id": tokenizer.eos_token_id}, out)
    print(f"wrote {rows} rows of {SEQ_LEN} tokens to {out}")


def load_package(path: str):
    """The model folder at `path` imported as a package of its own (its modules import each other relatively)."""
    return import_model_folder("ref", path, "configuration_kdamoe"), import_model_folder("ref", path, "modeling_kdamoe")


def config_kwargs(data: dict) -> dict:
    return dict(vocab_size=data["vocab_size"], hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
                kda_num_heads=4, kda_head_dim=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256, num_shared_experts=1,
                residual_mode="block_attnres", attnres_block_layers=2, router_balancing="quantile",
                fuse_linear_cross_entropy=True, pad_token_id=0, eos_token_id=data["eos_token_id"], bos_token_id=2)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - 1 - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, data: dict, args, device) -> list[float]:
    """`args.steps` optimizer steps on rows `[step * rows, (step + 1) * rows)`; the loss of each step."""
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    losses = []
    for step in range(args.steps):
        lo, hi = step * args.rows_per_step, (step + 1) * args.rows_per_step
        ids = data["input_ids"][lo:hi].long()
        pos = data["position_ids"][lo:hi].long()
        labels = ids.masked_fill(pos == 0, -100)  # no target across a document start
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids.to(device), position_ids=pos, labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.apply_load_balancing()
        losses.append(loss.detach())
    return [float(x) for x in torch.stack(losses).cpu()]


def smooth(xs: list[float], window: int) -> list[float]:
    return [sum(xs[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rows", help="write the token rows")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--rows", type=int, default=4800)
    r.add_argument("--vocab-size", type=int, default=8192)
    t = sub.add_parser("train", help="train both codes and compare the curves")
    t.add_argument("--rows", type=Path, required=True, help="the file `rows` wrote")
    t.add_argument("--ref", required=True, help="the reference model folder")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--rows-per-step", type=int, default=16)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--window", type=int, default=10)
    t.add_argument("--out", type=Path, default=Path("benchmarks/results/loss_curve.json"))
    args = ap.parse_args()
    if args.cmd == "rows":
        return make_rows(args.out, args.rows, args.vocab_size)
    import kdamoe
    from kdamoe.model import configuration_kdamoe, modeling_kdamoe

    data = torch.load(args.rows)
    if len(data["input_ids"]) < args.steps * args.rows_per_step:
        raise SystemExit(f"{args.rows} holds {len(data['input_ids'])} rows; {args.steps} steps need "
                         f"{args.steps * args.rows_per_step}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref_config, ref_modeling = load_package(args.ref)
    codes = {"current": (configuration_kdamoe, modeling_kdamoe), "reference": (ref_config, ref_modeling)}
    runs = {}
    for label, code, seed in (("current", "current", 0), ("reference", "reference", 0), ("current_seed1", "current", 1)):
        config_mod, modeling_mod = codes[code]
        torch.manual_seed(seed)
        model = modeling_mod.KDAMoEForCausalLM(config_mod.KDAMoEConfig(**config_kwargs(data)))
        if label == "reference":  # the current code's seed-0 weights
            torch.manual_seed(0)
            init = kdamoe.KDAMoEForCausalLM(kdamoe.KDAMoEConfig(**config_kwargs(data))).state_dict()
            model.load_state_dict(init, strict=True)
        t0 = time.perf_counter()
        losses = train(model, data, args, device)
        runs[label] = {"losses": losses, "seconds": time.perf_counter() - t0,
                       "last50": sum(losses[-50:]) / len(losses[-50:])}
        print(f"{label}: last-50 mean loss {runs[label]['last50']:.4f}, step 1 {losses[0]:.4f}, "
              f"{runs[label]['seconds']:.0f} s", flush=True)
        del model
    curves = {k: smooth(v["losses"], args.window) for k, v in runs.items()}

    def gap(a, b):
        return sum(abs(x - y) for x, y in zip(curves[a], curves[b])) / len(curves[a])

    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "reference": args.ref, "steps": args.steps,
              "rows_per_step": args.rows_per_step, "seq_len": SEQ_LEN, "config": config_kwargs(data),
              "gap_current_vs_reference": gap("current", "reference"),
              "gap_seed0_vs_seed1": gap("current", "current_seed1"), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"| run | last-50 mean loss |\n|---|---|\n" + "\n".join(f"| {k} | {v['last50']:.4f} |" for k, v in runs.items()))
    print(f"mean |Δ| of the smoothed curves: current vs reference {report['gap_current_vs_reference']:.4f}; "
          f"seed 0 vs seed 1 (noise) {report['gap_seed0_vs_seed1']:.4f}")


if __name__ == "__main__":
    main()

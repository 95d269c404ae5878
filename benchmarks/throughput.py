"""Training throughput of a `kdamoe-train` run: median tokens/s after warm-up and model FLOPs utilisation.

    python benchmarks/throughput.py RUN_DIR [--peak-tflops 989] [--skip 5] [--out RESULT.json]

MFU = 6 · N_active · tokens/s / peak, with N_active the parameters a token touches (embeddings and the
k/E share of routed experts included; attention-score FLOPs left out, as in the usual 6N estimate).
"""

import argparse
import json
import statistics
from pathlib import Path

from transformers import AutoConfig

from kdamoe.hub_card import parameter_counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    records = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    config = AutoConfig.from_pretrained(args.run_dir / "final")
    counts = parameter_counts(config)
    tps = statistics.median(r["tokens_per_second"] for r in records[args.skip:] or records)
    result = {
        "steps": len(records),
        "tokens_per_second": tps,
        "params_total": counts["total"],
        "params_active": counts["active_per_token"],
        "mfu": 6 * counts["active_per_token"] * tps / (args.peak_tflops * 1e12),
        "peak_tflops": args.peak_tflops,
        "final_loss": records[-1]["loss"],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

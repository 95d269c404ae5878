"""The main job: train the `tiny` preset on the embedded corpus, save it, reload it elsewhere and generate.

    python -m kdamoe.quickstart [--output-dir runs/quickstart] [extra kdamoe-train flags]

1. `kdamoe-train --preset tiny` on the Python standard library source (no download), printing the validation
   loss before and after training next to the unigram-entropy baseline; the run lands in `<output-dir>/final`.
2. A fresh Python process, started in an empty temporary directory with `HF_HUB_OFFLINE=1`, loads that folder
   with `AutoModelForCausalLM` and `AutoTokenizer` (`trust_remote_code=True`) and generates a continuation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .errors import run_cli
from .train import train

GENERATE = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, prompt = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
print(f"loaded {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
inputs = tokenizer(prompt, return_tensors="pt")
torch.manual_seed(0)
out = model.generate(**inputs, max_new_tokens=80, do_sample=True, temperature=0.7, top_k=40)
print("----- generated -----")
print(tokenizer.decode(out[0], skip_special_tokens=True))
"""


def generate_in_fresh_process(final_dir: Path, prompt: str) -> str:
    """Load `final_dir` in a new interpreter (temp cwd, offline) and return what it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", GENERATE, str(final_dir.resolve()), prompt], cwd=cwd,
                                env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"loading {final_dir} in a fresh process failed:\n{result.stderr}")
    return result.stdout


def quickstart(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kdamoe.quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/quickstart")
    parser.add_argument("--prompt", default="def ")
    args, train_flags = parser.parse_known_args(argv)
    start = time.perf_counter()
    flags = ["--preset", "tiny", "--output-dir", args.output_dir, *train_flags]
    if not torch.cuda.is_available() and "--threads" not in flags:
        print(f"CPU threads: {torch.get_num_threads()} (torch's default; choose with --threads N)")
    if "--resume" not in flags:
        flags.append("--overwrite")
    summary = train(flags)
    print(f"trained in {time.perf_counter() - start:.0f}s: validation loss {summary['val_loss_before']:.3f} -> "
          f"{summary['val_loss']:.3f} nats/token (unigram baseline {summary['unigram_entropy']:.3f})")
    final_dir = Path(args.output_dir) / "final"
    print(f"saved {final_dir}; loading it in a fresh process (HF_HUB_OFFLINE=1, trust_remote_code=True) ...")
    print(generate_in_fresh_process(final_dir, args.prompt))


def main(argv: list[str] | None = None) -> None:
    run_cli("python -m kdamoe.quickstart", quickstart, argv)


if __name__ == "__main__":
    main()

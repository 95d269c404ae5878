"""`kdamoe-card`: write the Hugging Face model card (`PATH/README.md`) of a saved kdamoe folder.

    kdamoe-card runs/tiny/final --eval runs/tiny/eval/eval.json --repo-id your-name/kdamoe-tiny

The card is built with `huggingface_hub`'s `ModelCard` / `ModelCardData`: license, `library_name: transformers`,
`pipeline_tag: text-generation`, tags, the evaluation results as `model-index`, then an architecture table and a
parameter table from the config (total parameters, and active parameters per token = everything but the routed
experts, plus k/E of the routed experts), the training data and recipe from `training_info.json` (written by
`kdamoe-train`), the evaluation results and plots of `kdamoe-eval` (copied into `PATH/eval/` so the card's links
resolve on the Hub), usage snippets that need only `transformers` (`trust_remote_code=True`; the lm-evaluation-harness
task files are copied into `PATH/lm_eval_tasks/` so they travel with the model), intended use and limitations,
fine-tuning with PEFT / `Trainer` / TRL, and citations.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .data import STDLIB
from .errors import UsageError, run_cli
from .evaluate import LM_EVAL_TASK_DIR

TAGS = ["kdamoe", "custom_code", "kda", "linear-attention", "moe", "mixture-of-experts", "attention-residuals",
        "long-context"]
EVAL_SUBDIR = "eval"
TASK_SUBDIR = "lm_eval_tasks"
CITATIONS = """```bibtex
@misc{kimiteam2025kimilinear,
  title         = {Kimi Linear: An Expressive, Efficient Attention Architecture},
  author        = {{Kimi Team} and Yu Zhang and Zongyu Lin and Xingcheng Yao and Jiaxi Hu and others},
  year          = {2025},
  eprint        = {2510.26692},
  archivePrefix = {arXiv},
  primaryClass  = {cs.CL},
  url           = {https://arxiv.org/abs/2510.26692}
}

@misc{su2026quantilebalancing,
  title  = {{MoE} Travelogue 6: Optimal Assignment for Load Balancing (Quantile Balancing; in Chinese)},
  author = {Jianlin Su},
  year   = {2026},
  url    = {https://kexue.fm/archives/11619}
}

@misc{kimiteam2026attnres,
  title         = {Attention Residuals},
  author        = {{Kimi Team}},
  year          = {2026},
  eprint        = {2603.15031},
  archivePrefix = {arXiv},
  url           = {https://arxiv.org/abs/2603.15031}
}
```"""
PLOT_TITLES = {
    "length_extrapolation": "Loss by token position (length extrapolation)",
    "passkey": "Passkey retrieval",
    "moe": "Expert load",
    "attnres": "AttnRes depth weights",
    "speed": "Speed and cache memory",
}


def parameter_counts(config) -> dict[str, int]:
    """Parameters of a `KDAMoEForCausalLM` built from `config` on the meta device (no memory, no weights).

    Returns `total` (tied weights counted once), `routed_experts`, `active_per_token` (= total - routed +
    routed * k / E, rounded), `embedding` and `lm_head` (0 when tied to the embedding).
    """
    from .model.modeling_kdamoe import KDAMoEForCausalLM

    with torch.device("meta"):
        model = KDAMoEForCausalLM(config)
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    routed = sum(p.numel() for name, p in named.items() if ".ffn.experts." in name)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {
        "total": total,
        "routed_experts": routed,
        "active_per_token": round(total - routed + routed * config.num_experts_per_tok / config.num_experts),
        "embedding": model.model.embed_tokens.weight.numel(),
        "lm_head": 0 if tied else model.lm_head.weight.numel(),
    }


def _hub_dataset_id(dataset: str | None) -> str | None:
    """The Hub dataset id of a training corpus spec (`owner/name[:config]`), None for stdlib and local files."""
    if not dataset or dataset == STDLIB or Path(dataset).exists() or any(c in dataset for c in "*?["):
        return None
    return dataset.partition(":")[0]


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def architecture_section(config) -> str:
    """Markdown: the layer layout and shapes of the config."""
    n_kda = config.layer_types.count("linear_attention")
    n_attn = config.layer_types.count("full_attention")
    n_moe = config.mlp_layer_types.count("sparse")
    gate = (f"bounded, lower bound {config.kda_gate_lower_bound}" if config.kda_gate == "bounded"
            else "softplus (unbounded)")
    pattern = " ".join("K" if t == "linear_attention" else "A" for t in config.layer_types)
    rows = [
        ("layers", f"{config.num_hidden_layers} ({n_kda} KDA, {n_attn} full attention; pattern `{pattern}`)"),
        ("hidden size", str(config.hidden_size)),
        ("KDA", f"{config.kda_num_heads} heads x {config.kda_head_dim}, short conv {config.kda_conv_size}, "
                f"gate {gate}"),
        ("full attention", f"{config.num_attention_heads} query / {config.num_key_value_heads} KV heads x "
                           f"{config.head_dim}, NoPE (no positional encoding)"),
        ("FFN", f"{n_moe} MoE layers, {config.num_hidden_layers - n_moe} dense (width {config.intermediate_size})"),
        ("MoE", f"{config.num_experts} routed experts, top-{config.num_experts_per_tok}, {config.num_shared_experts} "
                f"shared, expert width {config.moe_intermediate_size}, {config.expert_activation}"),
        ("router balancing", config.router_balancing),
        ("residual", f"{config.residual_mode}" + (f", {config.attnres_block_layers} layers per block"
                                                 if config.residual_mode == "block_attnres" else "")),
        ("vocabulary", f"{config.vocab_size}" + (", tied embeddings" if config.tie_word_embeddings else "")),
    ]
    return _table(rows, ("", ""))


def parameter_section(counts: dict[str, int], config) -> str:
    rows = [
        ("total", f"{counts['total']:,} ({_human(counts['total'])})"),
        ("active per token", f"{counts['active_per_token']:,} ({_human(counts['active_per_token'])})"),
        ("routed experts (all)", f"{counts['routed_experts']:,}"),
        ("embedding", f"{counts['embedding']:,}" + (" (shared with the LM head)" if not counts["lm_head"] else "")),
    ]
    if counts["lm_head"]:
        rows.append(("LM head", f"{counts['lm_head']:,}"))
    note = (f"Active parameters per token count everything except the routed experts, plus "
            f"{config.num_experts_per_tok}/{config.num_experts} of them (each token uses "
            f"{config.num_experts_per_tok} of {config.num_experts} routed experts per MoE layer).")
    return _table(rows, ("parameters", "count")) + "\n\n" + note


def training_section(info: dict) -> str:
    """Markdown: data and recipe from `training_info.json` (empty dict: a note that it is unknown)."""
    if not info:
        return "No `training_info.json` was found next to the weights, so the training run is not described here."
    data, s = info.get("data", {}), info.get("settings", {})
    stages = ", ".join(f"{st['seq_len']} tokens x {st['steps']} steps" for st in info.get("stages", []))
    rows = [
        ("data", data.get("description") or str(data.get("dataset", "unknown"))),
        ("dataset", f"`{data.get('dataset', 'unknown')}`"
                    + (f", {data['train_documents']:,} training documents" if "train_documents" in data else "")),
        ("held-out split", f"every document of `{data['validation_dataset']}`" if data.get("validation_dataset")
         else f"{data.get('validation_fraction', '?')} ({data.get('split_rule', '')})"),
        ("tokenizer", f"byte-level BPE, {info.get('tokenizer', {}).get('vocab_size', '?')} tokens"),
        ("steps / tokens", f"{info.get('steps', '?')} optimizer steps, {info.get('tokens_trained', 0):,} tokens"),
        ("context stages", stages or "?"),
        ("optimizer", f"AdamW, lr {s.get('lr')}, {s.get('schedule')} schedule, warmup {s.get('warmup_steps')}, "
                      f"weight decay {s.get('weight_decay')}, grad clip {s.get('max_grad_norm')}"),
        ("hardware", f"world size {info.get('world_size', '?')}, mixed precision {info.get('mixed_precision', '?')}"),
    ]
    if "val_loss" in info:
        rows.append(("validation loss", f"{info.get('val_loss_before', float('nan')):.4f} before -> "
                                        f"{info['val_loss']:.4f} after (unigram baseline "
                                        f"{info.get('unigram_entropy', float('nan')):.4f}) nats/token"))
    versions = info.get("versions", {})
    if versions:
        rows.append(("software", ", ".join(f"{k} {v}" for k, v in versions.items())))
    note = ("\n\nThe Python standard library source is distributed under the Python Software Foundation License."
            if data.get("dataset") == STDLIB else "")
    return _table(rows, ("", "")) + note


def eval_results(report: dict, model_name: str) -> list[EvalResult]:
    """`model-index` entries from an `eval.json` report."""
    ppl, bpb, pk = report["perplexity"], report["bits_per_byte"], report["passkey"]
    dataset = str(ppl.get("dataset", "held-out"))
    common = dict(task_type="text-generation", task_name="Language modeling", dataset_type=dataset,
                  dataset_name=f"{dataset} (held-out split)", dataset_split=ppl.get("split", "validation"))
    results = [
        EvalResult(**common, metric_type="perplexity", metric_name="Perplexity", metric_value=round(ppl["value"], 4)),
        EvalResult(**common, metric_type="bits_per_byte", metric_name="Bits per byte",
                   metric_value=round(bpb["value"], 4)),
        EvalResult(task_type="text-generation", task_name="Passkey retrieval", dataset_type="synthetic-passkey",
                   dataset_name=f"Passkey retrieval ({pk['style']} filler, up to {max(pk['lengths'])} tokens)",
                   metric_type="accuracy", metric_name="Passkey accuracy", metric_value=round(pk["mean_accuracy"], 4)),
    ]
    if report["moe"].get("layers"):
        results.append(EvalResult(**common, metric_type="max_vio_global", metric_name="MaxVio_global (mean over MoE "
                                  "layers)", metric_value=round(report["moe"]["max_vio_global_mean"], 4)))
    return results


def evaluation_section(report: dict, plots: dict[str, str]) -> str:
    ppl, bpb, pk, moe = report["perplexity"], report["bits_per_byte"], report["passkey"], report["moe"]
    rows = [
        ("perplexity", f"{ppl['value']:.3f} ({ppl['loss']:.4f} nats/token, {ppl['tokens']:,} tokens of "
                       f"`{ppl.get('dataset')}`, rows of {ppl['seq_len']})"),
        ("bits per byte", f"{bpb['value']:.4f} ({bpb['bytes']:,} bytes)"),
        ("passkey accuracy", f"{pk['mean_accuracy']:.3f} (lengths {pk['lengths']}, depths {pk['depths']}, "
                             f"{pk['trials']} trials each)"),
    ]
    ext = report.get("length_extrapolation")
    if ext and ext.get("loss_beyond_train_length") is not None:
        rows.append(("loss by position", f"{ext['loss_within_train_length']:.4f} within the training length "
                                         f"{ext['train_length']}, {ext['loss_beyond_train_length']:.4f} beyond "
                                         f"(up to {ext['length']})"))
    for layer, v in moe.get("layers", {}).items():
        rows.append((f"MoE layer {layer}", f"MaxVio_global {v['max_vio_global']:.3f}, mean MaxVio_batch "
                                           f"{v['max_vio_batch_mean']:.3f}, dead experts {v['dead_experts']}"))
    text = [_table(rows, ("metric", "value"))]
    speed = report.get("speed", {}).get("results", [])
    if speed:
        lines = [f"Speed on {report['speed']['device']} ({report['speed']['dtype']}, batch 1):", "",
                 "| context | prefill tok/s | decode tok/s | KDA state | attention KV |", "|---|---|---|---|---|"]
        lines += [f"| {r['context']} | {r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s'] or 0:,.1f} | "
                  f"{r['cache_bytes_kda'] / 2**20:.3f} MiB | {r['cache_bytes_attention'] / 2**20:.3f} MiB |"
                  for r in speed]
        text.append("\n".join(lines))
    for part, name in plots.items():
        text.append(f"**{PLOT_TITLES.get(part, part)}**\n\n![{PLOT_TITLES.get(part, part)}]({EVAL_SUBDIR}/{name})")
    return "\n\n".join(text)


def usage_section(repo_id: str) -> str:
    return f"""The model code ships with the weights (`trust_remote_code=True`); it needs `torch` and `transformers`
(Triton kernels are used on GPU when `triton` is installed).

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

repo = "{repo_id}"
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)
inputs = tokenizer("def fibonacci(n):", return_tensors="pt")
outputs = model.generate(**inputs, max_new_tokens=32, do_sample=False)
print(tokenizer.decode(outputs[0], skip_special_tokens=True))
```

or with a pipeline:

```python
from transformers import pipeline

generator = pipeline("text-generation", model="{repo_id}", trust_remote_code=True)
print(generator("import os\\n", max_new_tokens=32, do_sample=False)[0]["generated_text"])
```

lm-evaluation-harness: any task with `--model hf --model_args pretrained={repo_id},trust_remote_code=True`; the repo
also carries `kdamoe_pycloze`, a small Python cloze task (multiple choice by log-likelihood, no dataset download):

```bash
hf download {repo_id} --include "{TASK_SUBDIR}/*" --local-dir kdamoe-tasks
lm_eval --model hf --model_args pretrained={repo_id},trust_remote_code=True \\
    --tasks kdamoe_pycloze --include_path kdamoe-tasks/{TASK_SUBDIR}
```"""


def intended_use_section(info: dict) -> str:
    data = info.get("data", {})
    corpus = f" on {data.get('description') or '`' + str(data['dataset']) + '`'}" if "dataset" in data else ""
    return f"""A research model: for studying long-context, very sparse MoE language models built from KDA linear
attention, Quantile-Balanced routing and Block Attention Residuals (training dynamics, expert load, length
extrapolation, decoding cost), and as a starting point for fine-tuning such models. It was pretrained{corpus} as a
plain language model, with no instruction tuning, preference tuning or safety training."""


def limitations_section() -> str:
    return """- Small and briefly trained: its continuations are often wrong or meaningless, above all outside its
  training data. Do not use it to make decisions or to produce text for people without review.
- The numbers below come from the held-out split of its own training corpus and from small synthetic probes
  (passkey retrieval, loss by position); they say nothing about general ability.
- The model runs remote code (`trust_remote_code=True`): read the `*.py` files of the repo before running them.
  On CUDA with `triton` installed it uses Triton kernels; elsewhere a slower pure-PyTorch path.
- The MoE router biases move only when training code calls `model.apply_load_balancing()` once per optimizer step
  (see Fine-tuning); without it they stay as trained and expert load may drift during fine-tuning."""


def finetuning_section() -> str:
    return """The chat template is ChatML with the assistant turns marked for training, so TRL's
`SFTConfig(assistant_only_loss=True)` (or `apply_chat_template(..., return_assistant_tokens_mask=True)`) trains on
the assistant tokens only. The router is balanced by Quantile Balancing, not by a loss: the config's
`router_aux_loss_coef` is 0 and `output_router_logits` is off, so neither `Trainer` nor TRL adds a load-balancing
loss (`loss` is the language-model loss); instead call `apply_load_balancing()` after every optimizer step:

```python
from transformers import TrainerCallback

class LoadBalancing(TrainerCallback):  # `kdamoe.LoadBalancingCallback` does the same and logs MaxVio
    def on_step_end(self, args, state, control, model=None, **kwargs):
        getattr(model, "module", model).apply_load_balancing()

# trainer = transformers.Trainer(..., callbacks=[LoadBalancing()])
# trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(...), ..., callbacks=[LoadBalancing()])
```

PEFT LoRA: `target_modules="all-linear"` adapts every projection (attention and KDA `q/k/v/o_proj`, KDA's
`beta_proj`, `decay_*_proj` and `out_gate_*_proj`, the dense and shared-expert `gate/up/down_proj`); the routed
experts are 3-D parameters, adapted through `target_parameters`. The router (`router.weight`, `router.bias`) is
best left as it is.

```python
from peft import LoraConfig, get_peft_model

lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                  target_parameters=["experts.gate_up_proj", "experts.down_proj"])
model = get_peft_model(model, lora)
```"""


def build_card(path: str | Path, eval_json: str | Path | None = None, repo_id: str | None = None,
               license: str = "apache-2.0", model_name: str | None = None) -> ModelCard:
    """The model card of the folder `path`; copies the eval report and plots into `path/eval/` when given.

    Without `eval_json`, a report already in `path/eval/eval.json` is used if there is one.
    """
    from .model.configuration_kdamoe import KDAMoEConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UsageError(f"{path} is not a saved model folder (no config.json)")
    config = KDAMoEConfig.from_pretrained(path)
    repo_id = repo_id or f"your-name/{path.resolve().name}"
    model_name = model_name or repo_id.rsplit("/", 1)[-1]
    info_file = path / "training_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}

    eval_dir = path / EVAL_SUBDIR
    report = None
    if eval_json is not None:
        eval_json = Path(eval_json)
        if not eval_json.is_file():
            raise UsageError(f"--eval {eval_json} does not exist")
        report = json.loads(eval_json.read_text())
        eval_dir.mkdir(exist_ok=True)
        if eval_json.resolve() != (eval_dir / "eval.json").resolve():
            shutil.copyfile(eval_json, eval_dir / "eval.json")
            for name in report.get("plots", {}).values():
                if (eval_json.parent / name).is_file():
                    shutil.copyfile(eval_json.parent / name, eval_dir / name)
    elif (eval_dir / "eval.json").is_file():
        report = json.loads((eval_dir / "eval.json").read_text())
    missing = {"perplexity", "bits_per_byte", "passkey", "moe", "attnres", "speed"} - set(report or {})
    if report is not None and missing:
        raise UsageError(f"the eval report lacks {sorted(missing)}; write it with kdamoe-eval")

    hub_dataset = _hub_dataset_id(info.get("data", {}).get("dataset"))
    card_data = ModelCardData(
        license=license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=TAGS,
        model_name=model_name,
        datasets=[hub_dataset] if hub_dataset else None,
        eval_results=eval_results(report, model_name) if report else None,
    )
    shutil.copytree(LM_EVAL_TASK_DIR, path / TASK_SUBDIR, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    counts = parameter_counts(config)
    plots = {part: name for part, name in (report or {}).get("plots", {}).items() if (eval_dir / name).is_file()}
    sections = [
        f"# {model_name}",
        f"A {_human(counts['total'])}-parameter ({_human(counts['active_per_token'])} active per token) causal "
        "language model of the `kdamoe` family: Kimi Delta Attention (gated delta-rule linear attention) with a "
        "bounded log-decay gate, interleaved with NoPE full-attention layers; sparse MoE feed-forward layers "
        "balanced by Quantile Balancing (auxiliary-loss-free, closed-form router biases); and Block Attention "
        "Residuals (softmax attention over depth in place of the residual sum).",
        "## Usage", usage_section(repo_id),
        "## Intended use", intended_use_section(info),
        "## Limitations", limitations_section(),
        "## Fine-tuning", finetuning_section(),
        "## Architecture", architecture_section(config),
        "## Parameters", parameter_section(counts, config),
        "## Training", training_section(info),
        "## Evaluation",
        evaluation_section(report, plots) if report else "Not evaluated yet: run `kdamoe-eval` and rebuild the card.",
        "## Citation", "The three techniques this model is built from:", CITATIONS,
    ]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `kdamoe-card` and `python -m kdamoe.hub_card`: writes `PATH/README.md`."""
    run_cli("kdamoe-card", _main, argv)


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="kdamoe-card", description=__doc__.splitlines()[0])
    parser.add_argument("path", help="saved model folder")
    parser.add_argument("--eval", dest="eval_json", help="eval.json written by kdamoe-eval")
    parser.add_argument("--repo-id", help="Hub repo id used in the usage snippet (default your-name/<folder name>)")
    parser.add_argument("--license", default="apache-2.0")
    parser.add_argument("--model-name")
    args = parser.parse_args(argv)
    card = build_card(args.path, args.eval_json, args.repo_id, args.license, args.model_name)
    out = Path(args.path) / "README.md"
    card.save(out)
    print(f"wrote {out}")


__all__ = ["build_card", "eval_results", "main", "parameter_counts"]

if __name__ == "__main__":
    main()

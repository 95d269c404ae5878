"""Training: loss goes down, outputs, staged schedule, resume == uninterrupted, two gloo ranks in sync, errors."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kdamoe import KDAMoEConfig, KDAMoEForCausalLM, hub_card
from kdamoe import train as train_module
from kdamoe.data import validation_rows, load_corpus
from kdamoe.quickstart import generate_in_fresh_process
from kdamoe.train import (learning_rate, param_groups, parse_stages, plan_stages, rescale_stages, resolve_settings,
                          train)

MICRO = {
    "preset": "tiny",
    "model": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["sparse", "sparse"],
              "kda_num_heads": 2, "kda_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "attnres_block_layers": 1},
    "tokenizer_vocab_size": 384,
    "training": {"micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 2, "val_rows": 4, "shuffle_window_tokens": 2048},
}


def metrics(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A micro config file and a shared tokenizer (so each run skips tokenizer training)."""
    root = tmp_path_factory.mktemp("train")
    cfg = root / "micro.json"
    cfg.write_text(json.dumps(MICRO))
    out = root / "tok_run"
    train(["--config", str(cfg), "--output-dir", str(out), "--stages", "64:1"])
    return {"root": root, "config": str(cfg), "tokenizer": str(out / "tokenizer")}


def run(setup, out, *flags, return_model=False):
    argv = ["--config", setup["config"], "--tokenizer", setup["tokenizer"], "--output-dir", str(out), *flags]
    return train(argv, return_model=return_model)


@pytest.fixture(scope="module")
def base_run(setup):
    out = setup["root"] / "base"
    summary = run(setup, out, "--stages", "64:16")
    return out, summary


def test_training_lowers_loss_and_writes_a_loadable_folder(setup, base_run):
    out, summary = base_run
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 17))
    for r in rows:
        assert set(r) >= {"step", "loss", "lr", "tokens_per_second", "grad_norm", "max_vio", "dead_experts"}
        assert set(r["max_vio"]) == {"0", "1"} and all(v >= 0 for v in r["max_vio"].values())
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]))
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4]) - 4 * 0.3
    assert summary["val_loss"] < summary["val_loss_before"] - 0.3
    assert rows[-1]["tokens"] == 16 * 4 * 64 == summary["tokens_trained"]
    final = out / "final"
    for name in ("config.json", "model.safetensors", "modeling_kdamoe.py", "tokenizer.json",
                 "generation_config.json", "training_info.json"):
        assert (final / name).is_file(), name
    info = json.loads((final / "training_info.json").read_text())
    assert info["val_loss"] == summary["val_loss"] and info["data"]["dataset"] == "stdlib"
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    # the saved folder reproduces the reported validation loss
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(final, trust_remote_code=True)
    val = validation_rows(load_corpus("stdlib", "validation"), tok, 64, 4)
    with torch.no_grad():
        losses = [model(**{k: v[i:i + 1] for k, v in val.items()}).loss for i in range(4)]
    counts = (val["labels"][:, 1:] != -100).sum(1)
    reloaded = float(sum(l * c for l, c in zip(losses, counts)) / counts.sum())
    assert reloaded == pytest.approx(summary["val_loss"], abs=1e-5)
    # a fresh interpreter elsewhere, offline, loads it through the Auto classes and generates
    printed = generate_in_fresh_process(final, "def ")
    assert "generated" in printed and "KDAMoEForCausalLM" in printed


def test_resume_equals_uninterrupted(setup):
    flags = ("--stages", "32:4,64:4", "--save-every", "3")
    full = setup["root"] / "full"
    run(setup, full, *flags)
    part = setup["root"] / "part"
    run(setup, part, *flags, "--max-steps", "5")  # checkpoints at 3 and 5
    # simulate a crash while writing the step-6 checkpoint after losing step 5's
    shutil.rmtree(part / "checkpoints" / "step_00000005")
    tmp = part / "checkpoints" / ".tmp-step_00000006"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    summary = run(setup, part, *flags, "--resume")
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in b] == list(range(1, 9)) and [r["seq_len"] for r in b] == [32] * 4 + [64] * 4
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6, abs=0)
    assert [r["max_vio"] for r in a] == [r["max_vio"] for r in b]
    assert summary["val_loss"] == pytest.approx(json.loads((full / "final" / "training_info.json").read_text())["val_loss"],
                                                rel=1e-6)
    # the staged schedule kept tokens per step: 4 rows of 32 then 2 rows of 64
    assert [r["tokens"] for r in a] == [128 * i for i in range(1, 9)]
    stages = json.loads((full / "final" / "training_info.json").read_text())["stage_summary"]
    assert [(s["stage"], s["seq_len"], s["steps"]) for s in stages] == [(0, 32, 4), (1, 64, 4)]
    for s, rows in zip(stages, (a[:4], a[4:])):
        assert (s["loss_first"], s["loss_last"]) == (rows[0]["loss"], rows[-1]["loss"]) and s["loss_finite"]
        middle = sorted(r["tokens_per_second"] for r in rows)[1:3]  # the median of 4 steps
        assert s["tokens_per_second"] == pytest.approx(sum(middle) / 2)
        assert s["peak_memory_gib"] is None  # measured on CUDA only
    # a checkpoint from a different config is refused
    with pytest.raises(ValueError, match="different config"):
        run(setup, part, *flags, "--resume", "--lr", "5e-3")


def test_offloaded_activations_train_as_without(setup, tmp_path, monkeypatch):
    """--offload-activations wraps every forward in HostOffload (here taking CPU tensors as the device's, so the
    layers' inputs really go through host copies): the same losses as checkpointing alone."""
    made = []

    class CPUOffload(train_module.HostOffload):
        def __init__(self):
            super().__init__(min_bytes=0, device_types=("cpu",))
            made.append(self)

    monkeypatch.setattr(train_module, "HostOffload", CPUOffload)
    flags = ("--stages", "32:3", "--gradient-checkpointing")
    run(setup, tmp_path / "plain", *flags)
    run(setup, tmp_path / "offload", *flags, "--offload-activations")
    assert len(made) == 3 and all(hooks.offloaded_bytes > 0 for hooks in made)
    assert [r["loss"] for r in metrics(tmp_path / "offload")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "plain")], rel=1e-6, abs=0)


def test_output_dir_and_input_errors(setup, base_run, tmp_path):
    out, _ = base_run
    with pytest.raises(ValueError, match="holds another run"):
        run(setup, out, "--stages", "64:1")
    with pytest.raises(ValueError, match="above the preset's maximum"):
        run(setup, tmp_path / "a", "--stages", "4096:1")
    with pytest.raises(ValueError, match="bad stage"):
        run(setup, tmp_path / "b", "--stages", "64")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        run(setup, tmp_path / "c", "--dataset", str(tmp_path / "empty"), "--stages", "64:1")
    assert not (tmp_path / "c").exists()  # a failed start leaves no output folder behind
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"training": {"learning_rate": 1.0}}))
    with pytest.raises(ValueError, match="unknown training settings"):
        train(["--config", str(bad), "--output-dir", str(tmp_path / "d")])


def test_overwrite_replaces_a_run(setup, tmp_path):
    out = tmp_path / "o"
    run(setup, out, "--stages", "32:2")
    run(setup, out, "--stages", "32:1", "--overwrite")
    assert [r["step"] for r in metrics(out)] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


def final_loss(final: Path, val: dict) -> float:
    """Mean validation loss of the saved model over `val` rows (an independent re-computation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True).eval()
    with torch.no_grad():
        losses = [model(**{k: v[i:i + 1] for k, v in val.items()}).loss for i in range(len(val["input_ids"]))]
    counts = (val["labels"][:, 1:] != -100).sum(1)
    return float(sum(l * c for l, c in zip(losses, counts)) / counts.sum())


def test_one_text_file_trains_and_validates(setup, tmp_path):
    import datasets
    from transformers import AutoTokenizer

    lines = [line for row in load_corpus("stdlib", "validation").select(range(8)) for line in
             row["text"].splitlines(keepends=True)]
    text = "".join(lines)
    (tmp_path / "book.txt").write_text(text)
    tok = AutoTokenizer.from_pretrained(setup["tokenizer"])
    summary = run(setup, tmp_path / "one", "--dataset", str(tmp_path / "book.txt"), "--stages", "64:2")
    # validation is the tail of the file from the first line start after 95 % of it, every other line trains
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    cut = next(o for o in offsets if o >= round(0.95 * len(text)))
    tail = validation_rows(datasets.Dataset.from_dict({"text": [text[cut:]]}), tok, 64, 4)
    assert summary["val_loss"] == pytest.approx(final_loss(tmp_path / "one" / "final", tail), abs=1e-5)
    assert summary["data"]["train_characters"] == cut
    # an explicit held-out corpus: all of --dataset trains, all of --validation-dataset validates
    (tmp_path / "other.txt").write_text(text[:cut // 3])
    summary = run(setup, tmp_path / "two", "--dataset", str(tmp_path / "book.txt"), "--stages", "64:2",
                  "--validation-dataset", str(tmp_path / "other.txt"))
    other = validation_rows(datasets.Dataset.from_dict({"text": [text[:cut // 3]]}), tok, 64, 4)
    assert summary["val_loss"] == pytest.approx(final_loss(tmp_path / "two" / "final", other), abs=1e-5)
    assert summary["data"]["train_characters"] == len(text)
    assert summary["data"]["validation_dataset"] == str(tmp_path / "other.txt")


def test_resume_keeps_the_card_and_eval(setup, tmp_path):
    out, final = tmp_path / "r", tmp_path / "r" / "final"
    run(setup, out, "--stages", "32:4", "--max-steps", "2")
    hub_card.main([str(final)])
    (final / "eval").mkdir()
    (final / "eval" / "eval.json").write_text("{}")
    card = (final / "README.md").read_text()
    weights = (final / "model.safetensors").read_bytes()
    summary = run(setup, out, "--stages", "32:4", "--resume")  # trains steps 3-4 and rewrites the model
    assert summary["steps"] == 4 and (final / "model.safetensors").read_bytes() != weights
    assert (final / "README.md").read_text() == card and (final / "eval" / "eval.json").read_text() == "{}"
    info = (final / "training_info.json").read_text()
    weights = (final / "model.safetensors").read_bytes()
    again = run(setup, out, "--stages", "32:4", "--resume")  # finished: nothing to train, nothing rewritten
    assert again["steps"] == 4 and (final / "training_info.json").read_text() == info
    assert (final / "model.safetensors").read_bytes() == weights and (final / "README.md").read_text() == card
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]


def test_max_steps_scales_the_warmup_with_the_stages(tmp_path):
    def resolved(*flags):
        settings = resolve_settings(["--preset", "tiny", "--output-dir", str(tmp_path), *flags])[0]
        return settings["stages"], settings["warmup_steps"]

    assert resolved() == ("256:300", 30)
    assert resolved("--max-steps", "40") == ("256:40", 4)  # 30 of 300 steps -> 4 of 40
    assert resolved("--max-steps", "40", "--warmup-steps", "10") == ("256:40", 10)  # an explicit warmup stays
    assert resolved("--stages", "256:300", "--max-steps", "40") == ("256:300", 30)  # stops early in the same run
    s = {"lr": 1.0, "warmup_steps": 4, "min_lr_ratio": 0.1, "schedule": "cosine", "wsd_decay_fraction": 0.2}
    assert [learning_rate(i, 40, s) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_staged_million_token_config(tmp_path):
    """configs/small_staged_1m.json: the small preset from 8K to 1M tokens a row, one row a step past 64K, with
    checkpointed layers whose inputs wait in host memory."""
    config = Path(__file__).parents[1] / "configs" / "small_staged_1m.json"
    settings, model_kwargs, limits = resolve_settings(["--config", str(config), "--output-dir", str(tmp_path)])
    plans = plan_stages(parse_stages(settings["stages"], limits["max_seq_len"]), settings["micro_batch_size"],
                        settings["grad_accum"], world=1)
    assert [p.seq_len for p in plans] == [8192, 65536, 262144, 1 << 20]
    assert [p.rows(1) * p.seq_len for p in plans] == [65536, 65536, 262144, 1 << 20]
    assert settings["gradient_checkpointing"] and settings["offload_activations"] and settings["preset"] == "small"


def test_schedule_plan_and_no_decay_groups():
    assert parse_stages("512:200, 2048:100", 4096) == [(512, 200), (2048, 100)]
    assert rescale_stages([(256, 300), (1024, 100)], 40) == [(256, 30), (1024, 10)]
    plans = plan_stages([(64, 1), (256, 1), (1024, 1)], micro_batch_size=8, grad_accum=2, world=2)
    assert [p.rows(2) * p.seq_len for p in plans] == [2048] * 3
    assert [(p.micro_batch, p.grad_accum) for p in plans] == [(8, 2), (2, 2), (1, 1)]
    s = {"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1, "schedule": "cosine", "wsd_decay_fraction": 0.2}
    lrs = [learning_rate(i, 110, s) for i in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[-1] == pytest.approx(0.1)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    wsd = [learning_rate(i, 100, {**s, "schedule": "wsd"}) for i in range(100)]
    assert wsd[10:80] == [1.0] * 70 and wsd[-1] == pytest.approx(0.1) and wsd[80] < 1.0
    config = KDAMoEConfig(**MICRO["model"], vocab_size=64)
    model = KDAMoEForCausalLM(config)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    for name, p in model.named_parameters():
        expected = p.ndim < 2 or any(m in name for m in ("A_log", "dt_bias", "norm", "attn_res")) or name.endswith("bias")
        assert (name in no_decay_names) == expected, name
    assert any("A_log" in n for n in no_decay_names) and any("dt_bias" in n for n in no_decay_names)
    assert any("attn_res" in n for n in no_decay_names)
    assert all(p.ndim >= 2 for p in decay["params"])
    assert any(p.ndim == 3 for p in decay["params"])  # expert weights decay


DIGEST = r"""
import hashlib, json, os, sys
import torch
from kdamoe.train import train
summary, model = train(sys.argv[2:], return_model=True)
state = model.state_dict()
blob = b"".join(state[k].detach().contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(state))
biases = {k: v.tolist() for k, v in state.items() if k.endswith("router.bias")}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"sha256": hashlib.sha256(blob).hexdigest(), "biases": biases}, f)
"""


def torchrun(setup, tmp_path, script: str, out, *flags) -> subprocess.CompletedProcess:
    """The Python source `script` on 2 gloo ranks (`torch.distributed.run`), given tmp_path and then kdamoe-train flags:
    the micro config, the shared tokenizer, `--output-dir out` and `flags`."""
    path = tmp_path / "script.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(path),
           str(tmp_path), "--config", setup["config"], "--tokenizer", setup["tokenizer"], "--output-dir", str(out),
           *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_two_ranks_stay_in_sync(setup, base_run, tmp_path):
    """2 gloo ranks x micro-batch 2 train like 1 process x micro-batch 4, with identical weights and router biases."""
    out = tmp_path / "ddp"
    result = torchrun(setup, tmp_path, DIGEST, out, "--stages", "64:16", "--micro-batch-size", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0["sha256"] == r1["sha256"]
    assert r0["biases"] == r1["biases"] and len(r0["biases"]) == 2
    assert any(abs(b) > 0 for bias in r0["biases"].values() for b in bias)  # the balancer did move the biases
    base_out, base_summary = base_run
    info = json.loads((out / "final" / "training_info.json").read_text())
    assert info["world_size"] == 2
    ddp_losses, base_losses = [r["loss"] for r in metrics(out)], [r["loss"] for r in metrics(base_out)]
    assert ddp_losses == pytest.approx(base_losses, abs=2e-3)
    assert info["val_loss"] == pytest.approx(base_summary["val_loss"], abs=2e-3)


def test_torchrun_context_parallel_trains_as_one_process(setup, base_run, tmp_path):
    """--context-parallel 2 on 2 gloo ranks: each rank trains half of every row of the single process's batches; the
    loss of each step (the mean over both halves) and the validation loss are the single process's, and both ranks
    hold the same weights and router biases."""
    out = tmp_path / "cp"
    result = torchrun(setup, tmp_path, DIGEST, out, "--stages", "64:16", "--max-steps", "3", "--context-parallel", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert r0 == r1
    base_out, base_summary = base_run
    info = json.loads((out / "final" / "training_info.json").read_text())
    assert info["world_size"] == 2 and info["context_parallel"] == 2
    cp_losses, base_losses = [r["loss"] for r in metrics(out)], [r["loss"] for r in metrics(base_out)][:3]
    assert cp_losses[0] == pytest.approx(base_losses[0], rel=1e-6, abs=0)  # the same weights, batch and loss
    assert cp_losses == pytest.approx(base_losses, rel=1e-4, abs=0)  # then fp32 rounding of different sums
    assert info["val_loss_before"] == pytest.approx(base_summary["val_loss_before"], rel=1e-6, abs=0)


def test_context_parallel_errors(setup, tmp_path):
    """--context-parallel N must divide the number of processes and every stage's row length."""
    with pytest.raises(ValueError, match=r"--context-parallel 2 does not divide the number of processes \(1\)"):
        run(setup, tmp_path / "a", "--stages", "64:1", "--context-parallel", "2")
    with pytest.raises(ValueError, match="--context-parallel must be >= 1"):
        run(setup, tmp_path / "b", "--stages", "64:1", "--context-parallel", "0")
    four = type("Accelerator", (), {"num_processes": 4, "process_index": 0})()
    with pytest.raises(ValueError, match="--context-parallel 2 does not divide the sequence length 63"):
        train_module.parallel_layout(four, 2, [64, 63])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_torchrun_expert_parallel_trains_as_one_process_and_resumes(setup, base_run, tmp_path):
    """--expert-parallel 2 on 2 gloo ranks x micro-batch 2: each rank holds half of every MoE layer's experts and the
    losses are the single process's (micro-batch 4); `final/` holds the whole model (gathered), the same on both
    ranks; a run stopped after 2 steps resumes (each rank's expert shards and optimizer state) into the same step 3."""
    def launch(out, *flags):
        result = torchrun(setup, tmp_path, DIGEST, out, "--stages", "64:16", "--micro-batch-size", "2",
                          "--expert-parallel", "2", *flags)
        assert result.returncode == 0, result.stderr[-4000:]
        return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]

    r0, r1 = launch(tmp_path / "ep", "--max-steps", "3")
    assert r0 == r1
    base_out, _ = base_run
    ep_losses, base_losses = [r["loss"] for r in metrics(tmp_path / "ep")], [r["loss"] for r in metrics(base_out)]
    assert ep_losses[0] == pytest.approx(base_losses[0], rel=1e-6, abs=0)
    assert ep_losses == pytest.approx(base_losses[:3], rel=1e-4, abs=0)
    info = json.loads((tmp_path / "ep" / "final" / "training_info.json").read_text())
    assert info["expert_parallel"] == 2
    whole = KDAMoEForCausalLM.from_pretrained(tmp_path / "ep" / "final")
    assert all(layer.ffn.experts.gate_up_proj.shape[0] == 4 for layer in whole.model.layers if layer.is_moe)

    launch(tmp_path / "resumed", "--max-steps", "2")
    s0, _ = launch(tmp_path / "resumed", "--max-steps", "3", "--resume")
    assert s0["sha256"] == r0["sha256"]  # the same weights as the uninterrupted run
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == ep_losses


def test_expert_parallel_errors(setup, tmp_path):
    with pytest.raises(ValueError, match=r"--expert-parallel 2 does not divide the number of processes \(1\)"):
        run(setup, tmp_path / "a", "--stages", "64:1", "--expert-parallel", "2")
    with pytest.raises(ValueError, match="--expert-parallel must be >= 1"):
        run(setup, tmp_path / "b", "--stages", "64:1", "--expert-parallel", "0")


@pytest.mark.parametrize("save_every", ["0", "3"])
def test_a_non_finite_loss_stops_before_the_optimizer_step_and_keeps_the_last_finite_weights(setup, tmp_path,
                                                                                               monkeypatch, save_every):
    """The 4th training forward returns a NaN loss: the run raises a one-line error naming step 4, logs steps 1-3,
    and step 3's checkpoint (written at the stop, or by --save-every 3 before it) holds the weights of a run stopped
    after 3 steps, bit for bit."""
    from safetensors.torch import load_file

    from kdamoe.errors import UsageError

    three = tmp_path / "three"
    run(setup, three, "--stages", "32:6", "--max-steps", "3")
    forward, calls = KDAMoEForCausalLM.forward, []

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if len(calls) == 4:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(KDAMoEForCausalLM, "forward", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(UsageError, match=r"step 4: the loss \(nan\) .* not finite .* weights after step 3 are in"):
        run(setup, out, "--stages", "32:6", "--save-every", save_every)
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert not (out / "final").exists()
    saved = load_file(out / "checkpoints" / "step_00000003" / "model.safetensors")
    expected = load_file(three / "checkpoints" / "step_00000003" / "model.safetensors")
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved) and all(v.isfinite().all() for v in saved.values())


NAN_ON_RANK_1 = r"""
import os, sys
from kdamoe.errors import UsageError
from kdamoe.model.modeling_kdamoe import KDAMoEForCausalLM
from kdamoe.train import train
forward, calls = KDAMoEForCausalLM.forward, []
def poisoned(self, *args, **kwargs):
    out = forward(self, *args, **kwargs)
    if self.training and os.environ["RANK"] == "1":
        calls.append(1)
        if len(calls) == 4:
            out.loss = out.loss * float("nan")
    return out
KDAMoEForCausalLM.forward = poisoned
try:
    train(sys.argv[2:])
except UsageError as error:
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w") as f:
        f.write(str(error))
    sys.exit(2)
"""


def test_torchrun_a_non_finite_loss_on_one_rank_stops_every_rank(setup, tmp_path):
    """Rank 1 alone gets a NaN loss at step 4: both ranks stop there with the same error (no rank left waiting in a
    collective), after writing step 3's checkpoint together."""
    out = tmp_path / "ddp"
    result = torchrun(setup, tmp_path, NAN_ON_RANK_1, out, "--stages", "64:8", "--micro-batch-size", "2")
    assert result.returncode != 0
    errors = [(tmp_path / f"rank{i}.txt").read_text() for i in (0, 1)]
    assert errors[0] == errors[1] and errors[0].startswith("step 4: the loss (nan)"), (errors, result.stderr[-3000:])
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert (out / "checkpoints" / "step_00000003" / "trainer_state.json").is_file()

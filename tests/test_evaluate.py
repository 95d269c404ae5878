"""kdamoe-eval on a tiny model trained by kdamoe-train: each metric against an independent computation."""

import json
import math

import numpy as np
import pytest
import torch
from tqdm.auto import tqdm

import kdamoe
from kdamoe import evaluate as ev
from conftest import DECODE_TOKENS, PASSKEY_DEPTHS, PASSKEY_LENGTHS, SPEED_LENGTHS, TRAIN_LEN, VAL_ROWS
from kdamoe.data import load_corpus, validation_rows
from kdamoe.errors import UsageError

@pytest.fixture(scope="package")
def val_rows(loaded):
    return validation_rows(load_corpus("stdlib", "validation"), loaded[1], TRAIN_LEN, VAL_ROWS)


def test_report_has_every_part_and_plot(report, eval_dir):
    for key in ("perplexity", "bits_per_byte", "passkey", "moe", "attnres", "speed", "length_extrapolation"):
        assert key in report
    assert set(report["plots"]) == set(ev.PLOTS)
    for name in report["plots"].values():
        assert (eval_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_perplexity_matches_training_and_direct_loss(report, trained_run, loaded, val_rows):
    info = json.loads((trained_run / "final" / "training_info.json").read_text())
    ppl = report["perplexity"]
    # Defaults come from the run: same corpus split, row length and rows as the training loop's validation loss.
    assert (ppl["seq_len"], ppl["rows"]) == (TRAIN_LEN, VAL_ROWS)
    assert ppl["loss"] == pytest.approx(info["val_loss"], rel=1e-5)
    with torch.no_grad():
        direct = loaded[0](**val_rows).loss.item()  # the model's own label-shifting loss
    assert ppl["loss"] == pytest.approx(direct, rel=1e-5)
    assert ppl["value"] == pytest.approx(math.exp(direct), rel=1e-5)
    assert ppl["tokens"] == int((val_rows["labels"][:, 1:] != -100).sum())
    # bits per byte: summed nats -> bits, over the UTF-8 bytes of the predicted text
    targets = val_rows["labels"][:, 1:]
    targets = targets[targets != -100].tolist()
    tokenizer = loaded[1]
    special = set(tokenizer.all_special_ids)
    text = tokenizer.decode([t for t in targets if t not in special])
    n_bytes = len(text.encode("utf-8"))
    assert report["bits_per_byte"]["bytes"] == n_bytes
    assert report["bits_per_byte"]["value"] == pytest.approx(direct * ppl["tokens"] / math.log(2) / n_bytes, rel=1e-5)


def test_token_byte_lengths_count_utf8_bytes(loaded):
    tokenizer = loaded[1]
    text = "naïve café → ünïcode ✓ and plain ascii\n\tdef f(x): return x"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    lengths = ev.token_byte_lengths(tokenizer, loaded[0].config.vocab_size)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert all(lengths[i] == 0 for i in tokenizer.all_special_ids)


def test_moe_max_vio_matches_direct_count(report, loaded, val_rows):
    model = loaded[0]
    k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    with torch.no_grad():
        out = model(input_ids=val_rows["input_ids"], position_ids=val_rows["position_ids"],
                    output_router_logits=True)
    moe_layers = [i for i, t in enumerate(model.config.mlp_layer_types) if t == "sparse"]
    assert sorted(report["moe"]["layers"], key=int) == [str(i) for i in moe_layers]
    for i, logits in zip(moe_layers, out.router_logits):
        bias = model.model.layers[i].ffn.router.bias.double()
        chosen = torch.topk(torch.sigmoid(logits.double()) + bias, k, dim=-1).indices
        loads = np.bincount(chosen.flatten().numpy(), minlength=num_experts)
        layer = report["moe"]["layers"][str(i)]
        assert layer["loads"] == loads.tolist()
        assert sum(layer["loads"]) == k * val_rows["input_ids"].numel()
        assert layer["max_vio_global"] == pytest.approx((loads.max() - loads.mean()) / loads.mean(), rel=1e-9)
        assert layer["dead_experts"] == int((loads == 0).sum())


def _expected_source_counts(config) -> list[int]:
    """Block AttnRes: layer i's mixer sees the embedding + i // b closed blocks (+ the open block's partial sum
    unless the block just started); its ffn always sees the partial sum; the final query all of them."""
    b, n = config.attnres_block_layers, config.num_hidden_layers
    counts = []
    for i in range(n):
        counts += [1 + i // b + (i % b != 0), 1 + i // b + 1]
    return counts + [1 + n // b + (n % b != 0)]


def test_attnres_weights_layout_and_convexity(report, loaded):
    config = loaded[0].config
    subl = report["attnres"]["sublayers"]
    assert [len(s["weights"]) for s in subl] == _expected_source_counts(config)
    for s in subl:
        assert sum(s["weights"]) == pytest.approx(1.0, abs=1e-6)
        assert min(s["weights"]) >= 0


def test_attnres_weights_are_uniform_with_zero_queries(loaded, val_rows):
    # A fresh model has zero pseudo-queries, so every query averages its sources uniformly.
    config = kdamoe.KDAMoEConfig(**{**loaded[0].config.to_dict(), "attnres_block_layers": 3})
    model = kdamoe.KDAMoEForCausalLM(config).eval()
    rows = {k: v[:2, :16] for k, v in val_rows.items()}
    out = ev.heldout_metrics(model, loaded[1], rows, 2, torch.device("cpu"), tqdm(disable=True))
    subl = out["attnres"]["sublayers"]
    assert [len(s["weights"]) for s in subl] == _expected_source_counts(config)
    for s in subl:
        assert s["weights"] == pytest.approx([1 / len(s["weights"])] * len(s["weights"]), abs=1e-6)


def test_loss_within_training_length_equals_truncated_rows(report, loaded, model_dir):
    ext = report["length_extrapolation"]
    assert ext["length"] == 4 * TRAIN_LEN and ext["train_length"] == TRAIN_LEN
    assert len(ext["loss_by_bin"]) == len(ext["bin_edges"]) - 1 == 8
    rows, _ = ev.long_rows(load_corpus("stdlib", "validation"), loaded[1], ext["length"], ext["rows"])
    short = rows[:, :TRAIN_LEN]
    with torch.no_grad():  # causal model: the first positions of a long row see exactly the short row
        direct = loaded[0](input_ids=short, labels=short).loss.item()
    assert ext["loss_within_train_length"] == pytest.approx(direct, rel=1e-4)


def test_passkey_report_shape(report, loaded):
    pk = report["passkey"]
    acc = np.array(pk["accuracy"])
    assert acc.shape == (len(PASSKEY_LENGTHS), len(PASSKEY_DEPTHS))
    assert np.array(pk["answer_logprob"]).shape == acc.shape
    assert ((acc * pk["trials"]) == np.round(acc * pk["trials"])).all() and ((0 <= acc) & (acc <= 1)).all()
    unit = len(loaded[1](ev.PASSKEY_TEMPLATES["code"][1], add_special_tokens=False)["input_ids"])
    for target, actual in zip(pk["target_lengths"], pk["lengths"]):
        assert target - unit - 2 <= actual <= target  # whole filler lines up to the target (answers vary by a token)
    assert pk["mean_accuracy"] == pytest.approx(acc.mean())


def test_passkey_example_hides_the_key_at_the_depth(loaded):
    tokenizer = loaded[1]
    prefix, unit, needle, question, _ = ev.PASSKEY_TEMPLATES["code"]
    needle = needle.format(key=48213)
    filler_lines = {}
    for depth in (0.0, 0.5, 1.0):
        prompt, answer = ev.passkey_example(tokenizer, "code", 400, depth, 48213)
        text = tokenizer.decode(prompt)
        assert tokenizer.decode(answer) == " 48213"
        assert text.startswith(prefix) and text.endswith(question) and text.count(needle) == 1
        before, after = text[len(prefix):-len(question)].split(needle)
        assert before == unit * before.count(unit) and after == unit * after.count(unit)
        filler_lines[depth] = (before.count(unit), after.count(unit))
    total = sum(filler_lines[0.0])
    assert total > 4 and filler_lines[0.0] == (0, total) and filler_lines[1.0] == (total, 0)
    assert abs(filler_lines[0.5][0] - filler_lines[0.5][1]) <= 1
    with pytest.raises(ValueError, match="depth"):
        ev.passkey_example(tokenizer, "code", 200, 1.5, 1)
    with pytest.raises(ValueError, match="style"):
        ev.passkey_example(tokenizer, "poetry", 200, 0.5, 1)


def test_speed_cache_memory_kda_constant_attention_grows(report, loaded):
    config = loaded[0].config
    results = report["speed"]["results"]
    assert [r["context"] for r in results] == SPEED_LENGTHS
    kda = {r["cache_bytes_kda"] for r in results} | {r["cache_bytes_kda_after_prefill"] for r in results}
    assert len(kda) == 1 and kda.pop() > 0
    n_attn = config.layer_types.count("full_attention")
    for r in results:
        tokens = r["context"] + DECODE_TOKENS
        assert r["cache_bytes_attention"] == n_attn * 2 * config.num_key_value_heads * config.head_dim * tokens * 4
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0


def test_bad_inputs(tmp_path, model_dir):
    with pytest.raises(ValueError, match="config.json"):
        ev.evaluate(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="position-rows"):
        ev.evaluate(model_dir, tmp_path / "out", ev.EvalSettings(position_rows=0))


def test_a_model_with_non_finite_loss_is_an_error_not_a_report(model_dir, tmp_path, capsys):
    """A model whose held-out loss is NaN stops kdamoe-eval with one line naming the dtype (no eval.json of NaNs)."""
    import shutil

    from transformers import AutoModelForCausalLM

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    model = AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    with pytest.raises(SystemExit) as exit_info:
        ev.main([str(broken), "--output-dir", str(tmp_path / "eval"), "--rows", "2", "--device", "cpu",
                 "--no-progress", "--no-plots"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading messages
    assert last.startswith("kdamoe-eval: error: ") and "not finite in float32 on cpu" in last
    assert not (tmp_path / "eval" / "eval.json").exists()


def test_precision_choices():
    """auto: kdamoe-train's numerics on CUDA (fp32 weights under bf16 autocast), fp32 on the CPU; a bad name is a
    usage error naming the choices."""
    assert ev._precision(ev.EvalSettings(device="cuda")) == (torch.device("cuda"), torch.float32, True)
    assert ev._precision(ev.EvalSettings(device="cpu")) == (torch.device("cpu"), torch.float32, False)
    assert ev._precision(ev.EvalSettings(device="cpu", dtype="autocast")) == (torch.device("cpu"), torch.float32, True)
    assert ev._precision(ev.EvalSettings(device="cpu", dtype="bfloat16"))[1:] == (torch.bfloat16, False)
    with pytest.raises(UsageError, match="'autocast'"):
        ev._precision(ev.EvalSettings(device="cpu", dtype="fp8"))


def test_autocast_evaluation_runs_under_bf16_autocast(model_dir, report, tmp_path):
    """--dtype autocast: the report says so, and its held-out loss is the fp32 one to bf16 accuracy, not bit for bit
    (the matmuls ran in bf16)."""
    settings = ev.EvalSettings(device="cpu", dtype="autocast", position_rows=1, position_bins=4,
                               passkey_lengths=[PASSKEY_LENGTHS[0]], passkey_depths=[0.5], passkey_trials=1,
                               speed_lengths=[SPEED_LENGTHS[0]], decode_tokens=2)
    out = ev.evaluate(model_dir, tmp_path / "eval", settings, progress=False, plots=False)
    assert out["environment"]["dtype"] == out["speed"]["dtype"] == "float32 weights, bfloat16 autocast"
    assert report["environment"]["dtype"] == "float32"
    loss, ref = out["perplexity"]["loss"], report["perplexity"]["loss"]
    assert loss != ref and loss == pytest.approx(ref, rel=2e-2)


def test_next_token_losses_in_chunks_equal_the_full_logits(loaded):
    model = loaded[0]
    ids = torch.randint(3, model.config.vocab_size, (1, 50))
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1]
        expected = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        torch.testing.assert_close(ev.next_token_losses(model, ids, chunk=7), expected, rtol=1e-5, atol=1e-6)


def test_max_context_caps_every_part_and_reports_resources(model_dir, tmp_path):
    """kdamoe-eval --max-context 128 on a model trained on rows of 64: the default lengths scale with 64 and stop at
    128; every part reports its seconds (and no peak memory: on CUDA only); --no-plots writes eval.json alone."""
    ev.main([str(model_dir), "--output-dir", str(tmp_path / "eval"), "--max-context", str(2 * TRAIN_LEN), "--rows", "2",
             "--position-rows", "1", "--position-bins", "4", "--passkey-depths", "0.5", "--passkey-trials", "1",
             "--decode-tokens", "2", "--device", "cpu", "--no-progress", "--no-plots"])
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["eval.json"]
    out = json.loads((tmp_path / "eval" / "eval.json").read_text())
    s = out["settings"]
    assert s["position_length"] == 2 * TRAIN_LEN == out["length_extrapolation"]["length"]
    assert s["passkey_lengths"] == [TRAIN_LEN // 2, TRAIN_LEN, 2 * TRAIN_LEN] == out["passkey"]["target_lengths"]
    assert s["speed_lengths"] == [TRAIN_LEN, 2 * TRAIN_LEN] == [r["context"] for r in out["speed"]["results"]]
    assert set(out["resources"]) == {"heldout", "length_extrapolation", "passkey", "speed"}
    for part in out["resources"].values():
        assert part["seconds"] > 0 and part["peak_memory_gib"] is None
    assert [r["length"] for r in out["passkey"]["resources_by_length"]] == s["passkey_lengths"]
    with pytest.raises(ValueError, match="max-context"):
        ev.evaluate(model_dir, tmp_path / "bad", ev.EvalSettings(max_context=128, passkey_lengths=[256]))

"""kdamoe-ablate end to end on a minuscule model: the report's numbers are those of the runs' own files, finished runs
are reused, and user errors are one line with exit status 2."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdamoe.ablate import ablate, floor_run, main, run_metrics, verdict

MODEL = {"hidden_size": 32, "intermediate_size": 64, "kda_num_heads": 2, "kda_head_dim": 16, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 16}


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    from kdamoe.data import load_corpus
    from kdamoe.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("ablate")
    texts = (row["text"] for row in load_corpus("stdlib", "train"))
    train_tokenizer(texts, 300, max_chars=100_000, save_dir=str(root / "tok"))
    (root / "cfg.json").write_text(json.dumps({"preset": "tiny", "model": MODEL, "training": {
        "micro_batch_size": 4, "val_rows": 2, "warmup_steps": 1}}))
    argv = ["--output-dir", str(root / "out"), "--factors", "kda_gate", "--seeds", "0,1", "--config",
            str(root / "cfg.json"), "--tokenizer", str(root / "tok"), "--stages", "32:3"]
    return root / "out", argv, ablate(argv)


def steady_median(values):
    return float(np.median(values[max(1, len(values) // 10):]))


def test_report_numbers_are_the_runs_metrics(ablation):
    out, _, results = ablation
    part = results["factors"]["kda_gate"]
    assert part["runs"] == {"bounded": "base", "softplus": "kda_gate=softplus"}
    report = (out / "report.md").read_text()
    for value, name in part["runs"].items():
        val, tps = [], []
        for seed in (0, 1):
            run = out / "runs" / name / f"seed{seed}"
            steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            assert len(steps) == 3
            config = json.loads((run / "final" / "config.json").read_text())
            assert config["kda_gate"] == value and config["num_experts"] == 8
            val.append(json.loads((run / "final" / "training_info.json").read_text())["val_loss"])
            tps.append(steady_median([s["tokens_per_second"] for s in steps]))
            vio = [np.mean(list(s["max_vio"].values())) for s in steps]
            assert results["runs"][name][str(seed)]["max_vio_second_half"] == pytest.approx(np.mean(vio[1:]))
        stats = part["summary"][value]
        assert stats["val_loss"]["mean"] == pytest.approx(np.mean(val))
        assert stats["val_loss"]["std"] == pytest.approx(np.std(val, ddof=1))
        assert stats["tokens_per_second"]["mean"] == pytest.approx(np.mean(tps))
        assert f"| {value} | {name} | {np.mean(val):.4f} ± {np.std(val, ddof=1):.4f} |" in report
    # matched runs: the same seed gives the same data and the same first loss wherever the gate does not enter it
    seeds = [json.loads((out / "runs" / "base" / f"seed{s}" / "metrics.jsonl").read_text().splitlines()[0])
             for s in (0, 1)]
    assert seeds[0]["tokens"] == seeds[1]["tokens"] and seeds[0]["loss"] != seeds[1]["loss"]
    assert "Bounded gate: val loss" in part["verdict"] and part["verdict"] in report
    assert results["plots"] == ["loss_kda_gate.png"]  # kda_gate needs no kdamoe-eval, so no loss by position
    assert all((out / name).stat().st_size > 1000 for name in results["plots"])


def test_finished_runs_are_reused(ablation):
    out, argv, results = ablation
    final = out / "runs" / "base" / "seed0" / "final" / "model.safetensors"
    before = final.stat().st_mtime_ns
    again = ablate(argv)
    assert final.stat().st_mtime_ns == before
    assert again["factors"] == json.loads(json.dumps(results["factors"]))


def test_floor_of_a_run_is_kept_in_its_eval_folder_and_reported(ablation):
    """`floor_run` (what `router_balancing` runs add to their metrics): `balance_floor` of the run at its 4 rows a
    step, written to eval/balance_floor.json and reused; `run_metrics` reports its first row; the verdict compares
    Quantile Balancing's MaxVio_batch with it."""
    out, _, _ = ablation
    run = out / "runs" / "base" / "seed0"
    floor = floor_run(run)
    kept = run / "eval" / "balance_floor.json"
    assert json.loads(kept.read_text()) == floor
    assert floor["rows_per_step"] == 4 and [row["rows"] for row in floor["table"]] == [4]
    row = floor["table"][0]
    moe_layers = len(json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["max_vio"])
    assert row["batches_x_layers"] == 32 * moe_layers  # 48 batches after the run, the first 16 fitted
    assert 0 <= floor["fitted"] < row["floor"] <= 8 / 2 - 1 and 0 <= row["previous"] <= 8 / 2 - 1  # 8 experts top-2
    before = kept.stat().st_mtime_ns
    assert floor_run(run) == floor and kept.stat().st_mtime_ns == before
    metrics = run_metrics(run, None, floor)
    assert (metrics["max_vio_floor"], metrics["max_vio_floor_previous"]) == (row["floor"], row["previous"])
    stat = lambda x: {"mean": x, "std": 0.0, "n": 1}  # noqa: E731
    summary = {mode: {"max_vio_second_half": stat(v), "val_loss": stat(3.0), "dead_experts_last_step": stat(0),
                      "max_vio_floor": stat(0.5), "max_vio_floor_previous": stat(0.4)}
               for mode, v in (("quantile", 0.6), ("loss_free", 0.9))}
    assert "leaves a fresh batch at 0.400 (0.500 with that of 16 other batches): Quantile Balancing's 0.600 is 1.50x" \
        in verdict("router_balancing", summary)


def test_a_killed_ablation_keeps_the_report_of_the_runs_it_finished(ablation, tmp_path, monkeypatch):
    """The report is rewritten after every run: killed at the first softplus run (a time limit), results.json holds
    both seeds of the base run, and the factor's verdict says what it lacks."""
    import kdamoe.ablate as ablate_module

    out, argv, results = ablation
    real_train_run = ablate_module.train_run

    def killed_at_softplus(folder, *args, **kwargs):
        if "softplus" in str(folder):
            raise KeyboardInterrupt
        return real_train_run(folder, *args, **kwargs)

    monkeypatch.setattr(ablate_module, "train_run", killed_at_softplus)
    part_argv = ["--output-dir", str(tmp_path), *argv[argv.index("--factors"):]]
    with pytest.raises(KeyboardInterrupt):
        ablate(part_argv)
    kept = json.loads((tmp_path / "results.json").read_text())
    assert list(kept["runs"]) == ["base"] and list(kept["runs"]["base"]) == ["0", "1"]
    for seed, run in kept["runs"]["base"].items():  # training is deterministic on the CPU
        assert run["val_loss"] == pytest.approx(results["runs"]["base"][seed]["val_loss"], rel=1e-6)
    assert kept["factors"]["kda_gate"]["runs"] == {"bounded": "base"}
    assert kept["factors"]["kda_gate"]["verdict"] == "needs both gates"
    assert "needs both gates" in (tmp_path / "report.md").read_text()


def test_merge_reports_partial_ablations_as_one(ablation, tmp_path):
    """Two ablations of one seed each (as separate jobs would run them), merged: the runs of both seeds and the same
    summaries as the ablation that ran both seeds at once (training is deterministic on the CPU; tokens/s is not)."""
    out, argv, results = ablation
    flags = argv[argv.index("--factors"):]
    parts = []
    for seed in ("0", "1"):
        part_argv = ["--output-dir", str(tmp_path / f"seed{seed}"), *flags]
        part_argv[part_argv.index("--seeds") + 1] = seed
        ablate(part_argv)
        parts.append(str(tmp_path / f"seed{seed}"))
    merged = ablate(["--merge", ",".join(parts), "--output-dir", str(tmp_path / "merged")])
    assert merged["seeds"] == [0, 1] and merged["factors"].keys() == results["factors"].keys()
    for value, stats in merged["factors"]["kda_gate"]["summary"].items():
        ref = results["factors"]["kda_gate"]["summary"][value]
        assert stats["val_loss"]["n"] == 2
        assert stats["val_loss"]["mean"] == pytest.approx(ref["val_loss"]["mean"], rel=1e-6)
        assert stats["val_loss"]["std"] == pytest.approx(ref["val_loss"]["std"], rel=1e-4, abs=1e-9)
    assert "Bounded gate: val loss" in (tmp_path / "merged" / "report.md").read_text()
    # a run in both folders is taken from the first, once
    again = ablate(["--merge", f"{parts[0]},{parts[0]}", "--output-dir", str(tmp_path / "twice")])
    assert again["seeds"] == [0] and again["factors"]["kda_gate"]["summary"]["bounded"]["val_loss"]["n"] == 1


def test_merge_keeps_each_factors_own_copy_of_the_shared_run(ablation, tmp_path):
    """Jobs of different factors each train the base config: merged, each factor compares the runs of its own jobs
    (the base run of another job differs by GPU nondeterminism and by what ran beside it), the second under the name
    "base (<factor>)"."""
    out, _, results = ablation
    other = copy.deepcopy(results)  # a job of residual_mode whose base run ended elsewhere
    other["factors"] = {"residual_mode": {"runs": {"block_attnres": "base", "standard": "residual_mode=standard"}}}
    base = {seed: dict(m, val_loss=m["val_loss"] + 1.0) for seed, m in results["runs"]["base"].items()}
    standard = {seed: dict(m, val_loss=m["val_loss"] + 2.0) for seed, m in results["runs"]["base"].items()}
    other["runs"] = {"base": base, "residual_mode=standard": standard}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "results.json").write_text(json.dumps(other))
    own_loss = results["factors"]["kda_gate"]["summary"]["bounded"]["val_loss"]["mean"]
    for order, shared in (((out, tmp_path / "other"), "kda_gate"), ((tmp_path / "other", out), "residual_mode")):
        merged = ablate(["--merge", ",".join(map(str, order)), "--output-dir", str(tmp_path / "merged")])
        gate, residual = merged["factors"]["kda_gate"], merged["factors"]["residual_mode"]
        assert gate["runs"]["bounded"] == ("base" if shared == "kda_gate" else "base (kda_gate)")
        assert residual["runs"]["block_attnres"] == ("base" if shared == "residual_mode" else "base (residual_mode)")
        assert gate["summary"]["bounded"]["val_loss"]["mean"] == pytest.approx(own_loss)
        assert residual["summary"]["block_attnres"]["val_loss"]["mean"] == pytest.approx(own_loss + 1.0)
        assert residual["summary"]["standard"]["val_loss"]["mean"] == pytest.approx(own_loss + 2.0)


def test_merge_refuses_unmatched_runs_and_other_flags(ablation, tmp_path, capsys):
    out, _, results = ablation
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({**results, "train_argv": ["--lr", "0.1"]}))
    for args, fragment in ((["--merge", f"{out},{other}"], "ran other kdamoe-train flags"),
                           (["--merge", str(tmp_path / "missing")], "cannot read"),
                           (["--merge", str(out), "--seeds", "3"], "takes only --output-dir, got --seeds")):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--output-dir", str(tmp_path / "merged")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and fragment in lines[0], lines


@pytest.mark.parametrize("args, fragment", [
    (["--factors", "kda_gate,depth"], "unknown factor depth"),
    (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
    (["--seed", "3"], "sets --output-dir, --seed"),
    (["--lr", "fast"], "kdamoe-train flags: argument --lr: invalid float value"),
    (["--bogus"], "kdamoe-train flags: unrecognized arguments: --bogus"),
])
def test_user_errors_are_one_line(tmp_path, capsys, args, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(["--output-dir", str(tmp_path / "out"), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kdamoe-ablate: error: ") and fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_command_line_error_exit_status(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "kdamoe.ablate", "--output-dir", str(tmp_path), "--factors", "x"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["kdamoe-ablate: error: --factors: unknown factor x; known: "
                                                  "kda_gate, router_balancing, residual_mode, length"]

"""kdamoe-ablate end to end on a minuscule model: the report's numbers are those of the runs' own files, finished runs
are reused, and user errors are one line with exit status 2."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdamoe.ablate import ablate, main

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

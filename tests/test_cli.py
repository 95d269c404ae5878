"""Command-line user errors: one line on stderr naming the problem, exit status 2, no traceback, nothing left behind."""

import os
import shutil
import subprocess
import sys

import pytest

from kdamoe.errors import UsageError, check_safetensors, run_cli
from kdamoe.train import main as train_main, train

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def cli(module: str, *args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)


def assert_usage_error(result: subprocess.CompletedProcess, prog: str, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_train_user_errors(trained_run, tmp_path, capsys):
    """The first error through the installed command's process; the rest through `kdamoe.train.main` in this one
    (the same `run_cli` wrapper, without a Python start each)."""
    base = ["--config", trained_run.parent / "cfg.json", "--tokenizer", trained_run.parent / "tok", "--stages", "32:2"]
    out = tmp_path / "run"
    train([*map(str, base), "--output-dir", str(out)])
    (tmp_path / "empty.txt").write_text("")
    result = cli("kdamoe.train", *base, "--dataset", tmp_path / "empty.txt", "--output-dir", tmp_path / "new",
                 cwd=tmp_path)
    assert_usage_error(result, "kdamoe-train", "empty.txt", "is empty")
    assert not (tmp_path / "new").exists()

    def in_process(*args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            train_main([*map(str, base), *map(str, args)])
        return subprocess.CompletedProcess(args, exit_info.value.code, "", capsys.readouterr().err)

    assert_usage_error(in_process("--max-steps", "0", "--output-dir", tmp_path / "new"),
                       "kdamoe-train", "--max-steps must be >= 1")
    assert_usage_error(in_process("--output-dir", out), "kdamoe-train", "holds another run", "--resume")
    assert_usage_error(in_process("--output-dir", out, "--resume", "--lr", "0.5"),
                       "kdamoe-train", "different config", "settings.lr")
    (checkpoint,) = (out / "checkpoints").iterdir()
    truncate(checkpoint / "model.safetensors")
    assert_usage_error(in_process("--output-dir", out, "--resume"),
                       "kdamoe-train", str(checkpoint / "model.safetensors"), "is damaged", f"delete {checkpoint}")
    assert not (tmp_path / "new").exists()


def test_eval_and_push_name_a_damaged_weights_file(model_dir, tmp_path):
    final = shutil.copytree(model_dir, tmp_path / "final")  # a copy these tests may damage
    weights = final / "model.safetensors"
    truncate(weights)
    with pytest.raises(UsageError, match="model.safetensors is damaged"):
        check_safetensors(final, "")
    assert_usage_error(cli("kdamoe.evaluate", final, "--output-dir", tmp_path / "eval", cwd=tmp_path),
                       "kdamoe-eval", str(weights), "is damaged")
    assert not (tmp_path / "eval").exists()
    assert_usage_error(cli("kdamoe.hub", final, "someone/x", cwd=tmp_path), "kdamoe-push", str(weights),
                       "is damaged", "nothing was uploaded")


def test_only_usage_errors_are_shortened(capsys):
    def fails(error):
        def main(argv):
            raise error
        return main

    with pytest.raises(SystemExit) as exit_info:
        run_cli("prog", fails(UsageError("bad value\nsecond line")))
    assert exit_info.value.code == 2 and capsys.readouterr().err == "prog: error: bad value second line\n"
    with pytest.raises(KeyError):  # a bug keeps its exception and traceback
        run_cli("prog", fails(KeyError("x")))

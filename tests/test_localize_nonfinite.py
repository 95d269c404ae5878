"""tools/localize_nonfinite.py on a saved model with one poisoned KDA layer: it names that layer, the kernel buffer
and token where the forward first turns non-finite, and writes the failing document's KDA inputs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_localizer_names_the_poisoned_kda_layer_and_buffer(model_dir, tmp_path):
    from kdamoe.model.modeling_kdamoe import KDAMoEForCausalLM

    model = KDAMoEForCausalLM.from_pretrained(model_dir)
    kda_layers = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    layer = kda_layers[1]  # not the first: the layers before it must stay finite
    with torch.no_grad():  # one v channel of head 0 overflows fp32 in the projection: U0 = T β V is the first bad buffer
        model.model.layers[layer].mixer.v_proj.weight[0].fill_(3e38)
    poisoned = tmp_path / "model"
    model.save_pretrained(poisoned)
    for name in os.listdir(model_dir):
        if name.startswith("tokenizer") or name.endswith(".jinja") or name == "special_tokens_map.json":
            shutil.copy(model_dir / name, poisoned / name)
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "inputs"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "localize_nonfinite.py"), str(poisoned), "--out",
                             str(out), "--device", "cpu", "--dtype", "float32", "--lengths", "32,64", "--rows", "2"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout
    assert f"first non-finite sublayer: model.layers.{layer}.mixer" in log, log
    assert "its input finite: True" in log and "first bad buffer: u, token 0" in log, log
    meta = torch.load(out / "meta.pt")
    q, v = torch.load(out / "q.pt"), torch.load(out / "v.pt")
    assert meta["token"] == 0 and q.shape[:2] == v.shape[:2] and q.shape[1] <= 64
    assert torch.isfinite(q).all() and not torch.isfinite(v[..., 0, 0]).all()  # the poisoned channel, as saved

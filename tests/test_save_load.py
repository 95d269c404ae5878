"""`save_pretrained` writes a self-contained remote-code folder that loads where `kdamoe` is not installed."""

import json
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import kdamoe
from kdamoe.model import modeling_kdamoe
from conftest import tiny_config

LOADER = textwrap.dedent(
    """
    import sys
    sys.modules["kdamoe"] = None  # the package must not be importable: only the folder's own code may run
    try:
        import kdamoe
    except ImportError:
        pass
    else:
        raise SystemExit("kdamoe was importable")
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    path, ids_file, out_file = sys.argv[1:4]
    ids = torch.load(ids_file)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert AutoConfig.from_pretrained(path, trust_remote_code=True).model_type == "kdamoe"
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert type(base).__name__ == "KDAMoEModel"
    with torch.no_grad():
        logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.save({"logits": logits, "generated": generated}, out_file)
    """
)


def test_save_pretrained_folder_loads_offline_without_the_package(tmp_path):
    model = kdamoe.KDAMoEForCausalLM(tiny_config()).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.ffn.router.bias.normal_(0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("attn_res.query"):
                p.normal_(0, 0.5)
    folder = tmp_path / "model"
    model.save_pretrained(folder)

    files = {p.name for p in folder.iterdir()}
    # every file of the remote-code folder travels, the Triton kernels' too (imported inside try/except)
    code = {p.name for p in Path(modeling_kdamoe.__file__).parent.glob("*.py")}
    assert {"config.json", "model.safetensors", "kda_chunk_intra.py", "kda_fused_recurrent.py"} | code <= files
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt")) for name in files)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "kdamoe"
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    tensors = load_file(folder / "model.safetensors")
    assert any(name.endswith("router.bias") for name in tensors), "router bias must be saved"

    ids = torch.randint(3, 97, (2, 11))
    torch.save(ids, tmp_path / "ids.pt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HOME=str(tmp_path / "hf"))
    script = tmp_path / "load.py"
    script.write_text(LOADER)
    result = subprocess.run(
        [sys.executable, str(script), str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(tmp_path / "out.pt")
    reloaded_here = kdamoe.KDAMoEForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        # Same weights, same code path: bit-identical. (Against the in-memory model, BLAS may round differently
        # on differently aligned buffers, so that comparison allows float32 rounding.)
        torch.testing.assert_close(loaded["logits"], reloaded_here(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(loaded["logits"], model(ids).logits, rtol=1e-5, atol=1e-6)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.testing.assert_close(loaded["generated"], expected)


def test_router_bias_round_trips_in_process(tmp_path):
    """The selection bias and the state of its filter (`quantile_window`) load exactly and stay fp32; a checkpoint
    saved without the filter state loads with a fresh one (zeros), not as an incomplete checkpoint."""
    from safetensors.torch import save_file

    model = kdamoe.KDAMoEForCausalLM(tiny_config())
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.ffn.router.bias.uniform_(-0.3, 0.3)
                layer.ffn.router.bias_filter.uniform_(-0.3, 0.3)
    model.save_pretrained(tmp_path)
    loaded = kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path)
    for a, b in zip(model.model.layers, loaded.model.layers):
        if a.is_moe:
            torch.testing.assert_close(a.ffn.router.bias, b.ffn.router.bias, rtol=0, atol=0)
            torch.testing.assert_close(a.ffn.router.bias_filter, b.ffn.router.bias_filter, rtol=0, atol=0)
            assert b.ffn.router.bias.dtype == b.ffn.router.bias_filter.dtype == torch.float32
    older = tmp_path / "without_filter"
    model.save_pretrained(older)
    weights = load_file(older / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.endswith("bias_filter")}, older / "model.safetensors",
              metadata={"format": "pt"})
    for a, b in zip(model.model.layers, kdamoe.KDAMoEForCausalLM.from_pretrained(older).model.layers):
        if a.is_moe:
            torch.testing.assert_close(a.ffn.router.bias, b.ffn.router.bias, rtol=0, atol=0)
            assert not b.ffn.router.bias_filter.any()
    from transformers import AutoModelForCausalLM

    # `import kdamoe` registered the classes: the Auto class finds the local code without trust_remote_code.
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is kdamoe.KDAMoEForCausalLM
    loaded_bf16 = kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded_bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    for a, b in zip(model.model.layers, loaded_bf16.model.layers):
        if a.is_moe:  # the selection bias stays fp32 and exact
            torch.testing.assert_close(a.ffn.router.bias, b.ffn.router.bias, rtol=0, atol=0)
    router = model.to(torch.bfloat16).model.layers[1].ffn.router
    assert router.bias.dtype == router.bias_filter.dtype == torch.float32


def test_incomplete_or_corrupt_checkpoint_is_a_clear_error(tmp_path):
    from safetensors.torch import save_file

    kdamoe.KDAMoEForCausalLM(tiny_config()).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    dropped = next(name for name in weights if name.endswith("mixer.A_log"))
    save_file({k: v for k, v in weights.items() if k != dropped}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="incomplete.*" + dropped.replace(".", r"\.")):
        kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match=re.escape(str(tmp_path / "model.safetensors")) + " cannot be read"):
        kdamoe.KDAMoEForCausalLM.from_pretrained(tmp_path)

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run in Triton's CPU interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kdamoe  # noqa: E402
from kdamoe.model.caches import CACHE_FIELD  # noqa: E402


def tiny_config(**overrides) -> "kdamoe.KDAMoEConfig":
    """A model small enough for CPU tests: 4 layers (3 KDA + 1 attention), 8 experts top-2."""
    kwargs = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        intermediate_size=64,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        kda_num_heads=2,
        kda_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        num_shared_experts=1,
        attnres_block_layers=2,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return kdamoe.KDAMoEConfig(**kwargs)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a - b|| / ||b|| in float64 on the CPU; a must be finite."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def cache_of(out):
    """The cache a model output carries (transformers renamed the field from `past_key_values` to `cache`)."""
    return getattr(out, CACHE_FIELD)


def tiny_model(**overrides) -> "kdamoe.KDAMoEForCausalLM":
    """`tiny_config`'s model with non-zero pseudo-queries and router biases, so that nothing passes by accident of
    initialisation (zero pseudo-queries make depth attention a plain average, zero biases leave routing unbalanced)."""
    model = kdamoe.KDAMoEForCausalLM(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn_res.query"):
                p.normal_(0, 0.5)
        for layer in model.model.layers:
            if layer.is_moe:
                layer.ffn.router.bias.normal_(0, 0.05)
    return model


def assert_out_dtype_is_a_rounding(run):
    """``run(out_dtype) -> (output, gradients)`` of an op with an ``out_dtype`` (None: its wide dtype): in fp16 the
    output equals the fp32 output rounded to fp16, and the gradients from an fp16 cotangent equal those from the same
    cotangent widened to fp32, bit for bit. fp16, as the Triton interpreter truncates bf16 casts."""
    out16, grads16 = run(torch.float16)
    out32, grads32 = run(None)
    assert out16.dtype == torch.float16 and out32.dtype == torch.float32
    assert torch.equal(out16, out32.to(torch.float16))
    for a, b in zip(grads16, grads32, strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------------------------------
# A tiny trained run shared by the evaluation and Hub tests (trained once per test run)
# ---------------------------------------------------------------------------------------------------------------------

TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "kda_num_heads": 2, "kda_head_dim": 16,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16}
TRAIN_LEN = 64
VAL_ROWS = 4
PASSKEY_LENGTHS = [128, 192]
PASSKEY_DEPTHS = [0.0, 0.5, 1.0]
SPEED_LENGTHS = [32, 96]
DECODE_TOKENS = 3


@pytest.fixture(scope="package")
def trained_run(tmp_path_factory):
    """A 3-step kdamoe-train run of a tiny model (300-token BPE) on the embedded corpus; returns the run dir."""
    from kdamoe.data import load_corpus
    from kdamoe.tokenizer import train_tokenizer
    from kdamoe.train import train

    root = tmp_path_factory.mktemp("kdamoe-run")
    texts = (row["text"] for row in load_corpus("stdlib", "train"))
    train_tokenizer(texts, 300, max_chars=100_000, save_dir=str(root / "tok"))
    (root / "cfg.json").write_text(json.dumps({"preset": "tiny", "model": TINY_MODEL, "training": {
        "micro_batch_size": 4, "val_rows": VAL_ROWS, "warmup_steps": 1, "save_every": 0}}))
    train(["--config", str(root / "cfg.json"), "--tokenizer", str(root / "tok"), "--stages", f"{TRAIN_LEN}:3",
           "--output-dir", str(root / "out")])
    return root / "out"


@pytest.fixture(scope="package")
def model_dir(trained_run):
    return trained_run / "final"


@pytest.fixture(scope="package")
def eval_dir(model_dir, tmp_path_factory):
    """`kdamoe-eval` through its command line, with every part made small."""
    from kdamoe import evaluate

    out = tmp_path_factory.mktemp("kdamoe-eval")
    evaluate.main([str(model_dir), "--output-dir", str(out), "--position-rows", "2", "--position-bins", "8",
                   "--passkey-lengths", ",".join(map(str, PASSKEY_LENGTHS)),
                   "--passkey-depths", ",".join(map(str, PASSKEY_DEPTHS)), "--passkey-trials", "2",
                   "--speed-lengths", ",".join(map(str, SPEED_LENGTHS)), "--decode-tokens", str(DECODE_TOKENS),
                   "--device", "cpu", "--no-progress"])
    return out


@pytest.fixture(scope="package")
def report(eval_dir):
    return json.loads((eval_dir / "eval.json").read_text())


@pytest.fixture(scope="package")
def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    return model, tokenizer



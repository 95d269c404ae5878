"""Tokenizer: byte-level BPE round-trip, special tokens, chat template, save/load through AutoTokenizer, CLI."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import kdamoe
from conftest import tiny_config

from kdamoe.data import stdlib_dataset
from kdamoe.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, main, train_tokenizer

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "\tmixed \r\n whitespace   and trailing spaces   \n\n",
    "unicode: héllo wörld, 日本語, emoji 🙂, combining e\u0301, NUL \x00 byte",
    "",
    "<|endoftext|> looks special but is ordinary text here? no: it is the eos token",
]


@pytest.fixture(scope="module")
def corpus():
    return stdlib_dataset("train")["text"][:40]


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus, vocab_size=600, save_dir=str(path))
    return AutoTokenizer.from_pretrained(path)


def test_round_trip_any_string(tok):
    for text in SAMPLES[:4]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # merges learnt from code: a common keyword is one token, so encoding compresses
    assert len(tok(" return", add_special_tokens=False)["input_ids"]) == 1


def test_special_tokens_and_size(tok):
    assert len(tok) == 600
    for name, text in (("eos", "<|endoftext|>"), ("pad", "<|pad|>"), ("bos", "<|startoftext|>")):
        assert getattr(tok, f"{name}_token") == text
        assert tok.convert_tokens_to_ids(text) == SPECIAL_TOKENS.index(text)
    assert len({tok.eos_token_id, tok.pad_token_id, tok.bos_token_id}) == 3
    ids = tok(SAMPLES[4], add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.eos_token_id  # special tokens are atomic
    # nothing is added implicitly: packing appends eos itself
    assert tok("abc")["input_ids"] == tok("abc", add_special_tokens=False)["input_ids"]


def test_chat_template(tok):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == CHAT_TEMPLATE
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_template_marks_the_assistant_turns(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "for i in x:\n    pass"}]
    out = tok.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    # reference: the masked runs are exactly each assistant turn's content and its closing <|im_end|>
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    assert runs == [tok(m["content"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
                    for m in messages if m["role"] == "assistant"]
    assert ids == tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


LOAD_WITHOUT_REMOTE_CODE = """
import sys
sys.modules["kdamoe"] = None  # neither the package nor the folder's remote code may run
from transformers import AutoTokenizer
path, text = sys.argv[1], sys.argv[2]
for kwargs in ({}, {"trust_remote_code": False}):
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    print("RESULT", tok(text)["input_ids"], tok.eos_token, chat.count("<|im_start|>"))
print("RESULT", sorted(name for name in sys.modules if name.startswith("transformers_modules")))
"""


def test_autotokenizer_loads_a_model_folder_without_remote_code(tok, tmp_path):
    kdamoe.KDAMoEForCausalLM(tiny_config(vocab_size=len(tok))).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    text = "def f(x):\n    return x  # ok"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_REMOTE_CODE, str(tmp_path), text], cwd=tmp_path,
                            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # (without the flag transformers asks whether to run the folder's code; with no answer it goes on without)
    printed = [line.split("RESULT ", 1)[1] for line in result.stdout.splitlines() if "RESULT " in line]
    expected = f"{tok(text)['input_ids']} <|endoftext|> 1"
    assert printed == [expected, expected, "[]"], result.stdout


def test_bad_inputs():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer(["", ""], vocab_size=300)


def test_cli(tmp_path):
    (tmp_path / "data").mkdir()
    for i in range(6):
        (tmp_path / "data" / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps " * (i + 3))
    main(["--dataset", str(tmp_path / "data"), "--vocab-size", "280", "--output-dir", str(tmp_path / "out")])
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>"
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert len(tok) == 280 and tok.decode(tok("the quick brown fox")["input_ids"]) == "the quick brown fox"

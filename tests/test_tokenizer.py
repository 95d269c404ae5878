"""Tokenizer: byte-level BPE round-trip, special tokens, chat template, save/load through AutoTokenizer, CLI."""

import json

import pytest
from transformers import AutoTokenizer

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

"""Byte-level BPE tokenizer for kdamoe, trained with `tokenizers` and wrapped as a transformers fast tokenizer.

Byte-level means every string round-trips exactly (`decode(encode(s)) == s`, no unknown token). Special tokens:
`<|endoftext|>` (eos, appended to every training document), `<|pad|>`, `<|startoftext|>` (bos; not added by
default) and `<|im_start|>` / `<|im_end|>` for a ChatML chat template whose assistant turns are marked for
training (`return_assistant_tokens_mask`, TRL's `assistant_only_loss`). The saved folder loads with
`AutoTokenizer.from_pretrained(path)`, no remote code needed.

    kdamoe-tokenizer --dataset stdlib --vocab-size 4096 --output-dir runs/tokenizer
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .errors import UsageError, run_cli

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|startoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN, *CHAT_TOKENS)
# ChatML. An assistant turn's content and its closing <|im_end|> sit inside {% generation %} ... {% endgeneration %},
# so `apply_chat_template(..., return_assistant_tokens_mask=True)` (TRL's `assistant_only_loss`) marks them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_MAX_CHARS = 8_000_000


def _limited(texts: Iterable[str], max_chars: int | None) -> Iterator[str]:
    """`texts` until `max_chars` characters have been yielded (the last text is included whole)."""
    seen = 0
    for text in texts:
        if max_chars is not None and seen >= max_chars:
            return
        seen += len(text)
        yield text


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 4096,
    *,
    min_frequency: int = 2,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    model_max_length: int = 1_048_576,
    save_dir: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (special tokens included) on `texts`.

    Only the first `max_chars` characters are used (None: all). Returns the wrapped fast tokenizer; saves it to
    `save_dir` when given. Raises `UsageError` if `vocab_size` cannot hold the 256 bytes and the special tokens,
    or if `texts` is empty.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise UsageError(f"`vocab_size` must be at least {minimum} (256 bytes + special tokens), got {vocab_size}")
    sample = [t for t in _limited(texts, max_chars) if t]
    if not sample:
        raise UsageError("cannot train a tokenizer on an empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        extra_special_tokens=list(CHAT_TOKENS),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        wrapped.save_pretrained(save_dir)
    return wrapped


def main(argv: list[str] | None = None) -> None:
    """`kdamoe-tokenizer`: train a tokenizer on the train split of a corpus and save it."""
    run_cli("kdamoe-tokenizer", _main, argv)


def _main(argv: list[str] | None) -> None:
    from .data import STDLIB, load_corpus

    parser = argparse.ArgumentParser(prog="kdamoe-tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default=STDLIB, help="'stdlib' (default), local files, or a Hub name")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--streaming", action="store_true", help="stream the corpus instead of loading it")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                        help="train on the first N characters of the corpus (0: all)")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    ds = load_corpus(args.dataset, "train", streaming=args.streaming, text_column=args.text_column)
    tok = train_tokenizer((row["text"] for row in ds), args.vocab_size, min_frequency=args.min_frequency,
                          max_chars=args.max_chars or None, save_dir=args.output_dir)
    print(f"saved a {len(tok)}-token byte-level BPE tokenizer to {args.output_dir}")


__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "main", "train_tokenizer"]

if __name__ == "__main__":
    main()

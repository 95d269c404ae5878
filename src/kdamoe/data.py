"""Corpora, document packing and deterministic batches for training kdamoe.

Corpora:

- `"stdlib"` (the default): the Python standard library source of the running interpreter, one document per `.py`
  file (sorted relative paths, `site-packages` excluded). Nothing is downloaded.
- local files: a `.txt` / `.jsonl` / `.json` / `.parquet` file, a directory of them, or a glob (loaded through
  `datasets`; text files give one document per file);
- any other string: a dataset name on the Hugging Face Hub (when it is reachable), optionally `name:config`.

The train/validation split is by document and deterministic: a document goes to validation iff
`sha256(key) mod 10_000 < validation_fraction * 10_000`, where the key is the relative path for `stdlib` and the
text itself otherwise. A corpus that ships a `validation` split keeps it. A single text file is one document, so it
is split by position instead: its last `validation_fraction` of characters, from a line start, is the validation
split (`split_text`). The split `"all"` is the whole corpus (a Hub dataset's `train` split), for a corpus that is used
whole for training or for validation.

Packing: each document is tokenised and followed by `eos`; documents are concatenated into one endless token
stream (documents shuffled per epoch) that is cut into rows of `seq_len` tokens. A row's `position_ids` restart
at 0 at every document start and at the row start (transformers' `DataCollatorWithFlattening` convention, which
the model turns into `cu_seqlens` and a block-diagonal mask); `labels` are `-100` at every document start, so the
last token of one document is never trained to predict the first token of the next (labels are shifted inside the
model). Nothing is padded; only the tail of a finite stream and the unused rows of a stage's last shuffle window
(see `PackedBatches`) are never trained on.

Training batches (`PackedBatches`) take their rows from shuffled windows of consecutive rows, and are a pure
function of the optimizer step, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np
import torch

from .errors import UsageError

STDLIB = "stdlib"
SPLITS = ("train", "validation", "all")
DEFAULT_VALIDATION_FRACTION = 0.05
_LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json",
                   ".parquet": "parquet"}


# --------------------------------------------------------------------------------------------- corpora


def is_validation(key: str, validation_fraction: float) -> bool:
    """Deterministic document-level split: True iff `key` (a path or the text) falls in the validation share."""
    digest = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return digest % 10_000 < round(validation_fraction * 10_000)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_dataset(split: str = "train", validation_fraction: float = DEFAULT_VALIDATION_FRACTION) -> datasets.Dataset:
    """The embedded corpus: one row per stdlib `.py` file, columns `text` and `path` (relative), sorted by path.

    Built once per process and split (walking and reading the standard library takes seconds; a training run
    loads two splits, an evaluation or a floor measurement loads them again)."""
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
    return _stdlib_dataset(split, validation_fraction)


@functools.lru_cache(maxsize=4)
def _stdlib_dataset(split: str, validation_fraction: float) -> datasets.Dataset:
    root = stdlib_root()
    paths = sorted(p for p in root.rglob("*.py")
                   if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts))
    rows = {"text": [], "path": []}
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if split != "all" and is_validation(rel, validation_fraction) != (split == "validation"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            rows["text"].append(text)
            rows["path"].append(rel)
    return datasets.Dataset.from_dict(rows)


def split_text(text: str, split: str, validation_fraction: float) -> str:
    """The `split` part of one text held out by position: validation is the last `validation_fraction` of its
    characters, starting at the first line start at or after that point; train is the rest."""
    cut = round((1 - validation_fraction) * len(text))
    if 0 < cut < len(text) and text[cut - 1] != "\n":
        newline = text.find("\n", cut)
        cut = len(text) if newline < 0 else newline + 1
    return text[:cut] if split == "train" else text[cut:]


def _single_text_file(files: list[str]) -> bool:
    return len(files) == 1 and _LOCAL_BUILDERS.get(Path(files[0]).suffix) == "text"


def _local_files(spec: str) -> list[str]:
    """Files named by a local path, directory or glob (empty if `spec` names nothing local)."""
    if os.path.isdir(spec):
        return sorted(str(p) for p in Path(spec).rglob("*") if p.is_file() and p.suffix in _LOCAL_BUILDERS)
    if os.path.isfile(spec):
        return [spec]
    return sorted(glob.glob(spec, recursive=True)) if glob.has_magic(spec) else []


def load_corpus(
    dataset: str = STDLIB,
    split: str = "train",
    *,
    streaming: bool = False,
    text_column: str = "text",
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> datasets.Dataset | datasets.IterableDataset:
    """Load one split (`"train"`, `"validation"` or `"all"`) of a corpus as a `datasets` (Iterable)Dataset with a
    `text` column (see the module doc).

    Raises `ValueError` for an unknown split, and `UsageError` for a corpus that cannot be found or read, a missing
    text column, or an empty map-style result.
    """
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {SPLITS}, got {split!r}")
    if not 0.0 < validation_fraction < 1.0:
        raise UsageError(f"the validation fraction must lie in (0, 1), got {validation_fraction}")
    if dataset == STDLIB:
        ds = stdlib_dataset(split, validation_fraction)
        return ds.to_iterable_dataset() if streaming else ds
    files = _local_files(dataset)
    if files:
        suffixes = {Path(f).suffix for f in files}
        builders = {_LOCAL_BUILDERS.get(s) for s in suffixes}
        if None in builders or len(builders) != 1:
            raise UsageError(f"local dataset {dataset!r} must hold one kind of file among "
                             f"{sorted(_LOCAL_BUILDERS)}, got suffixes {sorted(suffixes)}")
        if all(os.path.getsize(f) == 0 for f in files):
            raise UsageError(f"dataset {dataset!r} is empty (every file has 0 bytes)")
        builder, single_text = builders.pop(), _single_text_file(files)
        presplit = split == "all" or single_text
        if single_text:  # one document: held out by position
            text = Path(files[0]).read_text(encoding="utf-8", errors="replace")
            part = text if split == "all" else split_text(text, split, validation_fraction)
            ds = datasets.Dataset.from_dict({"text": [part] if part.strip() else []})
            ds = ds.to_iterable_dataset() if streaming else ds
        else:
            kwargs = {"sample_by": "document"} if builder == "text" else {}
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **kwargs)
    else:
        if os.path.sep in dataset or dataset.startswith("."):
            raise UsageError(f"dataset {dataset!r} is neither a local file, directory or glob, nor a Hub name")
        name, _, config = dataset.partition(":")
        try:
            splits = datasets.get_dataset_split_names(name, config or None)
        except (ConnectionError, FileNotFoundError) as error:
            raise UsageError(f"dataset {dataset!r} is not a local file, directory or glob, and the Hub gave no such "
                             f"dataset ({error})") from error
        presplit = split == "all" or split in splits
        ds = datasets.load_dataset(name, config or None, split=split if split in splits else "train",
                                   streaming=streaming)
    if text_column not in (ds.column_names or [text_column]):
        raise UsageError(f"dataset {dataset!r} has no column {text_column!r} (columns: {ds.column_names})")
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    if not presplit:
        want = split == "validation"
        ds = ds.filter(lambda row: is_validation(row["text"], validation_fraction) == want)
    if not streaming and len(ds) == 0:
        hint = "; give a held-out corpus with --validation-dataset" if split == "validation" else ""
        raise UsageError(f"the {split} split of dataset {dataset!r} is empty{hint}")
    return ds


def describe_corpus(dataset: str, train: datasets.Dataset | datasets.IterableDataset,
                    validation_fraction: float, validation_dataset: str | None = None) -> dict:
    """A JSON-able description of the training corpus (for the run record and the model card)."""
    if validation_dataset:
        info = {"dataset": dataset, "validation_dataset": validation_dataset,
                "split_rule": "every document trains; validation on every document of validation_dataset"}
    else:
        single_text = dataset != STDLIB and _single_text_file(_local_files(dataset))
        info = {"dataset": dataset, "validation_fraction": validation_fraction,
                "split_rule": "the last fraction of the text, from a line start" if single_text else
                "sha256(key) % 10000 < fraction * 10000, key = relative path (stdlib) or text"}
    if dataset == STDLIB:
        info.update(description="Python standard library source (.py files) of the training interpreter",
                    python_version=sys.version.split()[0], stdlib_root=str(stdlib_root()))
    if isinstance(train, datasets.Dataset):
        info.update(train_documents=len(train), train_characters=int(sum(len(t) for t in train["text"])))
    return info


# --------------------------------------------------------------------------------------------- packing


class TokenStream:
    """Tokens of documents (each followed by `eos`) concatenated into one stream, read `n` tokens at a time.

    `epoch_documents(epoch)` yields the token ids of every document of one epoch (in that epoch's order). With
    `cycle=True` the stream goes on with the next epoch when one ends; otherwise `read` returns fewer tokens at
    the end. `position` counts the tokens read or skipped so far, so `skip(position)` on a new stream restores it.
    """

    def __init__(self, epoch_documents: Callable[[int], Iterable[Sequence[int]]], eos_token_id: int,
                 cycle: bool = True):
        self._epoch_documents = epoch_documents
        self.eos_token_id = eos_token_id
        self.cycle = cycle
        self.position = 0
        self._epoch = 0
        self._docs = iter(epoch_documents(0))
        self._epoch_has_tokens = False
        self._current = np.empty(0, dtype=np.int64)  # rest of the current document (with its eos)
        self._current_starts = True  # whether `_current` begins at a document start

    def _next_document(self) -> np.ndarray | None:
        """The next non-empty document's tokens with `eos` appended; None at the end of a finite stream."""
        while True:
            for ids in self._docs:
                if len(ids):
                    self._epoch_has_tokens = True
                    return np.append(np.asarray(ids, dtype=np.int64), self.eos_token_id)
            if not self.cycle:
                return None
            if not self._epoch_has_tokens:
                raise UsageError("the dataset has no tokens (it is empty or every document is empty)")
            self._epoch += 1
            self._epoch_has_tokens = False
            self._docs = iter(self._epoch_documents(self._epoch))

    def read(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Next `n` tokens `[n]` int64 and document-start flags `[n]` bool (fewer only at the end of a finite stream)."""
        tokens, starts, have = [], [], 0
        while have < n:
            if not len(self._current):
                doc = self._next_document()
                if doc is None:
                    break
                self._current, self._current_starts = doc, True
            take = self._current[: n - have]
            flags = np.zeros(len(take), dtype=bool)
            flags[0] = self._current_starts
            tokens.append(take)
            starts.append(flags)
            have += len(take)
            self._current, self._current_starts = self._current[len(take):], False
        self.position += have
        if not tokens:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
        return np.concatenate(tokens), np.concatenate(starts)

    def skip(self, n: int) -> None:
        """Advance by `n` tokens without materialising them (whole documents are skipped by length)."""
        left = n
        while left > 0:
            if not len(self._current):
                doc = self._next_document()
                if doc is None:
                    break
                self._current, self._current_starts = doc, True
            step = min(left, len(self._current))
            self._current = self._current[step:]
            self._current_starts = False
            left -= step
        self.position += n - left


def rows_to_batch(tokens: np.ndarray, starts: np.ndarray) -> dict[str, torch.Tensor]:
    """Model inputs for packed rows.

    Args:
        tokens: `[B, L]` token ids; starts: `[B, L]` bool, True at the first token of a document.
    Returns:
        `input_ids`, `position_ids` (restart at 0 at each document start and at column 0) and `labels`
        (= input_ids, `-100` at document starts and column 0), each `[B, L]` int64.
    """
    if tokens.ndim != 2 or tokens.shape != starts.shape:
        raise ValueError(f"tokens {tokens.shape} and starts {starts.shape} must be equal [B, L] arrays")
    segment_start = starts.copy()
    segment_start[:, 0] = True
    columns = np.arange(tokens.shape[1])
    last_start = np.maximum.accumulate(np.where(segment_start, columns, 0), axis=1)
    labels = np.where(segment_start, -100, tokens)
    return {"input_ids": torch.as_tensor(tokens, dtype=torch.long),
            "position_ids": torch.as_tensor(columns - last_start, dtype=torch.long),
            "labels": torch.as_tensor(labels, dtype=torch.long)}


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int, eos_token_id: int
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """Pack tokenised documents (each + eos) into rows of `seq_len`; yields `rows_to_batch` dicts of shape `[L]`.

    The incomplete last row is dropped.
    """
    if seq_len < 2:
        raise ValueError(f"`seq_len` must be >= 2, got {seq_len}")
    stream = TokenStream(lambda epoch: documents, eos_token_id, cycle=False)
    while True:
        tokens, starts = stream.read(seq_len)
        if len(tokens) < seq_len:
            return
        yield {k: v[0] for k, v in rows_to_batch(tokens[None], starts[None]).items()}


def tokenize_documents(texts: Iterable[str], tokenizer, batch_size: int = 256) -> Iterator[list[int]]:
    """Token ids of each text (no special tokens added), tokenised in batches that double from one text up to
    `batch_size` (a reader that needs the first few documents does not wait for `batch_size` of them)."""
    batch, size = [], 1
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield from tokenizer(batch, add_special_tokens=False)["input_ids"]
            batch, size = [], min(2 * size, batch_size)
    if batch:
        yield from tokenizer(batch, add_special_tokens=False)["input_ids"]


class CorpusStream:
    """The training token stream of a corpus: documents shuffled per epoch from `seed`.

    A map-style dataset is shuffled with `numpy.random.default_rng([seed, epoch])` and tokenised lazily, in that
    order, the first time each document is needed (so a short run never tokenises the whole corpus); a streaming
    dataset is shuffled with `datasets`' buffer shuffle (`seed`, `set_epoch(epoch)`) and tokenised on the fly.
    `tokens(position)` returns a `TokenStream` placed after `position` tokens.
    """

    def __init__(self, ds: datasets.Dataset | datasets.IterableDataset, tokenizer, seed: int,
                 shuffle_buffer: int = 10_000, tokenize_batch: int = 64):
        if isinstance(ds, datasets.Dataset) and len(ds) == 0:
            raise UsageError("the training dataset is empty")
        self.eos_token_id = tokenizer.eos_token_id
        self.seed = seed
        self._tokenizer = tokenizer
        self._batch = tokenize_batch
        if isinstance(ds, datasets.Dataset):
            self._ds = ds
            self._cache: dict[int, np.ndarray] = {}
            self._epoch_documents = self._shuffled_documents
        else:
            shuffled = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)

            def epoch_documents(epoch: int) -> Iterator[list[int]]:
                shuffled.set_epoch(epoch)
                return tokenize_documents((row["text"] for row in shuffled), tokenizer, tokenize_batch)

            self._epoch_documents = epoch_documents

    def _shuffled_documents(self, epoch: int) -> Iterator[np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self._ds)).tolist()
        for first in range(0, len(order), self._batch):
            chunk = order[first:first + self._batch]
            missing = [i for i in chunk if i not in self._cache]
            if missing:
                texts = self._ds.select(missing)["text"]
                for i, ids in zip(missing, tokenize_documents(texts, self._tokenizer, self._batch)):
                    self._cache[i] = np.asarray(ids, dtype=np.int32)
            yield from (self._cache[i] for i in chunk)

    def tokens(self, position: int = 0) -> TokenStream:
        stream = TokenStream(self._epoch_documents, self.eos_token_id, cycle=True)
        stream.skip(position)
        return stream


class PackedBatches:
    """Global training batches of packed rows, each a pure function of the optimizer step.

    `stages` lists `(seq_len, steps, rows_per_step)`. Within a stage the token stream is cut into rows of
    `seq_len`; rows are served in windows of `W` rows (about `window_tokens` tokens, a multiple of the rows of one
    step) whose order is permuted with `numpy.random.default_rng([seed, stage, window])`, so the rows of one batch
    come from many documents rather than one or two long ones. A stage starts where the previous stage's last
    (possibly partly used) window ended. `batch(step)` reads the stream forward (or re-opens it after a backward
    jump), so calling it for steps `s, s+1, ...` of a resumed run gives exactly the batches of an uninterrupted one.
    """

    def __init__(self, corpus: CorpusStream, stages: Sequence[tuple[int, int, int]], seed: int,
                 window_tokens: int = 1 << 20):
        self._corpus = corpus
        self._seed = seed
        self._plan = []  # per stage: (first step, steps, seq_len, rows per step, rows per window, token offset)
        step = offset = 0
        for seq_len, steps, rows in stages:
            window = max(1, window_tokens // (seq_len * rows)) * rows
            self._plan.append((step, steps, seq_len, rows, window, offset))
            step += steps
            offset += -(-steps * rows // window) * window * seq_len
        self.total_steps = step
        self._stream = None
        self._window_key = None
        self._window = None

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens `[rows, seq_len]` int64 and document-start flags `[rows, seq_len]` of optimizer step `step`."""
        if not 0 <= step < self.total_steps:
            raise ValueError(f"step {step} is outside the schedule of {self.total_steps} steps")
        stage = max(i for i, plan in enumerate(self._plan) if plan[0] <= step)
        first, _, seq_len, rows, window, offset = self._plan[stage]
        row = (step - first) * rows
        key = (stage, row // window)
        if key != self._window_key:
            start = offset + key[1] * window * seq_len
            if self._stream is None or self._stream.position > start:
                self._stream = self._corpus.tokens(start)
            else:
                self._stream.skip(start - self._stream.position)
            tokens, starts = self._stream.read(window * seq_len)
            order = np.random.default_rng([self._seed, *key]).permutation(window)
            self._window = (tokens.reshape(window, seq_len)[order], starts.reshape(window, seq_len)[order])
            self._window_key = key
        at = row % window
        return self._window[0][at:at + rows], self._window[1][at:at + rows]


def validation_rows(ds: datasets.Dataset | datasets.IterableDataset, tokenizer, seq_len: int, max_rows: int,
                    pool_factor: int = 16) -> dict[str, torch.Tensor]:
    """`max_rows` packed validation rows `[N, seq_len]` sampled across the split (fewer if it is small; >= 1).

    The split is packed in dataset order into a pool of up to `pool_factor * max_rows` rows, and `max_rows` of
    them are picked with `default_rng(0)` (kept in pool order), so a few rows still sample many documents.
    """
    stream = TokenStream(lambda epoch: tokenize_documents((row["text"] for row in ds), tokenizer),
                         tokenizer.eos_token_id, cycle=False)
    tokens, starts = stream.read(seq_len * max_rows * pool_factor)
    pool = len(tokens) // seq_len
    if pool == 0:
        raise UsageError(f"the validation split has {len(tokens)} tokens, fewer than one row of {seq_len}")
    n = pool * seq_len
    pick = np.sort(np.random.default_rng(0).choice(pool, size=min(max_rows, pool), replace=False))
    return rows_to_batch(tokens[:n].reshape(pool, seq_len)[pick], starts[:n].reshape(pool, seq_len)[pick])


def unigram_entropy(labels: torch.Tensor) -> float:
    """Entropy (nats) of the empirical unigram distribution of the predicted tokens `labels[:, 1:] != -100`.

    This is the lowest cross-entropy any context-free (unigram) model can reach on these tokens.
    """
    target = labels[:, 1:]
    target = target[target != -100]
    if target.numel() == 0:
        raise ValueError("no labelled tokens to compute a unigram entropy from")
    counts = torch.bincount(target).double()
    p = counts[counts > 0] / target.numel()
    return float(-(p * p.log()).sum())


__all__ = ["SPLITS", "STDLIB", "CorpusStream", "PackedBatches", "TokenStream", "describe_corpus", "is_validation",
           "load_corpus", "pack_documents", "rows_to_batch", "split_text", "stdlib_dataset", "tokenize_documents",
           "unigram_entropy", "validation_rows"]

"""Corpora, the deterministic split, packing with document boundaries, the token stream and the unigram baseline."""

import json
import math
from collections import Counter

import datasets
import numpy as np
import pytest
import torch

from kdamoe.data import (CorpusStream, PackedBatches, TokenStream, is_validation, load_corpus, pack_documents, rows_to_batch,
                         stdlib_dataset, stdlib_root, tokenize_documents, unigram_entropy, validation_rows)
from kdamoe.errors import UsageError
from kdamoe.tokenizer import train_tokenizer

EOS = 0


def naive_pack(docs, seq_len, eos):
    """Independent reference: token-by-token loop over documents (+eos), cut into rows."""
    flat = []  # (token, doc index, index within the doc)
    for d, doc in enumerate(docs):
        for j, t in enumerate([*doc, eos]):
            flat.append((t, d, j))
    rows = []
    for r in range(len(flat) // seq_len):
        chunk = flat[r * seq_len:(r + 1) * seq_len]
        ids, pos, labels, doc_of = [], [], [], []
        for i, (t, d, j) in enumerate(chunk):
            new_segment = i == 0 or j == 0
            p = 0 if new_segment else pos[-1] + 1
            ids.append(t)
            pos.append(p)
            labels.append(-100 if new_segment else t)
            doc_of.append(d)
        rows.append((ids, pos, labels, doc_of))
    return rows


def random_docs(rng, n, max_len=40, vocab=50):
    return [rng.integers(1, vocab, size=rng.integers(0, max_len)).tolist() for _ in range(n)]


@pytest.mark.parametrize("seq_len", [2, 7, 16, 64])
def test_pack_matches_reference(seq_len):
    docs = random_docs(np.random.default_rng(seq_len), 30)
    rows = list(pack_documents(docs, seq_len, EOS))
    ref = naive_pack([d for d in docs if d], seq_len, EOS)
    assert len(rows) == len(ref) > 0
    for row, (ids, pos, labels, doc_of) in zip(rows, ref):
        assert row["input_ids"].tolist() == ids
        assert row["position_ids"].tolist() == pos
        assert row["labels"].tolist() == labels
        # the model predicts labels[t+1] from position t: never across two documents
        for t in range(seq_len - 1):
            if row["labels"][t + 1] != -100:
                assert doc_of[t] == doc_of[t + 1]


def test_rows_to_batch_shapes_and_errors():
    tokens = np.arange(12).reshape(2, 6)
    starts = np.zeros((2, 6), dtype=bool)
    starts[0, 3] = True
    batch = rows_to_batch(tokens, starts)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert batch["labels"].tolist() == [[-100, 1, 2, -100, 4, 5], [-100, 7, 8, 9, 10, 11]]
    assert all(v.dtype == torch.long for v in batch.values())
    with pytest.raises(ValueError):
        rows_to_batch(tokens[0], starts[0])
    with pytest.raises(ValueError, match="seq_len"):
        next(pack_documents([[1, 2]], 1, EOS))


def test_token_stream_skip_equals_read_and_cycles():
    docs = random_docs(np.random.default_rng(0), 12)
    epochs = lambda e: [docs[i] for i in np.random.default_rng([5, e]).permutation(len(docs))]  # noqa: E731
    a = TokenStream(epochs, EOS)
    total = sum(len(d) + 1 for d in docs if d)
    whole, starts = a.read(3 * total + 5)  # three epochs and a bit
    assert len(whole) == 3 * total + 5 and a.position == len(whole)
    epoch0 = np.concatenate([[*d, EOS] for d in epochs(0) if d])
    epoch1 = np.concatenate([[*d, EOS] for d in epochs(1) if d])
    assert np.array_equal(whole[:total], epoch0) and np.array_equal(whole[total:2 * total], epoch1)
    assert starts.sum() == 3 * sum(1 for d in docs if d) + 1
    for cut in (0, 1, 17, total, total + 3):
        b = TokenStream(epochs, EOS)
        b.skip(cut)
        tail, tail_starts = b.read(len(whole) - cut)
        assert np.array_equal(tail, whole[cut:])
        # a document cut by skip is not a start any more; the reference flags are those of the full read
        assert np.array_equal(tail_starts, starts[cut:])


def test_empty_inputs_raise():
    with pytest.raises(ValueError, match="no tokens"):
        TokenStream(lambda e: [[], []], EOS).read(4)
    assert len(TokenStream(lambda e: [[1]], EOS, cycle=False).read(10)[0]) == 2  # finite: stops at the end


def test_unigram_entropy_against_counter():
    labels = torch.tensor([[-100, 3, 3, 5, -100, 7], [-100, 3, 9, 9, 9, 9]])
    kept = [3, 3, 5, 7, 3, 9, 9, 9, 9]
    n = len(kept)
    ref = -sum(c / n * math.log(c / n) for c in Counter(kept).values())
    assert unigram_entropy(labels) == pytest.approx(ref, rel=1e-12)
    with pytest.raises(ValueError):
        unigram_entropy(torch.full((1, 4), -100))


def test_stdlib_split_is_deterministic_and_disjoint():
    train, val = stdlib_dataset("train"), stdlib_dataset("validation")
    assert train["path"] == sorted(train["path"]) and val["path"] == sorted(val["path"])
    assert not set(train["path"]) & set(val["path"])
    assert all(is_validation(p, 0.05) for p in val["path"])
    assert 0.02 < len(val) / (len(train) + len(val)) < 0.08
    assert not any("site-packages" in p for p in train["path"])
    assert "json/decoder.py" in set(train["path"]) | set(val["path"])
    assert train[0]["text"] == (stdlib_root() / train[0]["path"]).read_text(encoding="utf-8", errors="replace")
    assert stdlib_dataset("validation")["path"] == val["path"]


def test_local_corpora(tmp_path):
    (tmp_path / "txt").mkdir()
    texts = [f"document number {i}\nwith two lines\n" for i in range(200)]
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i:03d}.txt").write_text(t)
    train = load_corpus(str(tmp_path / "txt"), "train")
    val = load_corpus(str(tmp_path / "txt"), "validation", validation_fraction=0.2)
    assert len(train) + len(load_corpus(str(tmp_path / "txt"), "validation")) == 200
    assert set(train["text"]) <= set(texts)  # one document per file, line breaks kept
    assert all(is_validation(t, 0.2) for t in val["text"])
    with open(tmp_path / "d.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"content": t, "n": 1}) + "\n")
    js = load_corpus(str(tmp_path / "d.jsonl"), "train", text_column="content")
    assert sorted(js["text"]) == sorted(train["text"])
    streamed = load_corpus(str(tmp_path / "d.jsonl"), "train", text_column="content", streaming=True)
    assert isinstance(streamed, datasets.IterableDataset)
    assert [r["text"] for r in streamed] == js["text"]
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "d.parquet"))
    assert load_corpus(str(tmp_path / "d.parquet"), "train")["text"] == js["text"]


def test_single_text_file_is_held_out_by_position(tmp_path):
    lines = [f"line {i}: " + "word " * (i % 7) + "\n" for i in range(400)]
    text = "".join(lines)
    (tmp_path / "book.txt").write_text(text)
    path = str(tmp_path / "book.txt")
    (train,), (val,) = load_corpus(path, "train")["text"], load_corpus(path, "validation")["text"]
    # reference: the first line start at or after 95 % of the characters
    starts = np.cumsum([0] + [len(line) for line in lines])
    cut = int(starts[np.searchsorted(starts, round(0.95 * len(text)))])
    assert (train, val) == (text[:cut], text[cut:])
    assert load_corpus(path, "all")["text"] == [text]
    assert [r["text"] for r in load_corpus(path, "validation", streaming=True)] == [val]
    (tmp_path / "one_line.txt").write_text("a single line without any break " * 10)
    with pytest.raises(UsageError, match="validation split .* is empty; .*--validation-dataset"):
        load_corpus(str(tmp_path / "one_line.txt"), "validation")


def test_corpus_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "one.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(tmp_path / "empty.jsonl"), "train")
    with pytest.raises(ValueError, match="no column 'text'"):
        load_corpus(str(tmp_path / "one.jsonl"), "train")
    with pytest.raises(ValueError, match="split"):
        load_corpus("stdlib", "test")
    with pytest.raises(ValueError, match="neither a local file"):
        load_corpus(str(tmp_path / "missing" / "file.txt"))
    with pytest.raises(ValueError, match="empty"):
        CorpusStream(datasets.Dataset.from_dict({"text": []}), None, seed=0)


@pytest.fixture(scope="module")
def small_tokenizer():
    return train_tokenizer(stdlib_dataset("train")["text"][:30], vocab_size=400)


def test_corpus_stream_is_a_function_of_position(small_tokenizer):
    ds = stdlib_dataset("train").select(range(40))
    a = CorpusStream(ds, small_tokenizer, seed=3).tokens()
    first, _ = a.read(5000)
    b = CorpusStream(ds, small_tokenizer, seed=3).tokens(1234)
    assert np.array_equal(b.read(3766)[0], first[1234:])
    c, _ = CorpusStream(ds, small_tokenizer, seed=4).tokens().read(5000)
    assert not np.array_equal(c, first)  # the seed changes the document order
    # the stream is the documents in the seeded order, each + eos
    order = np.random.default_rng([3, 0]).permutation(len(ds))
    ref = []
    for i in order:
        ref += small_tokenizer(ds[int(i)]["text"], add_special_tokens=False)["input_ids"] + [small_tokenizer.eos_token_id]
        if len(ref) >= 5000:
            break
    assert first.tolist() == ref[:5000]
    # streaming datasets give a deterministic stream too, and skip == read
    it = ds.to_iterable_dataset(num_shards=2)
    s1, _ = CorpusStream(it, small_tokenizer, seed=3, shuffle_buffer=8).tokens().read(3000)
    s2, _ = CorpusStream(it, small_tokenizer, seed=3, shuffle_buffer=8).tokens(1000).read(2000)
    assert np.array_equal(s1[1000:], s2)


def test_tokenize_documents_in_doubling_batches_equals_one_text_at_a_time(small_tokenizer):
    texts = stdlib_dataset("validation")["text"][:11]
    sizes = []

    def spy(batch, **kwargs):
        sizes.append(len(batch))
        return small_tokenizer(batch, **kwargs)

    ids = list(tokenize_documents(iter(texts), spy, batch_size=4))
    assert sizes == [1, 2, 4, 4]  # the first document after one text, not after batch_size of them
    assert ids == [small_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_validation_rows(small_tokenizer):
    val = stdlib_dataset("validation").select(range(3))
    rows = validation_rows(val, small_tokenizer, 32, 4, pool_factor=3)
    assert rows["input_ids"].shape == (4, 32)
    ref = list(pack_documents((small_tokenizer(t, add_special_tokens=False)["input_ids"] for t in val["text"]), 32,
                              small_tokenizer.eos_token_id))[:12]
    pick = sorted(np.random.default_rng(0).choice(12, size=4, replace=False))
    assert torch.equal(rows["labels"], torch.stack([ref[i]["labels"] for i in pick]))
    assert torch.equal(rows["position_ids"], torch.stack([ref[i]["position_ids"] for i in pick]))
    text = "a b c d e f g h"
    tiny = validation_rows(datasets.Dataset.from_dict({"text": [text]}), small_tokenizer, 4, 10)
    n_tokens = len(small_tokenizer(text)["input_ids"]) + 1  # + eos
    assert n_tokens >= 8 and tiny["input_ids"].shape == (n_tokens // 4, 4)  # a small split gives what it has
    with pytest.raises(ValueError, match="fewer than one row"):
        validation_rows(datasets.Dataset.from_dict({"text": ["a b"]}), small_tokenizer, 64, 2)


def test_packed_document_logits_do_not_depend_on_the_previous_document():
    """With position_ids restarting per document, doc B's logits are those of B alone (KDA and attention)."""
    from kdamoe import KDAMoEConfig, KDAMoEForCausalLM

    torch.manual_seed(0)
    config = KDAMoEConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                          layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                          kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, attnres_block_layers=1)
    model = KDAMoEForCausalLM(config).eval()
    with torch.no_grad():  # give the zero-initialised AttnRes queries weight so depth attention matters too
        for name, p in model.named_parameters():
            if p.ndim == 1 and "attn_res" in name:
                p.normal_()
    rng = np.random.default_rng(1)
    doc_a, doc_b = rng.integers(1, 97, 37).tolist(), rng.integers(1, 97, 40).tolist()
    doc_a2 = rng.integers(1, 97, 37).tolist()
    [row] = list(pack_documents([doc_a, doc_b], 79, EOS))  # 38 + 41 tokens
    [row2] = list(pack_documents([doc_a2, doc_b], 79, EOS))
    with torch.no_grad():
        packed = model(input_ids=row["input_ids"][None], position_ids=row["position_ids"][None]).logits[0]
        packed2 = model(input_ids=row2["input_ids"][None], position_ids=row2["position_ids"][None]).logits[0]
        alone = model(input_ids=torch.tensor([[*doc_b, EOS]])).logits[0]
        unpacked = model(input_ids=row["input_ids"][None]).logits[0]  # no boundary information
    torch.testing.assert_close(packed[38:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed2[38:], alone, rtol=1e-5, atol=1e-5)
    assert (unpacked[38:] - alone).abs().max() > 1e-3  # the check above can fail


def test_packed_batches_shuffle_windows_and_random_access(small_tokenizer):
    ds = stdlib_dataset("train").select(range(30))
    corpus = CorpusStream(ds, small_tokenizer, seed=1)
    stages = [(16, 7, 4), (32, 3, 2)]  # (seq_len, steps, rows): windows of 8 rows (2 steps) then 4 rows (2 steps)
    seq = PackedBatches(corpus, stages, seed=2, window_tokens=128)
    batches = [seq.batch(s) for s in range(10)]
    assert [b[0].shape for b in batches] == [(4, 16)] * 7 + [(2, 32)] * 3
    # random access (a resumed run) gives the same batches
    for s in (9, 3, 0, 8, 8, 5):
        tokens, starts = PackedBatches(corpus, stages, seed=2, window_tokens=128).batch(s)
        assert np.array_equal(tokens, batches[s][0]) and np.array_equal(starts, batches[s][1])
    # each full window holds exactly the next consecutive rows of the stream, in a permuted order
    stream_tokens, _ = corpus.tokens().read(4 * 8 * 16 + 2 * 4 * 32)
    for w in range(3):
        rows = np.concatenate([batches[2 * w][0], batches[2 * w + 1][0]])
        ref = stream_tokens[w * 128:(w + 1) * 128].reshape(8, 16)
        assert sorted(map(tuple, rows)) == sorted(map(tuple, ref))
        assert not np.array_equal(rows, ref) or w  # shuffled (at least the first window)
    # step 6 uses half of window 3; stage 2 starts after that whole window
    stage2 = np.concatenate([batches[7][0], batches[8][0]])
    ref = stream_tokens[4 * 128:4 * 128 + 128].reshape(4, 32)
    assert sorted(map(tuple, stage2)) == sorted(map(tuple, ref))
    with pytest.raises(ValueError, match="outside"):
        seq.batch(10)

"""Tests for dipaco.data: sources, the built-in corpus, the tokenizer and token shards."""

from __future__ import annotations

import json
import json.decoder
import random
from pathlib import Path

import numpy as np
import pytest

from dipaco.data import (
    Document,
    ShardWriter,
    Tokenizer,
    TokenShard,
    builtin_corpus,
    open_source,
    read_jsonl,
    read_parquet,
    read_text,
    sample_windows,
    split_train_val,
)
from dipaco.errors import CorruptFileError, DataError

# --- sources -----------------------------------------------------------------------------------


def test_text_folder_reads_text_files_sorted_with_relative_ids(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("bee")
    (tmp_path / "sub" / "a.py").write_text("print('a')\n")
    (tmp_path / "c.bin").write_bytes(b"\x00\x01")
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")  # latin-1, not utf-8

    docs = list(open_source(str(tmp_path)))

    assert [d.doc_id for d in docs] == ["a.txt", "b.md", "sub/a.py"]
    assert docs[0].text == "caf\ufffd"
    assert docs[2].text == "print('a')\n"


def test_single_text_file_is_one_document(tmp_path: Path) -> None:
    path = tmp_path / "notes.rst"
    path.write_text("hello\nworld\n")
    assert list(read_text(path)) == [Document(str(path), "hello\nworld\n")]


def test_jsonl_reads_records_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"text": "one"}\n\n{"id": "doc-2", "text": "two"}\n{"body": "x", "text": "3"}\n'
    )

    docs = list(open_source(str(path)))

    assert docs == [
        Document("data.jsonl:1", "one"),
        Document("doc-2", "two"),
        Document("data.jsonl:4", "3"),
    ]
    with pytest.raises(DataError, match=r"line 1 has no string field 'body'"):
        list(open_source(str(path), field="body"))


@pytest.mark.parametrize("bad_line", ["{not json", '{"title": "no text"}', '{"text": 5}'])
def test_malformed_jsonl_line_is_reported_with_file_and_line_number(
    tmp_path: Path, bad_line: str
) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(f'{{"text": "ok"}}\n{{"text": "ok"}}\n{bad_line}\n')
    docs = read_jsonl(path)
    assert next(docs).text == "ok"
    with pytest.raises(DataError, match=r"data\.jsonl.*line 3"):
        list(docs)


def test_parquet_file_and_folder_are_read(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "parts").mkdir()
    pq.write_table(pa.table({"text": ["a", "b"], "n": [1, 2]}), tmp_path / "parts" / "0.parquet")
    pq.write_table(pa.table({"text": ["c"], "id": ["c-id"]}), tmp_path / "parts" / "1.parquet")

    docs = list(open_source(str(tmp_path / "parts")))

    assert [d.text for d in docs] == ["a", "b", "c"]
    assert [d.doc_id for d in docs] == ["0.parquet:0", "0.parquet:1", "c-id"]
    assert [d.text for d in open_source(str(tmp_path / "parts" / "1.parquet"))] == ["c"]


def test_parquet_without_the_column_names_file_and_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["a"], "lang": ["en"]}), path)

    with pytest.raises(DataError, match=r"t\.parquet.*'text'.*content, lang"):
        read_parquet(path)
    assert [d.text for d in read_parquet(path, field="content")] == ["a"]


def test_hf_dataset_saved_to_disk_is_read_by_spec(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(tmp_path / "flat"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"content": ["t1"]}),
            "validation": datasets.Dataset.from_dict({"content": ["v1", "v2"]}),
        }
    ).save_to_disk(str(tmp_path / "dict"))

    flat = list(open_source(f"hf:{tmp_path / 'flat'}"))
    val = list(open_source(f"hf:{tmp_path / 'dict'}:validation", field="content"))

    assert [d.text for d in flat] == ["x", "y"]
    assert len({d.doc_id for d in flat}) == 2
    assert [d.text for d in val] == ["v1", "v2"]
    with pytest.raises(DataError, match="no split 'test'.*train, validation"):
        open_source(f"hf:{tmp_path / 'dict'}:test", field="content")


def test_missing_path_and_unknown_builtin_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere"):
        open_source(str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(DataError, match="builtin:stdlib"):
        open_source("builtin:wikipedia")


# --- built-in corpus ---------------------------------------------------------------------------


def test_builtin_corpus_has_thousands_of_mid_sized_documents() -> None:
    docs = builtin_corpus()
    lengths = np.array([len(d.text) for d in docs])

    assert 3000 <= len(docs) <= 8000
    assert len({d.doc_id for d in docs}) == len(docs)
    assert lengths.min() >= 300 and 1500 <= np.median(lengths) <= 4000
    assert any(d.doc_id.startswith("stdlib/json/") for d in docs)
    assert any(d.doc_id.startswith("pydoc/") for d in docs)
    assert not any("/test/" in d.doc_id or "site-packages" in d.doc_id for d in docs)
    assert [d.doc_id for d in open_source("builtin")] == [d.doc_id for d in docs]


def test_builtin_sample_is_deterministic_and_spread_over_the_corpus() -> None:
    sample = builtin_corpus(max_docs=50)

    assert len(sample) == 50
    assert sample == builtin_corpus(max_docs=50)
    assert len({d.doc_id.split("/")[1] for d in sample}) >= 20
    # Stdlib files come first and pydoc topics last: a spread sample reaches both.
    assert sample[0].doc_id.startswith("stdlib/") and sample[-1].doc_id.startswith("pydoc/")


def test_builtin_documents_keep_source_lines_whole() -> None:
    docs = [d for d in builtin_corpus() if d.doc_id.startswith("stdlib/json/decoder.py#")]
    source = Path(json.decoder.__file__).read_text(encoding="utf-8")
    assert "".join(d.text for d in docs) == source
    assert all(d.text.endswith("\n") for d in docs)


def test_train_val_split_is_stable_under_reordering_and_subsetting() -> None:
    docs = builtin_corpus()
    train, val = split_train_val(docs, val_fraction=0.05, seed=3)
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    _, val_shuffled = split_train_val(shuffled, val_fraction=0.05, seed=3)
    _, val_half = split_train_val(docs[::2], val_fraction=0.05, seed=3)
    _, val_other_seed = split_train_val(docs, val_fraction=0.05, seed=4)

    assert len(train) + len(val) == len(docs)
    assert 0.03 * len(docs) < len(val) < 0.07 * len(docs)
    assert {d.doc_id for d in val_shuffled} == {d.doc_id for d in val}
    assert {d.doc_id for d in val_half} == {d.doc_id for d in val} & {d.doc_id for d in docs[::2]}
    assert {d.doc_id for d in val_other_seed} != {d.doc_id for d in val}


# --- tokenizer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    texts = [d.text for d in builtin_corpus(max_docs=200)]
    return Tokenizer.train(texts, tmp_path_factory.mktemp("tok") / "tok.model", vocab_size=512)


def test_tokenizer_round_trips_source_text_exactly(small_tokenizer: Tokenizer) -> None:
    texts = [d.text for d in builtin_corpus(max_docs=300)][::7]
    texts.append("def f(x):\n\tif x:  \r\n        return 'é😀' + \"12345\"\n\n\n   \n")
    ids = small_tokenizer.encode_batch(texts)

    assert [small_tokenizer.decode(i) for i in ids] == texts
    assert ids[0] == small_tokenizer.encode(texts[0])
    assert all(0 <= t < small_tokenizer.vocab_size for seq in ids for t in seq)


def test_tokenizer_properties_and_reload(small_tokenizer: Tokenizer) -> None:
    loaded = Tokenizer.load(small_tokenizer.path)

    assert small_tokenizer.vocab_size == loaded.vocab_size == 512
    assert (loaded.bos_id, loaded.eos_id) == (1, 2)
    assert loaded.sha256 == small_tokenizer.sha256
    assert loaded.encode("x = 1\n") == small_tokenizer.encode("x = 1\n")
    # Digits are split, so numbers never become one opaque piece.
    assert len(loaded.encode("1234567")) == 7


def test_tokenizer_training_is_deterministic(small_tokenizer: Tokenizer, tmp_path: Path) -> None:
    texts = [d.text for d in builtin_corpus(max_docs=200)]
    again = Tokenizer.train(reversed(texts), tmp_path / "again.model", vocab_size=512)

    assert again.sha256 == small_tokenizer.sha256
    assert (tmp_path / "again.model").read_bytes() == small_tokenizer.path.read_bytes()


def test_text_with_more_characters_than_pieces_trains_and_round_trips(tmp_path: Path) -> None:
    # 3,000 distinct CJK characters against 512 pieces: the rare ones are spelled in bytes.
    rare = "".join(chr(0x4E00 + i) for i in range(3000))
    texts = [rare[i : i + 60] + " the common words come back often\n" for i in range(0, 3000, 60)]
    texts = texts * 4
    tok = Tokenizer.train(texts, tmp_path / "cjk.model", vocab_size=512)
    ids = tok.encode_batch(texts[:10])
    assert [tok.decode(i) for i in ids] == texts[:10]
    assert all(0 <= t < 512 for seq in ids for t in seq)


def test_tokenizer_vocab_too_large_for_tiny_text_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="vocab_size=4096 is too large"):
        Tokenizer.train(["print('hi')\n" * 20], tmp_path / "t.model", vocab_size=4096)
    assert not (tmp_path / "t.model").exists()


def test_ctrl_c_while_the_tokenizer_reads_its_lines_is_a_stop_not_bad_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sentencepiece turns an exception raised while it reads the training lines into its own
    RuntimeError ("INTERNAL: KeyboardInterrupt"); Ctrl-C there must stop the command as
    Ctrl-C (exit 130), not as a "tokenizer training failed" data error."""
    from dipaco.data import tokenizer as tokenizer_module

    calls = [0]
    real = str.splitlines

    class Lines(str):
        def splitlines(self, keepends: bool = False) -> list[str]:
            calls[0] += 1
            if calls[0] == 3:  # the signal's handler raises in the middle of the reading
                raise KeyboardInterrupt
            return real(self, keepends)

    sample = tokenizer_module._sample_texts
    monkeypatch.setattr(
        tokenizer_module, "_sample_texts", lambda *a: [Lines(t) for t in sample(*a)]
    )
    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(50)]
    with pytest.raises(KeyboardInterrupt):
        Tokenizer.train(texts, tmp_path / "t.model", vocab_size=300)
    assert calls[0] == 3 and not (tmp_path / "t.model").exists()


# --- shards ------------------------------------------------------------------------------------


def write_shard(prefix: Path, docs: list[list[int]], vocab_size: int = 1000) -> None:
    with ShardWriter(prefix, vocab_size) as writer:
        for i, tokens in enumerate(docs):
            writer.add(tokens, f"doc{i}")


@pytest.mark.parametrize(("vocab_size", "itemsize"), [(1000, 2), (70_000, 4)])
def test_shard_round_trips_documents(tmp_path: Path, vocab_size: int, itemsize: int) -> None:
    docs = [[1, 2, 3], [], list(range(vocab_size - 5, vocab_size)), [7]]
    prefix = tmp_path / "shards" / "P0.train"
    write_shard(prefix, docs, vocab_size)

    shard = TokenShard(prefix, verify=True)

    assert TokenShard.exists(prefix)
    assert len(shard) == 4 and shard.n_tokens == 9
    assert [shard[i].tolist() for i in range(len(shard))] == docs
    assert shard[-1].tolist() == [7]
    assert shard.doc_ids == ["doc0", "doc1", "doc2", "doc3"]
    assert shard.doc_lengths.tolist() == [3, 0, 5, 1]
    assert (tmp_path / "shards" / "P0.train.tokens").stat().st_size == 9 * itemsize
    with pytest.raises(IndexError):
        shard[4]


def test_shard_is_not_published_when_writing_fails(tmp_path: Path) -> None:
    prefix = tmp_path / "P1"
    with pytest.raises(DataError, match="outside"), ShardWriter(prefix, vocab_size=10) as writer:
        writer.add([1, 2], "ok")
        writer.add([3, 10], "bad")

    assert not TokenShard.exists(prefix)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="no complete shard"):
        TokenShard(prefix)


def test_corrupted_token_bytes_fail_verification(tmp_path: Path) -> None:
    prefix = tmp_path / "P2"
    write_shard(prefix, [[1, 2, 3, 4]])
    tokens = tmp_path / "P2.tokens"
    data = bytearray(tokens.read_bytes())
    data[2] ^= 0xFF
    tokens.write_bytes(bytes(data))

    shard = TokenShard(prefix)  # same size: only the checksum can tell
    with pytest.raises(CorruptFileError, match=r"P2\.tokens"):
        shard.verify()
    with pytest.raises(CorruptFileError, match=r"P2\.tokens"):
        TokenShard(prefix, verify=True)


def test_truncated_or_missing_tokens_file_is_detected_at_open(tmp_path: Path) -> None:
    prefix = tmp_path / "P3"
    write_shard(prefix, [[1, 2, 3, 4]])
    tokens = tmp_path / "P3.tokens"
    tokens.write_bytes(tokens.read_bytes()[:-2])

    with pytest.raises(CorruptFileError, match=r"P3\.tokens.*6 bytes, expected 8"):
        TokenShard(prefix)
    tokens.unlink()
    with pytest.raises(CorruptFileError, match=r"P3\.tokens is missing"):
        TokenShard(prefix)


def test_shard_metadata_records_checksums(tmp_path: Path) -> None:
    prefix = tmp_path / "P4"
    write_shard(prefix, [[5, 6], [7]])
    meta = json.loads((tmp_path / "P4.json").read_text())

    assert meta["dtype"] == "uint16" and meta["n_docs"] == 2 and meta["n_tokens"] == 3
    assert len(meta["tokens_sha256"]) == len(meta["index_sha256"]) == 64
    assert np.load(tmp_path / "P4.index.npy", allow_pickle=False).tolist() == [0, 2, 3]


def test_sample_windows_are_contiguous_slices_of_the_token_stream(tmp_path: Path) -> None:
    prefix = tmp_path / "P5"
    write_shard(prefix, [list(range(0, 40)), list(range(40, 100))])
    shard = TokenShard(prefix)

    windows = sample_windows(shard, np.random.default_rng(0), batch=64, length=16)
    again = sample_windows(shard, np.random.default_rng(0), batch=64, length=16)

    assert windows.shape == (64, 16) and windows.dtype == np.int64
    # The stream is 0..99, so every window is a run of consecutive ids crossing documents freely.
    assert (np.diff(windows, axis=1) == 1).all()
    assert windows[:, 0].min() >= 0 and windows[:, -1].max() <= 99
    assert len(set(windows[:, 0].tolist())) > 20
    assert np.array_equal(windows, again)
    assert (
        sample_windows(shard, np.random.default_rng(1), batch=2, length=100).tolist()
        == [list(range(100))] * 2
    )
    with pytest.raises(DataError, match="fewer than a window"):
        sample_windows(shard, np.random.default_rng(0), batch=1, length=101)


def test_without_byte_fallback_a_vocabulary_of_256_is_characters_and_merges(tmp_path: Path) -> None:
    """With byte fallback 256 pieces are bytes, so 256 is too small for any text; without it
    (``data.byte_fallback = false``, the regime ladder's tiny paths) the pieces are characters
    and merges, and a character without a piece becomes the unknown token."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5)) for _ in range(300)
    ]
    texts = [
        f"def {rng.choice(words)}(x):\n    return {rng.choice(words)}(x) * {i}  # "
        + " ".join(rng.choice(words) for _ in range(12))
        + "\n"
        for i in range(400)
    ]
    with pytest.raises(DataError):
        Tokenizer.train(texts, tmp_path / "bytes.model", vocab_size=256)
    tok = Tokenizer.train(texts, tmp_path / "chars.model", vocab_size=256, byte_fallback=False)
    assert tok.vocab_size == 256
    ids = tok.encode_batch(texts[:3])
    assert [tok.decode(i) for i in ids] == texts[:3]
    assert len(ids[0]) < len(texts[0]) / 1.5  # merges, not one piece a character
    unknown = tok.encode_batch(["x = '\u4e00'\n"])[0]
    assert 0 in unknown  # the unknown piece (id 0) for a character never seen

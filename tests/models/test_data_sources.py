"""The building blocks of models.data: lazy documents, the split, encode_pieces, open_shards."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import numpy as np
import pytest

from models.data import load_corpus
from models.prepare import DEFAULT_BPE_VOCAB, prepare
from models.shards import META_FILE, SHARD_FORMAT, ShardSet, open_shards
from models.sources import (
    CorpusError,
    Documents,
    Fingerprint,
    check_split,
    list_documents,
    split_pieces,
)
from models.tokenizer import ByteTokenizer, IdTokenizer, encode_pieces, padded_vocab


def test_documents_are_listed_sorted_and_read_lazily(tmp_path):
    for name in ("b.txt", "a/c.txt", "a/b.txt", ".hidden"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(name.encode() * 3)
    docs = list_documents(f"file:{tmp_path}")
    assert isinstance(docs, Documents) and len(docs) == 3
    assert docs.names == ["a/b.txt", "a/c.txt", "b.txt"] and docs.sizes == [21, 21, 15]
    (tmp_path / "b.txt").write_bytes(b"changed after listing")
    assert docs.read(2) == b"changed after listing"          # read when asked, not before


def test_fingerprint_and_split_pieces_reproduce_load_corpus(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(200)))
    fingerprint = Fingerprint()
    pieces = list(split_pieces(list_documents(f"file:{path}"), 0.25, fingerprint))
    assert pieces == [(False, bytes(range(150))), (True, bytes(range(150, 200)))]
    expected = hashlib.sha256(b"one.txt\0" + (200).to_bytes(8, "little") + bytes(range(200)))
    assert fingerprint.hexdigest() == expected.hexdigest()
    assert load_corpus(f"file:{path}", val_fraction=0.25).fingerprint == expected.hexdigest()


def test_encode_pieces_joins_each_split_with_a_newline():
    pieces = [(False, b"ab"), (True, b"v1"), (False, b""), (False, b"cd"), (True, b"v2")]
    out: dict[bool, list[int]] = {False: [], True: []}
    for is_val, ids in encode_pieces(ByteTokenizer(), pieces, batch_bytes=3):
        out[is_val].extend(ids.tolist())
    assert bytes(out[False]) == b"ab\n\ncd" and bytes(out[True]) == b"v1\nv2"
    with pytest.raises(CorpusError, match="no tokenizer to encode text with"):
        list(encode_pieces(IdTokenizer(10), pieces))


def test_check_split_and_padded_vocab_errors():
    check_split("x", 10, 5, 5)
    with pytest.raises(CorpusError, match=r"corpus 'x' is empty \(0 bytes\)"):
        check_split("x", 0, 0, 0)
    with pytest.raises(CorpusError, match=r"too small to split .*\(3 bytes\)"):
        check_split("x", 3, 3, 0)
    assert padded_vocab(256, None, "w") == 256 and padded_vocab(256, 320, "w") == 320
    with pytest.raises(CorpusError, match=r"vocab_size 100 is smaller than the vocabulary of w's"):
        padded_vocab(256, 100, "w")
    with pytest.raises(CorpusError, match="positive integer, got True"):
        padded_vocab(256, True, "w")


def test_open_shards_reports_the_folder_hashes_and_metadata(tmp_path):
    meta = prepare("synthetic:20000", tmp_path)
    shards = open_shards(tmp_path)
    assert isinstance(shards, ShardSet) and shards.folder == tmp_path
    assert shards.meta == json.loads((tmp_path / META_FILE).read_text()) == meta
    assert shards.meta["format"] == SHARD_FORMAT and shards.notes == ()
    for split in ("train", "val"):
        digest = hashlib.sha256((tmp_path / f"{split}.bin").read_bytes()).hexdigest()
        assert shards.sha256[split] == digest
    assert np.array_equal(shards.val.array, np.fromfile(tmp_path / "val.bin", dtype="<u2"))


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason="needs the optional tokenizers package")
def test_prepare_trains_the_default_bpe_vocabulary(tmp_path):
    meta = prepare("synthetic:30000", tmp_path, tokenizer="bpe")
    assert 256 < meta["vocab_size"] <= DEFAULT_BPE_VOCAB == 1024

"""bin:DIR token shards: nanoGPT folders, the ids' dtype, vocabulary rules, chunked counting,
one-line errors."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from models.data import BatchSampler, CorpusError, check_size, load_corpus, unigram_entropy
from models.prepare import prepare
from models.shards import SCAN_TOKENS, SHARD_DTYPES
from models.train import main as train


def _nanogpt(folder: Path, train: np.ndarray, val: np.ndarray) -> Path:
    """A folder as nanoGPT's prepare.py writes it: raw uint16 files and a meta.pkl."""
    folder.mkdir(parents=True, exist_ok=True)
    train.astype(np.uint16).tofile(folder / "train.bin")
    val.astype(np.uint16).tofile(folder / "val.bin")

    class Explodes:  # unpickling this would run code: the loader must never do it
        def __reduce__(self):
            return (pytest.fail, ("meta.pkl was unpickled",))

    (folder / "meta.pkl").write_bytes(pickle.dumps(Explodes()))
    return folder


def test_nanogpt_folder_takes_the_vocabulary_from_the_largest_id_and_says_so(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000), rng.integers(0, 900, 600)
    train[17] = 999
    folder = _nanogpt(tmp_path / "nano", train, val)
    corpus = load_corpus(f"bin:{folder}", shard_dtype="uint16")
    assert corpus.vocab_size == 1000 and corpus.tokenizer.name == "ids"
    assert len(corpus.notes) == 1 and "no meta.json" in corpus.notes[0]
    assert "uint16 ids as given" in corpus.notes[0]
    assert "largest token id + 1" in corpus.notes[0] and str(folder) in corpus.notes[0]
    assert corpus.describe()["notes"] == list(corpus.notes)
    assert torch.equal(corpus.train[:], torch.from_numpy(train))
    assert corpus.tokenizer.encode(b"text") == [] and corpus.tokenizer.decode([3, 4]) == "3 4"
    x, y = BatchSampler(corpus.train, 2, 8, seed=0).next_batch()
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 1000
    check_size(corpus, batch_size=4, block_size=64)
    padded = load_corpus(f"bin:{folder}", vocab_size=1024, shard_dtype="uint16")
    assert padded.vocab_size == 1024 and "1024 as given" in padded.notes[0]
    assert padded.fingerprint == corpus.fingerprint


def test_a_padded_vocabulary_over_prepared_shards(tmp_path):
    prepare("synthetic:20000", tmp_path)
    assert load_corpus(f"bin:{tmp_path}", vocab_size=320).vocab_size == 320
    with pytest.raises(CorpusError, match=r"vocab_size 100 is smaller than the vocabulary .*256"):
        load_corpus(f"bin:{tmp_path}", vocab_size=100)
    with pytest.raises(CorpusError, match="made with the 'byte' tokenizer"):
        load_corpus(f"bin:{tmp_path}", tokenizer="bpe")
    text = load_corpus("synthetic:20000", vocab_size=300)             # text corpora pad too
    assert text.vocab_size == 300 and text.train.dtype == torch.int32
    assert torch.equal(text.train.long(), load_corpus("synthetic:20000").train.long())
    with pytest.raises(CorpusError, match="vocab_size must be a positive integer, got 0"):
        load_corpus("synthetic:20000", vocab_size=0)


def test_entropy_of_a_shard_larger_than_one_chunk_equals_the_in_memory_one(tmp_path):
    rng = np.random.default_rng(1)
    train = rng.integers(0, 50, SCAN_TOKENS + 4321).astype(np.uint16)
    folder = _nanogpt(tmp_path / "big", train, train[:100])
    corpus = load_corpus(f"bin:{folder}", shard_dtype="uint16")
    memory = torch.from_numpy(train.astype(np.int32))
    assert unigram_entropy(corpus.train, 50) == unigram_entropy(memory, 50)
    assert unigram_entropy(corpus.train, 50) == pytest.approx(math.log(50), abs=1e-4)
    assert unigram_entropy(np.arange(16, dtype=np.uint16).repeat(3), 4) == pytest.approx(
        math.log(16), abs=1e-12)                            # ids past vocab_size still count


def _tamper(kind: str, folder: Path) -> tuple[str, str]:
    """Damage a prepared folder; returns (spec, the path the error must name)."""
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    if kind == "missing-dir":
        return f"bin:{folder / 'nope'}", str(folder / "nope")
    if kind in ("no-train", "no-val"):
        path = folder / f"{kind[3:]}.bin"
        path.unlink()
        return f"bin:{folder}", str(path)
    if kind == "size-vs-meta":
        with open(folder / "val.bin", "ab") as f:
            f.write(b"\0\0")
        return f"bin:{folder}", str(folder / "val.bin")
    if kind == "half-token":
        with open(folder / "train.bin", "ab") as f:
            f.write(b"\0")
        return f"bin:{folder}", str(folder / "train.bin")
    if kind == "edited":
        data = bytearray((folder / "train.bin").read_bytes())
        data[0] ^= 1
        (folder / "train.bin").write_bytes(bytes(data))
        return f"bin:{folder}", str(folder / "train.bin")
    if kind == "id-past-vocab":
        ids = np.fromfile(folder / "val.bin", dtype="<u2")
        ids[5] = 300
        ids.tofile(folder / "val.bin")
        del meta["sha256"]
    elif kind == "bad-json":
        meta_path.write_text("{not json")
        return f"bin:{folder}", str(meta_path)
    elif kind == "foreign-meta":
        meta = {"vocab": 3}
    elif kind == "bad-dtype":
        meta["dtype"] = "int8"
    elif kind == "bad-digest":
        meta["tokenizer_sha256"] = 12
    meta_path.write_text(json.dumps(meta))
    return f"bin:{folder}", str(folder / "val.bin" if kind == "id-past-vocab" else meta_path)


@pytest.mark.parametrize("kind, needle", [
    ("missing-dir", "does not exist"), ("no-train", "does not exist (a bin: folder"),
    ("no-val", "does not exist (a bin: folder"), ("size-vs-meta", "meta.json says"),
    ("half-token", "not a positive whole number of uint16 tokens"),
    ("edited", "changed since"), ("id-past-vocab", "token id 300, outside the vocabulary of 256"),
    ("bad-json", "cannot be read as JSON"), ("foreign-meta", "is not token-shard metadata"),
    ("bad-dtype", "'dtype' must be one of"), ("bad-digest", "'tokenizer_sha256' must be a string"),
])
def test_bad_shards_raise_one_line_errors_naming_the_path(tmp_path, kind, needle):
    prepare("synthetic:20000", tmp_path / "shards")
    spec, path = _tamper(kind, tmp_path / "shards")
    with pytest.raises(CorpusError) as info:
        load_corpus(spec)
    message = str(info.value)
    assert needle in message and path in message and "\n" not in message


def test_bin_spec_without_a_folder_or_with_a_file(tmp_path):
    with pytest.raises(CorpusError, match="'bin:' needs a folder"):
        load_corpus("bin:")
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(CorpusError, match=r"train\.bin is not a folder"):
        load_corpus(f"bin:{tmp_path / 'train.bin'}")


# ---- the ids' dtype --------------------------------------------------------------------------


def _wide_without_meta(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """uint32 shards of small ids and no meta.json (a prepared folder whose meta.json was lost,
    or another tool's): read as uint16 they would be valid-looking ids, every other one 0."""
    rng = np.random.default_rng(2)
    train, val = rng.integers(1, 250, 4000), rng.integers(1, 250, 500)
    folder.mkdir()
    train.astype("<u4").tofile(folder / "train.bin")
    val.astype("<u4").tofile(folder / "val.bin")
    return train, val


def test_shards_without_meta_json_are_refused_until_their_dtype_is_given(tmp_path):
    folder = tmp_path / "wide"
    train, val = _wide_without_meta(folder)
    with pytest.raises(CorpusError) as info:
        load_corpus(f"bin:{folder}")
    message = str(info.value)
    assert message.startswith(f"token shards {folder} have no meta.json, so the width of their "
                              f"ids is unknown")
    assert "--shard_dtype uint16" in message and "--shard_dtype uint32" in message
    assert "\n" not in message
    wide = load_corpus(f"bin:{folder}", shard_dtype="uint32")
    assert torch.equal(wide.train[:], torch.from_numpy(train))
    assert torch.equal(wide.val[:], torch.from_numpy(val))
    assert wide.vocab_size == max(train.max(), val.max()) + 1
    assert wide.describe()["shards"]["dtype"] == "uint32"
    narrow = load_corpus(f"bin:{folder}", shard_dtype="uint16")  # what the user asked for
    assert narrow.fingerprint != wide.fingerprint  # and a resume can tell the two apart
    assert SHARD_DTYPES == ("uint16", "uint32")
    with pytest.raises(CorpusError, match=r"shard dtype must be one of uint16, uint32, got 'int8'"):
        load_corpus(f"bin:{folder}", shard_dtype="int8")


def test_a_given_dtype_must_agree_with_meta_json(tmp_path):
    prepare("synthetic:20000", tmp_path)  # uint16, recorded
    assert load_corpus(f"bin:{tmp_path}", shard_dtype="uint16").train.dtype == np.dtype("<u2")
    with pytest.raises(CorpusError) as info:
        load_corpus(f"bin:{tmp_path}", shard_dtype="uint32")
    assert str(info.value) == (f"shard dtype uint32 was given, but {tmp_path / 'meta.json'} "
                               f"records uint16; drop --shard_dtype to read what it records")
    with pytest.raises(CorpusError, match="shard_dtype 'uint16' is for token shards"):
        load_corpus("synthetic:20000", shard_dtype="uint16")


def test_a_missing_shard_is_named_before_the_dtype_is_asked_for(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(CorpusError, match=r"val\.bin does not exist \(a bin: folder holds"):
        load_corpus(f"bin:{tmp_path}")


def test_the_trainer_refuses_shards_of_unknown_dtype_in_one_line_and_reads_the_given_one(
        tmp_path, capsys):
    folder = tmp_path / "wide"
    _wide_without_meta(folder)
    args = ["--preset", "smoke", "--corpus", f"bin:{folder}", "--steps", "2", "--sample_tokens",
            "0", "--progress", "false"]
    assert train([*args, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: token shards {folder} have no meta.json") and \
        err.count("\n") == 1
    assert not (tmp_path / "refused").exists()
    assert train([*args, "--shard_dtype", "uint32", "--out", str(tmp_path / "run")]) == 0
    recorded = json.loads((tmp_path / "run" / "corpus.json").read_text())
    assert recorded["shards"]["dtype"] == "uint32" and recorded["vocab_size"] < 256
    assert train(["--preset", "smoke", "--shard_dtype", "uint16", "--out",
                  str(tmp_path / "text")]) == 2
    assert "shard_dtype 'uint16' is for token shards (--corpus bin:DIR); corpus " \
           "'synthetic:60000' is text" in capsys.readouterr().err


def test_a_run_on_nanogpt_shards_saved_before_shard_dtype_resumes_with_it(tmp_path, capsys):
    rng = np.random.default_rng(3)
    folder = _nanogpt(tmp_path / "nano", rng.integers(0, 200, 6000), rng.integers(0, 200, 800))
    out = tmp_path / "run"
    assert train(["--preset", "smoke", "--corpus", f"bin:{folder}", "--shard_dtype", "uint16",
                  "--steps", "10", "--stop_at", "5", "--sample_tokens", "0", "--progress",
                  "false", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    del saved["shard_dtype"]  # as a run directory written before the key existed
    (out / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert train(["--resume", "--out", str(out)]) == 2
    assert "have no meta.json" in capsys.readouterr().err
    assert train(["--resume", "--shard_dtype", "uint16", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 10

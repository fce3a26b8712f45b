"""models.prepare: text corpus -> token shards -> memmap batches equal to the in-memory path's."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from models.data import (
    BatchSampler,
    CorpusError,
    TokenFile,
    eval_batches,
    load_corpus,
    shard_dtype,
    unigram_entropy,
)
from models.prepare import main, prepare
from models.train import main as train

needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="needs the optional tokenizers package")
SPEC = "synthetic:30000"


def _assert_same_batches(memory: torch.Tensor, shards: TokenFile, seed: int) -> None:
    a = BatchSampler(memory, batch_size=4, block_size=16, seed=seed)
    b = BatchSampler(shards, batch_size=4, block_size=16, seed=seed)
    for _ in range(5):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert xb.dtype == yb.dtype == torch.int64 and xb.shape == (4, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_byte_shards_round_trip_to_the_in_memory_batches(tmp_path):
    meta = prepare(SPEC, tmp_path / "shards")
    memory = load_corpus(SPEC)
    shards = load_corpus(f"bin:{tmp_path / 'shards'}")
    assert isinstance(shards.train, TokenFile) and isinstance(shards.train.array, np.memmap)
    assert meta["dtype"] == "uint16" and meta["tokenizer"] == "byte"
    assert meta["source"]["fingerprint"] == memory.fingerprint
    assert (meta["train_tokens"], meta["val_tokens"]) == (memory.train.numel(),
                                                          memory.val.numel())
    on_disk = np.fromfile(tmp_path / "shards" / "train.bin", dtype="<u2")
    assert np.array_equal(on_disk, memory.train.numpy())
    assert torch.equal(shards.val[:], memory.val.long())
    assert shards.vocab_size == 256 and shards.tokenizer.name == "byte"
    assert (shards.n_train_files, shards.n_val_files, shards.n_bytes) == (
        memory.n_train_files, memory.n_val_files, memory.n_bytes)
    for seed in (0, 7):
        _assert_same_batches(memory.train, shards.train, seed)
    for (xa, ya), (xb, yb) in zip(eval_batches(memory.val, 4, 16, 3),
                                  eval_batches(shards.val, 4, 16, 3)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert unigram_entropy(shards.train, 256) == unigram_entropy(memory.train, 256)
    assert int(shards.train[3]) == int(memory.train[3])


def test_memmap_sampler_resumes_exactly(tmp_path):
    prepare(SPEC, tmp_path)
    tokens = load_corpus(f"bin:{tmp_path}").train
    sampler = BatchSampler(tokens, 4, 16, seed=3)
    sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(3)]
    again = BatchSampler(load_corpus(f"bin:{tmp_path}").train, 4, 16, seed=99)
    again.load_state_dict(state)
    for (ex, ey), (gx, gy) in zip(expected, (again.next_batch() for _ in range(3))):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_single_file_and_folder_sources_match_load_corpus(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes("héllo wörld\n".encode() * 300)
    folder = tmp_path / "src"
    for i in range(12):
        (folder / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"d{i % 3}" / f"m{i}.py").write_bytes(f"x{i} = {i}\n".encode() * 30)
    for spec in (f"file:{text}", f"file:{folder}"):
        out = tmp_path / f"out-{spec[-3:]}"
        prepare(spec, out, val_fraction=0.25)
        memory = load_corpus(spec, val_fraction=0.25)
        shards = load_corpus(f"bin:{out}")
        assert torch.equal(shards.train[:], memory.train.long())
        assert torch.equal(shards.val[:], memory.val.long())
        assert shards.describe()["shards"]["source"]["fingerprint"] == memory.fingerprint


@needs_tokenizers
def test_bpe_shards_round_trip_and_a_users_tokenizer_file(tmp_path):
    meta = prepare(SPEC, tmp_path / "a", tokenizer="bpe", vocab_size=300)
    assert meta["tokenizer"] == "bpe" and 256 < meta["vocab_size"] <= 300
    assert (tmp_path / "a" / "tokenizer.json").is_file()
    shards = load_corpus(f"bin:{tmp_path / 'a'}")
    memory = load_corpus(SPEC, tokenizer="bpe", tokenizer_path=tmp_path / "a" / "tokenizer.json")
    assert shards.tokenizer.name == "bpe" and shards.vocab_size == memory.vocab_size
    assert torch.equal(shards.train[:], memory.train.long())
    _assert_same_batches(memory.train, shards.train, seed=1)
    text = "def alpha_0(beta, gamma):\n"
    assert shards.tokenizer.decode(shards.tokenizer.encode(text.encode())) == text
    # the user's tokenizer.json encodes without training: the same shards
    prepare(SPEC, tmp_path / "b", tokenizer_file=tmp_path / "a" / "tokenizer.json",
            tokenizer="bpe")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(CorpusError, match=r"--vocab_size 512 disagrees with .*tokenizer\.json"):
        prepare(SPEC, tmp_path / "c", tokenizer="bpe", vocab_size=512,
                tokenizer_file=tmp_path / "a" / "tokenizer.json")
    prepare(SPEC, tmp_path / "b", overwrite=True)                   # bytes over a BPE folder
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["meta.json", "train.bin",
                                                                  "val.bin"]
    assert load_corpus(f"bin:{tmp_path / 'b'}").tokenizer.name == "byte"


def test_uint32_shards_read_like_uint16(tmp_path):
    assert shard_dtype(256) == shard_dtype(65536) == "uint16"
    assert shard_dtype(65537) == shard_dtype(200_000) == "uint32"
    prepare(SPEC, tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    narrow = load_corpus(f"bin:{tmp_path}")
    expected = [narrow.train[:], narrow.val[:]]
    for split in ("train", "val"):
        wide = np.fromfile(tmp_path / f"{split}.bin", dtype="<u2").astype("<u4")
        wide.tofile(tmp_path / f"{split}.bin")
        meta["sha256"][split] = hashlib.sha256(wide.tobytes()).hexdigest()
    meta["dtype"] = "uint32"
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    wide = load_corpus(f"bin:{tmp_path}")
    assert wide.train.dtype == np.dtype("<u4")
    assert torch.equal(wide.train[:], expected[0]) and torch.equal(wide.val[:], expected[1])
    assert wide.fingerprint != narrow.fingerprint      # the bytes on disk differ


@pytest.mark.parametrize("kwargs, needle", [
    ({"spec": "bin:x"}, "already token shards"),
    ({"tokenizer": "wordpiece"}, "tokenizer must be 'byte' or 'bpe'"),
    ({"vocab_size": 300}, "is for --tokenizer bpe"),
    ({"tokenizer": "bpe", "vocab_size": 200}, "must be > 256"),
    ({"val_fraction": 0.0}, "val_fraction must be in"),
    ({"spec": "tiny"}, "too small to split"),
])
def test_bad_options_are_one_line_errors(tmp_path, kwargs, needle):
    (tmp_path / "one.txt").write_bytes(b"x")
    kwargs = {"spec": SPEC, **kwargs}
    if kwargs["spec"] == "tiny":
        kwargs["spec"] = f"file:{tmp_path / 'one.txt'}"
    with pytest.raises(CorpusError) as info:
        prepare(kwargs.pop("spec"), tmp_path / "out", **kwargs)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not any(p.name.endswith(".partial") for p in tmp_path.rglob("*"))


def test_cli_writes_refuses_to_overwrite_and_overwrites(tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(["--corpus", SPEC, "--out", str(out)]) == 0
    assert f"--corpus bin:{out}" in capsys.readouterr().out
    first = (out / "train.bin").read_bytes()
    assert main(["--corpus", "synthetic:40000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--overwrite" in err and str(out) in err
    assert (out / "train.bin").read_bytes() == first
    assert main(["--corpus", "synthetic:40000", "--out", str(out), "--overwrite"]) == 0
    assert len(load_corpus(f"bin:{out}").train) > len(first) // 2
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_python_dash_m_runs(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-m", "models.prepare", "--corpus", "synthetic:5000",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, check=False,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {tmp_path}")
    assert len(load_corpus(f"bin:{tmp_path}").val) > 0


def _rows(run: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rows]


def test_training_on_shards_equals_training_on_the_text_and_resumes_exactly(tmp_path):
    prepare("synthetic:60000", tmp_path / "shards")
    args = ["--preset", "smoke", "--sample_tokens", "0", "--steps", "10", "--eval_interval", "5",
            "--log_interval", "5", "--progress", "false", "--connection", "pre-ln"]
    shards = ["--corpus", f"bin:{tmp_path / 'shards'}"]
    assert train([*args, "--out", str(tmp_path / "text"), "--corpus", "synthetic:60000"]) == 0
    assert train([*args, *shards, "--out", str(tmp_path / "bin")]) == 0
    assert train([*args, *shards, "--stop_at", "5", "--out", str(tmp_path / "cut")]) == 0
    assert train(["--resume", "--out", str(tmp_path / "cut")]) == 0
    text = _rows(tmp_path / "text")
    assert len(text) >= 2 and text == _rows(tmp_path / "bin") == _rows(tmp_path / "cut")

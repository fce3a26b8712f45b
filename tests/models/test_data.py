"""Corpora: stdlib file selection, fingerprints, deterministic file split, batches, errors."""

from __future__ import annotations

import importlib.util
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from models.data import (
    EXCLUDED_DIRS,
    BatchSampler,
    CorpusError,
    check_size,
    eval_batches,
    load_corpus,
    stdlib_files,
    synthetic_documents,
    unigram_entropy,
)


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def _doc(i: int) -> bytes:
    return f"def f{i}(x):\n    return x * {i}\n".encode() * 20


# ---- stdlib selection -----------------------------------------------------------------------


def test_stdlib_files_skip_site_packages_and_test_folders(tmp_path):
    root = _tree(tmp_path, {
        "os.py": b"a", "json/__init__.py": b"b", "json/notes.txt": b"not python",
        "site-packages/pkg/mod.py": b"x", "dist-packages/mod.py": b"x",
        "test/test_os.py": b"x", "lib2to3/tests/data.py": b"x", "idlelib/idle_test/t.py": b"x",
        "idlelib/run.py": b"c", "unittest/test/test_case.py": b"x"})
    names = [p.relative_to(root).as_posix() for p in stdlib_files(root)]
    assert names == ["idlelib/run.py", "json/__init__.py", "os.py"]


def test_real_stdlib_selection_has_no_test_or_site_packages_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()
    rel = [f.relative_to(root) for f in files]
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any(set(r.parts[:-1]) & EXCLUDED_DIRS for r in rel)
    assert Path("json/__init__.py") in rel and Path("os.py") in rel
    assert [r.as_posix() for r in rel] == sorted(r.as_posix() for r in rel)


# ---- fingerprint and split ------------------------------------------------------------------


def test_fingerprint_is_stable_and_sees_every_change(tmp_path):
    root = _tree(tmp_path / "c", {f"m{i}.py": _doc(i) for i in range(12)})
    spec = f"file:{root}"
    first, second = load_corpus(spec), load_corpus(spec)
    assert first.fingerprint == second.fingerprint and len(first.fingerprint) == 64
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    (root / "m3.py").write_bytes(_doc(3) + b"#")                     # contents
    changed = load_corpus(spec).fingerprint
    (root / "m3.py").rename(root / "m3b.py")                          # name
    renamed = load_corpus(spec).fingerprint
    assert len({first.fingerprint, changed, renamed}) == 3


def test_split_is_by_file_and_does_not_move_when_files_are_added(tmp_path):
    files = {f"m{i:02d}.py": _doc(i) for i in range(40)}
    root = _tree(tmp_path / "c", files)
    corpus = load_corpus(f"file:{root}", val_fraction=0.25)
    assert corpus.n_train_files + corpus.n_val_files == 40
    assert 0 < corpus.n_val_files < 40
    val_text = bytes(corpus.val.tolist())
    in_val = {name for name, doc in files.items() if doc in val_text}
    assert len(in_val) == corpus.n_val_files               # whole files, never cut
    _tree(root, {"zz_new.py": _doc(99)})
    grown = bytes(load_corpus(f"file:{root}", val_fraction=0.25).val.tolist())
    assert {name for name, doc in files.items() if doc in grown} == in_val


def test_stdlib_corpus_bytes_split_and_unigram_entropy():
    corpus = load_corpus("stdlib")
    assert corpus.vocab_size == 256 and corpus.train.dtype == torch.uint8
    assert corpus.n_train_files + corpus.n_val_files == len(stdlib_files())
    assert 0.03 < corpus.n_val_files / (corpus.n_train_files + corpus.n_val_files) < 0.25
    h = unigram_entropy(corpus.train, 256)
    assert 2.0 < h < math.log(256)                         # text, far from uniform bytes


def test_single_file_is_split_by_position(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(f"file:{path}", val_fraction=0.1)
    assert corpus.train.numel() + corpus.val.numel() == 256 * 40
    assert corpus.val.numel() == 256 * 40 - round(256 * 40 * 0.9)
    assert torch.equal(torch.cat([corpus.train, corpus.val]),
                       torch.tensor(list(bytes(range(256)) * 40), dtype=torch.uint8))


def test_synthetic_corpus_is_deterministic_and_sized():
    a, b = synthetic_documents(5000, seed=1), synthetic_documents(5000, seed=1)
    assert a == b and synthetic_documents(5000, seed=2) != a
    assert 5000 <= sum(map(len, a)) < 5000 + max(map(len, a))


def test_unigram_entropy_matches_closed_forms():
    assert unigram_entropy(torch.full((50,), 7, dtype=torch.uint8), 256) == 0.0
    uniform = torch.arange(16, dtype=torch.uint8).repeat(5)
    assert unigram_entropy(uniform, 256) == pytest.approx(math.log(16), abs=1e-12)


# ---- batches --------------------------------------------------------------------------------


def test_sampler_targets_are_shifted_inputs_and_state_resumes_exactly():
    tokens = torch.arange(1000) % 251
    sampler = BatchSampler(tokens.to(torch.uint8), batch_size=4, block_size=16, seed=3)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(3)]
    other = BatchSampler(tokens.to(torch.uint8), batch_size=4, block_size=16, seed=99)
    other.load_state_dict(state)
    assert other.position == 1
    for (ex, ey), (gx, gy) in zip(expected, (other.next_batch() for _ in range(3))):
        assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_ranks_draw_different_batches():
    tokens = (torch.arange(5000) % 256).to(torch.uint8)
    x0, _ = BatchSampler(tokens, 4, 16, seed=0, rank=0).next_batch()
    x1, _ = BatchSampler(tokens, 4, 16, seed=0, rank=1).next_batch()
    assert not torch.equal(x0, x1)


def test_eval_batches_are_fixed_and_in_range():
    tokens = (torch.arange(300) % 256).to(torch.uint8)
    first = list(eval_batches(tokens, 4, 32, 3))
    second = list(eval_batches(tokens, 4, 32, 3))
    assert len(first) == 3
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2) and x1.shape == (4, 32)
    assert int(first[-1][1][-1, -1]) == int(tokens[-1])    # the last window reaches the end


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
def test_eval_windows_of_a_split_past_float32s_integers_stay_inside_it(kind):
    """The last start of a split of 2**24 + 12 tokens (block 8: last start 2**24 + 3) rounds
    up in float32: the window ran one token off the end (IndexError / a ragged np.stack)."""
    n = 2**24 + 12
    array = np.zeros(n, dtype=np.uint8)  # (n,)
    array[-1] = 7
    tokens = torch.from_numpy(array) if kind == "tensor" else array
    batches = list(eval_batches(tokens, 4, 8, 2))
    assert all(x.shape == y.shape == (4, 8) for x, y in batches)
    assert int(batches[-1][1][-1, -1]) == int(array[-1])   # the last window ends at the end


# ---- errors ---------------------------------------------------------------------------------


def _bad_spec(kind: str, root: Path) -> str:
    if kind == "empty-file":
        (root / "empty.txt").write_bytes(b"")
        return f"file:{root / 'empty.txt'}"
    if kind == "empty-folder":
        (root / "void").mkdir()
        return f"file:{root / 'void'}"
    return {"missing": f"file:{root / 'missing.txt'}", "no-path": "file:",
            "unknown": "webtext", "bad-size": "synthetic:lots"}[kind]


@pytest.mark.parametrize("kind, needle", [
    ("missing", "does not exist"), ("empty-file", "is empty"),
    ("empty-folder", "contains no files"), ("no-path", "needs a path"),
    ("unknown", "unknown corpus"), ("bad-size", "synthetic:NBYTES")])
def test_bad_corpus_specs_raise_one_line_errors(tmp_path, kind, needle):
    spec = _bad_spec(kind, tmp_path)
    with pytest.raises(CorpusError) as info:
        load_corpus(spec)
    message = str(info.value)
    assert needle in message and "\n" not in message
    if spec.startswith("file:") and len(spec) > 5:
        assert spec[5:] in message                          # names the path


def test_corpus_smaller_than_one_batch_is_rejected(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(b"x" * 500)
    corpus = load_corpus(f"file:{path}")
    with pytest.raises(CorpusError, match=r"smaller than one batch.*450 tokens.*513"):
        check_size(corpus, batch_size=8, block_size=64)
    check_size(corpus, batch_size=2, block_size=16)       # big enough: no error


def test_bad_val_fraction_and_tokenizer_name():
    with pytest.raises(CorpusError, match="val_fraction must be in"):
        load_corpus("synthetic:2000", val_fraction=1.0)
    with pytest.raises(CorpusError, match="tokenizer must be"):
        load_corpus("synthetic:2000", tokenizer="wordpiece")


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None,
                    reason="tokenizers is installed")
def test_bpe_without_tokenizers_names_the_missing_extra():
    with pytest.raises(CorpusError, match=r"tokenizers.*pip install -e '\.\[bpe\]'"):
        load_corpus("synthetic:20000", tokenizer="bpe", bpe_vocab_size=300)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                    reason="needs the optional tokenizers package")
def test_bpe_round_trip(tmp_path):
    corpus = load_corpus("synthetic:20000", tokenizer="bpe", bpe_vocab_size=300)
    assert 256 < corpus.vocab_size <= 300
    text = "def alpha_0(beta, gamma):\n"
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text.encode())) == text
    corpus.tokenizer.save(tmp_path / "tok.json")
    again = load_corpus("synthetic:20000", tokenizer="bpe", tokenizer_path=tmp_path / "tok.json")
    assert torch.equal(again.train, corpus.train)

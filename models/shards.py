"""Token shards: nanoGPT's ``train.bin`` / ``val.bin``, read through ``numpy.memmap``.

A shard folder holds ``train.bin`` and ``val.bin``, flat arrays of little-endian token ids, as
nanoGPT's ``prepare.py`` scripts write them (``uint16``) and as ``python -m models.prepare``
writes them (``uint16``, or ``uint32`` when the vocabulary exceeds 65536 ids) with a
``meta.json`` beside them: ``format``, ``tokenizer`` (``byte`` / ``bpe``, whose
``tokenizer.json`` lies beside), ``vocab_size``, ``dtype``, ``train_tokens``, ``val_tokens``,
``sha256`` of each file, the ``source`` corpus (spec, fingerprint, bytes, files) and, for BPE,
the ``tokenizer_sha256`` of the ``tokenizer.json`` written with the shards.

:func:`open_shards` checks the files against the metadata (sizes, hashes), scans them once in
chunks for the largest id (which must lie inside the vocabulary) and their SHA-256, and opens
them as :class:`TokenFile`: windows are read from the page cache, the corpus is never loaded
whole. Without ``meta.json`` nothing on disk says how wide the ids are (``uint32`` ids of a
small vocabulary read as ``uint16`` give every other id 0, with no error), so the dtype must be
given (``dtype=``, the trainer's ``--shard_dtype``; nanoGPT's ``prepare.py`` scripts write
``uint16``) and such a folder is refused without it; the vocabulary is the largest id + 1 unless
a ``vocab_size`` is given. nanoGPT's ``meta.pkl`` is never unpickled (unpickling runs arbitrary
code). The shards' fingerprint is the SHA-256 of their dtype and both files' SHA-256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from .sources import CorpusError
from .tokenizer import BPETokenizer, ByteTokenizer, IdTokenizer, padded_vocab

__all__ = ["META_FILE", "SCAN_TOKENS", "SHARD_DTYPES", "SHARD_FORMAT", "ShardSet", "TokenFile",
           "open_shards", "recorded_tokenizer", "shard_dtype"]

#: The metadata file ``models.prepare`` writes beside ``train.bin`` / ``val.bin``.
META_FILE = "meta.json"
#: Its ``format`` value.
SHARD_FORMAT = "manifoldlib-token-shards"
#: Tokens per chunk when a shard is scanned or counted (32 MiB of ``uint16``).
SCAN_TOKENS = 1 << 24


class TokenFile:
    """One split of token shards read through ``numpy.memmap``: never loaded whole.

    Offers what the training code asks of a token tensor: ``numel()``, ``len()``, ``t[i]`` (an
    ``int``) and ``t[a:b]`` (an ``int64`` tensor); :class:`models.data.BatchSampler`,
    :func:`models.data.eval_batches` and :func:`models.data.unigram_entropy` read it window by
    window or chunk by chunk.

    Args:
        path: the ``.bin`` file, a flat array of token ids.
        dtype: its numpy dtype (little-endian ``uint16`` or ``uint32``).
    """

    def __init__(self, path: str | os.PathLike, dtype: np.dtype | str) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.array = np.memmap(self.path, dtype=self.dtype, mode="r")  # (N,)

    def numel(self) -> int:
        return int(self.array.shape[0])

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, index: int | slice) -> int | torch.Tensor:
        if isinstance(index, slice):
            return torch.from_numpy(self.array[index].astype(np.int64))  # (n,)
        return int(self.array[index])

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r}, {self.dtype.name}, {self.numel():,} tokens)"


_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
#: The dtypes token shards may hold (little-endian).
SHARD_DTYPES = tuple(_DTYPES)


def shard_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id of the vocabulary fits in 16 bits, else ``"uint32"``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _read_meta(folder: Path) -> dict | None:
    path = folder / META_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT:
        raise CorpusError(f"{path} is not token-shard metadata (no \"format\": "
                          f"\"{SHARD_FORMAT}\"); move it away to read the folder as nanoGPT's")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CorpusError(f"{path}: {key!r} must be a positive integer, got {value!r}")
    for key, accepted in (("dtype", tuple(_DTYPES)), ("tokenizer", ("byte", "bpe"))):
        if meta.get(key) not in accepted:
            raise CorpusError(f"{path}: {key!r} must be one of {list(accepted)}, "
                              f"got {meta.get(key)!r}")
    for key in ("sha256", "source"):
        if not isinstance(meta.setdefault(key, {}), dict):
            raise CorpusError(f"{path}: {key!r} must be an object, got {meta[key]!r}")
    if not isinstance(meta.get("tokenizer_sha256", ""), str):
        raise CorpusError(f"{path}: 'tokenizer_sha256' must be a string, "
                          f"got {meta['tokenizer_sha256']!r}")
    return meta


def recorded_tokenizer(folder: str | os.PathLike) -> str | None:
    """The name of the tokenizer a run on the shard folder uses, read from ``meta.json`` alone
    (no shard is opened): ``"byte"`` or ``"bpe"`` as it records, ``"ids"`` for a folder without
    one (nanoGPT's: ids read as they are, :class:`~models.tokenizer.IdTokenizer`), ``None`` where
    there is no folder (which :func:`open_shards` refuses, naming it).

    Raises:
        CorpusError: a ``meta.json`` that :func:`open_shards` would refuse, with its message.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    meta = _read_meta(folder)
    return IdTokenizer.name if meta is None else meta["tokenizer"]


def _require_shards(folder: Path) -> None:
    for split in ("train", "val"):
        if not (folder / f"{split}.bin").is_file():
            raise CorpusError(f"token shard {folder / f'{split}.bin'} does not exist (a bin: "
                              f"folder holds train.bin and val.bin, as python -m models.prepare "
                              f"or nanoGPT's prepare.py writes them)")


def _count_tokens(path: Path, dtype: np.dtype) -> int:
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise CorpusError(f"token shard {path} is {size} bytes, not a positive whole number of "
                          f"{dtype.name} tokens")
    return size // dtype.itemsize


def _scan(path: Path, dtype: np.dtype) -> tuple[str, int]:
    """SHA-256 and largest id of a shard, read in chunks (never the whole file at once)."""
    array = np.memmap(path, dtype=dtype, mode="r")  # (N,)
    digest, top = hashlib.sha256(), 0
    for start in range(0, array.shape[0], SCAN_TOKENS):
        chunk = np.ascontiguousarray(array[start:start + SCAN_TOKENS])
        digest.update(chunk.data)
        top = max(top, int(chunk.max()))
    return digest.hexdigest(), top


def _shard_tokenizer(folder: Path, meta: dict | None, vocab: int):
    if meta is None:
        return IdTokenizer(vocab)
    if meta["tokenizer"] == "byte":
        tok = ByteTokenizer()
    else:
        tok = BPETokenizer.load(folder / str(meta.get("tokenizer_file", "tokenizer.json")))
        _check_tokenizer_file(folder, meta, tok)
    if tok.vocab_size != meta["vocab_size"]:
        raise CorpusError(f"{folder / META_FILE} says vocab_size {meta['vocab_size']} but its "
                          f"{tok.name} tokenizer has {tok.vocab_size}")
    return tok


def _check_tokenizer_file(folder: Path, meta: dict, tok: BPETokenizer) -> None:
    """Refuse a ``tokenizer.json`` that is not the file ``models.prepare`` wrote with the shards
    (its SHA-256 differs from ``meta.json``'s ``tokenizer_sha256``): the shards' hashes cover
    the ids, not the text they decode to, so an edited decoder or vocabulary entry would train
    and sample without a word. A ``meta.json`` written before the digest was recorded is not
    checked."""
    recorded = meta.get("tokenizer_sha256")
    if recorded is None or recorded == tok.sha256:
        return
    raise CorpusError(f"tokenizer file {tok.path} changed since {folder / META_FILE} was written "
                      f"(SHA-256 {tok.sha256[:12]} != {recorded[:12]}, which it records): the "
                      f"shards' token ids were made with that file, so a run would decode them "
                      f"otherwise; restore it, or prepare the shards again with "
                      f"python -m models.prepare")


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """An opened shard folder.

    Attributes:
        folder: the folder.
        train: ``train.bin`` as a :class:`TokenFile`.
        val: ``val.bin`` as a :class:`TokenFile`.
        tokenizer: from ``meta.json`` (``ByteTokenizer`` / ``BPETokenizer``), else ``IdTokenizer``.
        vocab_size: the model's vocabulary (see :func:`open_shards`).
        fingerprint: SHA-256 of the dtype and of both files' SHA-256.
        sha256: each file's SHA-256, by split.
        meta: the metadata, ``None`` for nanoGPT shards.
        notes: one-line remarks for the user (where an assumed vocabulary came from).
    """

    folder: Path
    train: TokenFile
    val: TokenFile
    tokenizer: object
    vocab_size: int
    fingerprint: str
    sha256: dict
    meta: dict | None
    notes: tuple[str, ...]


def _scan_split(folder: Path, split: str, dtype: np.dtype, meta: dict | None) -> tuple[str, int]:
    path = folder / f"{split}.bin"
    n = _count_tokens(path, dtype)
    if meta is not None and n != meta[f"{split}_tokens"]:
        raise CorpusError(f"token shard {path} holds {n} {dtype.name} tokens but "
                          f"{folder / META_FILE} says {meta[f'{split}_tokens']}")
    digest, top = _scan(path, dtype)
    recorded = (meta or {}).get("sha256", {}).get(split, digest)
    if recorded != digest:
        raise CorpusError(f"token shard {path} changed since {folder / META_FILE} was "
                          f"written (SHA-256 {digest[:12]} != {str(recorded)[:12]})")
    return digest, top


def _shard_vocab(folder: Path, meta: dict | None, vocab_size: int | None, top: int,
                 dtype: np.dtype) -> tuple[int, str, tuple[str, ...]]:
    """(vocabulary, where it came from, notes)."""
    if meta is not None:
        vocab = padded_vocab(meta["vocab_size"], vocab_size, f"token shards {folder}")
        return vocab, META_FILE if vocab_size is None else "the vocab_size given", ()
    read_as = f"{folder} has no {META_FILE}: read as nanoGPT shards ({dtype.name} ids as given)"
    if vocab_size is None:
        vocab = top + 1
        note = (f"{read_as}, vocabulary size {vocab} = the largest token id + 1; pass "
                f"--vocab_size N to set it")
        return vocab, "the largest token id + 1", (note,)
    vocab = padded_vocab(1, vocab_size, f"token shards {folder}")
    return vocab, "the vocab_size given", (f"{read_as}, vocabulary size {vocab} as given",)


def _shard_dtype(folder: Path, meta: dict | None, dtype: str | None) -> np.dtype:
    """The dtype ``meta.json`` records, which a given ``dtype`` must match; without
    ``meta.json``, the given one: the files alone do not say how wide their ids are."""
    if dtype is not None and dtype not in _DTYPES:
        raise CorpusError(f"shard dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if meta is not None:
        if dtype is not None and dtype != meta["dtype"]:
            raise CorpusError(f"shard dtype {dtype} was given, but {folder / META_FILE} records "
                              f"{meta['dtype']}; drop --shard_dtype to read what it records")
        return _DTYPES[meta["dtype"]]
    if dtype is None:
        raise CorpusError(f"token shards {folder} have no {META_FILE}, so the width of their ids "
                          f"is unknown (uint32 ids read as uint16 would be wrong without any "
                          f"error); pass --shard_dtype uint16 (what nanoGPT's prepare.py "
                          f"writes) or --shard_dtype uint32, or write the folder with "
                          f"python -m models.prepare, which records it")
    return _DTYPES[dtype]


def open_shards(folder: str | os.PathLike, vocab_size: int | None = None,
                dtype: str | None = None) -> ShardSet:
    """Check and open a shard folder (see the module docstring).

    Args:
        folder: the folder holding ``train.bin`` and ``val.bin``.
        vocab_size: the model's vocabulary: at least the tokenizer's (padding it, as nanoGPT
            pads GPT-2's 50257 to 50304); for nanoGPT shards, the vocabulary itself (default:
            the largest token id + 1).
        dtype: the ids' dtype, ``"uint16"`` or ``"uint32"``: required for a folder without
            ``meta.json`` (nanoGPT's ``prepare.py`` writes ``uint16``); with one, it must be the
            dtype ``meta.json`` records (``None``: take that one).

    Raises:
        CorpusError: a missing folder or file, a folder without ``meta.json`` and no ``dtype``,
            unreadable or inconsistent metadata (a ``dtype`` that disagrees with it included), a
            file whose size or hash disagrees with it, a token id outside the vocabulary.
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise CorpusError(f"token-shard folder {folder} does not exist" if not folder.exists()
                          else f"{folder} is not a folder (bin: takes the folder holding "
                               f"train.bin and val.bin)")
    meta = _read_meta(folder)
    _require_shards(folder)
    dtype = _shard_dtype(folder, meta, dtype)
    scans = {split: _scan_split(folder, split, dtype, meta) for split in ("train", "val")}
    top = max(t for _, t in scans.values())
    vocab, source, notes = _shard_vocab(folder, meta, vocab_size, top, dtype)
    for split, (_, t) in scans.items():
        if t >= vocab:
            raise CorpusError(f"token shard {folder / f'{split}.bin'} holds token id {t}, "
                              f"outside the vocabulary of {vocab} (from {source})")
    sha = {split: digest for split, (digest, _) in scans.items()}
    fingerprint = hashlib.sha256(f"{dtype.name}:{sha['train']}:{sha['val']}".encode())
    return ShardSet(folder=folder, train=TokenFile(folder / "train.bin", dtype),
                    val=TokenFile(folder / "val.bin", dtype),
                    tokenizer=_shard_tokenizer(folder, meta, vocab), vocab_size=vocab,
                    fingerprint=fingerprint.hexdigest(), sha256=sha, meta=meta, notes=notes)

"""Tokenizers of the reference GPT's corpora, and the one way documents become a token sequence.

``ByteTokenizer`` (vocabulary 256), ``BPETokenizer`` (byte-level BPE trained locally with the
optional ``tokenizers`` package, or a user's ``tokenizer.json``; nothing is downloaded) and
``IdTokenizer`` (ids whose text is unknown: nanoGPT shards). :func:`encode_pieces` turns a
split's documents into its tokens: each document encoded on its own, consecutive documents
joined by the tokens of a newline. Both the in-memory path (``models.data.load_corpus``) and
``models.prepare`` use it, so prepared shards hold exactly the in-memory tokens.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import numpy as np

from .sources import CorpusError
from .storage import atomic_write

__all__ = ["BPETokenizer", "ByteTokenizer", "IdTokenizer", "encode_pieces", "padded_vocab"]

_DOC_SEPARATOR = b"\n"




class Tokenizer(Protocol):
    """What the training loop and ``models.prepare`` need from a tokenizer."""

    name: str
    vocab_size: int
    #: SHA-256 of the ``tokenizer.json`` that defines it (``None``: bytes or ids, nothing to read)
    sha256: str | None
    #: the file it was read from (``None``: built in memory)
    path: Path | None

    def encode(self, data: bytes) -> list[int]: ...

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: ``vocab_size = 256``, lossless, nothing to train or save."""

    name = "byte"
    vocab_size = 256
    sha256 = path = None

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        """Each document's bytes as a ``uint8`` array (no copy through Python lists)."""
        return [np.frombuffer(d, dtype=np.uint8) for d in docs]

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        """Nothing to save for bytes."""


class IdTokenizer:
    """Token ids whose text is unknown: a nanoGPT shard folder without ``meta.json``.

    nanoGPT keeps its vocabulary in a pickle, which is never loaded, so text cannot be encoded
    (:meth:`encode` returns no ids) and :meth:`decode` prints the ids.
    """

    name = "ids"
    sha256 = path = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def encode(self, data: bytes) -> list[int]:
        return []

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        raise CorpusError("token shards without meta.json have no tokenizer to encode text with")

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def save(self, path: Path) -> None:
        """Nothing to save: the vocabulary is unknown."""


class BPETokenizer:
    """A byte-level BPE trained locally with the optional ``tokenizers`` package (extra ``bpe``).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        path: the ``tokenizer.json`` it was read from (:meth:`load`).
        sha256: that file's SHA-256; default: that of :meth:`to_json`, the file :meth:`save`
            writes. A run records it, and a resume refuses a tokenizer file that no longer has
            it (the ids would decode otherwise).
    """

    name = "bpe"

    def __init__(self, tokenizer, path: Path | None = None, sha256: str | None = None) -> None:
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size())
        self.path = path
        self.sha256 = sha256 or hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    @staticmethod
    def _module():
        try:
            import tokenizers
        except ImportError as exc:
            raise CorpusError(
                "tokenizer='bpe' needs the optional 'tokenizers' package, which is not installed "
                f"({exc}); install it with: pip install -e '.[bpe]'") from None
        return tokenizers

    @classmethod
    def train(cls, documents: Iterable[bytes], vocab_size: int, progress: bool = False
              ) -> BPETokenizer:
        """Train on ``documents`` (decoded as UTF-8, invalid bytes replaced), locally.

        A text with fewer distinct merges than ``vocab_size`` asks for gives a smaller
        vocabulary (the one the run then has): a :class:`RuntimeWarning` names both sizes, so
        that runs asking for different sizes are not taken for different tokenizers."""
        tk = cls._module()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=progress,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((d.decode("utf-8", errors="replace") for d in documents),
                                trainer=trainer)
        trained = cls(tok)
        if trained.vocab_size < vocab_size:
            warnings.warn(f"the BPE trained {trained.vocab_size} ids of the {vocab_size} asked: the "
                          f"training text holds no more merges, so the vocabulary is "
                          f"{trained.vocab_size} (a larger size gives the same tokenizer)",
                          RuntimeWarning, stacklevel=2)
        return trained

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        """A saved ``tokenizer.json`` (ours or any ``tokenizers`` file), with the SHA-256 of its
        bytes; missing or bad: error."""
        tk = cls._module()
        path = Path(path)
        if not path.is_file():
            raise CorpusError(f"tokenizer file {path} does not exist")
        try:
            data = path.read_bytes()  # one read: the digest is of the text the tokenizer is
            return cls(tk.Tokenizer.from_str(data.decode("utf-8")), path,
                       hashlib.sha256(data).hexdigest())
        except Exception as exc:  # noqa: BLE001 -- tokenizers raises a bare Exception
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CorpusError(f"tokenizer file {path} cannot be read: {first}") from None

    def encode(self, data: bytes) -> list[int]:
        return self._tok.encode(data.decode("utf-8", errors="replace")).ids

    def encode_many(self, docs: list[bytes]) -> list[np.ndarray]:
        """Each document encoded on its own (in parallel by ``tokenizers``), as ``int64`` arrays."""
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (what ``tokenizers``' own pretty ``save`` writes)."""
        return self._tok.to_str(pretty=True)

    def save(self, path: Path) -> None:
        """Write :meth:`to_json` to ``path`` atomically (:func:`~models.storage.atomic_write`).

        Raises:
            OSError: naming ``path``; a full disk leaves no truncated file behind (``tokenizers``'
                own ``save`` writes in place and raises a bare ``Exception``).
        """
        atomic_write(path, self.to_json().encode("utf-8"))


def encode_pieces(tokenizer: Tokenizer, pieces: Iterable[tuple[bool, bytes]],
                  batch_bytes: int = 1 << 22) -> Iterator[tuple[bool, np.ndarray]]:
    """Token ids of each split, in order: the pieces of a split joined by a newline's tokens.

    Every piece is encoded on its own (``tokenizer.encode_many`` over batches of about
    ``batch_bytes``), and the separator's ids come before each piece but the first of its
    split. For bytes this is exactly the bytes of ``b"\\n".join(pieces)``.

    Yields:
        ``(is_validation, ids)``: consecutive parts of each split's token sequence.
    """
    sep = tokenizer.encode_many([_DOC_SEPARATOR])[0]
    started = {False: False, True: False}  # has the split received a piece yet?
    batch: list[tuple[bool, bytes]] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[1])
        if size >= batch_bytes:
            yield from _encode_batch(tokenizer, batch, sep, started)
            batch, size = [], 0
    yield from _encode_batch(tokenizer, batch, sep, started)


def _encode_batch(tokenizer: Tokenizer, batch: list[tuple[bool, bytes]], sep: np.ndarray,
                  started: dict[bool, bool]) -> Iterator[tuple[bool, np.ndarray]]:
    for (is_val, _), ids in zip(batch, tokenizer.encode_many([p for _, p in batch])):
        if started[is_val]:
            yield is_val, sep
        started[is_val] = True
        yield is_val, ids


def padded_vocab(tokenizer_vocab: int, vocab_size: int | None, where: str) -> int:
    """The tokenizer's vocabulary, or ``vocab_size`` when it pads it."""
    if vocab_size is None:
        return tokenizer_vocab
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise CorpusError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    if vocab_size < tokenizer_vocab:
        raise CorpusError(f"vocab_size {vocab_size} is smaller than the vocabulary of {where}'s "
                          f"tokenizer ({tokenizer_vocab})")
    return vocab_size

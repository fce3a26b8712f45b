"""Corpora for the reference GPT: read locally, tokenized, split by file, fingerprinted.

Three sources, named by a *corpus spec* string:

- ``"stdlib"`` (the default): the running Python's own standard-library source, every ``*.py``
  file under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages`` / ``dist-packages`` and
  test folders (``test``, ``tests``, ``idle_test``), read at run time in sorted order as bytes.
  Present on every machine, real text, nothing downloaded.
- ``"file:PATH"``: a user's text file, or every file of a folder (recursively, sorted, hidden
  files and folders skipped).
- ``"synthetic"`` or ``"synthetic:NBYTES"``: a small deterministic Python-like corpus for tests.

Tokens are bytes (vocabulary 256) unless a BPE tokenizer is asked for (``tokenizer="bpe"``,
trained locally with the optional ``tokenizers`` package). The train/validation split is by
file: a file belongs to validation when a hash of its relative path falls below
``val_fraction``, so the split is deterministic and does not move when other files change. A
single-file corpus is split by position instead (the last ``val_fraction`` of its bytes).

The fingerprint is the SHA-256 of every file's relative path, length and contents in order; it
is recorded with every run because the stdlib differs between Python versions.

Every problem with the user's input raises :class:`CorpusError`, whose message is one line that
names the path and the problem; the training CLI prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

__all__ = [
    "EXCLUDED_DIRS",
    "BPETokenizer",
    "BatchSampler",
    "ByteTokenizer",
    "Corpus",
    "CorpusError",
    "check_size",
    "eval_batches",
    "load_corpus",
    "stdlib_files",
    "synthetic_documents",
    "unigram_entropy",
]

#: Folder names never read from the stdlib: installed packages and test suites.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})

_SYNTHETIC_DEFAULT_BYTES = 200_000
_DOC_SEPARATOR = b"\n"


class CorpusError(ValueError):
    """A corpus that cannot be used: missing or empty path, too small, unknown spec."""


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


class Tokenizer(Protocol):
    """What the training loop needs from a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, data: bytes) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Bytes as tokens: ``vocab_size = 256``, lossless, nothing to train or save."""

    name = "byte"
    vocab_size = 256

    def encode(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        """Nothing to save for bytes."""


class BPETokenizer:
    """A byte-level BPE trained locally with the optional ``tokenizers`` package (extra ``bpe``).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
    """

    name = "bpe"

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size())

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
    def train(cls, documents: list[bytes], vocab_size: int) -> BPETokenizer:
        """Train on ``documents`` (decoded as UTF-8, invalid bytes replaced)."""
        tk = cls._module()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((d.decode("utf-8", errors="replace") for d in documents),
                                trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        tk = cls._module()
        return cls(tk.Tokenizer.from_file(str(path)))

    def encode(self, data: bytes) -> list[int]:
        return self._tok.encode(data.decode("utf-8", errors="replace")).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def save(self, path: Path) -> None:
        self._tok.save(str(path))


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The stdlib ``*.py`` files used as the default corpus, sorted by relative path.

    Args:
        root: the stdlib directory; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns:
        Absolute paths, with no file below ``site-packages``, ``dist-packages`` or a test folder.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    return _walk(root, suffix=".py", skip=EXCLUDED_DIRS)


def _walk(root: Path, suffix: str | None, skip: frozenset[str] = frozenset()) -> list[Path]:
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        # pruning in place keeps os.walk out of site-packages (thousands of files) entirely
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        for name in files:
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            found.append(Path(folder) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def synthetic_documents(n_bytes: int = _SYNTHETIC_DEFAULT_BYTES, seed: int = 0) -> list[bytes]:
    """A deterministic Python-like corpus of small "files", for tests.

    It has learnable structure (keywords, indentation, repeated identifiers), so a tiny model's
    loss falls quickly below the unigram entropy.

    Args:
        n_bytes: approximate total size in bytes (> 0).
        seed: generator seed.
    """
    if n_bytes <= 0:
        raise CorpusError(f"synthetic corpus size must be > 0 bytes, got {n_bytes}")
    rng = random.Random(seed)  # the stdlib generator: fast per draw, stable across versions
    names = ["alpha", "beta", "gamma", "delta", "value", "count", "items", "total", "left", "right"]
    ops = ["+", "-", "*", "//"]
    pick = rng.choice

    docs: list[bytes] = []
    total = 0
    while total < n_bytes:
        lines = []
        for k in range(rng.randint(2, 5)):
            a, b = pick(names), pick(names)
            lines.append(f"def {pick(names)}_{k}({a}, {b}):")
            lines.append(f"    if {a} > {b}:")
            lines.append(f"        return {a} {pick(ops)} {b}")
            lines.append(f"    return {b} {pick(ops)} {rng.randint(0, 9)}")
            lines.append("")
        doc = ("\n".join(lines) + "\n").encode()
        docs.append(doc)
        total += len(doc)
    return docs


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus with its train/validation split.

    Attributes:
        spec: the corpus spec it was loaded from (``"stdlib"``, ``"file:PATH"``, ...).
        train: training tokens, shape ``(N_train,)``, ``torch.uint8`` for bytes else ``int32``.
        val: validation tokens, shape ``(N_val,)``.
        tokenizer: the tokenizer (``ByteTokenizer`` or ``BPETokenizer``).
        fingerprint: SHA-256 hex digest of the files (relative path, length, contents).
        n_train_files: number of files (documents) in the training split.
        n_val_files: number of files (documents) in the validation split.
        n_bytes: total raw bytes read.
    """

    spec: str
    train: torch.Tensor
    val: torch.Tensor
    tokenizer: object
    fingerprint: str
    n_train_files: int
    n_val_files: int
    n_bytes: int

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def describe(self) -> dict:
        """Plain-data description, recorded in the run directory."""
        return {"spec": self.spec, "fingerprint": self.fingerprint,
                "tokenizer": self.tokenizer.name, "vocab_size": self.vocab_size,
                "train_tokens": int(self.train.numel()), "val_tokens": int(self.val.numel()),
                "train_files": self.n_train_files, "val_files": self.n_val_files,
                "bytes": self.n_bytes}


def _read_documents(spec: str) -> tuple[list[str], list[bytes]]:
    """(relative names, contents) of the documents named by ``spec``, in sorted order."""
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        if not files:
            raise CorpusError(f"stdlib corpus: no *.py files found under {root}")
        return [f.relative_to(root).as_posix() for f in files], [f.read_bytes() for f in files]
    if spec == "synthetic" or spec.startswith("synthetic:"):
        size = spec.partition(":")[2]
        try:
            n_bytes = int(size) if size else _SYNTHETIC_DEFAULT_BYTES
        except ValueError:
            raise CorpusError(f"corpus {spec!r}: expected 'synthetic' or 'synthetic:NBYTES' "
                              f"with an integer NBYTES") from None
        docs = synthetic_documents(n_bytes)
        return [f"doc{i:05d}" for i in range(len(docs))], docs
    if spec.startswith("file:"):
        raw = spec[len("file:"):]
        if not raw:
            raise CorpusError("corpus 'file:' needs a path, e.g. file:notes.txt or file:src/")
        path = Path(raw).expanduser()
        if not path.exists():
            raise CorpusError(f"corpus path {path} does not exist")
        if path.is_file():
            return [path.name], [path.read_bytes()]
        files = _walk(path, suffix=None)
        if not files:
            raise CorpusError(f"corpus folder {path} contains no files")
        return [f.relative_to(path).as_posix() for f in files], [f.read_bytes() for f in files]
    raise CorpusError(f"unknown corpus {spec!r}; expected 'stdlib', 'file:PATH' or "
                      f"'synthetic[:NBYTES]'")


def _fingerprint(names: list[str], docs: list[bytes]) -> str:
    h = hashlib.sha256()
    for name, doc in zip(names, docs):
        h.update(name.encode("utf-8", errors="surrogateescape"))
        h.update(b"\0")
        h.update(len(doc).to_bytes(8, "little"))
        h.update(doc)
    return h.hexdigest()


def _is_validation(name: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(name.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


def _split(names: list[str], docs: list[bytes], val_fraction: float
           ) -> tuple[list[bytes], list[bytes]]:
    """Split documents by a hash of their names; a single document is split by position."""
    if len(docs) == 1:
        cut = int(round(len(docs[0]) * (1.0 - val_fraction)))
        return [docs[0][:cut]], [docs[0][cut:]]
    is_val = [_is_validation(n, val_fraction) for n in names]
    # a hash split can leave one side empty on tiny corpora: move the last / first document
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val


def _to_tensor(ids: list[int] | bytes, vocab_size: int) -> torch.Tensor:
    if isinstance(ids, (bytes, bytearray)):
        return torch.frombuffer(bytearray(ids), dtype=torch.uint8)  # (N,)
    dtype = torch.uint8 if vocab_size <= 256 else torch.int32
    return torch.tensor(ids, dtype=dtype)  # (N,)


def load_corpus(spec: str = "stdlib", *, val_fraction: float = 0.1, tokenizer: str = "byte",
                bpe_vocab_size: int = 1024, tokenizer_path: str | os.PathLike | None = None
                ) -> Corpus:
    """Read, split, fingerprint and tokenize a corpus.

    Args:
        spec: ``"stdlib"``, ``"file:PATH"`` or ``"synthetic[:NBYTES]"``.
        val_fraction: share of files (or of bytes, for a single file) held out, in ``(0, 1)``.
        tokenizer: ``"byte"`` (vocabulary 256) or ``"bpe"`` (needs ``tokenizers``).
        bpe_vocab_size: BPE vocabulary size (> 256) when training a BPE.
        tokenizer_path: a saved BPE ``tokenizer.json`` to load instead of training one (used
            by ``--resume``, so a resumed run tokenizes exactly as before).

    Raises:
        CorpusError: unknown spec, missing or empty path, empty split, missing ``tokenizers``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if tokenizer not in ("byte", "bpe"):
        raise CorpusError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    names, docs = _read_documents(spec)
    n_bytes = sum(len(d) for d in docs)
    if n_bytes == 0:
        raise CorpusError(f"corpus {spec!r} is empty (0 bytes)")
    fingerprint = _fingerprint(names, docs)
    train_docs, val_docs = _split(names, docs, val_fraction)
    train_bytes = _DOC_SEPARATOR.join(train_docs)
    val_bytes = _DOC_SEPARATOR.join(val_docs)
    if not val_bytes or not train_bytes:
        raise CorpusError(f"corpus {spec!r} is too small to split into train and validation "
                          f"({n_bytes} bytes)")
    if tokenizer == "byte":
        tok = ByteTokenizer()
        train, val = _to_tensor(train_bytes, 256), _to_tensor(val_bytes, 256)
    else:
        if tokenizer_path is not None:
            tok = BPETokenizer.load(Path(tokenizer_path))
        else:
            if bpe_vocab_size <= 256:
                raise CorpusError(f"bpe_vocab_size must be > 256, got {bpe_vocab_size}")
            tok = BPETokenizer.train(train_docs, bpe_vocab_size)
        train = _to_tensor(tok.encode(train_bytes), tok.vocab_size)
        val = _to_tensor(tok.encode(val_bytes), tok.vocab_size)
    return Corpus(spec=spec, train=train, val=val, tokenizer=tok, fingerprint=fingerprint,
                  n_train_files=len(train_docs), n_val_files=len(val_docs), n_bytes=n_bytes)


def check_size(corpus: Corpus, batch_size: int, block_size: int) -> None:
    """Raise :class:`CorpusError` unless each split holds at least one batch of sequences.

    Training needs ``batch_size * block_size + 1`` tokens (one batch of disjoint sequences plus
    the shifted target); validation needs ``block_size + 1``.
    """
    need_train = batch_size * block_size + 1
    if corpus.train.numel() < need_train:
        raise CorpusError(
            f"corpus {corpus.spec!r} is smaller than one batch: its training split has "
            f"{corpus.train.numel()} tokens, batch_size*block_size+1 = {need_train} needed")
    if corpus.val.numel() < block_size + 1:
        raise CorpusError(
            f"corpus {corpus.spec!r} is too small: its validation split has "
            f"{corpus.val.numel()} tokens, block_size+1 = {block_size + 1} needed")


def unigram_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    """Entropy in nats of the tokens' empirical unigram distribution.

    The loss of the best model that ignores context: a model that learns anything about
    context gets below it.
    """
    counts = torch.bincount(tokens.long(), minlength=vocab_size).double()
    prob = counts[counts > 0] / counts.sum()
    return float(-(prob * prob.log()).sum())


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def _windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(block_size + 1)
    chunk = tokens[starts[:, None] + offsets].long()  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


class BatchSampler:
    """Random training windows with a resumable random state.

    Each call of :meth:`next_batch` draws ``batch_size`` start offsets uniformly from
    ``[0, N - block_size - 1]`` with its own ``torch.Generator`` (seeded from ``seed`` and the
    rank; ``models.train`` passes ``rank=0`` on every rank so all ranks draw the same global batch
    and each keeps its slice), and returns inputs and next-token targets.
    :meth:`state_dict` / :meth:`load_state_dict` capture the generator state and the number of
    batches drawn, which is what ``--resume`` needs to continue the same data order.

    Args:
        tokens: ``(N,)`` token tensor.
        batch_size: sequences per batch on this rank.
        block_size: sequence length ``T``.
        seed: base seed.
        rank: this process's rank (0 without distributed training).
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int,
                 rank: int = 0) -> None:
        if tokens.numel() < block_size + 1:
            raise CorpusError(f"need at least block_size+1 = {block_size + 1} tokens, "
                              f"got {tokens.numel()}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.position = 0  # batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(B, T)`` and targets ``(B, T)``, both int64."""
        high = self.tokens.numel() - self.block_size
        starts = torch.randint(high, (self.batch_size,), generator=self.generator)  # (B,)
        self.position += 1
        return _windows(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.position = int(state["position"])


def eval_batches(tokens: torch.Tensor, batch_size: int, block_size: int, n_batches: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced validation windows: the same batches at every evaluation.

    Uses no random state, so evaluating never perturbs training (which keeps ``--resume``
    exact) and successive validation losses are comparable.
    """
    high = tokens.numel() - block_size - 1
    total = batch_size * n_batches
    starts = torch.linspace(0, max(high, 0), total).round().long()  # (n_batches * B,)
    for i in range(n_batches):
        yield _windows(tokens, starts[i * batch_size:(i + 1) * batch_size], block_size)


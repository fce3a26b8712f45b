"""Text sources of the reference GPT's corpora: which documents, in which order, in which split.

Three text corpus specs (``models.data`` adds ``bin:DIR``, token shards):

- ``"stdlib"`` (the default): the running Python's own standard-library source, every ``*.py``
  file under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages`` / ``dist-packages`` and
  test folders (``test``, ``tests``, ``idle_test``), read at run time in sorted order as bytes.
  Present on every machine, real text, nothing downloaded.
- ``"file:PATH"``: a user's text file, or every file of a folder (recursively, sorted, hidden
  files and folders skipped).
- ``"synthetic"`` or ``"synthetic:NBYTES"``: a small deterministic Python-like corpus for tests.

Files are read one at a time (:class:`Documents`), so a large folder streams. The split is by
file: a file belongs to validation when a hash of its relative path falls below
``val_fraction``, so the split is deterministic and does not move when other files change. A
single-file corpus is split by position instead (the last ``val_fraction`` of its bytes). The
fingerprint is the SHA-256 of every file's relative path, length and contents in order.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "EXCLUDED_DIRS",
    "CorpusError",
    "Documents",
    "Fingerprint",
    "check_split",
    "list_documents",
    "split_pieces",
    "stdlib_files",
    "synthetic_documents",
]

#: Folder names never read from the stdlib: installed packages and test suites.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})

_SYNTHETIC_DEFAULT_BYTES = 200_000


class CorpusError(ValueError):
    """A corpus that cannot be used: missing or empty path, too small, unknown spec, bad shards.

    Its message is one line that names the path and the problem; the CLIs print it without a
    traceback.
    """


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


class Documents:
    """The documents of a text corpus spec, in sorted order, read one at a time.

    Files are read only when :meth:`read` asks for them, so ``models.prepare`` streams a large
    folder instead of holding it in memory.

    Attributes:
        spec: the corpus spec.
        names: relative names (file paths relative to the root, or ``docNNNNN``).
        sizes: sizes in bytes at listing time (for progress bars).
    """

    def __init__(self, spec: str, names: list[str], sizes: list[int],
                 paths: list[Path] | None = None, contents: list[bytes] | None = None) -> None:
        self.spec, self.names, self.sizes = spec, names, sizes
        self._paths, self._contents = paths, contents

    def __len__(self) -> int:
        return len(self.names)

    def read(self, i: int) -> bytes:
        return self._contents[i] if self._contents is not None else self._paths[i].read_bytes()


def _from_files(spec: str, root: Path, files: list[Path]) -> Documents:
    return Documents(spec, [f.relative_to(root).as_posix() for f in files],
                     [f.stat().st_size for f in files], paths=files)


def list_documents(spec: str) -> Documents:
    """The documents named by a text corpus spec (``stdlib``, ``file:PATH``, ``synthetic``).

    Raises:
        CorpusError: unknown spec, missing path, empty folder.
    """
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = stdlib_files(root)
        if not files:
            raise CorpusError(f"stdlib corpus: no *.py files found under {root}")
        return _from_files(spec, root, files)
    if spec == "synthetic" or spec.startswith("synthetic:"):
        size = spec.partition(":")[2]
        try:
            n_bytes = int(size) if size else _SYNTHETIC_DEFAULT_BYTES
        except ValueError:
            raise CorpusError(f"corpus {spec!r}: expected 'synthetic' or 'synthetic:NBYTES' "
                              f"with an integer NBYTES") from None
        docs = synthetic_documents(n_bytes)
        return Documents(spec, [f"doc{i:05d}" for i in range(len(docs))],
                         [len(d) for d in docs], contents=docs)
    if spec.startswith("file:"):
        raw = spec[len("file:"):]
        if not raw:
            raise CorpusError("corpus 'file:' needs a path, e.g. file:notes.txt or file:src/")
        path = Path(raw).expanduser()
        if not path.exists():
            raise CorpusError(f"corpus path {path} does not exist")
        if path.is_file():
            return _from_files(spec, path.parent, [path])
        files = _walk(path, suffix=None)
        if not files:
            raise CorpusError(f"corpus folder {path} contains no files")
        return _from_files(spec, path, files)
    raise CorpusError(f"unknown corpus {spec!r}; expected 'stdlib', 'file:PATH', "
                      f"'synthetic[:NBYTES]' or 'bin:DIR'")


class Fingerprint:
    """SHA-256 of documents fed in order: each one's name, a zero byte, its length, its bytes."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, name: str, doc: bytes) -> None:
        self._hash.update(name.encode("utf-8", errors="surrogateescape"))
        self._hash.update(b"\0")
        self._hash.update(len(doc).to_bytes(8, "little"))
        self._hash.update(doc)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _is_validation(name: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(name.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


def _validation_flags(names: list[str], val_fraction: float) -> list[bool]:
    is_val = [_is_validation(n, val_fraction) for n in names]
    # a hash split can leave one side empty on tiny corpora: move the last / first document
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    return is_val


def split_pieces(docs: Documents, val_fraction: float, fingerprint: Fingerprint | None = None
                 ) -> Iterator[tuple[bool, bytes]]:
    """``(is_validation, bytes)`` for every document, in order, reading each file once.

    Documents go to validation by a hash of their names; a single document is cut by position
    instead (train: the first ``1 - val_fraction`` of its bytes, rounded). Each document is fed
    to ``fingerprint`` whole as it is read.
    """
    is_val = _validation_flags(docs.names, val_fraction) if len(docs) > 1 else None
    for i, name in enumerate(docs.names):
        data = docs.read(i)
        if fingerprint is not None:
            fingerprint.update(name, data)
        if is_val is None:
            cut = round(len(data) * (1.0 - val_fraction))
            yield False, data[:cut]
            yield True, data[cut:]
        else:
            yield is_val[i], data


def check_split(spec: str, n_bytes: int, train_tokens: int, val_tokens: int) -> None:
    """Raise :class:`CorpusError` for an empty corpus or a split without tokens."""
    if n_bytes == 0:
        raise CorpusError(f"corpus {spec!r} is empty (0 bytes)")
    if not train_tokens or not val_tokens:
        raise CorpusError(f"corpus {spec!r} is too small to split into train and validation "
                          f"({n_bytes} bytes)")

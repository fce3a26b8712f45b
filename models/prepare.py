"""Write a corpus as nanoGPT-format token shards, for training at scale with ``--corpus bin:DIR``.

``python -m models.prepare --corpus SPEC --out DIR [--tokenizer byte|bpe] [--vocab_size N]
[--tokenizer_file tokenizer.json] [--val_fraction F] [--overwrite]``

reads the text corpus ``SPEC`` (``stdlib``, ``file:PATH``, ``synthetic[:NBYTES]``) one file at
a time, splits it exactly as ``models.data.load_corpus`` does and writes

- ``DIR/train.bin``, ``DIR/val.bin``: the token ids of each split as a flat little-endian array,
  ``uint16`` (nanoGPT's format) or ``uint32`` when the vocabulary exceeds 65536 ids;
- ``DIR/meta.json``: ``format``, ``tokenizer``, ``vocab_size``, ``dtype``, ``train_tokens``,
  ``val_tokens``, each file's ``sha256``, the ``source`` (spec, fingerprint, bytes, files) and,
  for BPE, ``tokenizer_file`` and its ``tokenizer_sha256``;
- ``DIR/tokenizer.json`` for BPE: trained locally with the ``tokenizers`` package (on the
  training split, ``--vocab_size`` ids, default 1024) or the user's ``--tokenizer_file``
  (which implies ``--tokenizer bpe``).
  Nothing is downloaded.

The tokens equal those ``load_corpus(SPEC)`` holds in memory (the same :func:`encode_pieces`),
so a run on ``bin:DIR`` draws the same batches as a run on ``SPEC`` with the same seed. Files
are written beside their target (``.train.bin.<pid>.partial``, ...) and renamed into place,
``meta.json`` last: a folder with a ``meta.json`` is complete. The partial files a killed run
left (its pid no longer alive) are removed at the next start. A progress bar (``tqdm``, when
installed and on a terminal) follows the tokenization.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from .data import (
    META_FILE,
    BPETokenizer,
    ByteTokenizer,
    CorpusError,
    Documents,
    Fingerprint,
    check_split,
    encode_pieces,
    list_documents,
    shard_dtype,
    split_pieces,
)
from .shards import SHARD_FORMAT
from .storage import describe_os_error, remove_stale_temporaries

__all__ = ["DEFAULT_BPE_VOCAB", "main", "prepare"]

#: BPE vocabulary trained when ``--vocab_size`` is not given (``TrainConfig.bpe_vocab_size``'s).
DEFAULT_BPE_VOCAB = 1024
_OUTPUTS = ("train.bin", "val.bin", META_FILE, "tokenizer.json")


def _tokenizer(name: str, vocab_size: int | None, tokenizer_file: str | os.PathLike | None,
               docs: Documents, val_fraction: float, progress: bool):
    """The byte tokenizer, the user's BPE, or a BPE trained on the training split."""
    if name not in ("byte", "bpe"):
        raise CorpusError(f"tokenizer must be 'byte' or 'bpe', got {name!r}")
    if name == "byte":
        if tokenizer_file is not None:
            raise CorpusError(f"--tokenizer_file {tokenizer_file} needs --tokenizer bpe")
        if vocab_size not in (None, 256):
            raise CorpusError(f"--vocab_size {vocab_size} is for --tokenizer bpe; bytes have 256")
        return ByteTokenizer()
    if tokenizer_file is not None:
        tok = BPETokenizer.load(Path(tokenizer_file))
        if vocab_size is not None and vocab_size != tok.vocab_size:
            raise CorpusError(f"--vocab_size {vocab_size} disagrees with {tokenizer_file}, "
                              f"whose vocabulary has {tok.vocab_size} ids")
        return tok
    vocab = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
    if vocab <= 256:
        raise CorpusError(f"--vocab_size must be > 256 for a BPE, got {vocab}")
    train_docs = (p for is_val, p in split_pieces(docs, val_fraction) if not is_val)
    return BPETokenizer.train(train_docs, vocab, progress=progress)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CorpusError(f"--out {out} exists and is not a folder")
    present = [name for name in _OUTPUTS if (out / name).exists()]
    if present and not overwrite:
        raise CorpusError(f"--out {out} already holds {', '.join(present)}; pass --overwrite "
                          f"to replace them")


class _Tally:
    """Bytes and documents seen per split, and the progress bar they advance."""

    def __init__(self, total_bytes: int, progress: bool) -> None:
        self.bytes = 0
        self.files = {False: 0, True: 0}
        self.bar = None
        if progress:
            try:
                from tqdm import tqdm
            except ImportError:  # the bar is optional (extra "train")
                tqdm = None
            if tqdm is not None:  # disable=None: shown on a terminal only
                self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True,
                                desc="tokenizing", disable=None, file=sys.stderr)

    def count(self, pieces: Iterable[tuple[bool, bytes]]) -> Iterator[tuple[bool, bytes]]:
        for is_val, data in pieces:
            self.bytes += len(data)
            self.files[is_val] += 1
            if self.bar is not None:
                self.bar.update(len(data))
            yield is_val, data

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _partial(out: Path, name: str) -> Path:
    return out / f".{name}.{os.getpid()}.partial"


def _write_partial(out: Path, name: str, data: bytes) -> None:
    """Write ``data`` to the partial file of ``out / name`` (flushed to disk).

    Raises:
        OSError: naming ``out / name`` (ENOSPC, EACCES, ...).
    """
    try:
        with open(_partial(out, name), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(out / name)) from None


def _write_splits(out: Path, tok, pieces: Iterable[tuple[bool, bytes]], dtype: np.dtype
                  ) -> tuple[dict[str, int], dict[str, str]]:
    """Stream the splits' tokens into the partial files: (token counts, SHA-256) by split.

    Raises:
        OSError: naming the shard (``out/train.bin`` or ``out/val.bin``) that could not be
            written; a failed write is not retried when the files are closed.
    """
    names = {False: "train", True: "val"}
    counts = {False: 0, True: 0}
    digests = {False: hashlib.sha256(), True: hashlib.sha256()}
    current = names[False]
    try:
        with contextlib.ExitStack() as stack:
            files = {v: stack.enter_context(open(_partial(out, f"{names[v]}.bin"), "wb"))
                     for v in names}
            for is_val, ids in encode_pieces(tok, pieces):
                data = np.ascontiguousarray(ids, dtype=dtype).tobytes()
                current = names[is_val]
                files[is_val].write(data)
                digests[is_val].update(data)
                counts[is_val] += len(ids)
            for is_val, f in files.items():
                current = names[is_val]
                f.flush()
                os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(out / f"{current}.bin")) from None
    return ({names[v]: counts[v] for v in names},
            {names[v]: digests[v].hexdigest() for v in names})


def prepare(spec: str, out: str | os.PathLike, *, tokenizer: str = "byte",
            vocab_size: int | None = None, tokenizer_file: str | os.PathLike | None = None,
            val_fraction: float = 0.1, overwrite: bool = False, progress: bool = False) -> dict:
    """Tokenize the text corpus ``spec`` into token shards in ``out``; returns the metadata.

    Args:
        spec: ``"stdlib"``, ``"file:PATH"`` or ``"synthetic[:NBYTES]"``.
        out: the folder to write (created if missing).
        tokenizer: ``"byte"`` or ``"bpe"``.
        vocab_size: the BPE vocabulary to train (default 1024; must match a ``tokenizer_file``).
        tokenizer_file: a user's ``tokenizer.json`` to encode with instead of training a BPE.
        val_fraction: share of files (of bytes, for a single file) held out, in ``(0, 1)``.
        overwrite: replace shards already in ``out``.
        progress: show progress bars (``tqdm``, when installed, on a terminal).

    Raises:
        CorpusError: a bad spec or option, an existing output, a corpus too small to split.
        OSError: a write the file system refused (a full disk), naming the file; nothing in
            ``out`` was replaced and no partial file is left.
    """
    if spec.startswith("bin:"):
        raise CorpusError(f"corpus {spec!r} is already token shards; prepare takes a text "
                          f"corpus: 'stdlib', 'file:PATH' or 'synthetic[:NBYTES]'")
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out = Path(out).expanduser()
    _check_out(out, overwrite)
    docs = list_documents(spec)
    tok = _tokenizer(tokenizer, vocab_size, tokenizer_file, docs, val_fraction, progress)
    dtype_name = shard_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, _OUTPUTS)  # the partial files of a killed run
    fingerprint, tally = Fingerprint(), _Tally(sum(docs.sizes), progress)
    try:  # every file is written in full before anything in ``out`` is replaced
        counts, sha = _write_splits(out, tok, tally.count(split_pieces(docs, val_fraction,
                                                                      fingerprint)),
                                    np.dtype("<u2" if dtype_name == "uint16" else "<u4"))
        check_split(spec, tally.bytes, counts["train"], counts["val"])
        meta = {"format": SHARD_FORMAT, "version": 1, "tokenizer": tok.name,
                "vocab_size": tok.vocab_size, "dtype": dtype_name,
                "train_tokens": counts["train"], "val_tokens": counts["val"], "sha256": sha,
                "source": {"spec": spec, "fingerprint": fingerprint.hexdigest(),
                           "bytes": tally.bytes, "train_files": tally.files[False],
                           "val_files": tally.files[True], "val_fraction": val_fraction}}
        if tok.name == "bpe":
            data = tok.to_json().encode("utf-8")
            _write_partial(out, "tokenizer.json", data)
            meta["tokenizer_file"] = "tokenizer.json"
            meta["tokenizer_sha256"] = hashlib.sha256(data).hexdigest()
        _write_partial(out, META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    except BaseException:
        for name in _OUTPUTS:
            _partial(out, name).unlink(missing_ok=True)
        raise
    finally:
        tally.close()
    _publish(out, tok.name == "bpe")
    return meta


def _publish(out: Path, has_tokenizer: bool) -> None:
    """Rename the written partial files into place, ``meta.json`` last (renames need no space)."""
    (out / META_FILE).unlink(missing_ok=True)  # until the new one: the folder is incomplete
    for split in ("train", "val"):
        os.replace(_partial(out, f"{split}.bin"), out / f"{split}.bin")
    if has_tokenizer:
        os.replace(_partial(out, "tokenizer.json"), out / "tokenizer.json")
    else:  # an overwritten BPE folder's tokenizer would no longer describe the shards
        (out / "tokenizer.json").unlink(missing_ok=True)
    os.replace(_partial(out, META_FILE), out / META_FILE)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m models.prepare",
        description="Write a text corpus as token shards (train.bin, val.bin, meta.json) for "
                    "python -m models.train --corpus bin:DIR.")
    parser.add_argument("--corpus", required=True,
                        help="stdlib, file:PATH or synthetic[:NBYTES]")
    parser.add_argument("--out", required=True, help="folder to write the shards to")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte",
                        help="byte (vocabulary 256) or bpe (the tokenizers package); "
                             "default: byte")
    parser.add_argument("--vocab_size", type=int, default=None,
                        help=f"BPE vocabulary to train (default {DEFAULT_BPE_VOCAB})")
    parser.add_argument("--tokenizer_file", default=None,
                        help="encode with this tokenizer.json instead of training a BPE "
                             "(implies --tokenizer bpe)")
    parser.add_argument("--val_fraction", type=float, default=0.1,
                        help="share of files held out for validation (default 0.1)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing shards")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit status (2 for a bad corpus or option, 1 when the file system
    refuses a write: one ``error:`` line naming the path, nothing half-written left behind)."""
    args = _parser().parse_args(argv)
    tokenizer = "bpe" if args.tokenizer_file is not None else args.tokenizer
    try:
        meta = prepare(args.corpus, args.out, tokenizer=tokenizer, vocab_size=args.vocab_size,
                       tokenizer_file=args.tokenizer_file, val_fraction=args.val_fraction,
                       overwrite=args.overwrite, progress=True)
    except CorpusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the environment: a full disk, a folder we may not write, ...
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens "
          f"({meta['dtype']}), {meta['tokenizer']} tokenizer with {meta['vocab_size']} ids, "
          f"source fingerprint {meta['source']['fingerprint'][:12]}; train on it with "
          f"python -m models.train --corpus bin:{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

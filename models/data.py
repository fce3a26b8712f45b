"""Corpora for the reference GPT: text read locally and tokenized, or token shards on disk.

A *corpus spec* string names the source: ``"stdlib"`` (the default: the running Python's
standard-library source), ``"file:PATH"`` (a user's file or folder) and ``"synthetic[:NBYTES]"``
(for tests) are text, read and split by file as :mod:`models.sources` describes and tokenized
as :mod:`models.tokenizer` describes, into in-memory tensors; ``"bin:DIR"`` is token shards
(nanoGPT's ``train.bin`` / ``val.bin``, written by ``python -m models.prepare`` or by nanoGPT),
opened through ``numpy.memmap`` as :mod:`models.shards` describes and never loaded whole.

The training loop sees one interface either way: :func:`load_corpus` returns a :class:`Corpus`;
:class:`BatchSampler` draws random windows with a resumable state, :func:`eval_batches` fixed
ones, both as int64 tensors gathered window by window; :func:`unigram_entropy` counts in chunks.
The windows depend only on the number of tokens and the seed, so shards of a corpus give the
same batches as the corpus in memory.

Every problem with the user's input raises :class:`CorpusError`, whose message is one line that
names the path and the problem; the training CLI prints it without a traceback.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from .shards import (  # noqa: F401
    META_FILE,
    SCAN_TOKENS,
    TokenFile,
    open_shards,
    recorded_tokenizer,
    shard_dtype,
)
from .sources import (  # noqa: F401
    EXCLUDED_DIRS,
    CorpusError,
    Documents,
    Fingerprint,
    check_split,
    list_documents,
    split_pieces,
    stdlib_files,
    synthetic_documents,
)
from .tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    IdTokenizer,
    encode_pieces,
    padded_vocab,
)

if TYPE_CHECKING:
    from .config import TrainConfig

#: The interface of the training loop (defined here). The names imported above from
#: ``models.sources``, ``models.tokenizer`` and ``models.shards`` stay importable from here.
__all__ = [
    "BatchSampler",
    "Corpus",
    "check_given_tokenizer",
    "check_size",
    "eval_batches",
    "load_corpus",
    "resolve_tokenizer",
    "unigram_entropy",
]


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus with its train/validation split.

    Attributes:
        spec: the corpus spec it was loaded from (``"stdlib"``, ``"file:PATH"``, ...).
        train: training tokens, shape ``(N_train,)``: a tensor (``torch.uint8`` for bytes else
            ``int32``) for text corpora, a :class:`TokenFile` for ``bin:`` shards.
        val: validation tokens, shape ``(N_val,)``, the same kind.
        tokenizer: ``ByteTokenizer``, ``BPETokenizer`` or (nanoGPT shards) ``IdTokenizer``.
        fingerprint: SHA-256 hex digest of the files (relative path, length, contents), or of
            the token shards.
        n_train_files: number of files (documents) in the training split (``None``: unknown).
        n_val_files: number of files (documents) in the validation split (``None``: unknown).
        n_bytes: total raw bytes read (``None``: unknown).
        vocab_size: the model's vocabulary size: the tokenizer's, or larger when padded.
        notes: one-line remarks for the user (e.g. where an assumed vocabulary size came from).
        details: more plain data for :meth:`describe` (the shard folder, dtype, source).
        tokens_fingerprint: SHA-256 of the token ids (train, then validation) of a text corpus
            under a BPE tokenizer, whose ids the file fingerprint does not determine (a
            ``tokenizer.json`` edited, a ``tokenizers`` release that encodes differently);
            ``None`` for bytes, where the ids are the bytes, and for shards, whose fingerprint
            covers their files.
    """

    spec: str
    train: torch.Tensor | TokenFile
    val: torch.Tensor | TokenFile
    tokenizer: object
    fingerprint: str
    n_train_files: int | None
    n_val_files: int | None
    n_bytes: int | None
    vocab_size: int
    notes: tuple[str, ...] = ()
    details: dict = dataclasses.field(default_factory=dict)
    tokens_fingerprint: str | None = None

    def describe(self) -> dict:
        """Plain-data description, recorded in the run directory (``tokenizer_sha256``: the
        SHA-256 of a BPE tokenizer's ``tokenizer.json``)."""
        out = {"spec": self.spec, "fingerprint": self.fingerprint,
               "tokenizer": self.tokenizer.name,
               **({"tokenizer_sha256": self.tokenizer.sha256} if self.tokenizer.sha256 else {}),
               "vocab_size": self.vocab_size,
               "train_tokens": len(self.train), "val_tokens": len(self.val),
               "train_files": self.n_train_files, "val_files": self.n_val_files,
               "bytes": self.n_bytes, **self.details}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def _to_tensor(parts: list[np.ndarray], vocab_size: int) -> torch.Tensor:
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)  # (N,)
    dtype = np.uint8 if vocab_size <= 256 else np.int32
    return torch.from_numpy(ids.astype(dtype, copy=False))  # (N,)


def load_corpus(spec: str = "stdlib", *, val_fraction: float = 0.1, tokenizer: str = "auto",
                bpe_vocab_size: int = 1024, tokenizer_path: str | os.PathLike | None = None,
                vocab_size: int | None = None,
                shard_dtype: str | None = None) -> Corpus:  # noqa: F811 - the config key's name
    """Read, split, fingerprint and tokenize a corpus, or open token shards (``bin:DIR``).

    Args:
        spec: ``"stdlib"``, ``"file:PATH"``, ``"synthetic[:NBYTES]"`` or ``"bin:DIR"``.
        val_fraction: share of files (or of bytes, for a single file) held out, in ``(0, 1)``;
            shards were split when they were prepared.
        tokenizer: ``"auto"`` (the corpus's own: bytes for text), ``"byte"`` (vocabulary 256)
            or ``"bpe"`` (needs ``tokenizers``). Shards carry their own tokenizer, which the
            corpus takes whatever this says (``"ids"`` is theirs without ``meta.json``);
            ``"bpe"`` on shards of another tokenizer is an error. The configuration a run
            saves names the one it took (:func:`check_given_tokenizer` refuses another).
        bpe_vocab_size: BPE vocabulary size (> 256) when training a BPE.
        tokenizer_path: a saved BPE ``tokenizer.json`` to load instead of training one (used
            by ``--resume``, so a resumed run tokenizes exactly as before). Shards use the
            ``tokenizer.json`` in their folder.
        vocab_size: the model's vocabulary when it should be larger than the tokenizer's
            (padding, as nanoGPT pads GPT-2's 50257 to 50304); for nanoGPT shards without
            ``meta.json``, the vocabulary (default: the largest token id + 1).
        shard_dtype: for ``bin:`` shards, the ids' dtype (``"uint16"`` / ``"uint32"``): required
            without ``meta.json``, else checked against it (see :func:`models.shards.open_shards`).

    Raises:
        CorpusError: unknown spec, missing or empty path, empty split, missing ``tokenizers``,
            shards without ``meta.json`` and no ``shard_dtype``, shards that disagree with their
            metadata or hold an id outside the vocabulary, a ``shard_dtype`` for a text corpus.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if tokenizer not in ("auto", "byte", "bpe", IdTokenizer.name):
        raise CorpusError(f"tokenizer must be 'auto', 'byte', 'bpe' or (token shards without "
                          f"{META_FILE}) 'ids', got {tokenizer!r}")
    if spec.startswith("bin:"):
        return _load_shards(spec, tokenizer, vocab_size, shard_dtype)
    if shard_dtype is not None:
        raise CorpusError(f"shard_dtype {shard_dtype!r} is for token shards (bin:DIR); corpus "
                          f"{spec!r} is text")
    if tokenizer == IdTokenizer.name:
        raise CorpusError(f"tokenizer 'ids' (token ids read as they are) is for token shards "
                          f"without {META_FILE}; corpus {spec!r} is text: use 'byte' or 'bpe'")
    docs = list_documents(spec)
    fingerprint = Fingerprint()
    pieces = list(split_pieces(docs, val_fraction, fingerprint))
    n_bytes = sum(len(p) for _, p in pieces)
    check_split(spec, n_bytes, 1, 1)
    train_docs = [p for is_val, p in pieces if not is_val]
    if tokenizer in ("auto", "byte"):
        tok = ByteTokenizer()
    elif tokenizer_path is not None:
        tok = BPETokenizer.load(Path(tokenizer_path))
    else:
        if bpe_vocab_size <= 256:
            raise CorpusError(f"bpe_vocab_size must be > 256, got {bpe_vocab_size}")
        tok = BPETokenizer.train(train_docs, bpe_vocab_size)
    vocab = padded_vocab(tok.vocab_size, vocab_size, f"corpus {spec!r}")
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for is_val, ids in encode_pieces(tok, pieces):
        parts[is_val].append(ids)
    train, val = _to_tensor(parts[False], vocab), _to_tensor(parts[True], vocab)
    check_split(spec, n_bytes, train.numel(), val.numel())
    return Corpus(spec=spec, train=train, val=val, tokenizer=tok,
                  fingerprint=fingerprint.hexdigest(), n_train_files=len(train_docs),
                  n_val_files=len(pieces) - len(train_docs), n_bytes=n_bytes, vocab_size=vocab,
                  tokens_fingerprint=None if tok.name == "byte" else _token_digest(train, val))


def _token_digest(*parts: torch.Tensor) -> str:
    """SHA-256 of the ids of ``parts`` in order (their bytes in native order, no copy)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(memoryview(part.contiguous().numpy()).cast("B"))
    return digest.hexdigest()


def _load_shards(spec: str, tokenizer: str, vocab_size: int | None, dtype: str | None
                 ) -> Corpus:
    raw = spec[len("bin:"):]
    if not raw:
        raise CorpusError("corpus 'bin:' needs a folder, e.g. bin:data/shards")
    shards = open_shards(raw, vocab_size, dtype)
    if tokenizer == "bpe" and shards.tokenizer.name != "bpe":
        raise CorpusError(f"tokenizer 'bpe' was asked for, but the token shards "
                          f"{shards.folder} were made with the {shards.tokenizer.name!r} tokenizer")
    source = (shards.meta or {}).get("source", {})
    details = {"shards": {"folder": str(shards.folder), "dtype": shards.train.dtype.name,
                          "metadata": shards.meta is not None, "sha256": shards.sha256,
                          "source": source}}
    return Corpus(spec=spec, train=shards.train, val=shards.val, tokenizer=shards.tokenizer,
                  fingerprint=shards.fingerprint, n_train_files=source.get("train_files"),
                  n_val_files=source.get("val_files"), n_bytes=source.get("bytes"),
                  vocab_size=shards.vocab_size, notes=shards.notes, details=details)


def check_given_tokenizer(spec: str, tokenizer: str, label: str, *,
                          advice: str | None = None) -> None:
    """Refuse a tokenizer named for token shards of another one.

    Token shards carry their tokenizer: a run on ``bin:DIR`` reads them with the one their
    ``meta.json`` records (:func:`models.shards.recorded_tokenizer`), whatever ``tokenizer``
    says, so ``--tokenizer byte`` on BPE shards would train on BPE ids under a configuration
    that says bytes. ``auto`` (the default: the shards' own), a text corpus, shards of the same
    tokenizer and a folder that does not exist (refused when it is opened) pass; nanoGPT shards
    (no ``meta.json``) hold ids of no known tokenizer and take ``ids`` only. Reads
    ``meta.json`` only, so it costs nothing before a run.

    Args:
        spec: the corpus spec.
        tokenizer: the tokenizer named (``"auto"`` / ``"byte"`` / ``"bpe"`` / ``"ids"``).
        label: how the error names where it was named (``--tokenizer``, ``'tokenizer' in config
            file run.toml``).
        advice: what the error tells the user to do instead of the other shards (default
            ``drop {label}``).

    Raises:
        CorpusError: one line naming the shard folder, the tokenizer the shards were made with
            and the one named.
    """
    if tokenizer == "auto" or not spec.startswith("bin:") or not spec[len("bin:"):]:
        return
    folder = spec[len("bin:"):]
    recorded = recorded_tokenizer(folder)
    if recorded is None or recorded == tokenizer:
        return
    given, advice = f"tokenizer {tokenizer!r} ({label})", advice or f"drop {label}"
    if recorded == IdTokenizer.name:
        raise CorpusError(f"{given} cannot apply to the token shards {folder}: they have no "
                          f"{META_FILE}, so a run reads their ids as they are, with no tokenizer; "
                          f"{advice}, or write the shards with python -m models.prepare "
                          f"--tokenizer {tokenizer}, which records it")
    raise CorpusError(f"{given} disagrees with the token shards {folder}: they were made with the "
                      f"{recorded!r} tokenizer (their {META_FILE} says so), which a run on them "
                      f"always uses; {advice}, or use shards made with the {tokenizer!r} "
                      f"tokenizer")


def resolve_tokenizer(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with tokenizer ``auto`` replaced by the corpus's own: ``byte`` for a text corpus,
    for ``bin:`` shards the one their ``meta.json`` records (``byte`` / ``bpe``; ``ids`` for
    nanoGPT shards, which have none). A named tokenizer is kept (:func:`check_given_tokenizer`
    judges it), and so is ``auto`` for a folder that does not exist (refused when it is opened).

    A run saves the tokenizer it trained with: :func:`models.train.run_training` resolves its
    configuration so, the command line does it before it checks the settings, and
    :mod:`models.compare` for each planned arm, so that the configuration it plans is the one a
    finished run saved. Reads ``meta.json`` only.

    Raises:
        CorpusError: a ``meta.json`` that cannot be read as token-shard metadata, as opening the
            shards would.
    """
    if cfg.tokenizer != "auto":
        return cfg
    if not cfg.corpus.startswith("bin:"):
        return cfg.replace(tokenizer=ByteTokenizer.name)
    recorded = recorded_tokenizer(cfg.corpus[len("bin:"):]) if cfg.corpus != "bin:" else None
    return cfg if recorded is None else cfg.replace(tokenizer=recorded)


def check_size(corpus: Corpus, batch_size: int, block_size: int) -> None:
    """Raise :class:`CorpusError` unless each split holds at least one batch of sequences.

    Training needs ``batch_size * block_size + 1`` tokens (one batch of disjoint sequences plus
    the shifted target); validation needs ``block_size + 1``.
    """
    need_train = batch_size * block_size + 1
    n_train, n_val = len(corpus.train), len(corpus.val)
    if n_train < need_train:
        raise CorpusError(
            f"corpus {corpus.spec!r} is smaller than one batch: its training split has "
            f"{n_train} tokens, batch_size*block_size+1 = {need_train} needed")
    if n_val < block_size + 1:
        raise CorpusError(
            f"corpus {corpus.spec!r} is too small: its validation split has "
            f"{n_val} tokens, block_size+1 = {block_size + 1} needed")


def _numpy_tokens(tokens) -> np.ndarray | None:
    """The numpy array behind ``tokens`` (a :class:`TokenFile`, memmap or array), else ``None``."""
    if isinstance(tokens, TokenFile):
        return tokens.array
    if isinstance(tokens, np.ndarray):
        return tokens
    return None


def unigram_entropy(tokens: torch.Tensor | TokenFile | np.ndarray, vocab_size: int) -> float:
    """Entropy in nats of the tokens' empirical unigram distribution.

    The loss of the best model that ignores context: a model that learns anything about
    context gets below it. Shards are counted in chunks (``np.bincount``), never loaded whole;
    the counts are exact integers, so the result equals the in-memory one.
    """
    array = _numpy_tokens(tokens)
    if array is None:
        counts = torch.bincount(tokens.long(), minlength=vocab_size).double()  # (V,)
    else:
        total = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, array.shape[0], SCAN_TOKENS):
            chunk = np.bincount(array[start:start + SCAN_TOKENS], minlength=vocab_size)
            if chunk.shape[0] > total.shape[0]:  # ids beyond vocab_size, as torch.bincount keeps
                total = np.pad(total, (0, chunk.shape[0] - total.shape[0]))
            total[:chunk.shape[0]] += chunk
        counts = torch.from_numpy(total).double()  # (V,)
    prob = counts[counts > 0] / counts.sum()
    return float(-(prob * prob.log()).sum())


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def _windows(tokens, starts: torch.Tensor, block_size: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the windows ``tokens[s : s + T + 1]``, gathered as int64."""
    array = _numpy_tokens(tokens)
    if array is None:
        offsets = torch.arange(block_size + 1)
        chunk = tokens[starts[:, None] + offsets].long()  # (B, T+1)
    else:  # one contiguous read per window: the pages of a memmap that the batch touches
        rows = [array[s:s + block_size + 1] for s in starts.tolist()]
        chunk = torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)


class BatchSampler:
    """Random training windows with a resumable random state.

    Each call of :meth:`next_batch` draws ``batch_size`` start offsets uniformly from
    ``[0, N - block_size - 1]`` with its own ``torch.Generator`` (seeded from ``seed`` and the
    rank; ``models.train`` passes ``rank=0`` on every rank so all ranks draw the same global batch
    and each keeps its slice), and returns inputs and next-token targets.
    :meth:`state_dict` / :meth:`load_state_dict` capture the generator state and the number of
    batches drawn, which is what ``--resume`` needs to continue the same data order.
    The offsets depend only on ``N`` and the generator, so a :class:`TokenFile` (or any numpy
    array) of the same tokens gives the same batches as the in-memory tensor.

    Args:
        tokens: ``(N,)`` token tensor, :class:`TokenFile` or numpy array (a memmap).
        batch_size: sequences per batch on this rank.
        block_size: sequence length ``T``.
        seed: base seed.
        rank: this process's rank (0 without distributed training).
    """

    def __init__(self, tokens: torch.Tensor | TokenFile | np.ndarray, batch_size: int,
                 block_size: int, seed: int, rank: int = 0) -> None:
        if len(tokens) < block_size + 1:
            raise CorpusError(f"need at least block_size+1 = {block_size + 1} tokens, "
                              f"got {len(tokens)}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
        self.position = 0  # batches drawn so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``(B, T)`` and targets ``(B, T)``, both int64."""
        high = len(self.tokens) - self.block_size
        starts = torch.randint(high, (self.batch_size,), generator=self.generator)  # (B,)
        self.position += 1
        return _windows(self.tokens, starts, self.block_size)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.position = int(state["position"])


def eval_batches(tokens: torch.Tensor | TokenFile | np.ndarray, batch_size: int,
                 block_size: int, n_batches: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced validation windows: the same batches at every evaluation.

    Uses no random state, so evaluating never perturbs training (which keeps ``--resume``
    exact) and successive validation losses are comparable. The starts are spaced in float32
    (the spacing every run has had) and clamped to the last window: past 2**24 tokens float32
    rounds the last start up to a window that runs off the end of the split.
    """
    high = max(len(tokens) - block_size - 1, 0)
    total = batch_size * n_batches
    starts = torch.linspace(0, high, total).round().long().clamp_(max=high)  # (n_batches * B,)
    for i in range(n_batches):
        yield _windows(tokens, starts[i * batch_size:(i + 1) * batch_size], block_size)

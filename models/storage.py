"""Run-directory storage primitives: atomic writes, sealed checkpoints, RNG state, metrics repair.

Guarantees (see ``docs/guides/training.rst``, "What happens when things go wrong"):

- **Atomic, exclusive writes.** :func:`atomic_write` writes a fresh temporary file beside the
  target, created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a unique name (so a planted
  symlink is never followed and two writers never share a file), flushes it to disk and then
  ``os.replace``-s the target. A crash leaves either the old file or the new one, and at most
  the temporary file, named ``.<target>.<pid>.<random>.tmp`` after the process that wrote it:
  :func:`remove_stale_temporaries` removes it at the next start once that process is gone.
- **Sealed checkpoints.** :func:`save_checkpoint` stores a SHA-256 ``checksum`` of the state's
  content (every tensor's dtype, shape and bytes; every plain value) inside ``checkpoint.pt``,
  reads the temporary file back and verifies it *before* it replaces anything, and keeps the
  previous checkpoint as ``checkpoint.prev.pt``. :func:`load_checkpoint` loads with
  ``torch.load(weights_only=True)`` (tensors and plain data only: a crafted pickle is refused,
  nothing in it runs), verifies the checksum, and falls back to the previous checkpoint when the
  newest is truncated, bit-flipped or incomplete.
- **Sharded checkpoints** (``fsdp=True``, :mod:`models.sharded_checkpoint`). The tensors go
  to a folder of shard files beside the checkpoint (:data:`SHARD_FOLDER`, one file per rank,
  written under a temporary name and renamed when complete); ``checkpoint.pt`` holds the rest
  and a manifest of the folder, the SHA-256 of every file in it (:func:`shard_manifest`), so
  its checksum seals them too. :func:`load_checkpoint` checks the manifest: a missing or
  altered shard file makes the checkpoint damaged, and the previous one (with its own folder)
  is used, as for a damaged ``checkpoint.pt``.
- **Plain-data RNG state.** :func:`rng_state` stores torch's, numpy's and Python's generators as
  tensors, numbers and tuples, so a checkpoint needs no pickled numpy objects.
- **One writer.** :class:`RunDirLock` (``flock`` on the run directory itself, no lock file) is
  held by the process that trains into a directory; a second run into it is refused before it
  writes anything.
- **metrics.jsonl repair.** :func:`read_metrics` drops a partial last line (what a kill during an
  append leaves) and names the line of any other unreadable row.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import os
import pickle
import random
import re
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: runs go on unlocked
    fcntl = None

import numpy as np
import torch

__all__ = ["CHECKPOINT", "DAMAGED_CHECKPOINT", "PREVIOUS_CHECKPOINT", "RUN_FILES", "SHARDS",
           "SHARD_FOLDER", "CheckpointError", "RunDirLock", "RunError", "atomic_write",
           "check_run_dir", "clear_stale_run", "describe_os_error", "has_checkpoint", "load_checkpoint",
           "read_metrics", "remove_stale_temporaries", "rewrite_metrics", "rng_state",
           "save_checkpoint", "set_rng_state", "shard_manifest", "state_checksum", "write_json"]

#: The newest checkpoint of a run directory.
CHECKPOINT = "checkpoint.pt"
#: The checkpoint before the newest, kept so that a damaged newest one has a fallback.
PREVIOUS_CHECKPOINT = "checkpoint.prev.pt"
#: Where a damaged ``checkpoint.pt`` is moved when the previous one is used instead.
DAMAGED_CHECKPOINT = "checkpoint.damaged.pt"
#: Files a run writes besides its checkpoints; a directory holding only these (and no
#: checkpoint) is a run that stopped before its first checkpoint, and may be started again.
RUN_FILES = frozenset({"config.json", "corpus.json", "metrics.jsonl", "summary.json", "loss.png",
                       "sample.txt", "tokenizer.json"})
#: Keys every checkpoint written by :mod:`models.train` holds.
REQUIRED_KEYS = ("model", "optimizer", "sampler", "rng", "step", "tokens", "config",
                 "wall_time_s", "corpus_fingerprint")
#: The key of a sharded checkpoint's manifest: ``{"folder": NAME, "files": {file: sha256}}``;
#: such a checkpoint keeps its ``model`` and ``optimizer`` tensors in that folder.
SHARDS = "shards"
#: The shard folder of a sharded checkpoint: ``checkpoint-<step>-<8 hex digits>.dcp``.
SHARD_FOLDER = re.compile(r"checkpoint-(?P<step>[0-9]+)-[0-9a-f]{8}\.dcp")
#: What a sharded checkpoint's folder stands in for.
_IN_SHARDS = ("model", "optimizer")


class RunError(Exception):
    """A run that cannot start or continue (run directory, resume, environment)."""


class CheckpointError(RunError):
    """A checkpoint that cannot be used: damaged, crafted, or missing."""


def describe_os_error(exc: OSError) -> str:
    """``"PATH: No space left on device (ENOSPC)"`` — the path and the cause, one line."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    cause = exc.strerror or str(exc)
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{cause}" + (f" ({name})" if name else "")


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------


@functools.cache
def _umask() -> int:
    """The process's umask (read once: ``os.umask`` can only be read by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_temporary(path: Path, data: bytes) -> Path:
    """``data`` in a new temporary file beside ``path``, flushed to disk; its path.

    Created exclusively (``tempfile.mkstemp``: ``O_CREAT | O_EXCL | O_NOFOLLOW``) under the
    hidden name ``.<name>.<pid>.<random>.tmp``, which says which process wrote it
    (:func:`remove_stale_temporaries`). On any failure the file is removed.

    Raises:
        OSError: with ``filename`` set to ``path`` (ENOSPC, EACCES, ...).
    """
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp",
                                   dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        _remove_stale(Path(tmp))
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    return Path(tmp)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically.

    The temporary file (:func:`_write_temporary`: created exclusively, a unique hidden name) is
    written in the target's directory, ``fsync``-ed and renamed over ``path``; on any failure it
    is removed and ``path`` is untouched. ``os.replace`` replaces a symlink at ``path`` itself,
    never the file it points to. The file gets the mode ``open`` would give a new file
    (``0o666`` less the umask), not ``mkstemp``'s owner-only ``0o600``: colleagues on a shared
    machine read run directories as they read any other file.

    Raises:
        OSError: with ``filename`` set to ``path`` (ENOSPC, EACCES, ...).
    """
    path = Path(path)
    tmp = _write_temporary(path, data)
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        _remove_stale(tmp)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


class _suppress_os_error:
    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        return kind is not None and issubclass(kind, OSError)


def write_json(path: str | Path, obj: dict, allow_nan: bool = False) -> None:
    """Write JSON atomically (:func:`atomic_write`).

    ``allow_nan`` lets a config hold ``p = inf`` (written as ``Infinity``, which Python's
    :mod:`json` reads back); metrics and summaries never contain non-finite numbers.
    """
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=allow_nan) + "\n"
    atomic_write(path, text.encode())


# --------------------------------------------------------------------------------------------
# RNG state as plain data
# --------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict:
    """torch, numpy and Python generator states as tensors and plain data (``weights_only``)."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"kind": str(kind), "key": torch.from_numpy(key.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
             "python": (int(version), tuple(int(v) for v in internal), gauss)}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def state_checksum(state) -> str:
    """SHA-256 over the content of ``state``: dict keys in order, every tensor's dtype, shape
    and bytes, every plain value's ``repr``. Independent of how ``torch.save`` lays it out."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest, obj) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        digest.update(f"D{len(obj)}".encode())
        for key in sorted(obj, key=repr):
            digest.update(f"K{key!r}".encode())
            _feed(digest, obj[key])
    elif isinstance(obj, (list, tuple)):
        digest.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for item in obj:
            _feed(digest, item)
    else:
        digest.update(f"V{obj!r}".encode())


def save_checkpoint(path: str | Path, state: dict, previous_step: int) -> None:
    """Seal ``state`` with its checksum and write it atomically; never go back in steps.

    The new file is read back and verified before it replaces ``path``; the replaced checkpoint
    is kept as ``checkpoint.prev.pt`` beside it.

    Args:
        path: ``checkpoint.pt``.
        state: the checkpoint dict (``step`` among its keys; tensors and plain data only).
        previous_step: the step of the checkpoint already on disk (-1 when none).

    Raises:
        OSError: the file system refused (its ``filename`` names the path); the checkpoint
            already on disk is intact.
        CheckpointError: the written file did not verify (it is removed).
    """
    if state["step"] <= previous_step:
        return
    path = Path(path)
    state = {k: v for k, v in state.items() if k != "checksum"}  # a loaded one, re-saved
    sealed = {**state, "checksum": state_checksum(state)}
    buffer = io.BytesIO()
    torch.save(sealed, buffer)
    tmp = _write_temporary(path, buffer.getvalue())  # an OSError names the checkpoint
    try:
        _read_verified(tmp)
        if path.exists():
            os.replace(path, path.with_name(PREVIOUS_CHECKPOINT))
        os.replace(tmp, path)
    except CheckpointError:
        raise CheckpointError(f"the checkpoint written to {path} did not verify on disk; "
                              f"the previous checkpoint is kept") from None
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    finally:
        _remove_stale(tmp)  # gone already unless something failed


def _remove_stale(path: Path) -> None:
    with _suppress_os_error():
        os.unlink(path)


class _Refused(CheckpointError):
    """A file holding objects other than tensors and plain data (never a fallback case)."""


def _read_verified(path: Path) -> dict:
    """Load ``path`` with ``weights_only=True`` and verify its checksum and keys."""
    data = path.read_bytes()  # a real I/O fault (EACCES, EIO) propagates as an OSError
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc):
            raise _Refused(f"refusing to load {path}: it holds objects other than tensors and "
                           f"plain data (a crafted file, or a checkpoint of a version that "
                           f"pickled them); nothing in it was run") from None
        raise CheckpointError(f"{path} is damaged (unreadable: {_first_line(exc)})") from None
    except Exception as exc:  # noqa: BLE001 - truncated or corrupted zip, EOF, bad record
        raise CheckpointError(f"{path} is damaged (unreadable: {_first_line(exc)})") from None
    if not isinstance(state, dict) or "checksum" not in state:
        raise CheckpointError(f"{path} has no checksum (not a checkpoint of this program, or "
                              f"written by an older version)")
    checksum = state.pop("checksum")
    if state_checksum(state) != checksum:
        raise CheckpointError(f"{path} is damaged (its content does not match its checksum)")
    return state


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:160] if text else type(exc).__name__


def shard_manifest(folder: str | Path) -> dict[str, str]:
    """``{file name: SHA-256}`` of every file in ``folder`` (reading each one back)."""
    return {path.name: _file_sha256(path) for path in sorted(Path(folder).iterdir())
            if path.is_file()}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_shards(path: Path, manifest) -> None:
    """Raise :class:`CheckpointError` unless the shard folder ``manifest`` describes (beside
    ``path``) holds every file it lists, each with its SHA-256."""
    folder = manifest.get("folder") if isinstance(manifest, dict) else None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(folder, str) and SHARD_FOLDER.fullmatch(folder) and isinstance(files, dict)
            and files and all(isinstance(k, str) and isinstance(v, str) and "/" not in k
                              and k not in (".", "..") for k, v in files.items())):
        raise CheckpointError(f"{path} is damaged (its shard manifest is not a folder name "
                              f"and a list of file checksums)")
    where = path.parent / folder
    if not where.is_dir():
        raise CheckpointError(f"{path} is damaged (its shard folder {folder} is missing)")
    for name, checksum in files.items():
        if not (where / name).is_file():
            raise CheckpointError(f"{path} is damaged (shard file {folder}/{name} is missing)")
        if _file_sha256(where / name) != checksum:
            raise CheckpointError(f"{path} is damaged (shard file {folder}/{name} does not "
                                  f"match its checksum)")


def _missing_keys(state: dict, required: tuple[str, ...]) -> list[str]:
    """The ``required`` keys ``state`` lacks (a sharded checkpoint's folder holds the model
    and the optimizer)."""
    present = set(state) | (set(_IN_SHARDS) if SHARDS in state else set())
    return [k for k in required if k not in present]


def load_checkpoint(run_dir: str | Path, required: tuple[str, ...] = REQUIRED_KEYS, *,
                    move_damaged: bool = True) -> tuple[dict, str | None]:
    """The newest good checkpoint of ``run_dir`` and a note when it is not ``checkpoint.pt``.

    A damaged ``checkpoint.pt`` (unreadable, checksum mismatch, a required key missing, a shard
    file missing or altered) is moved aside to ``checkpoint.damaged.pt`` and
    ``checkpoint.prev.pt`` is used instead; the note says
    so. A file holding anything but tensors and plain data is refused outright. Under
    ``torchrun`` every rank loads and only rank 0 passes ``move_damaged=True``.

    Raises:
        CheckpointError: no usable checkpoint (the message names every file tried and why).
    """
    run_dir = Path(run_dir)
    newest, previous = run_dir / CHECKPOINT, run_dir / PREVIOUS_CHECKPOINT
    problems = []
    for path in (newest, previous):
        if not path.is_file():
            continue
        try:
            state = _read_verified(path)
            missing = _missing_keys(state, required)
            if missing:
                raise CheckpointError(f"{path} is damaged (missing {', '.join(missing)})")
            if SHARDS in state:
                _check_shards(path, state[SHARDS])
        except _Refused:
            raise
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        note = None
        if path == previous:
            why = "; ".join(problems) if problems else f"{newest} is missing"
            note = f"{why}; resuming from the previous checkpoint {path.name} " \
                f"(step {state['step']})"
            if move_damaged and newest.exists():
                os.replace(newest, run_dir / DAMAGED_CHECKPOINT)
                note += f"; the damaged file is kept as {DAMAGED_CHECKPOINT}"
        return state, note
    if not problems:
        raise CheckpointError(f"cannot resume: {run_dir} has no {CHECKPOINT} (start a fresh run "
                              f"without --resume)")
    raise CheckpointError("cannot resume: " + "; ".join(problems) + " and no previous good "
                          "checkpoint is left")


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds ``checkpoint.pt`` or ``checkpoint.prev.pt``."""
    run_dir = Path(run_dir)
    return (run_dir / CHECKPOINT).is_file() or (run_dir / PREVIOUS_CHECKPOINT).is_file()


def check_run_dir(out: str | Path, resume: bool) -> bool:
    """Refuse a run directory that cannot be used; no writes (every rank checks the same).

    Returns:
        True when ``out`` holds a run that stopped before its first checkpoint (only
        :data:`RUN_FILES`, no checkpoint, not finished): a fresh run may clear and reuse it.
    """
    out = Path(out)
    if resume:
        if not has_checkpoint(out):
            raise RunError(f"cannot resume: {out} has no {CHECKPOINT} (start a fresh run "
                           f"without --resume)")
        return False
    if out.exists() and not out.is_dir():
        raise RunError(f"run directory {out} exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return False
    # a shard folder without a checkpoint: killed between writing the two (removed at start)
    names = {p.name for p in out.iterdir()
             if not _is_temporary(p.name) and not SHARD_FOLDER.fullmatch(p.name)}
    if names <= RUN_FILES and not _finished(out / "summary.json"):
        return True
    raise RunError(f"run directory {out} is not empty; pass --resume to continue it, or "
                   f"choose another --out")


def _is_temporary(name: str) -> bool:
    """A temporary file of :func:`atomic_write` or :func:`save_checkpoint` (a kill mid-write)."""
    return name.startswith(".") and name.endswith((".tmp", ".verify"))


#: A temporary file of ours: ``.<name>.<pid>.<random>.tmp`` (:func:`atomic_write`,
#: :func:`save_checkpoint`) or ``.<name>.<pid>.partial`` (``models.prepare``).
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>[1-9][0-9]*)\.(?:[a-z0-9_]{8}\.tmp|partial)")
#: What versions that did not put the pid in the name left: ``.<name>.<random>.tmp``, and the
#: checkpoint's verified copy ``.checkpoint.pt.verify`` (written through one of those).
_UNNAMED_TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")
_VERIFY = f".{CHECKPOINT}.verify"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: it may not be signalled)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: no such pid on this system
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: str | Path, names, *, locked: bool = False) -> list[str]:
    """Remove the temporary files that writers of ours, killed mid-write, left in ``folder``.

    A file is removed only when it is provably ours and provably stale: its name is ours for one
    of ``names`` (``.<name>.<pid>.<random>.tmp`` of :func:`atomic_write` and
    :func:`save_checkpoint`, ``.<name>.<pid>.partial`` of ``models.prepare``), ``pid`` is not
    this process, and no process ``pid`` exists — or ``locked``: the caller holds ``folder``'s
    :class:`RunDirLock`, so no other writer of ours is at work in it. With ``locked`` the
    temporary files of versions that did not put the pid in the name go too
    (``.<name>.<random>.tmp``, ``.checkpoint.pt.verify``).

    Args:
        folder: a run directory or a token-shard folder.
        names: the file names written there (``checkpoint.pt``, ``config.json``, ``train.bin``...).
        locked: the caller holds ``folder``'s lock (a real one: :attr:`RunDirLock.held`).

    Returns:
        The names of the removed files, sorted.
    """
    names = set(names)
    removed = []
    for path in Path(folder).iterdir():
        ours, old = _TEMPORARY.fullmatch(path.name), _UNNAMED_TEMPORARY.fullmatch(path.name)
        if ours is not None and ours["name"] in names:
            pid = int(ours["pid"])
            stale = pid != os.getpid() and (locked or not _alive(pid))
        else:
            stale = locked and (path.name == _VERIFY
                                or (old is not None and old["name"] in names | {_VERIFY}))
        if stale and path.is_file() and not path.is_symlink():
            _remove_stale(path)
            removed.append(path.name)
    return sorted(removed)


def _finished(summary: Path) -> bool:
    try:
        return bool(json.loads(summary.read_text()).get("finished"))
    except (OSError, ValueError, AttributeError):
        return False


def clear_stale_run(out: str | Path) -> None:
    """Remove the files of a run that stopped before its first checkpoint (see
    :func:`check_run_dir`), so that starting it again leaves no trace of the first attempt."""
    out = Path(out)
    for path in out.iterdir():
        if path.name in RUN_FILES or _is_temporary(path.name):
            _remove_stale(path)


class RunDirLock:
    """An exclusive lock on the run directory ``out`` (``flock`` on the directory), taken when
    constructed and held until :meth:`release` (or the end of a ``with`` block, or of the
    process), so that two runs never write one directory. Where the file system cannot lock
    (``flock`` unsupported, no :mod:`fcntl`) the lock is a no-op.

    Raises:
        RunError: another process holds the lock.
    """

    def __init__(self, out: str | Path) -> None:
        self.out, self.fd = Path(out), None
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.out, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunError(f"run directory {self.out} is in use by another run (it holds "
                               f"the directory's lock); wait for it to end, or choose another "
                               f"--out") from None
            return  # a file system without flock (some network mounts): unlocked
        self.fd = fd

    @property
    def held(self) -> bool:
        """Whether the directory is locked for real (False where the file system cannot lock)."""
        return self.fd is not None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------
# metrics.jsonl
# --------------------------------------------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file (empty list if it does not exist).

    A last line without its newline that does not parse is a row cut short by a kill during the
    append: it is dropped. Any other line that is not a JSON object with an integer ``step``
    and numbers or null for ``train_loss`` and ``val_loss`` (which a resumed run reads back:
    the plot, the summary) is an error.

    Raises:
        RunError: naming the file and the line number of an unreadable row.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not _is_metrics_row(row):
                raise ValueError("not a row with a step")
        except ValueError:
            if number == len(lines):  # the last line has no newline: a partial append
                break
            raise RunError(f"{path} line {number} is not a metrics row: {line[:80]!r}") from None
        rows.append(row)
    return rows


#: Row keys a resumed run reads back (the plot, the summary's last training loss).
_READ_LOSSES = ("train_loss", "val_loss")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_metrics_row(row) -> bool:
    """A JSON object with an integer ``step`` and a number or null for each read-back loss."""
    return isinstance(row, dict) and _is_number(row.get("step")) \
        and isinstance(row["step"], int) \
        and all(row.get(key) is None or _is_number(row[key]) for key in _READ_LOSSES)


def rewrite_metrics(path: str | Path, rows: list[dict]) -> None:
    """Replace ``metrics.jsonl`` by ``rows`` atomically (after a repair or on resume)."""
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows).encode())

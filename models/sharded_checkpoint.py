"""Checkpoints of FSDP runs: each rank writes its own shards with :mod:`torch.distributed.checkpoint`.

A sharded checkpoint at step :math:`s` is two things in the run directory:

- the folder ``checkpoint-<s>-<token>.dcp`` (:data:`~models.storage.SHARD_FOLDER`): DCP's
  ``.metadata`` and one ``__<rank>_0.distcp`` file per rank, holding the *tensors* of the model's
  and the optimizer's state dicts as :func:`~torch.distributed.checkpoint.state_dict.get_state_dict`
  gives them (parameters and per-parameter state keyed by parameter name, each rank its rows);
- ``checkpoint.pt``, sealed as every checkpoint is (:func:`~models.storage.save_checkpoint`): the
  step, tokens, sampler, loss scale, RNG states and configuration, the *plain data* of those state
  dicts (the optimizer's parameter groups; ``plain_state``) and the folder's manifest
  (``shards``: the SHA-256 of each of its files).

Writing (:func:`save_sharded_checkpoint`, every rank): DCP writes the folder under a temporary
name, ``.checkpoint-<s>-<token>.dcp.<pid>.tmp``; rank 0 then reads every file back for the
manifest, renames the folder (atomic) and writes ``checkpoint.pt`` (atomic, the previous one kept
as ``checkpoint.prev.pt``), and removes the folder of the checkpoint that dropped out. A kill at
any point leaves the previous checkpoints whole, and at most a temporary or unreferenced folder,
which :func:`remove_stale_shard_folders` removes at the next start.

Reading (:func:`load_sharded_checkpoint`, every rank): :func:`~models.storage.load_checkpoint`
has verified the manifest (a missing or altered shard file falls back to the previous checkpoint).
The optimizer's state is created first (torch's ``get_state_dict`` takes a step with zero
gradients and learning rate 0 when it is empty: a collective), then DCP reads into this job's
shards, whatever number of processes wrote them (DCP reshards: a run saved by 2 processes resumes
on 1 or 4). Every tensor the folder holds must have a place in the model or the optimizer, and
the reverse, or the resume is refused (a resumed run must not silently drop state). DCP's
``.metadata`` is a pickle: it is read with an unpickler that builds only DCP's metadata classes,
so, as ``checkpoint.pt`` is read with ``weights_only``, nothing in a crafted file runs.

Every rank reads the whole checkpoint once when it checks the manifest before loading.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import shutil
from pathlib import Path

import torch

from manifoldlib.distributed import all_gather_objects, raise_together

from .storage import (
    CHECKPOINT,
    DAMAGED_CHECKPOINT,
    PREVIOUS_CHECKPOINT,
    SHARD_FOLDER,
    SHARDS,
    CheckpointError,
    RunError,
    _alive,
    _read_verified,
    save_checkpoint,
    shard_manifest,
)

__all__ = ["PLAIN_STATE", "load_sharded_checkpoint", "remove_stale_shard_folders",
           "save_sharded_checkpoint"]

#: The key of ``checkpoint.pt`` holding the non-tensor parts of the model and optimizer states.
PLAIN_STATE = "plain_state"
#: Where DCP's files go while they are written: ``.<final folder>.<pid of rank 0>.tmp``.
_TEMPORARY_FOLDER = r"\.(?P<final>{})\.(?P<pid>[1-9][0-9]*)\.tmp"


def _split(tree: dict) -> tuple[dict, dict]:
    """``(tensors, plain)``: the nested dicts of ``tree`` with only its tensor leaves, and with
    only its other leaves (empty dicts dropped)."""
    tensors, plain = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            t, p = _split(value)
            if t:
                tensors[key] = t
            if p:
                plain[key] = p
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def _merge(a: dict, b: dict) -> dict:
    """The nested dicts ``a`` and ``b`` together (their leaves are disjoint)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def _paths(tree: dict, prefix: tuple = ()) -> set[tuple]:
    """The key paths of the leaves of nested dicts ``tree``."""
    out = set()
    for key, value in tree.items():
        out |= _paths(value, (*prefix, key)) if isinstance(value, dict) else {(*prefix, key)}
    return out


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model": ..., "optimizer": ...}`` of torch's ``get_state_dict`` (names as keys, this
    rank's shards as DTensors; an empty optimizer state is created first: a collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _dcp_error(exc: BaseException, path: Path) -> BaseException:
    """A DCP failure (``CheckpointException``, every rank's errors) as the first rank's error:
    an OSError naming ``path``, or a :class:`CheckpointError`."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), (exc, None))[0]
    if isinstance(first, OSError):
        return OSError(first.errno, first.strerror or str(first), str(path))
    detail = " ".join(str(first).split())[:300] or type(first).__name__
    return CheckpointError(f"the sharded checkpoint {path} failed: {detail}")


def save_sharded_checkpoint(out: Path, state: dict, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, previous_step: int,
                            is_main: bool) -> None:
    """Write the sharded checkpoint of step ``state["step"]`` (module docstring); a collective.

    Args:
        out: the run directory.
        state: what ``checkpoint.pt`` holds besides the model and the optimizer (rank 0's is
            written; the other ranks' is not read).
        model, optimizer: the sharded model and its optimizer.
        previous_step: the step of the checkpoint on disk (-1: none); nothing is written unless
            ``state["step"]`` is past it.
        is_main: this is rank 0, the process that writes ``checkpoint.pt``.

    Raises:
        OSError: the file system refused (naming the path); CheckpointError: the checkpoint did
            not verify; RunError: another rank failed. Every rank raises; the checkpoints
            already on disk are intact.
    """
    import torch.distributed.checkpoint as dcp

    if state["step"] <= previous_step:
        return
    token, pid = all_gather_objects((secrets.token_hex(4), os.getpid()))[0]
    folder = out / f"checkpoint-{state['step']}-{token}.dcp"
    temporary = out / f".{folder.name}.{pid}.tmp"
    tensors, plain = _split(_states(model, optimizer))
    error = None
    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(temporary))
    except dcp.CheckpointException as exc:  # a BaseException: every rank's failures
        error = _dcp_error(exc, temporary)
    if is_main and error is None:
        try:
            _seal(out, folder, temporary, {**state, PLAIN_STATE: plain}, previous_step)
        except (OSError, CheckpointError) as exc:
            error = exc
    if is_main and error is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    raise_together(error, RunError)


def _seal(out: Path, folder: Path, temporary: Path, state: dict, previous_step: int) -> None:
    """Rank 0, after DCP wrote ``temporary``: its manifest, the rename to ``folder``, the sealed
    ``checkpoint.pt``; then the folder of the checkpoint that dropped out is removed."""
    manifest = {"folder": folder.name, "files": shard_manifest(temporary)}
    try:
        dropping = _named_folder(out / PREVIOUS_CHECKPOINT)
    except (OSError, CheckpointError):
        dropping = None  # unreadable: its folder stays, for the next start to judge
    try:
        os.replace(temporary, folder)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(folder)) from None
    save_checkpoint(out / CHECKPOINT, {**state, SHARDS: manifest}, previous_step)
    referenced = _referenced(out)
    if dropping is not None and referenced is not None and dropping not in referenced:
        shutil.rmtree(out / dropping, ignore_errors=True)


def _named_folder(path: Path) -> str | None:
    """The shard folder the sealed checkpoint ``path`` names (None: no file, or no folder).

    Raises:
        OSError, CheckpointError: ``path`` cannot be read, or is not a good checkpoint.
    """
    if not path.is_file():
        return None
    manifest = _read_verified(path).get(SHARDS)
    folder = manifest.get("folder") if isinstance(manifest, dict) else None
    return folder if isinstance(folder, str) and SHARD_FOLDER.fullmatch(folder) else None


def _referenced(out: Path) -> set[str] | None:
    """The shard folders the checkpoints of ``out`` name; None when one of them cannot be read
    (then no folder may be taken for unreferenced)."""
    names = set()
    for path in (out / CHECKPOINT, out / PREVIOUS_CHECKPOINT, out / DAMAGED_CHECKPOINT):
        try:
            folder = _named_folder(path)
        except (OSError, CheckpointError):
            return None
        names |= {folder} - {None}
    return names


def remove_stale_shard_folders(out: Path, *, locked: bool) -> list[str]:
    """Remove the shard folders a killed run left in ``out``: temporary ones whose writer is gone
    (or all of them when ``locked``: the caller holds the directory's lock), and, when
    ``locked``, complete ones that no checkpoint names (killed between the rename and
    ``checkpoint.pt``). Folders a checkpoint names are kept, and all complete ones when a
    checkpoint cannot be read. Returns the removed names, sorted."""
    temporary = re.compile(_TEMPORARY_FOLDER.format(SHARD_FOLDER.pattern))
    referenced = _referenced(out) if locked else None
    removed = []
    for path in out.iterdir():
        if not path.is_dir() or path.is_symlink():
            continue
        match = temporary.fullmatch(path.name)
        stale = match is not None and int(match["pid"]) != os.getpid() and (
            locked or not _alive(int(match["pid"])))
        stale = stale or (referenced is not None and SHARD_FOLDER.fullmatch(path.name) is not None
                          and path.name not in referenced)
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return sorted(removed)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata (its dataclasses, sizes, dtypes, layouts, paths) and nothing else."""

    _ALLOWED = frozenset({("torch", "Size"), ("torch.serialization", "_get_layout"),
                          ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                          ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
                          ("collections", "OrderedDict")})

    def find_class(self, module: str, name: str):
        if module == "torch.distributed.checkpoint.metadata":
            from torch.distributed.checkpoint import metadata

            if isinstance(getattr(metadata, name, None), type):
                return getattr(metadata, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _reader(folder: Path):
    """DCP's file-system reader of ``folder``, reading ``.metadata`` with
    :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
                raise CheckpointError(f"refusing to load {path}: it is not DCP's metadata "
                                      f"({exc}); nothing in it was run") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def _check_same_entries(saved: set[tuple], expected: set[tuple], where: Path) -> None:
    """Refuse a checkpoint whose tensors and this job's state differ in what they hold."""
    for extra, what in ((saved - expected, "this model and optimizer have no place for"),
                        (expected - saved, "this model and optimizer need, missing from")):
        if extra:
            names = ", ".join(".".join(map(str, path)) for path in sorted(extra, key=str)[:4])
            more = f" and {len(extra) - 4} more" if len(extra) > 4 else ""
            raise CheckpointError(f"cannot resume exactly: state {what} the checkpoint {where}: "
                                  f"{names}{more}")


def load_sharded_checkpoint(out: Path, ckpt: dict, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
    """Load the model and optimizer state of the sharded checkpoint ``ckpt`` (``checkpoint.pt``
    as :func:`~models.storage.load_checkpoint` returned it, its shards verified) from ``out``
    into this job's shards; a collective.

    Raises:
        CheckpointError: the checkpoint's tensors do not fit the model and optimizer, or its
            metadata is not DCP's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    folder = out / ckpt[SHARDS]["folder"]
    tensors, _ = _split(_states(model, optimizer))
    reader = _reader(folder)
    planner_data = reader.read_metadata().planner_data
    if isinstance(planner_data, dict):  # DCP's default planner: name -> key path
        _check_same_entries({tuple(p) for p in planner_data.values()}, _paths(tensors), folder)
    try:
        dcp.load(tensors, storage_reader=reader)
    except dcp.CheckpointException as exc:  # a BaseException: every rank's failures
        raise _dcp_error(exc, folder) from None
    states = _merge(tensors, ckpt.get(PLAIN_STATE, {}))
    set_state_dict(model, optimizer, model_state_dict=states["model"],
                   optim_state_dict=states["optimizer"])

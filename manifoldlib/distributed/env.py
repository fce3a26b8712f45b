"""Process-group helpers: is a job distributed, which rank is this, and torchrun start-up.

These wrap :mod:`torch.distributed` so that the same code runs unchanged in a single process
(nothing initialized: rank 0 of a world of 1) and under ``torchrun`` / :func:`run_workers
<manifoldlib.distributed.launch.run_workers>` (an initialized default process group).

Teardown: :func:`torch.distributed.destroy_process_group` only unregisters the group; its gloo
threads stop when the last reference to it is dropped. A reference that outlives it leaves those
threads running into interpreter shutdown, where destroying them can abort the process ("terminate
called without an active exception", SIGABRT) after all its work is done. torch itself creates
such a reference: :mod:`torch.distributed.nn.functional` takes ``group.WORLD`` as the default
argument of its collectives *when it is imported*, and
:class:`~torch.nn.parallel.DistributedDataParallel` imports it on first use. So
:func:`import_before_init` imports it while there is no group yet (the defaults are then
``None``, "the default group at call time"), and :func:`destroy_process_group` warns if the
group survives its destruction.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import warnings
import weakref

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "destroy_process_group",
    "get_rank_world",
    "import_before_init",
    "init_from_env",
    "is_distributed",
]

#: Backends the helpers accept: ``gloo`` (CPU, every platform) and ``nccl`` (CUDA).
BACKENDS = ("gloo", "nccl")

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

#: torch modules that bind the default group as a default argument when imported (see above).
_CAPTURE_WORLD_ON_IMPORT = ("torch.distributed.nn.functional",)


def import_before_init() -> None:
    """Import the torch modules that would otherwise keep the default group alive forever.

    Call before :func:`torch.distributed.init_process_group` (:func:`init_from_env` and
    :func:`~manifoldlib.distributed.launch.run_workers` do). Imported later, e.g. by the first
    :class:`~torch.nn.parallel.DistributedDataParallel`, they would hold the group past
    :func:`destroy_process_group`; see the module docstring.
    """
    for name in _CAPTURE_WORLD_ON_IMPORT:
        importlib.import_module(name)


def is_distributed() -> bool:
    """Whether :mod:`torch.distributed` is available and its default process group initialized.

    A world of one initialized process counts as distributed (collectives run, trivially);
    an uninitialized process does not.
    """
    return dist.is_available() and dist.is_initialized()


def get_rank_world(process_group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank and the world size of ``process_group``.

    Args:
        process_group: a group from :func:`torch.distributed.new_group`, or ``None`` for the
            default group.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when nothing is initialized.

    Raises:
        ValueError: a group is given but nothing is initialized, or this process is not a
            member of the group.
    """
    if not is_distributed():
        if process_group is not None:
            raise ValueError(
                "a process_group was given but torch.distributed is not initialized; "
                "call torch.distributed.init_process_group first"
            )
        return 0, 1
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of {process_group!r}"
        )
    return rank, dist.get_world_size(process_group)


def init_from_env(backend: str | None = None, *, timeout: float = 1800.0) -> tuple[int, int, int]:
    """Initialize the default process group from ``torchrun``'s environment variables.

    ``torchrun`` (``python -m torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without them this is a plain
    single-process run and nothing is initialized.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks ``nccl`` when CUDA is available
            and ``gloo`` otherwise. With ``nccl`` the CUDA device is set to ``LOCAL_RANK``.
        timeout: seconds a collective may wait before it fails instead of hanging.

    Returns:
        ``(rank, world_size, local_rank)``; ``(0, 1, 0)`` outside ``torchrun``.

    Raises:
        ValueError: an unknown backend, a non-positive timeout, or an incomplete set of
            torchrun variables.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {backend!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    present = [name for name in _TORCHRUN_VARIABLES if name in os.environ]
    if not present:
        return 0, 1, 0
    if len(present) != len(_TORCHRUN_VARIABLES):
        missing = sorted(set(_TORCHRUN_VARIABLES) - set(present))
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} "
            "missing; launch with python -m torch.distributed.run"
        )
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        import_before_init()
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    return rank, world_size, local_rank


def destroy_process_group() -> None:
    """Destroy the default process group if one is initialized (safe to call twice).

    Call it after the last collective and after dropping what holds the group (a
    :class:`~torch.nn.parallel.DistributedDataParallel` wrapper and its reducer). If the group
    is still referenced afterwards, its backend threads outlive it and are torn down at
    interpreter exit, which can abort the process; that is reported with a
    :class:`RuntimeWarning` instead of passing silently.
    """
    if not is_distributed():
        return
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if group() is not None:
        gc.collect()  # a reference cycle (e.g. a dropped DDP wrapper) is not a leak
    if group() is not None:
        warnings.warn(
            "the default process group is still referenced after destroy_process_group, so its "
            "backend threads run on into interpreter shutdown and may abort the process there "
            "('terminate called without an active exception'); drop every reference to it "
            "before destroying it, and call manifoldlib.distributed.env.import_before_init() "
            "before init_process_group",
            RuntimeWarning,
            stacklevel=2,
        )

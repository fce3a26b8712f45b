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
import math
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

#: Seconds a collective of a group started by :func:`init_from_env` waits when no timeout is given.
_DEFAULT_TIMEOUT = 1800.0

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


def init_from_env(backend: str | None = None, *, timeout: float | None = None) -> tuple[int, int, int]:
    """Initialize the default process group from ``torchrun``'s environment variables.

    ``torchrun`` (``python -m torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. Without them this is a plain
    single-process run and nothing is initialized.

    If a default group already exists (a second call, or a group started elsewhere such as by
    :func:`~manifoldlib.distributed.launch.run_workers`), it is kept and checked, not replaced:
    ``backend`` must be one the group runs, ``RANK`` and ``WORLD_SIZE`` (where set) must be the
    group's rank and size, and ``timeout`` (where given) becomes the group's timeout for the
    collectives that follow. The rank and size returned are then the group's.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; ``None`` picks ``nccl`` when CUDA is available
            and ``gloo`` otherwise (for an existing group: whatever it runs). With ``nccl`` the
            CUDA device is set to ``LOCAL_RANK`` (not where an existing group has no torchrun
            variables: a group of one process keeps the device it was given).
        timeout: seconds a collective may wait before it fails instead of hanging; ``None``:
            1800 for a new group, an existing group's own timeout unchanged.

    Returns:
        ``(rank, world_size, local_rank)``; ``(0, 1, 0)`` outside ``torchrun`` with no group.

    Raises:
        ValueError: an unknown backend, a timeout that is not a finite number ``> 0``, or an
            incomplete set of torchrun variables; with an existing group: a ``backend`` it does
            not run, ``RANK`` / ``WORLD_SIZE`` other than its rank and size, or no
            ``LOCAL_RANK`` in a group of several processes (this process's local rank is then
            unknown: :func:`get_rank_world` gives the rank and size).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {backend!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not 0 < timeout < math.inf):
        raise ValueError(f"timeout must be a finite number > 0 of seconds or None, got {timeout!r}")
    present = [name for name in _TORCHRUN_VARIABLES if name in os.environ]
    if present and len(present) != len(_TORCHRUN_VARIABLES):
        missing = sorted(set(_TORCHRUN_VARIABLES) - set(present))
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(present)} set but {', '.join(missing)} "
            "missing; launch with python -m torch.distributed.run"
        )
    if is_distributed():
        return _join_existing_group(backend, timeout, bool(present))
    if not present:
        return 0, 1, 0
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    rank, world_size, local_rank = (_env_int(name) for name in _TORCHRUN_VARIABLES)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    import_before_init()
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=_DEFAULT_TIMEOUT if timeout is None else timeout),
    )
    return rank, world_size, local_rank


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer (torchrun sets it), got {name}={value!r}") from None


def _group_backends(name: str) -> set[str]:
    """The backends of a group named ``"gloo"`` or, with one per device, ``"cpu:gloo,cuda:nccl"``."""
    return {part.rpartition(":")[2] for part in name.split(",")}


def _join_existing_group(backend: str | None, timeout: float | None, torchrun: bool) -> tuple[int, int, int]:
    """:func:`init_from_env` where the default group exists: check it against the arguments and
    the torchrun variables, apply ``timeout``, and return its rank and size."""
    name = dist.get_backend()
    if backend is not None and backend not in _group_backends(name):
        raise ValueError(f"init_from_env(backend={backend!r}): the default process group already exists with "
                         f"backend {name!r}; pass backend=None (or one it runs), or destroy the group first")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torchrun:
        env_rank, env_world, local_rank = (_env_int(name) for name in _TORCHRUN_VARIABLES)
        if (env_rank, env_world) != (rank, world_size):
            raise ValueError(f"RANK={env_rank}, WORLD_SIZE={env_world} in the environment, but the existing default "
                             f"process group has this process as rank {rank} of {world_size}")
    elif world_size == 1:
        local_rank = 0
    else:
        raise ValueError(f"the default process group exists (rank {rank} of {world_size}) but LOCAL_RANK is not "
                         "set, so this process's local rank is unknown; set RANK, WORLD_SIZE and LOCAL_RANK, or "
                         "use get_rank_world()")
    if torchrun and "nccl" in _group_backends(name):
        torch.cuda.set_device(local_rank)
    if timeout is not None:
        dist.group.WORLD.set_timeout(datetime.timedelta(seconds=timeout))
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

"""Process-group helpers: is a job distributed, which rank is this, and torchrun start-up.

These wrap :mod:`torch.distributed` so that the same code runs unchanged in a single process
(nothing initialized: rank 0 of a world of 1) and under ``torchrun`` / :func:`run_workers
<manifoldlib.distributed.launch.run_workers>` (an initialized default process group).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = [
    "BACKENDS",
    "destroy_process_group",
    "get_rank_world",
    "init_from_env",
    "is_distributed",
]

#: Backends the helpers accept: ``gloo`` (CPU, every platform) and ``nccl`` (CUDA).
BACKENDS = ("gloo", "nccl")

_TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


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
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
    return rank, world_size, local_rank


def destroy_process_group() -> None:
    """Destroy the default process group if one is initialized (safe to call twice)."""
    if is_distributed():
        dist.destroy_process_group()

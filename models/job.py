"""This process's place in a training job: rank, world size, device; joining ``torchrun``."""

from __future__ import annotations

import dataclasses
import os

import torch

from manifoldlib.distributed import (
    get_rank_world,
    import_before_init,
    init_from_env,
    is_distributed,
)

from .storage import RunError

__all__ = ["Job", "set_rank_rng", "start_job"]


@dataclasses.dataclass(frozen=True)
class Job:
    """Rank, world size and device of this process (rank 0 of 1 outside ``torchrun``)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0


def start_job(device: torch.device, *, fsdp: bool = False) -> tuple[Job, bool]:
    """Join the torchrun job (if any): ``(job, whether we own the process group)``.

    An already initialized default group (a test harness) is used as it is; otherwise
    ``torchrun``'s variables start one (gloo on CPU, nccl on CUDA, one device per rank). With
    ``fsdp`` and neither, a group of this one process is started: FSDP2 shards over a device
    mesh, and a mesh of one is the single-process run (which a checkpoint written by several
    processes resumes into).

    Raises:
        RunError: an incomplete torchrun environment, or a device type without a backend (for
            several processes, or for ``fsdp``).
    """
    if fsdp and device.type not in ("cpu", "cuda"):
        raise RunError(f"fsdp runs on cpu (gloo) or cuda (nccl), not on {device.type}; pass "
                       f"--device cpu or --device cuda")
    if is_distributed():
        rank, world_size = get_rank_world()
        local_rank, owns = int(os.environ.get("LOCAL_RANK", rank)), False
    else:
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 \
                and device.type not in ("cpu", "cuda"):
            raise RunError(f"distributed training runs on cpu (gloo) or cuda (nccl), not on "
                           f"{device.type}; pass --device cpu or --device cuda")
        try:
            rank, world_size, local_rank = init_from_env("nccl" if device.type == "cuda"
                                                         else "gloo")
        except ValueError as exc:
            raise RunError(str(exc)) from None
        if fsdp and not is_distributed():
            _start_single_process_group(device)
        owns = is_distributed()
    if world_size > 1 and device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # nccl's object collectives use the current device
    return Job(rank, world_size, device), owns


def _start_single_process_group(device: torch.device) -> None:
    """A default process group of this process alone (an in-memory store, no network)."""
    import torch.distributed as dist

    import_before_init()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)


def set_rank_rng(seed: int, rank: int) -> None:
    """Give ranks other than 0 their own torch stream (rank 0 keeps the single-process one),
    so dropout masks differ across ranks as they would across the rows of one batch."""
    if rank > 0:
        torch.manual_seed(seed * 1_000_003 + rank)

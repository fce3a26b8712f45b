"""Run under torchrun: init_from_env + sharded_apply equal the local computation on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/torchrun_check.py

Exits non-zero on any mismatch; rank 0 prints one summary line.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for workers.py

import workers

from manifoldlib.distributed import (
    destroy_process_group,
    get_rank_world,
    init_from_env,
    sharded_apply,
)


def main() -> int:
    torch.set_num_threads(1)
    rank, world_size, _local_rank = init_from_env(timeout=60.0)
    try:
        assert (
            (rank, world_size)
            == get_rank_world()
            == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
        )
        tensors = workers.make_inputs()
        shared = sharded_apply(tensors, workers.reference_fn)
        local = [workers.reference_fn(i, t) for i, t in enumerate(tensors)]
        mismatches = [i for i, (a, b) in enumerate(zip(shared, local)) if not torch.equal(a, b)]
        if mismatches:
            print(
                f"rank {rank}: tensors {mismatches} differ from the local computation", flush=True
            )
            return 1
        if rank == 0:
            print(f"torchrun check ok: world_size={world_size} tensors={len(tensors)}", flush=True)
        return 0
    finally:
        destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

"""Distributed training support: sharded per-matrix work, guards, and a multi-process harness.

- :mod:`~manifoldlib.distributed.sharding`: :func:`assign_owners` gives each matrix one owner
  rank; :func:`sharded_apply` runs a per-matrix function on the owner only and shares the
  results with one ``all_gather`` per dtype (gloo and nccl).
- :mod:`~manifoldlib.distributed.env`: :func:`is_distributed`, :func:`get_rank_world`,
  :func:`init_from_env` (torchrun), :func:`import_before_init` and :func:`destroy_process_group`.
- :mod:`~manifoldlib.distributed.guards`: :func:`reject_unsupported_parameter` refuses DTensor
  and FSDP-flattened parameters, which a per-matrix manifold step would get wrong, except FSDP2's
  row shards where the caller gathers whole matrices (:func:`is_row_sharded`).
- :mod:`~manifoldlib.distributed.redistribute`: :func:`exchange`, one all-to-all that moves
  row shards to the rank solving a matrix and back; :func:`row_chunks` / :func:`row_range`,
  FSDP2's rows per rank.
- :mod:`~manifoldlib.distributed.batching`: :func:`batch_shard`, the rows of a global batch a
  rank trains on, so DDP keeps single-process batch semantics.
- :mod:`~manifoldlib.distributed.collectives`: :func:`all_mean`, :func:`from_rank0`,
  :func:`all_gather_objects` and :func:`raise_together`, the few collectives of a training loop
  (the identity in a single process).
- :mod:`~manifoldlib.distributed.launch`: :func:`run_workers`, the spawn + file-store harness
  used by the tests and benchmarks.
"""

from .batching import batch_shard
from .collectives import (
    RankFailedError,
    all_gather_objects,
    all_mean,
    from_rank0,
    raise_together,
)
from .env import (
    BACKENDS,
    destroy_process_group,
    get_rank_world,
    import_before_init,
    init_from_env,
    is_distributed,
)
from .guards import UnsupportedParameterError, is_row_sharded, reject_unsupported_parameter
from .redistribute import exchange, exchange_bytes, row_chunks, row_range
from .launch import WorkerError, WorkerTimeoutError, run_workers
from .sharding import STRATEGIES, assign_owners, matrix_cost, rank_loads, sharded_apply

__all__ = [
    "BACKENDS",
    "STRATEGIES",
    "RankFailedError",
    "UnsupportedParameterError",
    "WorkerError",
    "WorkerTimeoutError",
    "all_gather_objects",
    "all_mean",
    "assign_owners",
    "batch_shard",
    "destroy_process_group",
    "exchange",
    "exchange_bytes",
    "from_rank0",
    "get_rank_world",
    "import_before_init",
    "init_from_env",
    "is_distributed",
    "is_row_sharded",
    "matrix_cost",
    "raise_together",
    "rank_loads",
    "reject_unsupported_parameter",
    "row_chunks",
    "row_range",
    "run_workers",
    "sharded_apply",
]

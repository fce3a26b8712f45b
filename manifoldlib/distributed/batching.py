r"""Split a global batch across ranks so DDP reproduces one process's batch semantics.

Every rank draws the *same* global batch (same data order and random state as a single
process), then keeps its contiguous slice. With equal slices, DDP's average of the per-rank
mean losses' gradients is the gradient of the global mean loss:

.. math::

   \frac{1}{W}\sum_{r=0}^{W-1} \nabla \frac{W}{B} \sum_{j \in S_r} \ell_j
   = \nabla \frac{1}{B} \sum_{j=1}^{B} \ell_j ,

so a run on :math:`W` ranks takes the steps of the single-process run (up to rounding), and
resuming from a checkpoint restores the data order on every rank alike.
"""

from __future__ import annotations

from .env import get_rank_world

__all__ = ["batch_shard"]


def batch_shard(
    global_batch_size: int, rank: int | None = None, world_size: int | None = None
) -> slice:
    """The rows of a global batch that ``rank`` trains on.

    Args:
        global_batch_size: rows of the batch every rank draws; divisible by ``world_size``.
        rank: this rank; ``None`` reads it (with ``world_size``) from the default process
            group, ``0`` of ``1`` in a plain process.
        world_size: number of ranks; give both or neither.

    Returns:
        ``slice(rank * b, (rank + 1) * b)`` with ``b = global_batch_size // world_size``; use as
        ``x[batch_shard(len(x))]``.

    Raises:
        ValueError: a non-positive or indivisible batch size, only one of ``rank`` and
            ``world_size``, or a rank outside ``[0, world_size)``.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(
            f"give both rank and world_size or neither, got rank={rank!r}, world_size={world_size!r}"
        )
    if rank is None or world_size is None:
        rank, world_size = get_rank_world()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or global_batch_size < 1
    ):
        raise ValueError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by world_size {world_size}; "
            "choose a multiple so every rank trains on an equal share"
        )
    size = global_batch_size // world_size
    return slice(rank * size, (rank + 1) * size)

r"""Independent per-matrix solves of one optimizer step, run side by side on CPU threads.

Why: on a CPU the dual solve of a Stiefel or DGram matrix spends a third of its time in
``n × n`` eigendecompositions, and LAPACK's eigh uses extra threads poorly (its tridiagonal
reduction is half matrix–vector work). On the 2-core development machine (torch 2.13, MKL) a
768² float32 eigh takes 36 ms on two threads and 48 ms on one, so two of them side by side take
54 ms against 72 ms one after the other, while matrix products cost the same either way. Solving
*different* matrices in different threads, each with its share of the intra-op threads, recovers
that: a whole 3072×768 Stiefel step takes 1.64x as long on one thread as on two, so two such
matrices side by side finish in 0.82 of the time of one after the other.

It pays only when the matrices split evenly over the workers: one 3072×768 and one 768×768
Stiefel matrix took 1.41–1.55x *longer* side by side (the big one alone on one thread). Nor does
it pay for small matrices, whose solves are mostly Python (one interpreter lock for both
threads): eight matrices of a 21-wide block took 1.33x longer. ``"auto"`` therefore runs
matrices concurrently only when their mean estimated cost (:func:`~manifoldlib.distributed.matrix_cost`,
:math:`mn\min(m, n)`) reaches :data:`MIN_MEAN_COST` and the longest-processing-time-first
schedule of those costs (that of :func:`~manifoldlib.distributed.assign_owners`) is within
:data:`BALANCE_SLACK` of a perfect split (:func:`resolve_workers`).
``benchmarks/bench_concurrent_solves.py`` measures these cases and more.

Numerics: a matrix solved by a worker runs its products with ``intra = threads // workers``
intra-op threads, and its result is what a sequential step with ``torch.set_num_threads(intra)``
gives, bit for bit (the per-matrix work shares nothing). The decision depends only on the shapes
and the thread count, so every rank of a distributed job makes the same one.

Thread safety: each worker disables autograd (grad mode is thread-local) and sets its own
intra-op thread count; the caller holds :func:`~manifoldlib.optim.matmul_precision.ieee_float32_matmul`
around the whole section, so the workers' own uses of it find IEEE already set and write nothing.
The caller's thread count is restored afterwards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch

from ..distributed.sharding import assign_owners, matrix_cost, rank_loads

__all__ = ["BALANCE_SLACK", "MIN_MEAN_COST", "resolve_workers", "run_concurrently"]

#: ``"auto"`` runs solves concurrently when the schedule's longest worker is at most this factor
#: above a perfect split (break-even on the development machine was about 1.22 for two workers).
BALANCE_SLACK = 1.1
#: ... and when the solves are large enough for BLAS and LAPACK to outweigh the Python of the
#: solver loop, which two threads share under the GIL: mean :func:`~manifoldlib.distributed.matrix_cost`
#: at least this. Measured with ``benchmarks/bench_concurrent_solves.py --scale k`` (Stiefel, 2
#: threads): a 128-wide GPT block (mean cost 5.2e6) 0.91–0.92 of the one-at-a-time time, 96-wide
#: (2.2e6) 1.00–1.01, 64-wide 0.87–1.21, 21- to 48-wide 1.00–1.35.
MIN_MEAN_COST = 4_000_000

_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # by size: a pool of k threads runs at most k solves at once


def _forget_pools_in_child() -> None:
    """A forked child (e.g. a fork-started DataLoader worker) has none of the pools' threads:
    forget the executors so that a step there builds fresh ones instead of waiting forever."""
    global _pool_lock
    _pools.clear()
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def resolve_workers(workers: int | str, shapes: Sequence[Sequence[int]], threads: int | None = None) -> int:
    """How many solves to run at once: ``workers`` (an int ``>= 1``, or ``"auto"``) for matrices of these shapes.

    ``"auto"``: ``min(threads, len(shapes))`` when there are at least two solves and two threads,
    the solves are not tiny (:data:`MIN_MEAN_COST`) and the schedule is balanced
    (:data:`BALANCE_SLACK`), else 1. An int is capped at the number of solves. ``threads``
    defaults to ``torch.get_num_threads()``.

    Raises:
        ValueError: ``workers`` is neither ``"auto"`` nor an int ``>= 1``.
    """
    if workers != "auto" and not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
        raise ValueError(f"workers must be 'auto' or an int >= 1, got {workers!r}")
    count = len(shapes)
    if count < 2:
        return 1
    if workers != "auto":
        return min(workers, count)
    threads = torch.get_num_threads() if threads is None else threads
    k = min(threads, count)
    if k < 2:
        return 1
    total = sum(matrix_cost(shape) for shape in shapes)
    if total < MIN_MEAN_COST * count:
        return 1
    loads = rank_loads(shapes, assign_owners(shapes, k), k)
    return k if max(loads) <= BALANCE_SLACK * total / k else 1


def _executor(size: int) -> ThreadPoolExecutor:
    """The process-wide pool of exactly ``size`` threads, created on first use and kept (its
    threads keep their per-thread BLAS buffers from step to step)."""
    with _pool_lock:
        if size not in _pools:
            _pools[size] = ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"manifoldlib-solve{size}")
        return _pools[size]


def _in_worker(task: Callable[[], Any], intra: int) -> Any:
    torch.set_num_threads(intra)
    with torch.no_grad():
        return task()


def run_concurrently(tasks: Sequence[Callable[[], Any]], shapes: Sequence[Sequence[int]], workers: int) -> list[Any]:
    """``[task() for task in tasks]``, up to ``workers`` at a time, largest matrix (``shapes[i]``) first.

    With ``workers <= 1`` the tasks run here, in order, with the caller's settings. Otherwise
    each runs in a pool thread with ``torch.get_num_threads() // workers`` intra-op threads and
    autograd off — also a lone task, so that a matrix gets the same thread count however many
    others share the step with it (a rank of a sharded job may own just one); every task finishes
    before this returns (or raises the first failure, in task order), and the caller's thread
    count is restored.
    """
    if len(tasks) != len(shapes):
        raise ValueError(f"got {len(tasks)} tasks but {len(shapes)} shapes")
    if workers <= 1 or not tasks:
        return [task() for task in tasks]
    threads = torch.get_num_threads()
    intra = max(1, threads // workers)
    pool = _executor(workers)
    costs = [matrix_cost(shape) for shape in shapes]
    order = sorted(range(len(tasks)), key=lambda i: (-costs[i], i))
    try:
        futures = {i: pool.submit(_in_worker, tasks[i], intra) for i in order}
        wait(futures.values())
    finally:
        torch.set_num_threads(threads)
    return [futures[i].result() for i in range(len(tasks))]

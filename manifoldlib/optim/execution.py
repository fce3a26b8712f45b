r"""How a Manifold Muon step runs on its device: precision, spectral path, host synchronization, threads.

Everything that depends on the hardware and not on the mathematics is decided here, once per bank
(kept by the optimizer from step to step), by :meth:`Execution.resolve`, and only *read* below it.

* **Precision** (:func:`solve_dtype`, :func:`ieee_float32_matmul`). A solve runs in float32 for
  16-bit matrices and in the matrix's own dtype otherwise (the one 16-bit rule of the package).
  Its float32 products are IEEE products whatever the process's TF32 or bfloat16-pass setting
  (``torch.set_float32_matmul_precision``): those carry a relative error of about 1e-3, the size
  of the dual's tolerance, so a solve could no longer judge its own tangent residual.
* **The Euclidean Newton–Schulz dtype** (``ns_dtype``): :class:`torch.optim.Muon` iterates in
  bfloat16, fast where bfloat16 products are native (:func:`native_bfloat16`: CUDA, CPUs with
  AVX512-BF16 or AMX) and many times slower where they are emulated. ``"auto"`` takes bfloat16
  only where it is native.
* **Spectral path** of the dual (``spectral``): ``"eigh"`` (one ``n × n`` eigendecomposition an
  evaluation; exact gains, and the eigenbasis serves a Newton-like step) or ``"products"`` (the
  Newton–Schulz preset in Gram form, matrix products only). ``"auto"`` takes the products off the
  CPU, where eigendecompositions are slow next to products, and on the CPU for matrices narrower
  than :data:`EIGH_MIN_COLUMNS`; the eigh for wider ones on the CPU.
* **Host synchronization** (``sync_free``). On the products path the dual runs a fixed number of
  iterations with per-matrix convergence masks on the device, and nothing is read back to the
  host (but on the one-time checks of :class:`~manifoldlib.optim.ManifoldMuon`: a plan's first
  step and the first after a matrix changed in place, two reads per constrained bank): a GPU step is a few milliseconds of launches, and every read would stall it; on a CPU the
  same fixed, short loop is what keeps a small model's step near Muon's (its cost there is per
  operation, not per flop). On the eigh path the loop stops as soon as every matrix has converged
  and may continue a stalled matrix on the smoothed dual. ``DualOptions(sync_free=...)``
  overrides either way.
* **Search precision**: what only *proposes* the next dual iterate (the preconditioned step, the
  smoothed dual's Hessian products) runs in bfloat16 for float32 solves of at least
  :data:`BFLOAT16_MIN_SIZE` columns where bfloat16 is native; every iterate is then evaluated in
  the solve's dtype.
* **Threads** (:meth:`Execution.threads`): small matrices gain nothing from a second intra-op
  thread, and on a loaded machine a parallel region waits for a descheduled thread; a CPU step
  whose largest solve is below :data:`SMALL_SOLVE_FLOPS` runs on one thread
  (:func:`step_threads` sets it for the step and restores it). A bank of large constrained
  matrices is split over the threads instead (:func:`side_by_side`, :func:`run_side_by_side`):
  its eigendecompositions use a second thread poorly, two side by side well. The parts of all
  banks of a step run in one pool, longest first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = [
    "BFLOAT16_MIN_SIZE",
    "NS_DTYPES",
    "SMALL_SOLVE_FLOPS",
    "SPECTRAL_PATHS",
    "Execution",
    "ieee_float32_matmul",
    "native_bfloat16",
    "solve_dtype",
    "run_side_by_side",
    "side_by_side",
    "step_threads",
]

#: ``ns_dtype`` values: the dtype of a Euclidean group's Newton–Schulz iteration.
NS_DTYPES = ("auto", "bfloat16", "float32")
#: ``spectral`` values of the dual options.
SPECTRAL_PATHS = ("auto", "eigh", "products")
#: Smallest ``n`` (columns of the ``n × n`` work) at which search products switch to bfloat16.
BFLOAT16_MIN_SIZE = 256
#: ``spectral="auto"`` on the CPU takes the eigh for ``n × n`` work of at least this many columns
#: (an eigendecomposition there costs a few matrix products and the eigenbasis halves the
#: iterations) and the Gram-form products below it, where a step is mostly per-operation overhead.
EIGH_MIN_COLUMNS = 256
#: A CPU step whose largest matrix has ``m·n·min(m, n)`` below this runs on one intra-op thread.
SMALL_SOLVE_FLOPS = 128**3


@torch.compiler.assume_constant_result  # a fact of the hardware: a constant in compiled code
def native_bfloat16(device_type: str) -> bool:
    """Whether bfloat16 matrix products run natively (faster than float32) on this device type."""
    return _native_bfloat16(device_type)


@functools.cache
def _native_bfloat16(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(probe()) if probe is not None else False
    return False


def solve_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a solve runs in for matrices of ``dtype``: float32 for 16-bit ones, else their own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


#: The per-backend matmul precision handles this torch has (cuBLAS, oneDNN).
MATMUL_BACKENDS = tuple(h for h in (getattr(torch.backends.cuda, "matmul", None),
                                    getattr(torch.backends.mkldnn, "matmul", None))
                        if h is not None and hasattr(h, "fp32_precision"))


#: A CPU bank of constrained matrices each with ``m·n·min(m, n)`` at least this is split over the
#: intra-op threads (:func:`side_by_side`): smaller solves are mostly Python, which threads share.
SIDE_BY_SIDE_FLOPS = 4_000_000
#: ``fp32_precision`` values that already mean IEEE float32 products (``"none"``: not set).
FULL_PRECISION = ("ieee", "none")


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Run the block with IEEE float32 matrix products; restore each backend's setting after.

    Usable as a decorator. Not thread-safe: the setting is global to the process, as torch's is.
    Under :func:`torch.compile` it changes nothing (a compiled graph takes the process's setting
    at compile time: leave float32 products at IEEE precision around a compiled step).
    """
    if torch.compiler.is_compiling():
        yield
        return
    changed = []
    for handle in MATMUL_BACKENDS:
        previous = handle.fp32_precision
        if previous not in FULL_PRECISION:
            handle.fp32_precision = "ieee"
            changed.append((handle, previous))
    try:
        yield
    finally:
        for handle, previous in changed:
            handle.fp32_precision = previous


@contextlib.contextmanager
def step_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (``None``: leave them), then restore; under
    :func:`torch.compile` the compiled code's threads are left as they are."""
    if threads is None or torch.compiler.is_compiling():
        yield
        return
    before = torch.get_num_threads()
    if threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def side_by_side(device: torch.device | str, shape: Sequence[int], members: int, *, path: str = "eigh",
                 sync_free: bool = False) -> int:
    """Into how many equal parts a bank of ``members`` constrained ``shape`` matrices is split, each
    part solved on its own thread with a share of the intra-op threads (1: not split).

    Why: a CPU solve on the eigh path spends much of its time in ``n × n`` eigendecompositions,
    whose LAPACK routine uses extra threads poorly (half its work is matrix–vector), while matrix
    products cost the same either way; two matrices side by side on one thread each finish sooner
    than one after the other on two. Only on the CPU, on the early-stopping eigh ``path`` (not
    ``sync_free``: the products path has no eigendecomposition to gain on), with at least two
    threads, parts of equal size (a lone matrix left over would make its thread the step's tail),
    matrices of at least :data:`SIDE_BY_SIDE_FLOPS`, and no dispatch mode or compilation active
    (a :func:`~manifoldlib.testing.counting.count_ops` counter or a tracer sees its own thread only). The decision depends on the shapes and the thread count alone (every
    rank of a job with the same threads makes the same one); a part's result is its matrices' step
    with ``threads // parts`` intra-op threads, equal to the unsplit step to rounding.
    """
    if torch.device(device).type != "cpu" or members < 2 or path != "eigh" or sync_free:
        return 1
    if _get_current_dispatch_mode() is not None or torch.compiler.is_compiling():
        return 1
    if shape[-2] * shape[-1] * min(shape[-2], shape[-1]) < SIDE_BY_SIDE_FLOPS:
        return 1
    parts = min(torch.get_num_threads(), members)
    while parts > 1 and members % parts:
        parts -= 1
    return parts


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}


def _forget_pools_in_child() -> None:  # a forked child has none of the pools' threads
    global _pool_lock
    _pools.clear()
    _pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def _in_thread(task: Callable[[], Any], threads: int) -> Any:
    torch.set_num_threads(threads)
    with torch.no_grad():  # grad mode is per thread
        return task()


def run_side_by_side(tasks: Sequence[Callable[[], Any]], workers: int | None = None) -> list[Any]:
    """``[task() for task in tasks]`` on ``workers`` threads of a kept pool (default: one per task),
    each with ``threads // workers`` intra-op threads; a thread that finishes takes the next task in
    order, so put the longest first. The caller's thread count is restored, and the first failure
    (in task order) raised after all have finished. The caller holds :func:`ieee_float32_matmul`
    around it (a process-wide setting the threads then only read)."""
    workers = len(tasks) if workers is None else min(workers, len(tasks))
    if workers <= 1:
        return [task() for task in tasks]
    threads = torch.get_num_threads()
    with _pool_lock:
        if workers not in _pools:  # kept: its threads keep their BLAS buffers from step to step
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="manifoldlib-solve")
        pool = _pools[workers]
    try:
        futures = [pool.submit(_in_thread, task, max(1, threads // workers)) for task in tasks]
        for future in futures:
            future.exception()  # wait for every one
    finally:
        torch.set_num_threads(threads)
    return [future.result() for future in futures]


@dataclasses.dataclass(frozen=True)
class Execution:
    """The device-dependent choices of one step (see the module docstring).

    Attributes:
        spectral: ``"eigh"`` or ``"products"``.
        sync_free: run the dual a fixed number of iterations with device-side masks and read
            nothing back (the products path); else stop when every matrix has converged.
        ns_dtype: dtype of the Euclidean groups' Newton–Schulz.
        search_dtype: dtype of the search products of large float32 solves (``None``: the solve's).
        smoothed_dtype: work dtype of a float32 solve smoothed from the start (``None``: float32;
            float64 on CUDA, where a float32 eigh stalls the smoothed Newton steps).
    """

    spectral: str = "eigh"
    sync_free: bool = False
    ns_dtype: torch.dtype = torch.float32
    search_dtype: torch.dtype | None = None
    smoothed_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.spectral not in SPECTRAL_PATHS[1:]:
            raise ValueError(f"Execution.spectral must be 'eigh' or 'products', got {self.spectral!r}")

    @classmethod
    def resolve(cls, device: torch.device | str, *, spectral: str = "auto", ns_dtype: str = "auto",
                bfloat16_native: bool | None = None, sync_free: bool | None = None,
                columns: int | None = None) -> Execution:
        """The choices for ``device``.

        Args:
            device: where the matrices live.
            spectral: one of :data:`SPECTRAL_PATHS`.
            ns_dtype: one of :data:`NS_DTYPES`.
            bfloat16_native: whether bfloat16 products are native (``None``: probe the device).
            sync_free: ``None``: on the products path, not on the eigh path.
            columns: ``n`` of the ``n × n`` work, for ``spectral="auto"`` on the CPU.

        Raises:
            ValueError: naming an unknown ``spectral`` or ``ns_dtype``.
        """
        device = torch.device(device)
        if spectral not in SPECTRAL_PATHS:
            raise ValueError(f"spectral must be one of {', '.join(SPECTRAL_PATHS)}, got {spectral!r}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
        native = native_bfloat16(device.type) if bfloat16_native is None else bool(bfloat16_native)
        if spectral == "auto":
            small = columns is not None and columns < EIGH_MIN_COLUMNS
            path = "products" if device.type != "cpu" or small else "eigh"
        else:
            path = spectral
        return cls(
            spectral=path,
            sync_free=path == "products" if sync_free is None else bool(sync_free),
            ns_dtype=torch.bfloat16 if ns_dtype == "bfloat16" or (ns_dtype == "auto" and native) else torch.float32,
            search_dtype=torch.bfloat16 if native else None,
            smoothed_dtype=torch.float64 if device.type == "cuda" else None,
        )

    def search_dtype_for(self, t: torch.Tensor) -> torch.dtype:
        """Dtype of the search products of a solve whose ``(..., n, n)`` work is like ``t``."""
        if self.search_dtype is not None and t.dtype == torch.float32 and t.size(-1) >= BFLOAT16_MIN_SIZE:
            return self.search_dtype
        return t.dtype

    def work_dtype(self, dtype: torch.dtype, smoothed: bool = False) -> torch.dtype:
        """Work dtype of a solve for input ``dtype`` (:func:`solve_dtype`; :attr:`smoothed_dtype`
        for a float32 solve smoothed from the start)."""
        dtype = solve_dtype(dtype)
        if smoothed and dtype == torch.float32 and self.smoothed_dtype is not None:
            return self.smoothed_dtype
        return dtype

    @staticmethod
    def threads(device: torch.device | str, shapes: Sequence[Sequence[int]]) -> int | None:
        """Intra-op threads for a step over matrices of ``shapes`` (``None``: leave torch's).

        One thread on the CPU when the largest ``m·n·min(m, n)`` is below
        :data:`SMALL_SOLVE_FLOPS`; elsewhere torch's setting.
        """
        if torch.device(device).type != "cpu" or not shapes:
            return None
        largest = max(s[-2] * s[-1] * min(s[-2], s[-1]) for s in shapes)
        return 1 if largest < SMALL_SOLVE_FLOPS else None

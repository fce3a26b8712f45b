r"""How a Manifold Muon step runs on its device: one policy, resolved once per step.

Every choice that depends on the hardware and not on the mathematics lives here, decided from
the device and the group's options by :meth:`ExecutionPolicy.resolve`, and then *read* by the
functional core (:func:`~manifoldlib.optim.muon_step.manifold_muon`), the dual solve
(:func:`~manifoldlib.optim.steepest.solve_dual`) and its solvers. Nothing below the policy asks
the device again, so a test or a user can pin any choice by passing an explicit policy
(``execution=ExecutionPolicy(...)``) instead of patching the library.

The choices:

* **Euclidean Newton–Schulz dtype** (``ns_dtype``). :class:`torch.optim.Muon` runs its iteration in
  bfloat16, fast where the hardware multiplies bfloat16 natively (CUDA devices that support it,
  CPUs with AVX512-BF16 or AMX) and very slow where it does not: on a 2-core AMD EPYC with AVX2
  only (torch 2.13, MKL) a 768² bfloat16 product took 770–900 ms against 11–19 ms in float32.
  ``"auto"`` takes bfloat16 only where it is native (there it equals ``torch.optim.Muon``) and
  float32 elsewhere; ``"bfloat16"`` always (the Euclidean steps then equal ``torch.optim.Muon``'s
  on every device); ``"float32"``.
* **Spectral path of a plain dual evaluation** (``spectral``): ``"eigh"`` (one ``n × n``
  eigendecomposition) or ``"products"`` (the Newton–Schulz preset in Gram form, about twenty
  ``n × n`` products). ``"auto"`` takes the products on CUDA, where a 768² float32 eigh measured
  8.0 ms against 1.1 ms for the products (H200, torch 2.11), and the eigh elsewhere (2-core CPU:
  ~35 ms against ~180 ms).
* **Search-direction precision** (``search_dtype``). What only *proposes* the next dual iterate —
  the preconditioned step of the plain dual, the Hessian-vector products of the smoothed dual's
  conjugate gradients — tolerates a relative error of a few 1e-3, and every iterate is then
  checked in the solve's own dtype. Where bfloat16 is native those products of a float32 solve
  with at least ``search_min_size`` columns run in bfloat16 (2–3× faster per product, the same
  iteration counts); below :data:`BFLOAT16_MIN_SIZE` a bfloat16 product is no faster.
* **Work dtype of a solve** (:meth:`ExecutionPolicy.work_dtype`): float32 for 16-bit input; a
  float32 solve smoothed from the start runs in ``smoothed_dtype`` — float64 on CUDA, where
  cuSOLVER's float32 eigh stalled a 768² DGram solve at a residual of 1.2–1.5e-3 for its cap of
  30 Newton steps while float64 converged in 17–18 (the float64 eigh costs the same there).
* **Concurrency** (``workers``): how many constrained matrices are solved at once on CPU threads
  (:func:`~manifoldlib.optim.concurrent_solves.resolve_workers`; always 1 off the CPU).
* **Batching** (``batch``): the same-shape constrained matrices of a group are solved as one
  batched dual (:mod:`~manifoldlib.optim.batched_step`: every ``n × n`` product of the
  Barzilai–Borwein loop carries a leading batch dimension, one host synchronization per
  iteration for the whole stack). Products path only: ``"auto"`` batches exactly there. On a
  CPU torch runs a batch in sequence — a ``(2, 768, 768)`` eigh or product took as long as two
  — so batching buys nothing there and the eigh path keeps the thread pool (which overlaps two
  solves); on a GPU it replaces ``B`` launches of every product by one.
* **IEEE float32 products**: not a choice — every solve and retraction runs under
  :func:`~manifoldlib.optim.matmul_precision.ieee_float32_matmul` whatever the process's TF32
  setting, since TF32's 1e-3 error is the size of the dual's tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from .concurrent_solves import resolve_workers

__all__ = [
    "BATCH_MODES",
    "BFLOAT16_MIN_SIZE",
    "NS_DTYPES",
    "SMOOTHED_CUDA_DTYPE",
    "SPECTRAL_PATHS",
    "ExecutionPolicy",
    "native_bfloat16",
]

#: ``batch`` values of :meth:`ExecutionPolicy.resolve` (and of :class:`~manifoldlib.optim.ManifoldMuon`).
BATCH_MODES = ("auto", True, False)
#: ``ns_dtype`` values of a ManifoldMuon group: the dtype its Euclidean Newton–Schulz runs in.
NS_DTYPES = ("bfloat16", "float32", "auto")
#: How a plain dual evaluation gets its spectral factor: ``"auto"``, ``"eigh"`` or ``"products"``.
SPECTRAL_PATHS = ("auto", "eigh", "products")
#: Smallest ``n`` (columns of the ``n × n`` work) at which search products switch to bfloat16:
#: measured break-even at 128 (f32 0.026 ms, bf16 0.027 ms per product), a 1.8× gain at 256,
#: 2.1× at 768; at 64 columns bfloat16 was 2.5× slower.
BFLOAT16_MIN_SIZE = 256
#: Work dtype of a float32 solve smoothed from the start on a CUDA device (see the module docstring).
SMOOTHED_CUDA_DTYPE = torch.float64


@functools.cache
def native_bfloat16(device_type: str) -> bool:
    """Whether bfloat16 matrix products run natively (faster than float32) on this device type."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(probe()) if probe is not None else False
    return False


@dataclasses.dataclass(frozen=True)
class ExecutionPolicy:
    """The device-dependent choices of one step (see the module docstring).

    Attributes:
        ns_dtype: dtype of the Euclidean groups' Newton–Schulz.
        spectral: ``"eigh"`` or ``"products"``, the plain dual evaluations' spectral path.
        search_dtype: dtype of the search-direction products of float32 solves with at least
            ``search_min_size`` columns (``None``: the solve's own dtype).
        search_min_size: that column threshold.
        smoothed_dtype: work dtype of a float32 solve smoothed from the start (``None``: float32).
        workers: constrained matrices solved at once on CPU threads (1: one at a time).
        batch: solve the same-shape constrained matrices of a group as one batched dual (needs
            ``spectral="products"``; what a batched solve does not converge is solved per matrix).
    """

    ns_dtype: torch.dtype = torch.float32
    spectral: str = "eigh"
    search_dtype: torch.dtype | None = None
    search_min_size: int = BFLOAT16_MIN_SIZE
    smoothed_dtype: torch.dtype | None = None
    workers: int = 1
    batch: bool = False

    def __post_init__(self) -> None:
        if self.spectral not in SPECTRAL_PATHS[1:]:
            raise ValueError(f"ExecutionPolicy.spectral must be 'eigh' or 'products', got {self.spectral!r}")
        if not isinstance(self.batch, bool):
            raise ValueError(f"ExecutionPolicy.batch must be True or False, got {self.batch!r}")
        if self.batch and self.spectral != "products":
            raise ValueError(
                f"ExecutionPolicy.batch=True needs spectral='products' (the batched dual runs the "
                f"Gram-form products), got spectral={self.spectral!r}"
            )
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"ExecutionPolicy.workers must be an int >= 1, got {self.workers!r}")
        if not (isinstance(self.search_min_size, int) and self.search_min_size >= 1):
            raise ValueError(f"ExecutionPolicy.search_min_size must be an int >= 1, got {self.search_min_size!r}")

    @classmethod
    def resolve(
        cls,
        device: torch.device | str,
        *,
        ns_dtype: str = "auto",
        spectral: str = "auto",
        workers: int | str = 1,
        shapes: Sequence[Sequence[int]] = (),
        bfloat16_native: bool | None = None,
        batch: bool | str = "auto",
    ) -> ExecutionPolicy:
        """The policy for ``device`` and the group's options.

        Args:
            device: where the matrices live.
            ns_dtype: one of :data:`NS_DTYPES`.
            spectral: one of :data:`SPECTRAL_PATHS`.
            workers: an int ``>= 1`` (taken as is), or ``"auto"``, resolved for the constrained
                matrices' ``shapes`` (:func:`~manifoldlib.optim.concurrent_solves.resolve_workers`);
                always 1 off the CPU.
            bfloat16_native: whether bfloat16 products are native (``None``: probe the device,
                :func:`native_bfloat16`).
            batch: one of :data:`BATCH_MODES`: ``"auto"`` batches on the products path and not
                on the eigh path; ``True`` needs the products path; ``False`` never batches.

        Raises:
            ValueError: naming an unknown ``ns_dtype``, ``spectral``, ``workers`` or ``batch``
                value, or ``batch=True`` on the eigh path.
        """
        device = torch.device(device)
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {ns_dtype!r}")
        if spectral not in SPECTRAL_PATHS:
            raise ValueError(f"unknown spectral {spectral!r}; valid: {', '.join(SPECTRAL_PATHS)}")
        native = native_bfloat16(device.type) if bfloat16_native is None else bool(bfloat16_native)
        if not (batch is True or batch is False or batch == "auto"):
            raise ValueError(f"batch must be one of 'auto', True, False, got {batch!r}")
        resolve_workers(workers, ())  # raises on a bad value
        count = resolve_workers(workers, shapes) if workers == "auto" else workers
        path = ("products" if device.type == "cuda" else "eigh") if spectral == "auto" else spectral
        return cls(
            ns_dtype=torch.bfloat16 if ns_dtype == "bfloat16" or (ns_dtype == "auto" and native) else torch.float32,
            spectral=path,
            search_dtype=torch.bfloat16 if native else None,
            smoothed_dtype=SMOOTHED_CUDA_DTYPE if device.type == "cuda" else None,
            workers=count if device.type == "cpu" else 1,
            batch=path == "products" if batch == "auto" else batch,
        )

    def search_dtype_for(self, t: torch.Tensor) -> torch.dtype:
        """Dtype of the search products of a solve whose ``(..., n, n)`` work is like ``t``:
        :attr:`search_dtype` for float32 with ``n >=`` :attr:`search_min_size`, else ``t``'s own."""
        if self.search_dtype is not None and t.dtype == torch.float32 and t.size(-1) >= self.search_min_size:
            return self.search_dtype
        return t.dtype

    def work_dtype(self, dtype: torch.dtype, smoothed: bool) -> torch.dtype:
        """Work dtype of a solve for input ``dtype``: float32 for 16-bit input, :attr:`smoothed_dtype`
        for a float32 solve smoothed from the start, else ``dtype``."""
        if dtype in (torch.float16, torch.bfloat16):
            dtype = torch.float32
        if smoothed and dtype == torch.float32 and self.smoothed_dtype is not None:
            return self.smoothed_dtype
        return dtype

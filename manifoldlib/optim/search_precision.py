"""The precision of the dual solvers' search directions.

A dual solve checks every iterate by a residual evaluated in its own dtype; what only *proposes*
the next iterate — the preconditioned step of the plain dual, the Hessian-vector products of the
smoothed dual's conjugate gradients — tolerates a relative error of a few 1e-3. Where bfloat16
matrix products are native (CPUs with AVX512-BF16 or AMX, CUDA devices that support bfloat16)
those products run in bfloat16 for a float32 solve: two to three times faster per product on the
development machine, the same iteration counts (measured in ``docs/guides/benchmarks_optim.rst``).
Float64 solves always keep float64, and so do small ones: below :data:`BFLOAT16_MIN_SIZE`
columns a bfloat16 product is no faster (at 64 columns 2.5 times slower, and a 64×64 smoothed
DGram solve took 63 ms instead of 36).
"""

from __future__ import annotations

import torch

from .bfloat16_support import native_bfloat16

__all__ = ["BFLOAT16_MIN_SIZE", "search_dtype"]

#: Smallest ``n`` (columns of the ``n × n`` work) at which search products switch to bfloat16:
#: measured break-even at 128 on the development machine (f32 0.026 ms, bf16 0.027 ms per
#: product), a 1.8x gain at 256, 2.1x at 768.
BFLOAT16_MIN_SIZE = 256


def search_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype for search-direction products of a solve whose ``(..., n, n)`` work tensors are
    like ``t``: bfloat16 for float32 with ``n >=`` :data:`BFLOAT16_MIN_SIZE` where bfloat16 is
    native (:func:`~manifoldlib.optim.bfloat16_support.native_bfloat16`), else ``t``'s own dtype."""
    if t.dtype == torch.float32 and t.size(-1) >= BFLOAT16_MIN_SIZE and native_bfloat16(t.device.type):
        return torch.bfloat16
    return t.dtype

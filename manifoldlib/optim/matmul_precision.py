"""Full float32 matrix products inside the Manifold Muon solves, whatever the process's TF32 setting.

Training scripts commonly allow TF32 (``torch.set_float32_matmul_precision("high")``,
``torch.backends.cuda.matmul.allow_tf32 = True``) or bfloat16 passes (``"medium"``, on CPUs with
oneDNN) for float32 products. Those carry a relative error of about 1e-3, the size of the dual's
default tolerance, so a solve could no longer judge its own tangent residual and a retraction
would leave an orthogonality error of that size. Measured on an H200 (torch 2.11, precision
``"high"``): a square 768² Stiefel solve, exact in closed form, reported 1.1e-3 while its float64
residual was 3.2e-3, ran its 30 plain iterations and 30 smoothed Newton steps and took 5.1 s
instead of 1.6 ms; a square DGram solve stopped at 9.9e-3.

:func:`ieee_float32_matmul` switches the float32 matrix-product precision of the CUDA (cuBLAS)
and CPU (oneDNN) backends to IEEE float32 for the duration of a block (or a decorated function)
and restores exactly what was set before, through the per-backend ``fp32_precision`` attributes
(torch >= 2.9), so a process that uses either the legacy or the new precision API finds its
setting unchanged afterwards. Backends already at full precision are not touched. Explicit
lower-precision products (the bfloat16 search directions of
:attr:`~manifoldlib.optim.execution.ExecutionPolicy.search_dtype`) are unaffected: their operands are bfloat16 tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["FULL_PRECISION", "ieee_float32_matmul"]

#: ``fp32_precision`` values that already mean IEEE float32 products (``"none"``: not set, the default).
FULL_PRECISION = ("ieee", "none")


def _matmul_backends() -> list:
    """The per-backend matmul precision handles this torch has (cuBLAS, oneDNN)."""
    handles = (getattr(torch.backends.cuda, "matmul", None), getattr(torch.backends.mkldnn, "matmul", None))
    return [h for h in handles if h is not None and hasattr(h, "fp32_precision")]


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Run the block with IEEE float32 matrix products; restore each backend's setting after.

    Usable as a decorator (``@ieee_float32_matmul()``). Not thread-safe: the setting is global to
    the process, as torch's own is.
    """
    changed = []
    for handle in _matmul_backends():
        previous = handle.fp32_precision
        if previous not in FULL_PRECISION:
            handle.fp32_precision = "ieee"
            changed.append((handle, previous))
    try:
        yield
    finally:
        for handle, previous in changed:
            handle.fp32_precision = previous

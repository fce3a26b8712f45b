"""A dispatch-level recorder of the matrix products and factorizations a call runs: tests observe
what the library computes (which factorizations, under which matmul precision) without patching
any of its functions."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from manifoldlib.optim.execution import FULL_PRECISION, MATMUL_BACKENDS

PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "linalg_eigh",
            "_linalg_eigh", "linalg_qr", "linalg_svd", "_linalg_svd", "linalg_cholesky_ex",
            "linalg_solve_ex", "_linalg_solve_ex"}


def full_precision_now() -> bool:
    return all(h.fp32_precision in FULL_PRECISION for h in MATMUL_BACKENDS)


class ProductRecorder(TorchDispatchMode):
    """``seen``: ``(op name, IEEE float32 at that moment)`` for every floating-point product or
    factorization run inside the block."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.seen]

    def factorizations(self) -> list[str]:
        """The factorizations run, in order, by kind: ``"eigh"``, ``"svd"``, ``"qr"``,
        ``"cholesky"``, ``"solve"`` (the products left out)."""
        kinds = ("eigh", "svd", "qr", "cholesky", "solve")
        return [next(k for k in kinds if k in name) for name in self.names if any(k in name for k in kinds)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in PRODUCTS and any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args):
            self.seen.append((name, full_precision_now()))
        return func(*args, **(kwargs or {}))


class KernelRecorder(TorchDispatchMode):
    """``calls``: the names of the library's own C++ CPU kernels (the ``manifoldlib_cpu`` ops) run
    inside the block, forward and backward, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "manifoldlib_cpu":
            self.calls.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

r"""Device-independent cost counts of a call: ATen operations, host synchronizations and FLOPs.

What a step costs on a GPU is mostly decided by three numbers that can be read on any machine:

* **operations** — every ATen operator that is not a view (``view``, ``transpose``, ``select``,
  ``expand``, ... make no kernel). On a GPU each is about one kernel launch, and a small model's
  optimizer step is bound by launches, not arithmetic;
* **host synchronizations** — ``_local_scalar_dense`` (what ``.item()``, ``float(t)`` and
  ``bool(t)`` run), ``nonzero``, ``is_nonzero``, ``equal`` and ``allclose`` (which answer a Python
  bool), and the reads that dispatch nothing on a CPU tensor but copy a GPU tensor to the host:
  ``t.tolist()``, ``t.numpy()``, ``numpy.asarray(t)`` and ``repr(t)`` (:data:`HOST_READ_METHODS`,
  counted on the calling thread). Each waits for the device to drain its queue, so the host can no
  longer run ahead;
* **FLOPs** — :class:`torch.utils.flop_counter.FlopCounterMode`'s count (matrix products,
  convolutions, attention).

:func:`count_ops` runs a callable under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
and returns an :class:`OpCounts`. It sees what the call dispatches, on any device (the CPU
included), so a test can assert "no host synchronization in an optimizer step" without a GPU.

.. code-block:: python

    from manifoldlib.testing import count_ops

    counts = count_ops(optimizer.step)
    assert counts.syncs == 0
    print(counts.ops, counts.flops, counts.by_name.most_common(5))
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["HOST_READ_METHODS", "SYNC_OPS", "OpCounts", "count_ops"]

#: ATen operators that make the host wait for the device.
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "nonzero_static", "equal",
                      "allclose"})
#: Tensor methods that read a tensor's values on the host without dispatching an operator on a CPU
#: tensor (on a GPU tensor they copy it to the host first): each call counts as a synchronization.
HOST_READ_METHODS = ("tolist", "numpy", "__array__", "__repr__")


@dataclass
class OpCounts:
    """What :func:`count_ops` saw.

    Attributes:
        ops: ATen operators run that are not views (about one kernel launch each on a GPU).
        syncs: host synchronizations (:data:`SYNC_OPS`).
        flops: floating-point operations (:class:`~torch.utils.flop_counter.FlopCounterMode`).
        by_name: operator name -> count, views left out (and the :data:`HOST_READ_METHODS` called,
            by method name: host reads, not operators).
        result: what the call returned.
    """

    ops: int = 0
    syncs: int = 0
    flops: int = 0
    by_name: Counter = field(default_factory=Counter)
    result: Any = None


class _Recorder(TorchDispatchMode):
    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        is_view = bool(getattr(func, "is_view", False)) or torch.Tag.view_copy in func.tags \
            or name in ("view", "_unsafe_view", "alias", "detach", "lift_fresh")
        if not is_view:
            self.counts.ops += 1
            self.counts.by_name[name] += 1
        if name in SYNC_OPS:
            self.counts.syncs += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> OpCounts:
    """Run ``fn()`` and count its non-view ATen operators, host synchronizations and FLOPs.

    Nested inside an outer dispatch mode it counts what reaches it; under ``torch.compile`` it
    counts what the compiled graph dispatches (so count eager code).

    Returns:
        An :class:`OpCounts` (``result`` holds what ``fn`` returned).
    """
    counts = OpCounts()
    flop_mode = FlopCounterMode(display=False)
    thread = threading.get_ident()
    own = {name: torch.Tensor.__dict__.get(name) for name in HOST_READ_METHODS}  # None: inherited
    inside = 0  # one read counts once (repr runs tolist, __array__ numpy)

    def counted(name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def read(self, *args, **kwargs):
            nonlocal inside
            if threading.get_ident() != thread:
                return method(self, *args, **kwargs)
            if not inside:
                counts.syncs += 1
                counts.by_name[name] += 1
            inside += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                inside -= 1
        return read

    for name in HOST_READ_METHODS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        with flop_mode, _Recorder(counts):
            counts.result = fn()
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
    counts.flops = int(flop_mode.get_total_flops())
    return counts

r"""Device-independent cost counts of a call: ATen operations, host synchronizations and FLOPs.

What a step costs on a GPU is mostly decided by three numbers that can be read on any machine:

* **operations** — every ATen operator that is not a view (``view``, ``transpose``, ``select``,
  ``expand``, ... make no kernel). On a GPU each is about one kernel launch, and a small model's
  optimizer step is bound by launches, not arithmetic;
* **host synchronizations** — ``_local_scalar_dense`` (what ``.item()``, ``float(t)`` and
  ``bool(t)`` run), ``nonzero``, ``is_nonzero``, ``equal`` and ``allclose`` (which answer a Python
  bool); the error check of ``torch.linalg.cholesky`` / ``inv`` / ``solve`` / ``lu_factor`` /
  ``ldl_factor`` (``_linalg_check_errors``; their ``_ex`` twins skip it); the operators whose
  output size depends on the values, which a GPU reads back to allocate the output (:data:`SYNC_OPS`,
  and :func:`is_sync` for those that read only with some arguments: indexing with a boolean mask,
  ``repeat_interleave`` without ``output_size``, ``histc`` with ``min == max``); and the reads that
  dispatch nothing on a CPU tensor but copy a GPU tensor to the host: ``t.tolist()``,
  ``t.numpy()``, ``numpy.asarray(t)`` and ``repr(t)`` (:data:`HOST_READ_METHODS`), and
  ``torch.tensor`` / ``torch.as_tensor`` of a list that holds tensors (:data:`HOST_READ_FUNCTIONS`),
  counted on the calling thread. Each waits for the device to drain its queue, so the host can no
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

__all__ = ["HOST_READ_FUNCTIONS", "HOST_READ_METHODS", "SYNC_OPS", "OpCounts", "count_ops", "is_sync"]

#: ATen operators that make the host wait for the device: scalar reads, the linalg error check
#: (``torch.linalg.cholesky``, ``inv``, ``solve``, ``lu_factor``, ``ldl_factor``) and the
#: eigendecompositions and SVDs (``eigh``, ``eigvalsh``, ``svd``, ``svdvals``, ``pinv``): "synchronizes
#: that device with the CPU", torch's documentation; and operators whose output size depends on the
#: values (a GPU reads the size back before it can allocate the output).
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "nonzero_static", "equal",
                      "allclose", "_linalg_check_errors", "masked_select", "_unique", "_unique2", "unique_dim",
                      "unique_consecutive", "unique_dim_consecutive", "bincount",
                      "_linalg_eigh", "_linalg_svd", "linalg_pinv"})
#: Tensor methods that read a tensor's values on the host without dispatching an operator on a CPU
#: tensor (on a GPU tensor they copy it to the host first): each call counts as a synchronization.
HOST_READ_METHODS = ("tolist", "numpy", "__array__", "__repr__")
#: torch functions that read the values of the tensors in a list they are given on the host
#: (``torch.tensor([loss_a, loss_b])``) without dispatching an operator: such a call counts as one
#: synchronization (given a tensor itself, they copy it on its device and read nothing).
HOST_READ_FUNCTIONS = ("tensor", "as_tensor")

_MASK_DTYPES = (torch.bool, torch.uint8)
_INDEX_PUTS = ("index_put", "index_put_", "_index_put_impl_")


def _masks(indices) -> list[torch.Tensor]:
    return [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES]


def is_sync(func, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether the ATen operator ``func`` called with ``args`` and ``kwargs`` makes the host wait
    for the device: one of :data:`SYNC_OPS`, or an operator whose output size depends on the
    values only with some arguments — ``index`` with a boolean (or uint8) mask (``x[mask]``),
    ``index_put_`` with one unless it becomes a ``masked_fill_`` (not accumulating, one mask, a
    one-element value on the CPU: ``x[mask] = 0.0``), ``repeat_interleave`` with a tensor of
    repeats and no ``output_size``, ``histc`` with ``min == max`` (the default: it reads the range
    of the values)."""
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    kwargs = kwargs or {}
    if name == "index":
        return bool(_masks(args[1] if len(args) > 1 else kwargs.get("indices")))
    if name in _INDEX_PUTS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        masks = _masks(indices)
        if not masks:
            return False
        value = args[2] if len(args) > 2 else kwargs.get("values")
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        tensors = [i for i in indices if i is not None]
        masked_fill = (not accumulate and len(tensors) == 1 and isinstance(value, torch.Tensor)
                       and value.numel() == 1 and value.device.type == "cpu")
        return not masked_fill
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0] if args else None
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "histc":
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        return low == high
    return False


def _holds_tensor(data) -> bool:
    return isinstance(data, (list, tuple)) and any(
        isinstance(d, torch.Tensor) or _holds_tensor(d) for d in data)


@dataclass
class OpCounts:
    """What :func:`count_ops` saw.

    Attributes:
        ops: ATen operators run that are not views (about one kernel launch each on a GPU).
        syncs: host synchronizations (:func:`is_sync`, :data:`HOST_READ_METHODS`,
            :data:`HOST_READ_FUNCTIONS`).
        flops: floating-point operations (:class:`~torch.utils.flop_counter.FlopCounterMode`).
        by_name: operator name -> count, views left out (and the :data:`HOST_READ_METHODS` and
            :data:`HOST_READ_FUNCTIONS` that read, by name: host reads, not operators).
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
        if is_sync(func, args, kwargs):
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
    functions = {name: getattr(torch, name) for name in HOST_READ_FUNCTIONS}
    inside = 0  # one read counts once (repr runs tolist, __array__ numpy)

    def counted(name: str, method: Callable, reads: Callable[..., bool] = lambda *_, **__: True) -> Callable:
        @functools.wraps(method)
        def read(*args, **kwargs):
            nonlocal inside
            if threading.get_ident() != thread:
                return method(*args, **kwargs)
            if not inside and reads(*args, **kwargs):
                counts.syncs += 1
                counts.by_name[name] += 1
            inside += 1
            try:
                return method(*args, **kwargs)
            finally:
                inside -= 1
        return read

    for name in HOST_READ_METHODS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for name, function in functions.items():  # a list of tensors is read element by element
        setattr(torch, name, counted(name, function, lambda data=None, *_, **__: _holds_tensor(data)))
    try:
        with flop_mode, _Recorder(counts):
            counts.result = fn()
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        for name, function in functions.items():
            setattr(torch, name, function)
    counts.flops = int(flop_mode.get_total_flops())
    return counts

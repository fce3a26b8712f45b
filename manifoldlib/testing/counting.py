r"""Device-independent cost counts of a call: ATen operations, host synchronizations and FLOPs.

What a step costs on a GPU is mostly decided by three numbers that can be read on any machine:

* **operations** — every ATen operator that is not a view (``view``, ``transpose``, ``select``,
  ``expand``, ... make no kernel). On a GPU each is about one kernel launch, and a small model's
  optimizer step is bound by launches, not arithmetic;
* **host synchronizations** — what makes the host wait for a CUDA device to drain its queue, so
  that it can no longer run ahead (:func:`is_sync` answers for a CUDA device whatever device the
  tensors are on, so a CPU run stands in for a GPU one):

  - ``_local_scalar_dense`` (what ``.item()``, ``float(t)`` and ``bool(t)`` run), ``nonzero``,
    ``is_nonzero``, ``equal`` and ``allclose`` (which answer a Python bool);
  - the error check of ``torch.linalg.cholesky`` / ``inv`` / ``solve`` / ``lu_factor`` /
    ``ldl_factor`` / ``lstsq`` (``_linalg_check_errors``; their ``_ex`` twins skip it) and the decompositions
    torch documents as synchronizing (``eigh``, ``eigvalsh``, ``eig``, ``eigvals``, ``svd``,
    ``svdvals``, ``pinv``);
  - the operators whose output size depends on the values, which a GPU reads back to allocate the
    output (:data:`SYNC_OPS`; the backward of ``masked_scatter`` too, not its forward), and those that
    read only with some arguments: indexing with a
    boolean mask, ``index_put_`` that accumulates (``x.index_put_(i, v, accumulate=True)``: CUDA
    reads the largest and smallest index to check them), ``repeat_interleave`` without
    ``output_size``, ``histc`` with ``min == max`` (:func:`is_sync`);
  - a copy between the host and a device that the host waits for (``_to_copy`` / ``copy_`` without
    ``non_blocking``; a device-to-host ``copy_`` into pageable memory even with it), and an index
    tensor on the host given to a device tensor (ATen moves it with such a copy);
  - the reads that dispatch nothing on a CPU tensor but copy a GPU tensor to the host:
    ``t.cpu()``, ``t.tolist()``, ``t.numpy()``, ``numpy.asarray(t)`` and ``repr(t)``
    (:data:`HOST_READ_METHODS`), and ``torch.tensor`` / ``torch.as_tensor`` of a list that holds
    tensors (:data:`HOST_READ_FUNCTIONS`), counted on the calling thread, each once;

* **FLOPs** — :class:`torch.utils.flop_counter.FlopCounterMode`'s count (matrix products,
  convolutions, attention).

:func:`count_ops` runs a callable under a :class:`~torch.utils._python_dispatch.TorchDispatchMode`
and returns an :class:`OpCounts`. It sees what the call dispatches, on any device (the CPU
included), so a test can assert "no host synchronization in an optimizer step" without a GPU.

**What a CPU-only run cannot see.** A copy is visible by its devices: on a machine whose tensors
are all on the CPU, ``t.to("cpu")``, ``t.to(p.device)``, ``t.to("cpu", copy=True)``,
``dst.copy_(t)`` and ``x[host_index]`` copy from the host to the host, which is no
synchronization, while the same code on a GPU may copy to or from the device and wait (``t.cpu()``
alone is counted always: it has no other use). To see them, run the code on tensors that report a
CUDA device: under :class:`torch._subclasses.fake_tensor.FakeTensorMode`,
``torch.empty(n, device="cuda")`` makes one without CUDA, and every copy across devices is counted
as on a GPU. Such a tensor has no values: a read of one (``.item()`` included) raises
``DataDependentOutputException``, itself the sign of a synchronization. On a build without CUDA
most operators run on them (elementwise, reductions, matrix products, decompositions,
``.to(device)``, ``.cpu()``); a few raise ``RuntimeError`` (``copy_`` into one, ``.to("cuda")``
by name, indexing with a tensor).

.. code-block:: python

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, device="cuda")
        assert count_ops(lambda: x.to("cpu")).syncs == 1
        assert count_ops(lambda: x.to("cpu", non_blocking=True)).syncs == 0

.. code-block:: python

    from manifoldlib.testing import count_ops

    counts = count_ops(optimizer.step)
    assert counts.syncs == 0
    print(counts.ops, counts.flops, counts.by_name.most_common(5))
"""

from __future__ import annotations

import functools
import struct
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
#: eigendecompositions and SVDs (``eigh``, ``eigvalsh``, ``eig``, ``eigvals``, ``svd``, ``svdvals``,
#: ``pinv``): "synchronizes that device with the CPU", torch's documentation; and operators whose
#: output size depends on the values (a GPU reads the size back before it can allocate the output;
#: not ``nonzero_static``, whose size is given: its CUDA kernels count and pad on the device,
#: aten/src/ATen/native/cuda/Nonzero.cu, ``nonzero_static_cuda_out_impl``).
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal",
                      "allclose", "_linalg_check_errors", "masked_select", "_unique", "_unique2", "unique_dim",
                      "unique_consecutive", "unique_dim_consecutive", "bincount",
                      "_linalg_eigh", "_linalg_svd", "linalg_pinv", "linalg_eig", "linalg_eigvals",
                      # linalg_lstsq_out ends in _linalg_check_errors(infos, ...) for every driver, CUDA's
                      # 'gels' included (aten/src/ATen/native/BatchLinearAlgebra.cpp, linalg_lstsq_out),
                      # which reads infos.any().item(); one op here, its check runs inside it
                      "linalg_lstsq",
                      # autograd's backward of masked_scatter: grad.masked_select(mask), then a cat sized
                      # by the count (aten/src/ATen/native/TensorAdvancedIndexing.cpp,
                      # masked_scatter_backward_symint). The forward masked_scatter_ reads nothing: CUDA
                      # sums the mask on the device and checks it against the source in a kernel
                      # (aten/src/ATen/native/cuda/IndexKernel.cu, launch_masked_scatter_kernel)
                      "masked_scatter_backward"})
#: Tensor methods that read a tensor's values on the host, or copy it there, without dispatching an
#: operator on a CPU tensor (on a GPU tensor they copy it to the host first): each call counts as a
#: synchronization (``cpu`` once, not again for the copy it dispatches on a device tensor).
HOST_READ_METHODS = ("cpu", "tolist", "numpy", "__array__", "__repr__")
#: torch functions that read the values of the tensors in a list they are given on the host
#: (``torch.tensor([loss_a, loss_b])``) without dispatching an operator: such a call counts as one
#: synchronization (given a tensor itself, they copy it on its device and read nothing).
HOST_READ_FUNCTIONS = ("tensor", "as_tensor")

_MASK_DTYPES = (torch.bool, torch.uint8)
_INDEX_PUTS = ("index_put", "index_put_", "_index_put_impl_")
#: The autograd node whose backward puts with ``_index_put_impl_(..., unsafe=True)``: unobserved it
#: skips the index check; under a dispatch mode it calls ``index_put`` instead (``index_backward``).
_UNSAFE_PUT_NODE = "IndexBackward0"


def _masks(indices) -> list[torch.Tensor]:
    return [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES]


def _arg(args: tuple, kwargs: dict, position: int, name: str, default=None):
    return args[position] if len(args) > position else kwargs.get(name, default)


def _crosses(a: torch.device, b: torch.device) -> bool:
    """Whether a copy between ``a`` and ``b`` goes between the host and a device (a CUDA device, or
    a tensor that reports one under ``FakeTensorMode``)."""
    kinds = {a.type, b.type}
    return "cpu" in kinds and bool(kinds - {"cpu", "meta"})


def _pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # no accelerator to ask
        return False


def _histc_bound(value, dtype: torch.dtype):
    """``value`` as CUDA's histc compares its bounds: in ``acc_type`` of ``dtype`` (int64 for
    integers, float64 for float64, float32 otherwise)."""
    value = float(value)
    if not dtype.is_floating_point:
        return int(value) if abs(value) < float("inf") else value
    if dtype == torch.float64:
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return value


def _copy_waits(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> bool:
    """Whether ``dst.copy_(src, non_blocking)`` makes the host wait (aten/src/ATen/native/cuda/Copy.cu,
    ``copy_kernel_cuda``: a blocking copy between the host and a device ends in
    ``memcpy_and_sync``; a non-blocking one is a ``cudaMemcpyAsync``, which returns before the
    copy only to or from pinned host memory or from the host)."""
    if not _crosses(dst.device, src.device) or dst.numel() == 0:
        return False
    return not non_blocking or (dst.device.type == "cpu" and not _pinned(dst))


def _moves_indices(self: torch.Tensor, indices) -> bool:
    """An index tensor on the host given to a device tensor: ATen's ``make_info`` moves it with a
    blocking ``.to(self.device())`` (aten/src/ATen/native/TensorAdvancedIndexingUtils.h)."""
    return any(isinstance(i, torch.Tensor) and _crosses(i.device, self.device) for i in indices or ())


def _index_put_reads(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``index_put_`` (or ``index_put``, ``_index_put_impl_``) reads device values on the
    host, as ATen's ``_index_put_impl_`` (aten/src/ATen/native/TensorAdvancedIndexing.cpp) runs on
    a CUDA device:

    * not accumulating, one boolean mask on ``self``'s device and a one-element value on the host
      become ``masked_fill_`` (``canDispatchToMaskedFill``): nothing read (``x[mask] = 0.0``);
    * otherwise a mask is expanded by ``nonzero``, and a host index is moved by a blocking copy;
    * accumulating (or any put under ``torch.use_deterministic_algorithms`` with a value of more
      than one element) takes ``index_put_with_sort_kernel``
      (aten/src/ATen/native/cuda/Indexing.cu), whose ``wrapIndexOnce`` reads each index's
      ``max()`` and ``min()`` with ``.item()`` to check its range, unless ``unsafe`` (autograd's
      backward of ``x[index]``).
    """
    self = args[0]
    indices = _arg(args, kwargs, 1, "indices") or ()
    value = _arg(args, kwargs, 2, "values")
    accumulate = bool(_arg(args, kwargs, 3, "accumulate", False))
    unsafe = name == "_index_put_impl_" and bool(_arg(args, kwargs, 4, "unsafe", False))
    node = torch._C._current_autograd_node()
    unsafe = unsafe or (node is not None and node.name() == _UNSAFE_PUT_NODE)
    given = [i for i in indices if i is not None]
    masks = _masks(given)
    if (not accumulate and len(given) == 1 and masks and masks[0].device == self.device
            and isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"):
        return False
    if masks or _moves_indices(self, given):
        return True
    many = isinstance(value, torch.Tensor) and value.numel() > 1
    sorted_put = accumulate or (torch.are_deterministic_algorithms_enabled() and many)
    return sorted_put and not unsafe and any(i.numel() > 0 for i in given)


def is_sync(func, args: tuple = (), kwargs: dict | None = None) -> bool:
    """Whether the ATen operator ``func`` called with ``args`` and ``kwargs`` makes the host wait
    for a CUDA device, as it would with the same arguments on one (whatever device they are on):
    one of :data:`SYNC_OPS`, or an operator that reads device values only with some arguments —

    * ``index`` with a boolean (or uint8) mask (``x[mask]``) or with an index tensor on the host
      for a device tensor;
    * ``index_put_`` with a mask unless it becomes a ``masked_fill_`` (``x[mask] = 0.0`` does not
      read), accumulating (``x.index_put_((i,), v, accumulate=True)``: CUDA's range check reads
      each index tensor's largest and smallest entry; not in autograd's backward of ``x[i]``,
      which skips the check), or with a host index for a device tensor;
    * ``repeat_interleave`` with a tensor of repeats and no ``output_size``;
    * ``histc`` of a non-empty tensor with ``min == max`` as CUDA compares them (the default: it
      reads the range of the values; aten/src/ATen/native/cuda/SummaryOps.cu,
      ``_histc_cuda_template``);
    * ``linalg_matrix_exp`` of matrices larger than ``1 x 1`` (it reads their norms and its
      number of squarings to the host, aten/src/ATen/native/LinearAlgebra.cpp, ``mexp_impl``);
    * ``masked_fill_`` with a value tensor on a device, which CUDA reads with ``.item()``
      (aten/src/ATen/native/cuda/Indexing.cu, ``masked_fill__cuda``; a host value is read
      without waiting);
    * ``_to_copy`` (``.to``, ``.cpu()``, ``.cuda()``) and ``copy_`` between the host and a device,
      unless non-blocking (``.to("cpu", non_blocking=True)`` copies into pinned memory; a
      non-blocking ``copy_`` to the host still waits unless its destination is pinned).
    """
    name = func.overloadpacket.__name__
    if name in SYNC_OPS:
        return True
    kwargs = kwargs or {}
    if name == "index":
        indices = _arg(args, kwargs, 1, "indices")
        return bool(_masks(indices)) or _moves_indices(args[0], indices)
    if name in _INDEX_PUTS:
        return _index_put_reads(name, args, kwargs)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else args[0] if args else None
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "histc":
        low, high = _arg(args, kwargs, 2, "min", 0), _arg(args, kwargs, 3, "max", 0)
        return args[0].numel() > 0 and _histc_bound(low, args[0].dtype) == _histc_bound(high, args[0].dtype)
    if name == "linalg_matrix_exp":  # mexp_impl reads the 1-norms to the host to pick a degree, then the
        # squaring counts (aten/src/ATen/native/LinearAlgebra.cpp: norm.to(kCPU), s.to(kCPU)); 1 x 1 is exp
        return args[0].numel() > 0 and args[0].size(-1) > 1
    if name in ("masked_fill", "masked_fill_"):  # CUDA's Tensor overload runs value.item()
        value = _arg(args, kwargs, 2, "value")
        return isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")
    if name == "_to_copy":
        source = args[0]
        target = torch.device(kwargs.get("device") or source.device)
        return (_crosses(source.device, target) and source.numel() > 0
                and not kwargs.get("non_blocking", False))
    if name == "copy_":
        return _copy_waits(args[0], _arg(args, kwargs, 1, "src"), bool(_arg(args, kwargs, 2, "non_blocking", False)))
    if name == "_copy_from":  # self copied into dst, for devices copy_ hands over (XLA, ...)
        return _copy_waits(_arg(args, kwargs, 1, "dst"), args[0], bool(_arg(args, kwargs, 2, "non_blocking", False)))
    if name == "_copy_from_and_resize":
        return _copy_waits(_arg(args, kwargs, 1, "dst"), args[0], False)
    return False


def _holds_tensor(data) -> bool:
    return isinstance(data, (list, tuple)) and any(
        isinstance(d, torch.Tensor) or _holds_tensor(d) for d in data)


@dataclass
class OpCounts:
    """What :func:`count_ops` saw.

    Attributes:
        ops: ATen operators run that are not views nor ``prim`` queries of metadata (about one
            kernel launch each on a GPU).
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
    def __init__(self, counts: OpCounts, reading: Callable[[], bool]) -> None:
        super().__init__()
        self.counts = counts
        self.reading = reading  # inside a counted host read: its copy or scalar reads are that read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        is_view = bool(getattr(func, "is_view", False)) or torch.Tag.view_copy in func.tags \
            or name in ("view", "_unsafe_view", "alias", "detach", "lift_fresh")
        if not is_view and func.namespace != "prim":  # prim: a query of metadata (a fake tensor's device)
            self.counts.ops += 1
            self.counts.by_name[name] += 1
        if not self.reading() and is_sync(func, args, kwargs):
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
    inside = 0  # one read counts once (repr runs tolist, __array__ numpy, cpu a copy)

    def counted(name: str, method: Callable, reads: Callable[..., bool] = lambda *_, **__: True) -> Callable:
        @functools.wraps(method)
        def read(*args, **kwargs):
            nonlocal inside
            if threading.get_ident() != thread:
                return method(*args, **kwargs)
            if not inside:
                if not reads(*args, **kwargs):  # torch.tensor of numbers: its copies count as they go
                    return method(*args, **kwargs)
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
        with flop_mode, _Recorder(counts, lambda: inside > 0 and threading.get_ident() == thread):
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

"""Reject parameter layouts that per-matrix manifold updates would silently get wrong.

A manifold step (a Stiefel or DGram dual solve, a retraction) needs the *whole* matrix: the
polar factor of a row shard is not a shard of the polar factor. Sharded parameter layouts
therefore cannot be updated locally:

- :class:`torch.distributed.tensor.DTensor` parameters (FSDP2 ``fully_shard``, tensor
  parallelism, ``distribute_tensor``) hold one shard per rank: an optimizer that gathers whole
  matrices (ManifoldMuon) takes the rows FSDP2 gives each rank, ``Shard(0)`` on a one-dimensional
  mesh (``allow_row_shards=True``, :func:`is_row_sharded`); other placements are refused, naming
  them;
- FSDP1 (:class:`~torch.distributed.fsdp.FullyShardedDataParallel`) flattens a module's
  parameters into one ``FlatParameter``, and with ``use_orig_params=True`` exposes the
  originals as 1-D views into the local shard, marked ``_fsdp_flattened``.

:func:`reject_unsupported_parameter` raises :class:`UnsupportedParameterError` for all of these,
so a manifold optimizer fails at construction instead of training on a wrong geometry.
DistributedDataParallel keeps every parameter whole and replicated and is supported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["UnsupportedParameterError", "is_row_sharded", "reject_unsupported_parameter"]

# Attributes FSDP1 sets: on a FlatParameter, and on every parameter it flattened.
_FLAT_PARAM_ATTRIBUTE = "_is_flat_param"
_FSDP_FLATTENED_ATTRIBUTE = "_fsdp_flattened"

_ADVICE = (
    "manifold updates need whole matrices on every rank: wrap the model with "
    "DistributedDataParallel instead (whole, replicated parameters), or give this parameter "
    "to an elementwise optimizer (AdamW)"
)


class UnsupportedParameterError(TypeError, ValueError):
    """A parameter is sharded (DTensor / FSDP) and cannot take a per-matrix manifold step.

    Subclasses both :class:`TypeError` (the tensor type is the problem) and
    :class:`ValueError` (the project's convention for bad input), so either ``except`` works.
    """


def _dtensor_type() -> type | None:
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # very old builds; the FSDP checks below still apply
        return None
    return DTensor


def is_row_sharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor placed ``Shard(0)`` on a one-dimensional mesh (FSDP2's
    parameters): each rank holds a block of its rows."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return False
    from torch.distributed.tensor import Shard

    return param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),)


def reject_unsupported_parameter(param: torch.Tensor, name: str | None = None, *,
                                 allow_row_shards: bool = False) -> None:
    """Raise if ``param`` is sharded (DTensor or FSDP); do nothing for a whole tensor.

    Args:
        param: a parameter (or any tensor) about to be given to a manifold optimizer.
        name: its name in the model, used in the message.
        allow_row_shards: accept FSDP2's parameters too (:func:`is_row_sharded`: ``Shard(0)`` on
            a one-dimensional mesh), for an optimizer that gathers whole matrices itself.

    Raises:
        UnsupportedParameterError: ``param`` is a DTensor (with ``allow_row_shards``: one placed
            other than ``Shard(0)`` on a one-dimensional mesh, e.g. tensor parallel's
            ``Shard(1)``, ``Replicate()`` or a two-dimensional mesh), an FSDP ``FlatParameter``,
            or an original parameter flattened by FSDP (``use_orig_params=True``).
        TypeError: ``param`` is not a tensor at all.
    """
    label = f"parameter {name!r}" if name is not None else "a parameter"
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{label} must be a torch.Tensor, got {type(param).__name__}")
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(param, dtensor):
        if allow_row_shards:
            if is_row_sharded(param):
                return
            raise UnsupportedParameterError(
                f"{label} is a DTensor placed {tuple(param.placements)} on a mesh of shape "
                f"{tuple(param.device_mesh.shape)}; ManifoldMuon takes FSDP2's placement, (Shard(dim=0),) on a "
                f"one-dimensional mesh (fully_shard), and gathers whole matrices itself: tensor-parallel and "
                f"other placements are not supported (give this parameter to AdamW, or shard the model with "
                f"fully_shard only)")
        raise UnsupportedParameterError(
            f"{label} is a DTensor (global shape {tuple(param.shape)}, placements "
            f"{tuple(param.placements)}, mesh of {param.device_mesh.size()} ranks), as made by "
            f"FSDP2 fully_shard or tensor parallelism; {_ADVICE}"
        )
    if getattr(param, _FLAT_PARAM_ATTRIBUTE, False):
        raise UnsupportedParameterError(
            f"{label} is an FSDP FlatParameter (shape {tuple(param.shape)}) holding a flattened "
            f"shard of several parameters; {_ADVICE}"
        )
    if getattr(param, _FSDP_FLATTENED_ATTRIBUTE, False):
        raise UnsupportedParameterError(
            f"{label} was flattened by FSDP (use_orig_params=True; local shape "
            f"{tuple(param.shape)} is a view into this rank's shard); {_ADVICE}"
        )

r"""Global gradient-norm clipping whose norm does not overflow on a finite gradient.

The global norm is :math:`\|g\| = \sqrt{\sum_t \|g_t\|^2}` over the gradients :math:`g_t` of all
parameters; clipping multiplies every :math:`g_t` by :math:`\min(1, c / (\|g\| + 10^{-6}))` for
the limit :math:`c`.

:func:`torch.nn.utils.clip_grad_norm_` sums the squares in the gradients' dtype: a float32
gradient with entries of about :math:`10^{19}` (an exploding but finite gradient) has a norm of
``inf`` there, and torch then multiplies every gradient by :math:`c/\infty = 0`. A trainer would
read that as non-finite gradients. :func:`clip_grad_norm` computes the norm the fast way first
and, only when that is not finite, again with every tensor scaled by its largest entry,
:math:`\|x\| = s\,\|x/s\|` with :math:`s = \max_i |x_i|` (per tensor, then over the per-tensor
norms), which is finite whenever the true norm is below the dtype's largest value. A gradient
with an ``inf`` or ``nan`` entry keeps its non-finite norm, and is left unclipped.

Under FSDP2 (:mod:`models.fsdp`) the gradients are :class:`~torch.distributed.tensor.DTensor`\ s,
each rank holding some rows, beside the plain gradients of the parameters FSDP2 leaves whole.
Both measurements are then the global norm, the same on every rank, without code of their own:
the norm of a DTensor is a partial result that DTensor sums over the mesh (one all-reduce for the
fast norm of all gradients; one per gradient for the rare rescaled one), a plain gradient counts
once, and every rank scales its shards by the same factor. So the clipped gradient is a single
process's up to the rounding of the sums (``tests/distributed/test_train_fsdp.py``). Every rank
must clip: it is a collective.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["clip_grad_norm", "global_norm"]


def _scaled_norm(x: torch.Tensor) -> torch.Tensor:
    r""":math:`\|x\|_2 = s\,\|x / s\|_2` with :math:`s = \max_i |x_i|` (a zero tensor: 0)."""
    x = x.detach()
    top = x.abs().amax()
    return top * torch.linalg.vector_norm(x / top.clamp_min(torch.finfo(x.dtype).tiny))


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of ``grads`` without overflow (module docstring), a 0-dim tensor on the
    first gradient's device, in float64 if any gradient is float64, else float32."""
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device
    return _scaled_norm(torch.stack([_scaled_norm(g).to(device=device, dtype=dtype)
                                     for g in grads]))


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm of ``parameters`` to ``max_norm`` in place.

    Args:
        parameters: the parameters; those without a gradient are skipped.
        max_norm: the limit :math:`c`; ``math.inf`` only measures the norm.

    Returns:
        The global norm before clipping, a float: finite for every finite gradient whose norm
        the dtype can hold, ``inf`` or ``nan`` for a gradient with a non-finite entry (then
        nothing is scaled). 0.0 when no parameter has a gradient.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    value = float(norm)
    if not math.isfinite(value):  # overflow of the squares, or a non-finite entry
        rescaled = global_norm(grads)
        if math.isfinite(float(rescaled)):
            norm, value = rescaled, float(rescaled)
    if math.isfinite(value) and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return value

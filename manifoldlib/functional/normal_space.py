r"""The normal spaces of the matrix constraints :math:`\mathcal{M}(W^\top W) = \mathcal{M}(I)`, written once.

Stiefel (:math:`W^\top W = I`), DGram (:math:`\operatorname{Off}(W^\top W) = 0`) and Oblique
(:math:`\operatorname{Diag}(W^\top W) = I`) differ only in the projector :math:`\mathcal{P}` onto
the symmetric multipliers they constrain: the identity, :func:`off_diagonal` and
:func:`diagonal_part` (:doc:`/theory/matrix_constraints`). Their normal space at a point is
:math:`\{WS: S = \mathcal{P}(S) \text{ symmetric}\}` and, where the constrained entries of
:math:`W^\top W` are those of :math:`\operatorname{diag}(d^2)` (:math:`d_j = \|w_j\|`), the
orthogonal projection of :math:`Z` onto it is :math:`WS` with

.. math::

    S_{ij} = \mathcal{P}(W^\top Z + Z^\top W)_{ij} / (d_i^2 + d_j^2),

the normal-space metric :math:`(d_i^2 + d_j^2)/2` being diagonal in the entries of ``S``
(:func:`normal_metric`). The steepest-direction dual of :mod:`manifoldlib.optim` and the tangent
projections of :mod:`manifoldlib.manifolds` both take these formulas from here.
"""

from __future__ import annotations

import torch

__all__ = ["diagonal_part", "normal_metric", "normal_multiplier", "off_diagonal"]


def off_diagonal(a: torch.Tensor) -> torch.Tensor:
    r""":math:`\operatorname{Off}(A)`: ``a`` with its diagonal zeroed, ``(..., n, n)``."""
    return a - torch.diag_embed(torch.diagonal(a, dim1=-2, dim2=-1))


def diagonal_part(a: torch.Tensor) -> torch.Tensor:
    r""":math:`\operatorname{Diag}(A)`: ``a`` with its off-diagonal entries zeroed, ``(..., n, n)``."""
    return torch.diag_embed(torch.diagonal(a, dim1=-2, dim2=-1))


def normal_metric(d2: torch.Tensor) -> torch.Tensor:
    r"""``(..., n, n)`` metric :math:`(d_i^2 + d_j^2)/2` of the normal space in the entries of ``S``,
    from the squared column norms ``d2`` ``(..., n)``."""
    return 0.5 * (d2.unsqueeze(-1) + d2.unsqueeze(-2))


def normal_multiplier(w: torch.Tensor, z: torch.Tensor, mask) -> torch.Tensor:
    r""":math:`S = \mathcal{P}(W^\top Z + Z^\top W)/(d_i^2 + d_j^2)` with ``mask`` :math:`= \mathcal{P}`.

    ``WS`` is the normal component of ``Z`` at ``W`` (``(..., m, n)`` both) when the constrained
    entries of :math:`W^\top W` are diagonal. Returns ``(..., n, n)``.
    """
    wz = w.mT @ z  # (..., n, n)
    d2 = (w * w).sum(-2)  # (..., n)
    return mask(wz + wz.mT) / (2.0 * normal_metric(d2))

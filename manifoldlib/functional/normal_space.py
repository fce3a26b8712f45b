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

from .scaling import _power_of_two_scale

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

    :math:`S(W, Z) = \alpha\, S(\alpha W, Z)`: ``W`` is first multiplied by the power of two
    :math:`\alpha` that brings its largest :math:`|w_{ij}|` into :math:`[0.5, 1)` (exact), so
    :math:`d_i^2` neither overflows nor falls into the subnormals for any scale of ``W`` (float32
    columns of norm 1e20 gave NaN, of norm 1e-22 a projection off tangent by 5e-3 relative).
    ``Z`` is not rescaled (scaling it with ``W`` could push a ``Z`` much larger than ``W`` past the
    dtype's range). Bit-identical where nothing over- or underflowed. One max reduction over
    ``W``, one scaled copy of ``W`` and an ``n x n`` scale. In the promoted dtype of ``w`` and ``z``.
    """
    dtype = torch.promote_types(w.dtype, z.dtype)
    w, z = w.to(dtype), z.to(dtype)
    if w.numel() == 0:
        return _normal_multiplier(w, z, mask)
    scale = _power_of_two_scale(w.detach().abs().amax(dim=(-2, -1), keepdim=True))  # (..., 1, 1)
    return scale * _normal_multiplier(w * scale, z, mask)


def _normal_multiplier(w: torch.Tensor, z: torch.Tensor, mask) -> torch.Tensor:
    wz = w.mT @ z  # (..., n, n)
    d2 = (w * w).sum(-2)  # (..., n)
    return mask(wz + wz.mT) / (2.0 * normal_metric(d2))


def _normal_component(w: torch.Tensor, z: torch.Tensor, mask) -> torch.Tensor:
    r""":math:`WS`, :math:`S` of :func:`normal_multiplier`, without forming :math:`S` at its own scale.

    :math:`S_{ij}` is of order :math:`|z|/|w|` and leaves the dtype's range where ``Z`` is much
    larger than ``W`` (float32 ``W`` ~ 1e-20, ``Z`` ~ 1e20: :math:`S` ~ 1e40, NaN), or where two
    columns are both far smaller than the largest (``d_i^2 + d_j^2`` underflows), though
    :math:`WS` is of the order of ``Z``. With :math:`W = W'\operatorname{diag}(a)^{-1}`, ``a_j``
    the power of two that brings column ``j``'s largest entry into :math:`[0.5, 1)` (exact),
    :math:`WS = W'T`, :math:`T_{ij} = S_{ij}/a_i`, and with :math:`p_i = \min(a_i, a_j)/a_i \le 1`

    .. math::

        T_{ij} = rac{p_i^2\, w_i'^	op z_j + p_i p_j\, z_i^	op w_j'}{p_i^2 \|w_i'\|^2 + p_j^2 \|w_j'\|^2},

    whose denominator is at least 1/4 (one of :math:`p_i, p_j` is 1) and whose numerator is of
    the order of ``Z``. Powers of two only: the same bits as :math:`W(\mathcal{P}(W^	op Z +
    Z^	op W)/(d_i^2 + d_j^2))` where nothing over- or underflows. Returns ``(..., m, n)``."""
    if w.numel() == 0:
        return w @ _normal_multiplier(w, z, mask)
    a = _power_of_two_scale(w.detach().abs().amax(dim=-2, keepdim=True))  # (..., 1, n)
    ws = w * a  # W'
    a_col = a.mT  # (..., n, 1): a_i
    low = torch.minimum(a_col, a)  # (..., n, n): min(a_i, a_j)
    p_i, p_j = low / a_col, low / a  # powers of two in (0, 1], exact
    wz = ws.mT @ z  # (..., n, n): w_i'^T z_j
    d2 = (ws * ws).sum(-2)  # (..., n)
    num = p_i * torch.addcmul(p_j * wz.mT, p_i, wz)
    den = torch.addcmul((p_j * p_j) * d2.unsqueeze(-2), p_i * p_i, d2.unsqueeze(-1))
    return ws @ mask(num / den)


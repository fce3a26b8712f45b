r"""Oblique kernels: :math:`\mathrm{OB}(m, n) = \{W \in \mathbb{R}^{m\times n}: \operatorname{Diag}(W^\top W) = I\}`.

Unit-norm columns: a product of ``n`` spheres :math:`S^{m-1}`. Tangent space
:math:`\{V: w_j^\top v_j = 0\}`; normal space :math:`\{W\operatorname{diag}(s)\}`, the
multipliers of :mod:`~manifoldlib.functional.normal_space` with the projector
:math:`\operatorname{Diag}` (:doc:`/theory/matrix_constraints`), so the projection is
:math:`P_W(Z) = Z - W\operatorname{diag}(w_j^\top z_j / \|w_j\|^2)`. Its retraction normalizes
the columns of :math:`Y = W + V` (the metric projection, second order).
"""

from __future__ import annotations

import torch

from .scaling import _power_of_two_scale
from .sphere import exponential_coefficients, sphere_step_length
from .stiefel import _check_tall_pair

__all__ = [
    "oblique_constraint_deviation",
    "oblique_exp",
    "oblique_normalize",
    "oblique_project_tangent",
]


def _oblique_normal_coefficients(w: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(w_scaled, s)``, ``(..., m, n)`` and ``(..., 1, n)``, with ``w_scaled * s`` the normal component
    :math:`W\operatorname{diag}(w_j^\top z_j/\|w_j\|^2)` of ``z`` at ``w``.

    Each column of ``W`` is first multiplied by the power of two that brings its largest entry into
    :math:`[0.5, 1)` (exact; the component is unchanged by :math:`w_j \mapsto \alpha_j w_j`), so
    :math:`\|w_j\|^2` neither overflows nor falls into the subnormals whatever the column's norm
    (float32 columns of norm 1e20 gave NaN, of norm 1e-22 a projection off tangent by 5e-3),
    and ``Z`` is not rescaled. Column sums only: ``O(mn)``, no ``n x n`` product.
    """
    scale = _power_of_two_scale(w.detach().abs().amax(dim=-2, keepdim=True))  # (..., 1, n)
    ws = w * scale
    return ws, (ws * z).sum(-2, keepdim=True) / (ws * ws).sum(-2, keepdim=True)


def oblique_project_tangent(w: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    r""":math:`P_W(Z) = Z - W\operatorname{diag}(w_j^\top z_j/\|w_j\|^2)`, shapes ``(..., m, n)``
    (any nonzero columns; scale-safe, see ``_oblique_normal_coefficients``), in the promoted dtype
    of ``w`` and ``z`` (a float32 ``w`` with a float64 ``z`` had its :math:`\|w_j\|^2` in float32)."""
    dtype = torch.promote_types(w.dtype, z.dtype)
    w, z = w.to(dtype), z.to(dtype)
    ws, s = _oblique_normal_coefficients(w, z)
    return z - ws * s


def _normalize_columns(y: torch.Tensor) -> torch.Tensor:
    r""":math:`y_j/\|y_j\|` for every column of ``y`` ``(..., m, n)``, in ``y``'s dtype (a zero column: NaN).

    The map is invariant under :math:`y_j \mapsto s y_j`, :math:`s > 0`: each column is first
    multiplied by the power of two that brings its largest entry into :math:`[1/2, 1)` (exact), so
    :math:`\|y_j\|^2` neither overflows nor underflows and every finite nonzero column comes back a
    unit column (unscaled, a float32 column with entries of :math:`10^{20}` had the norm ``inf``
    and came back zero). Computed in at least float32.
    """
    work = y.to(torch.promote_types(y.dtype, torch.float32))
    work = work * _power_of_two_scale(work.detach().abs().amax(dim=-2, keepdim=True))  # (..., m, n)
    return (work / torch.linalg.vector_norm(work, dim=-2, keepdim=True)).to(y.dtype)


def oblique_normalize(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""Column-normalizing retraction :math:`y_j/\|y_j\|`, :math:`Y = W + V` (second order).

    Scale-safe (``_normalize_columns``): a unit column for every finite nonzero :math:`y_j`,
    however long the step (float32 steps of :math:`10^{20}` and float64 ones of :math:`10^{160}`
    gave zero columns).
    """
    _check_tall_pair(w, v, "oblique_normalize")
    return _normalize_columns(w + v)


def oblique_constraint_deviation(w: torch.Tensor) -> torch.Tensor:
    r"""``(..., n)`` :math:`\|w_j\|^2 - 1`: the constraint of a point, entry by entry."""
    return (w * w).sum(-2) - 1.0


def oblique_exp(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    r"""Exponential map, column by column on the unit sphere:
    :math:`\cos\theta_j\,w_j + (\sin\theta_j/\theta_j)\,v_j`, :math:`\theta_j = \|v_j\|` (``v`` tangent).

    Both coefficients are the sphere's :func:`~manifoldlib.functional.exponential_coefficients`
    of the same :math:`\sigma_j = \theta_j^2`, so the column norm
    :math:`\cos^2\theta_j + \sin^2\theta_j` is 1 to rounding at every angle (``torch.sinc`` of
    the rounded :math:`\theta_j/\pi` evaluated the sine at another angle than the cosine: an
    error of :math:`\epsilon\,\theta_j` in the norm, 4e-6 at :math:`\theta \approx 85` in
    float32, 9% in float16), and finite gradients at :math:`v_j = 0`. Computed in at least
    float32, returned in the dtype of ``w + v``.

    Each column of ``w`` is first normalized (:math:`O(mn)`, a pass like the map's own): the map
    keeps a column's norm (:math:`\|\cos\theta\,w + \operatorname{sinc}\theta\,v\|^2 =
    \cos^2\theta\,\|w\|^2 + \sin^2\theta`), so a deviation of ``w`` stayed and chained steps added
    their rounding to it, with a bias at small angles, where :math:`\cos\theta` rounds the same
    way at every step, so that a chain reached :meth:`~manifoldlib.Oblique.expmap`'s own check.
    Now a chain is off by one step's rounding (``test_chained_float32_oblique_expmap_stays_at_rounding``). This repairs rounding; it is no projection of an
    arbitrary ``w`` (``expmap`` refuses one off the manifold).

    A column whose :math:`\sigma_j` overflows (:math:`\theta_j` past about :math:`1.8\cdot10^{19}` in
    float32, :math:`1.3\cdot10^{154}` in float64) is rotated from its angle itself,
    :math:`\cos\theta_j\,w_j + \sin\theta_j\,\hat v_j` with :math:`\theta_j` and
    :math:`\hat v_j = v_j/\|v_j\|` from :func:`~manifoldlib.functional.sphere_step_length`
    (nothing squared), as :meth:`~manifoldlib.Sphere.expmap` does for a row: a unit column for
    every finite :math:`\theta_j` (the squares gave NaN columns from those lengths). The map is
    periodic in :math:`\theta_j`, and the float :math:`\theta_j` is exact only to
    :math:`\epsilon\,\theta_j`: past :math:`\theta_j \approx 2\pi/\epsilon` (:math:`5\cdot10^{7}`
    in float32, :math:`3\cdot10^{16}` in float64) the point is on the column's great circle but its
    position there is not determined by the input. A column whose :math:`\theta_j` itself overflows
    (a finite ``v`` of norm above the dtype's largest number) comes back non-finite
    (:meth:`~manifoldlib.Oblique.expmap` names it).
    """
    _check_tall_pair(w, v, "oblique_exp")
    work = torch.promote_types(torch.promote_types(w.dtype, v.dtype), torch.float32)
    ww, vw = _normalize_columns(w.to(work)), v.to(work)  # (v stays tangent: w_j^T v_j = 0 is kept)
    sigma = (vw * vw).sum(-2, keepdim=True)  # (..., 1, n)
    long = ~torch.isfinite(sigma)  # the square overflowed (or v is not finite)
    # double-where: neither form sees the other's columns, so no NaN reaches a gradient
    cos_theta, k = exponential_coefficients(torch.where(long, torch.zeros_like(sigma), sigma))  # (..., 1, n) each
    short = cos_theta * ww + k * torch.where(long, torch.zeros_like(vw), vw)
    theta, direction = sphere_step_length(torch.where(long, vw, ww).mT, 1.0)  # (..., n, 1), (..., n, m)
    rotated = torch.cos(theta.mT) * ww + torch.sin(theta.mT) * direction.mT  # (..., m, n)
    return torch.where(long, rotated, short).to(torch.promote_types(w.dtype, v.dtype))

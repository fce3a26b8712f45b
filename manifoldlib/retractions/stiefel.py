r"""Stiefel retractions, points ``(..., m, n)`` with :math:`m \ge n`, :math:`X^\top X = I`.

==========  =====================================================  ===================
name        formula                                                order (Euclidean)
==========  =====================================================  ===================
polar       :math:`\operatorname{msign}(X+V)`                      2
qr          :math:`\operatorname{qf}(X+V)` with the sign fix        1
cayley      low-rank Cayley transform                              1 (2 if square)
exp         Edelman–Arias–Smith geodesic                           exact (2)
==========  =====================================================  ===================
"""

from __future__ import annotations

import torch

from ..functional.msign import MSIGN_METHODS, POLAR_METHODS
from ..functional.stiefel import (
    stiefel_cayley,
    stiefel_exp,
    stiefel_polar,
    stiefel_qr,
)
from .base import Retraction, register_retraction

__all__ = [
    "StiefelCayleyRetraction",
    "StiefelExpRetraction",
    "StiefelPolarRetraction",
    "StiefelQRRetraction",
]


@register_retraction("stiefel", "polar")
class StiefelPolarRetraction(Retraction):
    r"""Polar = metric projection: :math:`(X+V)(I+V^\top V)^{-1/2}`, second order.

    Args:
        method: ``"auto"`` (exact SVD without autograd, the differentiable Newton iteration
            with it), ``"svd"``, ``"newton"``, ``"newton-schulz"`` (convergent) or ``"gram-eigh"``
            (:data:`~manifoldlib.functional.msign.POLAR_METHODS`); the fixed-count Newton–Schulz
            presets are refused: they leave points off the manifold.
    """

    order = 2

    def __init__(self, method: str = "auto"):
        if method not in POLAR_METHODS:
            hint = (" (a fixed-count Newton-Schulz preset is not a retraction: it leaves the point off "
                    "the manifold, R_x(0) != x)" if method in MSIGN_METHODS else "")
            raise ValueError(f"unknown polar method {method!r}; valid: {', '.join(POLAR_METHODS)}{hint}")
        self.method = method

    def options(self) -> dict:
        return {"method": self.method}

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_polar(x, v, self.method)


@register_retraction("stiefel", "qr")
class StiefelQRRetraction(Retraction):
    r"""QR with the sign fix :math:`Q\operatorname{diag}(\operatorname{sign}\operatorname{diag}R)`, first order."""

    order = 1

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_qr(x, v)


@register_retraction("stiefel", "cayley")
class StiefelCayleyRetraction(Retraction):
    r"""Cayley transform, low-rank :math:`O(mn^2)` form.

    First order for the Euclidean metric on tall matrices (second order only w.r.t. the
    canonical metric), but second order on square ones: there :math:`XX^\top = I`, so
    :math:`W = PVX^\top - XV^\top P = \tfrac12(VX^\top - XV^\top)` is skew with
    :math:`WX = V` and the curve :math:`(I - \tfrac t2 W)^{-1}(I + \tfrac t2 W)X` has
    acceleration :math:`W^2X = WV`, which is normal (:math:`X^\top WV` is symmetric for
    :math:`V = X\Omega`, :math:`\Omega` skew); :func:`~manifoldlib.testing.retraction_order`
    finds both (``test_stiefel_cayley_order_depends_on_the_shape``). :attr:`order` is the claim
    for every shape (1);
    :meth:`order_at` gives the shape's own.

    The transform keeps the deviation of ``x`` from the manifold, so the kernel
    (:func:`~manifoldlib.functional.stiefel_cayley`) re-orthonormalizes ``x`` first: chained
    float32 steps stay at one step's rounding (without it their rounding accumulated like a
    random walk towards :meth:`~manifoldlib.Stiefel.retr`'s refusal of ``x``).
    """

    order = 1
    needs_point = True  # (I - W/2)^{-1}(I + W/2) X keeps X's deviation; the kernel repairs only rounding

    def order_at(self, shape) -> int:
        """The order at points of ``shape`` ``(..., m, n)``: 2 if ``m == n``, else 1."""
        return 2 if len(shape) >= 2 and shape[-2] == shape[-1] else 1

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_cayley(x, v)


@register_retraction("stiefel", "exp")
class StiefelExpRetraction(Retraction):
    r"""The exponential map of the Euclidean metric (a geodesic, hence second order).

    ``v`` is projected onto the tangent space first, :math:`R_X(V) = \exp_X(P_X V)`: the geodesic
    formula leaves the manifold for a vector with a normal part (a momentum buffer seeded with a
    raw gradient, as geoopt's optimizers seed it), which the other Stiefel retractions, being
    projections or orthogonal transformations of :math:`X`, absorb. The projection and the
    exponential are computed in float64 and the result re-orthonormalized before the cast back
    (:func:`~manifoldlib.functional.stiefel_exp`), so the point is on the manifold to the
    rounding of its dtype for every step up to
    :data:`~manifoldlib.functional.stiefel.STIEFEL_EXP_MAX_STEP` (:math:`\|P_X V\|_F \le 2^{43}`);
    a longer one raises ``ValueError``.
    """

    order = 2
    needs_point = True  # the geodesic from x: from another point its start is not x

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_exp(x, v)

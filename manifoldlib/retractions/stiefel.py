r"""Stiefel retractions, points ``(..., m, n)`` with :math:`m \ge n`, :math:`X^\top X = I`.

==========  =====================================================  ===================
name        formula                                                order (Euclidean)
==========  =====================================================  ===================
polar       :math:`\operatorname{msign}(X+V)`                      2
qr          :math:`\operatorname{qf}(X+V)` with the sign fix        1
cayley      low-rank Cayley transform                              1
exp         Edelman–Arias–Smith geodesic                           exact (2)
==========  =====================================================  ===================
"""

from __future__ import annotations

import torch

from ..functional.msign import MSIGN_METHODS
from ..functional.stiefel import stiefel_cayley, stiefel_exp, stiefel_polar, stiefel_qr
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
            with it) or any :data:`~manifoldlib.functional.MSIGN_METHODS` entry; the fixed-count
            Newton–Schulz presets are *not* exact and leave points off the manifold.
    """

    order = 2

    def __init__(self, method: str = "auto"):
        if method != "auto" and method not in MSIGN_METHODS:
            raise ValueError(
                f"unknown polar method {method!r}; valid: auto, {', '.join(MSIGN_METHODS)}"
            )
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
    r"""Cayley transform, low-rank :math:`O(mn^2)` form; first order for the Euclidean metric
    (second order only w.r.t. the canonical metric)."""

    order = 1

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_cayley(x, v)


@register_retraction("stiefel", "exp")
class StiefelExpRetraction(Retraction):
    r"""The exponential map of the Euclidean metric (a geodesic, hence second order)."""

    order = 2

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return stiefel_exp(x, v)

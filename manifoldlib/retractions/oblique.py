r"""Oblique retractions, points ``(..., m, n)`` with unit-norm columns.

=========  =====================================================  =====
name       formula                                                order
=========  =====================================================  =====
normalize  :math:`y_j/\|y_j\|`, :math:`Y = W + V`                  2
=========  =====================================================  =====

Column normalization is the metric projection onto the product of spheres, hence second order.
"""

from __future__ import annotations

import torch

from ..functional.oblique import oblique_normalize
from .base import Retraction, register_retraction

__all__ = ["ObliqueNormalizeRetraction"]


@register_retraction("oblique", "normalize")
class ObliqueNormalizeRetraction(Retraction):
    """Normalize every column of :math:`W + V`; second order."""

    order = 2

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return oblique_normalize(x, v)

r"""DGram retractions, points ``(..., m, n)`` with :math:`\operatorname{Off}(W^\top W) = 0`.

=============  ========================================================================  =====
name           formula                                                                   order
=============  ========================================================================  =====
alternating    :math:`Q'=\operatorname{msign}(Y\operatorname{diag}(c))`,                   2
               :math:`d'_j = q_j'^\top y_j`, :math:`R = Q'\operatorname{diag}(d')`
colnorm-polar  :math:`\operatorname{msign}(YD_Y^{-1})D_Y`                                1
=============  ========================================================================  =====

(``U V^T diag(σ)`` from an SVD of ``Y`` is *not* a retraction: it sorts the column norms.)
"""

from __future__ import annotations

import torch

from ..functional.dgram import dgram_alternating, dgram_colnorm_polar
from ..functional.msign import MSIGN_METHODS, POLAR_METHODS
from .base import Retraction, register_retraction

__all__ = ["DGramAlternatingRetraction", "DGramColnormPolarRetraction"]


class _PolarBacked(Retraction):
    def __init__(self, method: str = "auto"):
        if method not in POLAR_METHODS:
            hint = (" (a fixed-count Newton-Schulz preset is not a retraction: it leaves the point off "
                    "the manifold, R_x(0) != x)" if method in MSIGN_METHODS else "")
            raise ValueError(f"unknown polar method {method!r}; valid: {', '.join(POLAR_METHODS)}{hint}")
        self.method = method

    def options(self) -> dict:
        return {"method": self.method}


@register_retraction("dgram", "alternating")
class DGramAlternatingRetraction(_PolarBacked):
    """One step of alternating metric projection onto DGram; second order (recommended)."""

    order = 2

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dgram_alternating(x, v, self.method)


@register_retraction("dgram", "colnorm-polar")
class DGramColnormPolarRetraction(_PolarBacked):
    """Column-normalized polar: cheap, first order."""

    order = 1

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dgram_colnorm_polar(x, v, self.method)

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
    r"""One step of alternating metric projection onto DGram; second order (recommended).

    The polar factor is taken of :math:`Y\operatorname{diag}(c)`, :math:`c_j = \|y_j\|`, whose
    columns have the norms :math:`c_j^2`: a spread of the column norms is squared. An SVD is
    backward stable only in norm, so it resolves a column of norm :math:`c_j^2` only to about
    :math:`\epsilon\,c_{\max}^2/c_j^2`, past its rank threshold :math:`\max(m, n)\,\epsilon`
    (a column-norm spread of about :math:`10^3` in float32, :math:`10^7` in float64) only through
    the singular vector it completes the range with (:math:`UV^\top`; msign's 0 there made the
    point's column collapse to zero, with no error).
    ``method="auto"`` therefore takes the scaled Newton iteration
    (:func:`~manifoldlib.functional.msign`, ``"newton"``) with or without autograd: its
    :math:`X^{-\top}` comes from a QR factorization, which is backward stable column by column,
    so a column is resolved relative to its own norm whatever the others' are, and a matrix
    whose columns cannot be resolved is refused with a ``ValueError``. ``"svd"`` named
    explicitly keeps the SVD's accuracy. ``"gram-eigh"`` (ManifoldMuon's) refines its eigh in
    column-scaled variables, so the grading costs it no accuracy, and takes the Newton polar factor
    where the Gram matrix cannot resolve the columns.
    """

    order = 2

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dgram_alternating(x, v, self.method)  # "auto": the Newton polar factor (see there)


@register_retraction("dgram", "colnorm-polar")
class DGramColnormPolarRetraction(_PolarBacked):
    """Column-normalized polar: cheap, first order."""

    order = 1

    def retract(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dgram_colnorm_polar(x, v, self.method)
